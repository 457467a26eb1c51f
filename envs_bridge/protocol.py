"""Sandbox protocol shared by servers and clients (DESIGN.md, "Sandbox protocol").

HTTP/JSON over FastAPI; the OpenAPI schema is served at `/openapi.json`.
  POST   /sessions              OpenRequest  -> OpenResponse   (404 UnknownTask with the task list)
  POST   /sessions/{id}/step    StepRequest  -> Observation    (unparseable action: 200, info.error set)
  GET    /sessions/{id}/observe              -> Observation
  DELETE /sessions/{id}                      -> {"closed": id}
  GET    /health, GET /tasks
Errors are JSON `{"error": <type name>, "reason": str, ...}` with the status codes below; the client
raises the matching exception class.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

MAX_ACTION_CHARS = 4096


class OpenRequest(BaseModel):
  task: str = Field(..., max_length=256, description="task name, e.g. 'miniwob/click-test'")
  seed: int = Field(0, ge=0, le=2**31 - 1, description="task seed (MiniWoB: Math.seedrandom(seed))")
  coords: str = Field("relative1000", pattern="^(relative1000|absolute)$",
                      description="coordinate convention of actions (tars_jax.agent.actions.CoordSpec)")


class StepRequest(BaseModel):
  action: str = Field(..., max_length=MAX_ACTION_CHARS,
                      description="reply 'Thought: ...\\nAction: ...' or a bare action string")


class Observation(BaseModel):
  screenshot_png_b64: str
  reward: float = 0.0
  done: bool = False
  info: dict[str, Any] = Field(default_factory=dict)

  def image(self) -> np.ndarray:
    """Screenshot as [H, W, 3] uint8 RGB."""
    from PIL import Image  # local: servers never decode
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(self.screenshot_png_b64))).convert("RGB"))


class OpenResponse(BaseModel):
  session_id: str
  observation: Observation


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
  status = 422


class TaskError(SandboxError):
  status = 500


class ServerBusy(SandboxError):
  status = 503


ERRORS = {c.__name__: c for c in (UnknownTask, UnknownSession, LeaseExpired, SessionLost, InvalidAction,
                                  TaskError, ServerBusy)}


def error_from_body(status: int, body: Any) -> SandboxError:
  """Rebuilds the typed error from an error response (client side)."""
  if isinstance(body, dict) and body.get("error") in ERRORS:
    extra = {k: v for k, v in body.items() if k not in ("error", "reason")}
    return ERRORS[body["error"]](str(body.get("reason", "")), **extra)
  err = SandboxError(f"HTTP {status}: {str(body)[:300]}")
  err.status = status
  return err
