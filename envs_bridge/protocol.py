"""Sandbox protocol shared by servers and clients (docs/ARCHITECTURE.md "Sandbox protocol", docs/INTERFACES.md).

HTTP/JSON over FastAPI; the OpenAPI schema is served at `/openapi.json`.
  POST   /sessions              OpenRequest  -> OpenResponse   (404 UnknownTask with the task list)
  POST   /sessions/{id}/step    StepRequest  -> Observation
  GET    /sessions/{id}/observe              -> Observation    (no action, no time passes)
  DELETE /sessions/{id}                      -> {"closed": id}
  POST   /sessions/{id}/snapshot            -> Snapshot       (deterministic replay record)
  POST   /sessions/{id}/restore  Snapshot    -> Observation    (replays it on the session's page)
  GET    /health                             -> {"ok": bool, "sessions": n, "browsers": [...], ...counters}
  GET    /metrics                            -> Prometheus text (sandbox_* series)
  GET    /events?since=seq&limit=n           -> {"events": [{seq, t, kind, ...}], "last": seq}
  GET    /tasks                              -> {"tasks": [name, ...]}
  GET    /debug/sessions/{id}/element_box?selector=css  (tests/debugging only; never shown to agents)

Observation: `screenshot_png_b64` (PNG of the 160 x 210 MiniWoB #wrap), `reward` (the page's reward,
non-zero only on the step that ends the episode), `done`, `info` with always the keys
  instruction  task text (core.getUtterance())
  step         actions taken so far (invalid ones included)
  elapsed_ms   virtual milliseconds since the episode started (step_ms per step)
  raw_reward   the page's reward before time discounting (0.0 until done)
  reason       the page's reward reason (e.g. 'timed out') or None
  error        None, "invalid action: <reason>" (HTTP 200, reward 0, the episode goes on: a format
               signal, never a crash) or "episode already done"
plus task, seed and, after a parsed action, `action` (its canonical text). Game tasks
('games/<name>', envs_bridge/games) add after every step the optional keys
  score, level, lives  from the game's verifier record (GAME_INFO_KEYS); their reward at the end
               is score / reference score (envs_bridge/games/record.py), raw_reward the score.

Done: an episode is done when the page ends it (success, failure, 10 s virtual time-out) or after
`finished()` / `call_user()`. Steps after that are answered with the current screenshot, done=True,
reward 0 and error "episode already done"; they are not counted.

Errors are JSON `{"error": <type name>, "reason": str, ...}` with the status codes below; the client
raises the matching exception class. A closed (or never opened) session is `UnknownSession`; a session
reclaimed after `lease_s` idle seconds is `LeaseExpired`; one whose page or browser died or hung is
`SessionLost` with `reason` and `cause` (browser_crash, page_crash, page_hang, page_error,
page_closed); a dead Chromium is relaunched at once. Malformed requests get FastAPI's 422.

Auth and limits (envs_bridge/app.py): a server started without a token binds loopback only; one
started with a token (`--token` or the env var TARS_SANDBOX_TOKEN) answers every route but
`/health` (the schema pages /openapi.json, /docs included) with 401 `Unauthorized` unless the request has
`Authorization: Bearer <token>`. A request body over `max_body_bytes` (default 4 MiB) gets 413
`PayloadTooLarge`.
"""

from __future__ import annotations

import base64
import io
import os
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, Field

MAX_ACTION_CHARS = 4096  # longer actions are invalid actions (an observation), not HTTP errors
MAX_REQUEST_CHARS = 1 << 20  # beyond this the request itself is rejected (422)
MAX_BODY_BYTES = 4 << 20  # default request body limit of a server (413 PayloadTooLarge beyond)
TOKEN_ENV = "TARS_SANDBOX_TOKEN"  # bearer token of servers and clients when not given explicitly
GAME_INFO_KEYS = ("score", "level", "lives")  # optional Observation.info keys of game tasks


def resolve_token(token: str | None, env: str = TOKEN_ENV) -> str | None:
  """The bearer token of a server or client: `token` if given, else the env var `env` (the sandbox
  fleet's `TOKEN_ENV` by default); '' (from either) means none -> None. One rule for both sides, so
  they agree on what "no token" is."""
  token = token if token is not None else os.environ.get(env)
  return token or None


class OpenRequest(BaseModel):
  task: str = Field(..., max_length=256, description="task name, e.g. 'miniwob/click-test'")
  seed: int = Field(0, ge=0, le=2**31 - 1, description="task seed (MiniWoB: Math.seedrandom(seed))")
  coords: str = Field("relative1000", pattern="^(relative1000|absolute)$",
                      description="coordinate convention of actions (tars_jax.agent.actions.CoordSpec)")
  data_mode: str = Field("train", pattern="^(train|test)$", description="MiniWoB core.setDataMode")


