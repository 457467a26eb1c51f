"""The sandbox protocol as a FastAPI app, shared by every sandbox server (docs/ARCHITECTURE.md, "Sandbox protocol").

`protocol_app(...)` wires what all sandboxes have in common — lifespan (start/stop the sandbox), typed
errors as JSON (`SandboxError.status` + `.body()`), a 500 for bugs that costs one request and not the
server, `GET /tasks`, and the session calls (`POST /sessions`, `POST /sessions/{id}/step`,
`GET /sessions/{id}/observe`, `DELETE /sessions/{id}`). Each server adds its own routes (health,
metrics, snapshots, debug) to the returned app.

Latency model (`StepLatency`, flags `--step-latency-median-s` / `--step-latency-sigma`): a real
wall-clock delay before each step answers, log-normal with a long tail, standing in for remote desktop
VMs (seconds per step) where asynchronous rollout is measured (`benchmarks/rollout_streaming.py`).
The page's virtual clock does not see it, so rewards stay reproducible.

Access (issue #5 "Bad input"): with a `token`, every route but `/health` (the schema pages
included) requires `Authorization: Bearer <token>`, else 401 `Unauthorized`. It is checked by an
ASGI middleware before the request is read at all, so an unauthenticated client gets no 422 that
tells it what the server expects (a FastAPI dependency would run after the body is parsed). Request bodies over `max_body_bytes`
are refused with 413 `PayloadTooLarge` (`BodyLimit`: by Content-Length before reading, else counted
while reading, so a chunked body is cut off too). Not FastAPI's own `max_body_size`: with a
Content-Length it answers a plain-text 413 that replaces any typed body. `check_bind` refuses a non-loopback host
without a token.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import math
import random
import secrets
from typing import Any, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from envs_bridge import protocol as P

# uvicorn's keep-alive timeout for servers of this protocol: longer than the client's KEEPALIVE_S, so
# the client always closes an idle connection first (uvicorn's default 5 s equals httpx's default).
SERVER_KEEPALIVE_S = 30
OPEN_PATHS = frozenset({"/health"})  # answered without a token (liveness probes, launch_server's wait)


def server_token(flag: str | None) -> str | None:
  """The server's token: `--token` if given, else the env var `protocol.TOKEN_ENV`; '' means none."""
  return P.resolve_token(flag)


def is_loopback(host: str) -> bool:
  """True for 'localhost' and loopback addresses (127.0.0.0/8, ::1); False for anything else,
  including 0.0.0.0 / :: (all interfaces) and host names."""
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host.strip("[]")).is_loopback
  except ValueError:
    return False


def check_bind(host: str, token: str | None, token_env: str = P.TOKEN_ENV) -> None:
  """Raises ValueError if `host` is not loopback and there is no token (anyone on the network could
  drive the browsers, or push a policy's weights, otherwise); `token_env`: the env var the message
  names."""
  if not token and not is_loopback(host):
    raise ValueError(f"refusing to bind {host!r} without a token: start with --token (or set {token_env}) "
                     "or bind 127.0.0.1")


class BearerAuth:
  """ASGI middleware: HTTP requests to paths other than OPEN_PATHS need `Authorization: Bearer <token>`
  (compared in constant time); others get 401 with the typed `Unauthorized` body."""

  def __init__(self, app, token: str):
    if not token:
      raise ValueError("BearerAuth needs a non-empty token")
    self.app, self._token = app, token.encode()

  async def __call__(self, scope, receive, send):
    if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
      scheme, _, cred = Headers(scope=scope).get("authorization", "").partition(" ")
      if scheme.lower() != "bearer" or not cred:
        err = P.Unauthorized("this server requires 'Authorization: Bearer <token>'")
      elif not secrets.compare_digest(cred.strip().encode(), self._token):
        err = P.Unauthorized("wrong bearer token")
      else:
        err = None
      if err is not None:
        await JSONResponse(status_code=401, content=err.body(), headers={"WWW-Authenticate": "Bearer"})(
            scope, receive, send)
        return
    await self.app(scope, receive, send)


class BodyLimit:
  """ASGI middleware: an HTTP request body over `max_bytes` gets 413 with the typed `PayloadTooLarge`
  body. The body is read (at most max_bytes + one chunk) before the app runs and then handed to it."""

  def __init__(self, app, max_bytes: int):
    self.app, self.max_bytes = app, max_bytes

  async def _refuse(self, scope, receive, send):
    err = P.PayloadTooLarge(f"request body over {self.max_bytes} bytes (this server's max_body_bytes)",
                            max_body_bytes=self.max_bytes)
    await JSONResponse(status_code=413, content=err.body(), headers={"Connection": "close"})(scope, receive, send)

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    length = Headers(scope=scope).get("content-length")
    if length is not None and length.isdigit() and int(length) > self.max_bytes:
      return await self._refuse(scope, receive, send)
    chunks, size = [], 0
    while True:
      msg = await receive()
      if msg["type"] != "http.request":  # the client went away: let the app see it
        chunks = None
        break
      chunks.append(msg.get("body", b""))
      size += len(chunks[-1])
      if size > self.max_bytes:
        return await self._refuse(scope, receive, send)
      if not msg.get("more_body", False):
        break
    if chunks is None:
      replay = [msg]
    else:
      replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

    async def replayed():
      return replay.pop() if replay else await receive()
    await self.app(scope, replayed, send)


