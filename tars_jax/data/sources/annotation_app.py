"""The annotation page and its HTTP API (report section 2.4.2; the service is `annotation.py`).

  GET  /                               the page (plain HTML + JS, `annotation_page.html`; no build step)
  GET  /health                         {"ok", "run", "version", "tasks", "order", "sessions"} (no token)
  POST /api/sessions                   {"annotator", "task"?} -> a new episode's state (201)
  GET  /api/sessions/{id}              its state: status, turn, instruction, screenshot, candidates, history
  POST /api/sessions/{id}/decide       {"turn", "accept": k} or {"turn", "thought", "action", "x", "y",
                                       "content"} -> the next state; 409 TurnMovedOn (a second submission
                                       for a turn: nothing done), 422 BadOverride (nothing executed)
  POST /api/sessions/{id}/close        the episode ends where it is (written as incomplete)
  POST /api/reload                     {"run"?}: the run's newest policy and its queue order

Every /api route needs the sandbox fleet's token when there is one (`Authorization: Bearer <token>`, or
`?token=` for the page's close beacon); without a token the server binds loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse

from tars_jax.data.sources.annotation import AnnotationServer, BadOverride, TurnMovedOn

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "annotation_page.html")


def make_app(server: AnnotationServer, token: str | None = None, connect=None) -> FastAPI:
  """The FastAPI app of `server`; `token`: required on /api routes (None: no auth). connect(): the
  sandbox clients, made on the app's event loop at start-up (closed at shutdown, after every open
  session was closed and written as incomplete); None: `server.clients` as given."""

  @contextlib.asynccontextmanager
  async def lifespan(app):
    if connect is not None:
      server.clients = list(connect())
    sweeper = asyncio.get_running_loop().create_task(server.sweep_idle())
    try:
      yield
    finally:
      sweeper.cancel()
      for s in list(server.sessions.values()):
        await s.close("the annotation server stopped")
      if connect is not None:
        for c in server.clients:
          await c.aclose()

  app = FastAPI(title="tars_jax annotation", lifespan=lifespan)
  with open(PAGE) as f:
    page = f.read()

  @app.middleware("http")
  async def auth(request: Request, call_next):
    if token and request.url.path.startswith("/api/"):
      scheme, _, cred = request.headers.get("authorization", "").partition(" ")
      given = cred.strip() if scheme.lower() == "bearer" else request.query_params.get("token", "")
      if not secrets.compare_digest(given.encode(), token.encode()):
        return JSONResponse(status_code=401, content={"error": "Unauthorized",
                                                      "reason": "this page needs the sandbox fleet's token"})
    return await call_next(request)

  def session(sid: str):
    s = server.sessions.get(sid)
    if s is None:
      return None, JSONResponse(status_code=404, content={"error": "UnknownSession", "reason": f"no session {sid}"})
    return s, None

  @app.get("/", response_class=HTMLResponse)
  async def index():
    return page

  @app.get("/health")
  async def health():
    return {"ok": True, "run": server.run, "version": server.version, "tasks": server.queue.tasks,
            "order": server.queue.order, "sessions": {k: s.status for k, s in server.sessions.items()}}

  @app.post("/api/sessions", status_code=201)
  async def start(body: dict):
    try:
      s = await server.start_session(str(body.get("annotator", "")), body.get("task") or None)
    except ValueError as e:
      return JSONResponse(status_code=422, content={"error": "BadRequest", "reason": str(e)})
    return s.state()

  @app.get("/api/sessions/{sid}")
  async def get(sid: str):
    s, err = session(sid)
    return err or s.state()

  @app.post("/api/sessions/{sid}/decide")
  async def decide(sid: str, body: dict):
    s, err = session(sid)
    if err:
      return err
    try:
      accept = body.get("accept")
      return await s.decide(int(body["turn"]), accept=None if accept is None else int(accept),
                            thought=str(body.get("thought", "")), action=str(body.get("action", "")),
                            x=body.get("x"), y=body.get("y"), content=str(body.get("content", "")))
    except TurnMovedOn as e:
      return JSONResponse(status_code=409, content={"error": "TurnMovedOn", "reason": str(e), "state": s.state()})
    except (BadOverride, IndexError, KeyError, TypeError, ValueError) as e:
      return JSONResponse(status_code=422, content={"error": "BadOverride", "reason": str(e)})

  @app.post("/api/sessions/{sid}/close")
  async def close(sid: str):
    s, err = session(sid)
    return err or await s.close()

  @app.post("/api/reload")
  async def reload(body: dict):
    return server.reload(body.get("run") or None)

  return app
