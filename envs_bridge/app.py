"""The sandbox protocol as a FastAPI app, shared by every sandbox server (DESIGN.md, "Sandbox protocol").

`protocol_app(...)` wires what all sandboxes have in common — lifespan (start/stop the sandbox), typed
errors as JSON (`SandboxError.status` + `.body()`), a 500 for bugs that costs one request and not the
server, `GET /tasks`, and the session calls (`POST /sessions`, `POST /sessions/{id}/step`,
`GET /sessions/{id}/observe`, `DELETE /sessions/{id}`). Each server adds its own routes (health,
metrics, snapshots, debug) to the returned app.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from envs_bridge import protocol as P


def protocol_app(title: str, sandbox: Any, task_names: Callable[[], Sequence[str]],
                 log: logging.Logger) -> FastAPI:
  """FastAPI app serving `sandbox` (an object with async start/stop/open/step/observe/close).

  sandbox.open(task, seed, coords, data_mode) -> (session_id, Observation); step(sid, action) ->
  Observation; observe(sid) -> Observation; close(sid). They raise `protocol.SandboxError`
  subclasses, which become HTTP errors with the error's status and typed body.
  """

  @contextlib.asynccontextmanager
  async def lifespan(app):
    await sandbox.start()
    yield
    await sandbox.stop()

  app = FastAPI(title=title, lifespan=lifespan)
  app.state.sandbox = sandbox

  @app.exception_handler(P.SandboxError)
  async def _typed(request: Request, exc: P.SandboxError):
    return JSONResponse(status_code=exc.status, content=exc.body())

  @app.exception_handler(Exception)
  async def _unexpected(request: Request, exc: Exception):
    # A bug must cost one request, not the server (and its other sessions).
    log.exception("unexpected error in %s %s", request.method, request.url.path)
    return JSONResponse(status_code=500, content={"error": "InternalError", "reason": repr(exc)[:500]})

  @app.get("/tasks")
  async def task_list():
    return {"tasks": list(task_names())}

  @app.post("/sessions", response_model=P.OpenResponse)
  async def open_session(req: P.OpenRequest):
    sid, obs = await sandbox.open(req.task, req.seed, req.coords, req.data_mode)
    return P.OpenResponse(session_id=sid, observation=obs)

  @app.post("/sessions/{sid}/step", response_model=P.Observation)
  async def step(sid: str, req: P.StepRequest):
    return await sandbox.step(sid, req.action)

  @app.get("/sessions/{sid}/observe", response_model=P.Observation)
  async def observe(sid: str):
    return await sandbox.observe(sid)

  @app.delete("/sessions/{sid}")
  async def close(sid: str):
    await sandbox.close(sid)
    return {"closed": sid}

  return app