def add_access_args(ap) -> None:
  """Adds `--host`, `--token` and `--max-body-bytes` to a server's argparse parser."""
  ap.add_argument("--host", default="127.0.0.1", help="bind address (non-loopback only with a token)")
  ap.add_argument("--token", default=None, help=f"bearer token required by every route but /health "
                  f"(default: env {P.TOKEN_ENV}; none: loopback only)")
  ap.add_argument("--max-body-bytes", type=int, default=P.MAX_BODY_BYTES, help="larger request bodies get 413")


@dataclasses.dataclass(frozen=True)
class StepLatency:
  """Wall-clock seconds a step waits before it answers: median_s * exp(sigma * z), z ~ N(0, 1) (a
  log-normal with median `median_s`; sigma 1 puts the 99th percentile at ~10x the median), drawn from
  a generator seeded with `seed`. Raises ValueError for median_s <= 0 or sigma < 0."""
  median_s: float
  sigma: float = 1.0
  seed: int = 0

  def __post_init__(self):
    if self.median_s <= 0 or self.sigma < 0:
      raise ValueError(f"step latency needs median_s > 0 and sigma >= 0, got {self}")

  def sampler(self) -> Callable[[], float]:
    """A function drawing the next delay in seconds."""
    rng = random.Random(self.seed)
    return lambda: self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0))


def add_latency_args(ap) -> None:
  """Adds `--step-latency-median-s` (0 = none) and `--step-latency-sigma` to a server's parser."""
  ap.add_argument("--step-latency-median-s", type=float, default=0.0,
                  help="median of a log-normal wall-clock delay before each step answers (0: none)")
  ap.add_argument("--step-latency-sigma", type=float, default=1.0, help="its log-space standard deviation")


def latency_from_args(args) -> StepLatency | None:
  """The `StepLatency` of parsed `add_latency_args` flags, or None."""
  if args.step_latency_median_s <= 0:
    return None
  return StepLatency(args.step_latency_median_s, args.step_latency_sigma)


def access_from_args(ap, args) -> str | None:
  """The server's token from parsed `add_access_args` flags; a non-loopback `--host` without one
  exits through `ap.error` (code 2) before anything starts."""
  token = server_token(args.token)
  try:
    check_bind(args.host, token)
  except ValueError as e:
    ap.error(str(e))
  return token


def protocol_app(title: str, sandbox: Any, task_names: Callable[[], Sequence[str]],
                 log: logging.Logger, token: str | None = None,
                 max_body_bytes: int = P.MAX_BODY_BYTES, step_latency: StepLatency | None = None) -> FastAPI:
  """FastAPI app serving `sandbox` (an object with async start/stop/open/step/observe/close).

  sandbox.open(task, seed, coords, data_mode) -> (session_id, Observation); step(sid, action) ->
  Observation; observe(sid) -> Observation; close(sid). They raise `protocol.SandboxError`
  subclasses, which become HTTP errors with the error's status and typed body.

  Args:
    token: bearer token required on every route but OPEN_PATHS (None: no auth; bind loopback only).
    max_body_bytes: request bodies over this many bytes -> 413 PayloadTooLarge.
    step_latency: a wall-clock delay before each step answers (None: none); module docstring.
  """
  if max_body_bytes < 1:
    raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")

  @contextlib.asynccontextmanager
  async def lifespan(app):
    await sandbox.start()
    yield
    await sandbox.stop()

  app = FastAPI(title=title, lifespan=lifespan)
  app.state.sandbox = sandbox
  app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
  if token:  # added last = outermost: checked before the body is read
    app.add_middleware(BearerAuth, token=token)

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

  delay = step_latency.sampler() if step_latency is not None else None
  app.state.step_latency = step_latency

  @app.post("/sessions/{sid}/step", response_model=P.Observation)
  async def step(sid: str, req: P.StepRequest):
    obs = await sandbox.step(sid, req.action)
    if delay is not None:
      await asyncio.sleep(delay())
    return obs

  @app.get("/sessions/{sid}/observe", response_model=P.Observation)
  async def observe(sid: str):
    return await sandbox.observe(sid)

  @app.delete("/sessions/{sid}")
  async def close(sid: str):
    await sandbox.close(sid)
    return {"closed": sid}

  return app
