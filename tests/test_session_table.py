"""The lease bookkeeping shared by the browser and desktop sandboxes (envs_bridge/session_table.py), pure
logic on plain session objects; the sandboxes' use of it on real Chromium / Xvfb sessions is tested in
test_browser_server.py, test_browser_platform.py and test_desktop.py."""

import asyncio
import dataclasses

import pytest

from envs_bridge import protocol as P
from envs_bridge import session_table as T


@dataclasses.dataclass
class S:
  last_used: float
  lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)


def test_lease_renews_a_live_session_and_ended_ones_raise_their_own_error():
  t = T.SessionTable()
  t["a"], t["b"] = S(0.0), S(0.0)
  assert t.lease("a") is t["a"] and t["a"].last_used > 0.0
  expired = P.LeaseExpired("session b reclaimed after 5 s idle")
  assert t.forget("b", expired) is not None and "b" not in t
  with pytest.raises(P.LeaseExpired, match="session b reclaimed"):
    t.lease("b")
  with pytest.raises(P.UnknownSession, match="no session 'never'"):
    t.lease("never")
  assert t.forget("b", P.UnknownSession("closed")) is None  # already ended: nothing live to return


def test_close_is_idempotent_for_ended_sessions_and_refuses_unknown_ids():
  t = T.SessionTable()
  t["a"] = S(0.0)
  assert t.to_close("a") is t["a"]
  t.forget("a", P.UnknownSession("session a was closed"))
  assert t.to_close("a") is None
  with pytest.raises(P.UnknownSession, match="no session 'x'"):
    t.to_close("x")


def test_expired_lists_idle_sessions_past_the_lease_but_not_one_inside_a_call():
  async def go():
    t = T.SessionTable()
    t["idle"], t["fresh"], t["busy"] = S(0.0), S(95.0), S(0.0)
    await t["busy"].lock.acquire()  # a step in flight: its session is not reclaimed under it
    return [sid for sid, _ in t.expired(10.0, now=100.0)]
  assert asyncio.run(go()) == ["idle"]


def test_gone_is_bounded_and_forgets_the_oldest_first(monkeypatch):
  monkeypatch.setattr(T, "MAX_GONE", 3)
  t = T.SessionTable()
  for i in range(5):
    t.forget(f"s{i}", P.SessionLost(f"lost {i}"))
  assert list(t.gone) == ["s2", "s3", "s4"]
  with pytest.raises(P.UnknownSession):
    t.lease("s0")
