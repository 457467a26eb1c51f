"""The lease bookkeeping the browser and desktop sandboxes share (envs_bridge/browser/sessions.py,
envs_bridge/desktop/sessions.py): live sessions by id, the typed error an ended session answers later
calls with, and the sessions whose lease ran out (docs/INTERFACES.md, "envs_bridge — HTTP protocol":
404 / 410 `SessionLost | LeaseExpired | UnknownSession`).

A session is any object with `last_used` (time.monotonic() seconds) and `lock` (an asyncio.Lock held
while a call on it runs).
"""

from __future__ import annotations

import time
from typing import Any

from envs_bridge import protocol as P

MAX_GONE = 10_000  # ended ids remembered (their typed errors); older ones answer UnknownSession


class SessionTable(dict):
  """{session id: session} of the live sessions, and `gone`: {id: the error later calls on that ended
  session raise} (LeaseExpired, SessionLost, UnknownSession "was closed"), the oldest dropped past
  MAX_GONE."""

  def __init__(self):
    super().__init__()
    self.gone: dict[str, P.SandboxError] = {}

  def lease(self, sid: str) -> Any:
    """The live session `sid`, its lease renewed. Raises the error it ended with, or UnknownSession for
    an id never opened (or forgotten)."""
    s = self.get(sid)
    if s is None:
      raise self.gone.get(sid) or P.UnknownSession(f"no session {sid!r}")
    s.last_used = time.monotonic()
    return s

  def forget(self, sid: str, err: P.SandboxError) -> Any | None:
    """Ends `sid`: later calls raise `err`. Returns the session if it was live, else None."""
    s = self.pop(sid, None)
    self.gone[sid] = err
    if len(self.gone) > MAX_GONE:
      self.gone.pop(next(iter(self.gone)))
    return s

  def to_close(self, sid: str) -> Any | None:
    """The live session `sid` that a close ends, or None when it already ended (closing is idempotent).
    Raises UnknownSession for an id never opened."""
    s = self.get(sid)
    if s is None and sid not in self.gone:
      raise P.UnknownSession(f"no session {sid!r}")
    return s

  def expired(self, lease_s: float, now: float | None = None) -> list[tuple[str, Any]]:
    """(id, session) of the live sessions idle for more than `lease_s` seconds and not inside a call."""
    now = time.monotonic() if now is None else now
    return [(sid, s) for sid, s in list(self.items()) if now - s.last_used > lease_s and not s.lock.locked()]