class StepRequest(BaseModel):
  action: str = Field(..., max_length=MAX_REQUEST_CHARS,
                      description="reply 'Thought: ...\\nAction: ...' or a bare action string")


class Observation(BaseModel):
  """One observation; see the module docstring for `info`."""

  screenshot_png_b64: str
  reward: float = 0.0
  done: bool = False
  info: dict[str, Any] = Field(default_factory=dict)

  def png(self) -> bytes:
    """Screenshot as PNG bytes."""
    return base64.b64decode(self.screenshot_png_b64)

  def image(self) -> np.ndarray:
    """Screenshot as [H, W, 3] uint8 RGB (MiniWoB: [210, 160, 3])."""
    from PIL import Image  # local: servers never decode
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(self.screenshot_png_b64))).convert("RGB"))


class OpenResponse(BaseModel):
  session_id: str
  observation: Observation


class Snapshot(BaseModel):
  """A session's state as a deterministic replay (envs_bridge/browser/sessions.py docstring): the
  episode's seed and the action texts taken so far, replayed under the virtual clock on restore;
  `screenshot_sha256` (of the PNG at snapshot time) is checked after the replay."""

  version: int = Field(1, ge=1, le=1)
  kind: str = Field("replay", pattern="^replay$")
  task: str = Field(..., max_length=256)
  seed: int = Field(..., ge=0, le=2**31 - 1)
  data_mode: str = Field("train", pattern="^(train|test)$")
  coords: str = Field("relative1000", pattern="^(relative1000|absolute)$")
  step_ms: int = Field(..., ge=0, description="virtual ms per step of the server that took it")
  actions: list[Annotated[str, Field(max_length=MAX_ACTION_CHARS + 1)]] = Field(default_factory=list,
                                                                               max_length=10_000,
                             description="action texts of the counted steps, in order")
  step: int = Field(0, ge=0)
  elapsed_ms: int = Field(0, ge=0)
  done: bool = False
  screenshot_sha256: str = Field(..., pattern="^[0-9a-f]{64}$")


class SandboxError(Exception):
  """Base of typed sandbox errors; `.reason` says why, `.status` is the HTTP status code."""

  status = 500

  def __init__(self, reason: str, **extra):
    super().__init__(reason)
    self.reason, self.extra = reason, extra

  def body(self) -> dict:
    return {"error": type(self).__name__, "reason": self.reason, **self.extra}


class UnknownTask(SandboxError):
  status = 404


class UnknownSession(SandboxError):
  status = 404


class LeaseExpired(SandboxError):
  status = 410


class SessionLost(SandboxError):
  status = 410


class InvalidAction(SandboxError):
  """A request the server cannot carry out (e.g. a debug selector that does not parse). Unparseable
  agent actions are NOT this: they come back as observations with `info.error`."""

  status = 422


class TaskError(SandboxError):
  """The task page itself failed (a JavaScript error while starting an episode)."""

  status = 500


class ServerBusy(SandboxError):
  """`max_sessions` sessions are open."""

  status = 503


class Unauthorized(SandboxError):
  """The server was started with a token and the request's `Authorization: Bearer` is missing or wrong."""

  status = 401


class PayloadTooLarge(SandboxError):
  """The request body is over the server's `max_body_bytes`."""

  status = 413


# Errors after which an episode is "lost and retried": its session or its server went away (or the
# server is full for now), so a replay of the same seed, on this server or another, can succeed.
# Everything else (UnknownTask, Unauthorized, PayloadTooLarge, InvalidAction, TaskError, UnknownSession,
# 422 validation errors, a server's 500) is a mistake of the caller or a bug that no replay fixes: it
# propagates at once with its reason. httpx's TransportError (refused, reset, timed out) is retryable
# too; see `is_retryable`.
RETRYABLE = (SessionLost, LeaseExpired, ServerBusy)


def is_retryable(exc: BaseException) -> bool:
  """True if `exc` loses the episode but a replay from its seed may succeed: one of `RETRYABLE`, or an
  `httpx.TransportError` (the server cannot be reached: refused, reset, timed out). The one rule of the
  client's `SessionPool.run_episode` and the trainer's `rollout.agent_loop.run_episodes`."""
  import httpx  # local: servers import this module and never need it
  return isinstance(exc, RETRYABLE + (httpx.TransportError,))


ERRORS = {c.__name__: c for c in (UnknownTask, UnknownSession, LeaseExpired, SessionLost, InvalidAction,
                                  TaskError, ServerBusy, Unauthorized, PayloadTooLarge)}


def error_from_body(status: int, body: Any) -> SandboxError:
  """Rebuilds the typed error from an error response (client side)."""
  if isinstance(body, dict) and body.get("error") in ERRORS:
    extra = {k: v for k, v in body.items() if k not in ("error", "reason")}
    return ERRORS[body["error"]](str(body.get("reason", "")), **extra)
  err = SandboxError(f"HTTP {status}: {str(body)[:300]}")
  err.status = status
  return err
