"""Concurrency stress of the browser sandbox (issue #5 item 1, the "page ... has been closed at open"
race): many sessions opened, stepped, closed and left to expire at once against a real server, with
the leaked-page GC running every 50 ms, so that every page hand-over (new page -> session, idle pool
-> session, session -> idle pool) overlaps GC passes. A page the sandbox still uses must never be
closed under it: no session is lost, the GC closes nothing (nothing leaked), and at the end every
Chromium context is an idle page."""

import asyncio

import httpx
import pytest

from envs_bridge import protocol as P
from envs_bridge.browser.sessions import BrowserSandbox
from envs_bridge.client import SandboxClient
from envs_bridge.launch import launch_server
from _shared import run

pytestmark = pytest.mark.browser

# Two reusable tasks (pages go back to the idle pool) and one that always gets a fresh page
# (REUSE_UNSAFE_TASKS: closed on close), so all three page paths run concurrently.
TASKS = ("miniwob/click-test", "miniwob/click-test-2", "miniwob/click-tab")
WORKERS, ROUNDS = 8, 4
LEASE_S = 5.0


def _wait_for(url, pred, timeout_s=60.0):
  """Polls /health until pred(health) (no timing asserted); returns the last health."""
  async def go():
    async with httpx.AsyncClient() as c:
      for _ in range(int(timeout_s / 0.1)):
        h = (await c.get(url + "/health")).json()
        if pred(h):
          return h
        await asyncio.sleep(0.1)
      return h
  return run(go())


async def _gc_while(sb: BrowserSandbox, coro):
  """Runs `coro` while GC passes run back to back (every 10 ms); -> (its result, pages GC closed)."""
  task = asyncio.ensure_future(coro)
  closed = 0
  while not task.done():
    closed += await sb.collect_garbage()
    await asyncio.sleep(0.01)
  return await task, closed


def test_gc_passes_during_open_and_close_spare_the_page():
  """The race, deterministically: GC passes during a fresh-page open, a close that waits for a step
  in flight, and a reused-page open. Each page is in no session and no idle pool for a moment, yet
  owned (by the call handing it over); before the fix the GC closed the opening page under it."""
  async def go():
    sb = BrowserSandbox(gc_interval_s=3600, page_timeout_s=10.0)  # GC passes driven by the test
    await sb.start()
    try:
      (sid, o1), c1 = await _gc_while(sb, sb.open("miniwob/click-test", 1))
      step = asyncio.ensure_future(sb.step(sid, "wait()"))
      await asyncio.sleep(0)  # the step holds the session lock: close waits for it
      _, c2 = await _gc_while(sb, sb.close(sid))
      o2 = await step
      idle_after_close = sb.health()["idle_pages"]
      (sid2, o3), c3 = await _gc_while(sb, sb.open("miniwob/click-test", 2))
      o4 = await sb.step(sid2, "wait()")
      return (c1, c2, c3), (o1, o2, o3, o4), idle_after_close, sb.health(), len(sb.slots[0].browser.contexts)
    finally:
      await sb.stop()
  closed, (o1, o2, o3, o4), idle_after_close, h, contexts = run(go())
  assert closed == (0, 0, 0)
  assert o1.info["step"] == 0 and o2.info["step"] == 1 and o3.info["step"] == 0 and o4.info["step"] == 1
  assert o3.info["seed"] == 2 and idle_after_close == 1
  assert h["pages_created"] == 1 and h["pages_reused"] == 1  # the second open reused the first page
  assert h["lost"] == 0 and h["gc_closed"] == 0 and h["sessions"] == 1 and contexts == 1


@pytest.mark.slow  # ~60 s on 2 busy cores (32 opens, a third of them fresh pages, 5 s leases)
def test_concurrent_open_step_close_expire_never_closes_a_live_page():
  # page_timeout_s=20: before the fix a page closed under `new_page` hung the open; it fails in 20 s.
  with launch_server(lease_s=LEASE_S, gc_interval_s=0.05, n_browsers=2, max_sessions=64, page_timeout_s=20.0) as h:
    async def worker(c: SandboxClient, w: int):
      out = {"opened": 0, "closed": 0, "abandoned": [], "errors": []}
      for r in range(ROUNDS):
        task = TASKS[(w + r) % len(TASKS)]
        try:
          sid, obs = await c.open(task, seed=w * 100 + r)
          out["opened"] += 1
          assert obs.info["step"] == 0 and obs.info["task"] == task
          if r % 4 == 3:  # every 4th session is abandoned: its lease expires while others run
            out["abandoned"].append(sid)
            continue
          for _ in range(r % 3):
            o = await c.step(sid, "wait()")
            assert not o.info["error"]
          await c.close(sid)
          out["closed"] += 1
        except P.SandboxError as e:  # recorded, asserted on below (with the reason)
          out["errors"].append(f"{task} round {r}: {type(e).__name__}: {e.reason}")
      return out

    async def go():
      async with SandboxClient(h.url, timeout_s=90.0) as c:
        return await asyncio.gather(*[worker(c, w) for w in range(WORKERS)])
    outs = run(go())
    errors = [e for o in outs for e in o["errors"]]
    assert errors == [], errors
    abandoned = [sid for o in outs for sid in o["abandoned"]]
    # the abandoned sessions expire, then their pages close (the reaper forgets first, then closes)
    health = _wait_for(h.url, lambda x: x["sessions"] == 0
                       and sum(b["pages"] for b in x["browsers"]) == x["idle_pages"])

    async def late():
      async with SandboxClient(h.url) as c:
        for sid in abandoned:
          with pytest.raises(P.LeaseExpired):
            await c.step(sid, "wait()")
    run(late())
  opened = sum(o["opened"] for o in outs)
  assert opened == WORKERS * ROUNDS
  assert health["opened"] == opened and health["closed"] == sum(o["closed"] for o in outs)
  assert health["expired"] == len(abandoned) == WORKERS * (ROUNDS // 4)
  # nothing lost, and nothing leaked: with a pass every 50 ms the GC would have closed (and counted)
  # any context left unowned; every Chromium context left is an idle page
  assert health["lost"] == 0 and health["gc_closed"] == 0, health
  assert sum(b["pages"] for b in health["browsers"]) == health["idle_pages"], health
  # the reuse path ran: a reusable task's closed page is either still idle or was taken by a later
  # open (idle may end at 0 when the last round's abandoned sessions took every pooled page)
  assert health["idle_pages"] + health["pages_reused"] > 0, health
