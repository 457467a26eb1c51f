"""Sandbox platform (issue #5 items 1 and 3) against real servers with real Chromium: several
browsers per server, /health, /metrics (Prometheus text), /events, replay snapshots, the leaked-page
GC, and virtual time (same seed + same actions -> byte-equal screenshots, across browsers, servers
and wall-clock pauses)."""

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from envs_bridge import protocol as P
from envs_bridge.browser.sessions import DEFAULT_CHROMIUM, BrowserSandbox
from envs_bridge.client import SandboxClient
from envs_bridge.launch import launch_server
from _shared import grid, run

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def server2():
  """A server with two Chromium processes."""
  with launch_server(step_ms=1000, lease_s=60.0, n_browsers=2) as h:
    yield h


def _cmdline(pid):
  with open(f"/proc/{pid}/cmdline", "rb") as f:
    return f.read().split(b"\0")


def _metrics(text):
  """{(name, labels as sorted tuple): value} of a Prometheus text exposition."""
  out = {}
  for fam in text_string_to_metric_families(text):
    for s in fam.samples:
      out[(s.name, tuple(sorted(s.labels.items())))] = s.value
  return out


def test_sessions_spread_over_browsers_health_events_metrics(server2):
  async def go():
    async with SandboxClient(server2.url) as c:
      h0 = await c.health()
      m0 = _metrics(await c.metrics())
      last = (await c.events(0, 10_000))[-1]["seq"]
      sids = [(await c.open("miniwob/click-test", s))[0] for s in range(4)]
      h = await c.health()
      for sid in sids:
        await c.step(sid, "wait()")
      await c.step(sids[0], "wait()")
      await c.observe(sids[1])
      m1 = _metrics(await c.metrics())
      evs = await c.events(last)
      for sid in sids:
        await c.close(sid)
      return h0, h, m0, m1, evs, sids, await c.health()
  h0, h, m0, m1, evs, sids, h_end = run(go())
  assert h["ok"] and h["n_browsers"] == 2 and len(h["browsers"]) == 2
  assert [b["sessions"] for b in h["browsers"]] == [2, 2]  # fewest-sessions-first placement
  pids = [b["pid"] for b in h["browsers"]]
  assert len(set(pids)) == 2
  assert h["chromium"] == DEFAULT_CHROMIUM
  for pid in pids:  # real Chromium browser processes (not renderers) of the executable /health names
    argv = _cmdline(pid)
    assert argv[0] == DEFAULT_CHROMIUM.encode() and not any(a.startswith(b"--type=") for a in argv)
  assert all(b["pages"] >= 2 for b in h["browsers"])
  # events: one session_opened per session, on the browser /health reported
  opened = [e for e in evs if e["kind"] == "session_opened"]
  assert [e["session"] for e in opened] == sids and sorted(e["browser"] for e in opened) == [0, 0, 1, 1]
  assert [e["seq"] for e in evs] == sorted(e["seq"] for e in evs)
  # metrics: deltas equal what this test did (5 steps, 4 opens, 1 observe)
  def d(name, **labels):
    k = (name, tuple(sorted(labels.items())))
    return m1.get(k, 0.0) - m0.get(k, 0.0)
  assert d("sandbox_steps_total") == 5 == h_end["steps"] - h0["steps"]
  assert d("sandbox_op_seconds_count", op="step") == 5
  assert d("sandbox_op_seconds_count", op="open") == 4
  assert d("sandbox_op_seconds_count", op="observe") == 1
  assert d("sandbox_session_events_total", event="opened") == 4
  assert m1[("sandbox_sessions", ())] == 4 and m1[("sandbox_browsers_up", ())] == 2
  assert m1[("sandbox_steps_per_second", ())] > 0
  assert h_end["sessions"] == 0 and [b["sessions"] for b in h_end["browsers"]] == [0, 0]


STOCK = "miniwob/stock-market"  # prices redrawn every 100 ms from Math.random: time-driven content
STOCK_ACTIONS = ["wait()", "wait()", "click(start_box='(500,700)')", "wait()"]


async def _shots(url, task, seed, actions, pause_s=0.0, hold=0):
  """PNG bytes of an episode; `hold` sessions are opened first (they take the idle page of an
  earlier run, so the episode gets a fresh page, on another browser of a multi-browser server);
  `pause_s` of wall-clock time between steps."""
  async with SandboxClient(url) as c:
    held = [(await c.open(task, 1000 + i))[0] for i in range(hold)]
    sid, o = await c.open(task, seed)
    browser = (await c.health())["browsers"]
    shots = [o.png()]
    for a in actions:
      await asyncio.sleep(pause_s)
      shots.append((await c.step(sid, a)).png())
    for s in [sid, *held]:
      await c.close(s)
    return shots, browser


def test_virtual_time_same_seed_same_actions_same_screenshots(server, server2):
  # stock-market is in REUSE_UNSAFE_TASKS (a reused page would show the last episode's price before
  # the first tick, and `slow` below would differ from `ref`), so every run gets a fresh page.
  ref, _ = run(_shots(server.url, STOCK, 42, STOCK_ACTIONS))
  assert len({ref[0], ref[1], ref[2]}) == 3  # waiting changes the picture: time really moves the page
  slow, _ = run(_shots(server.url, STOCK, 42, STOCK_ACTIONS, pause_s=0.7))  # wall clock plays no part
  a, ha = run(_shots(server2.url, STOCK, 42, STOCK_ACTIONS, hold=0))  # another server, its browser 0 ...
  b, hb = run(_shots(server2.url, STOCK, 42, STOCK_ACTIONS, hold=1))  # ... and its browser 1
  assert [x["sessions"] for x in ha] == [1, 0] and [x["sessions"] for x in hb] == [1, 1]
  assert slow == ref and a == ref and b == ref  # byte-equal PNGs (slow ran right after ref: no page reuse)
  other, _ = run(_shots(server.url, STOCK, 43, STOCK_ACTIONS))
  assert other[0] != ref[0]


def test_snapshot_restore_replays_state(server, server2):
  async def go():
    async with SandboxClient(server.url) as c, SandboxClient(server2.url) as c2:
      sid, _ = await c.open("miniwob/click-checkboxes", 5)
      for a in ["click(start_box='(200,400)')", "Action: jump()", "click(start_box='(200,520)')"]:
        await c.step(sid, a)
      at_snap = await c.observe(sid)
      snap = await c.snapshot(sid)
      after = [await c.step(sid, a) for a in ["click(start_box='(200,640)')", "wait()"]]
      # restore into a session of another seed on another server (two-browser one)
      sid2, o2 = await c2.open("miniwob/click-checkboxes", 9)
      assert o2.png() != at_snap.png()
      restored = await c2.restore(sid2, snap)
      after2 = [await c2.step(sid2, a) for a in ["click(start_box='(200,640)')", "wait()"]]
      # a finished episode: done and reward state come back too
      sid3, _ = await c.open("miniwob/click-test", 3)
      x, y = grid(await c.element_box(sid3, "#subbtn"))
      won = await c.step(sid3, f"click(start_box='({x},{y})')")
      snap3 = await c.snapshot(sid3)
      sid4, _ = await c.open("miniwob/click-test", 4)
      r4 = await c.restore(sid4, snap3)
      late = await c.step(sid4, "wait()")
      # bad snapshots: another task, a tampered hash
      with pytest.raises(P.InvalidAction, match="cannot be restored"):
        await c.restore(sid4, snap)
      bad = snap.model_copy(update={"screenshot_sha256": "0" * 64})
      with pytest.raises(P.TaskError, match="differs"):
        await c2.restore(sid2, bad)
      return at_snap, snap, after, restored, after2, won, snap3, r4, late
  at_snap, snap, after, restored, after2, won, snap3, r4, late = run(go())
  assert snap.task == "miniwob/click-checkboxes" and snap.seed == 5 and snap.step == 3
  assert snap.actions[1] == "Action: jump()"  # invalid actions are part of the replay (time passed)
  assert restored.png() == at_snap.png()
  assert restored.info["step"] == 3 and restored.info["elapsed_ms"] == 3000 and restored.info["seed"] == 5
  assert restored.info["instruction"] == at_snap.info["instruction"]
  assert [o.png() for o in after2] == [o.png() for o in after]
  assert [(o.reward, o.done, o.info["elapsed_ms"]) for o in after2] == [(o.reward, o.done, o.info["elapsed_ms"])
                                                                          for o in after]
  assert won.done and won.reward == pytest.approx(1.0) and snap3.done
  assert r4.done and r4.png() == won.png()
  assert late.info["error"] == "episode already done"


def test_bad_requests_on_new_endpoints(server):
  r = httpx.post(server.url + "/sessions/deadbeef/snapshot")
  assert r.status_code == 404 and r.json()["error"] == "UnknownSession"
  r = httpx.post(server.url + "/sessions/deadbeef/restore", json={"task": "x"})
  assert r.status_code == 422  # missing fields
  assert httpx.get(server.url + "/events", params={"since": -1}).status_code == 422
  r = httpx.get(server.url + "/metrics")
  assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
  assert "sandbox_op_seconds_bucket" in r.text


def test_gc_closes_leaked_pages_and_spares_live_ones():
  async def go():
    sb = BrowserSandbox(n_browsers=1, gc_interval_s=3600)  # GC passes driven by the test
    await sb.start()
    try:
      browser = sb.slots[0].browser
      live, _ = await sb.open("miniwob/click-test", 1)
      idle, _ = await sb.open("miniwob/click-test", 2)
      leaked, _ = await sb.open("miniwob/click-test", 3)
      await sb.close(idle)  # its page goes to the idle pool: owned, not leaked
      sb.sessions.pop(leaked)  # a bug forgets a session: its page leaks
      await browser.new_context()  # a context no one owns (e.g. left by an interrupted open)
      n_before = len(browser.contexts)
      first = await sb.collect_garbage()  # unowned once: only suspected
      second = await sb.collect_garbage()  # unowned twice: closed
      o = await sb.step(live, "wait()")  # the live session is untouched
      return n_before, first, second, len(browser.contexts), o, sb.health(), sb.events.kinds()
    finally:
      await sb.stop()
  n_before, first, second, n_after, o, h, kinds = run(go())
  assert n_before == 4 and first == 0 and second == 2 and n_after == 2  # live + idle remain
  assert o.info["step"] == 1 and h["gc_closed"] == 2 and h["idle_pages"] == 1
  assert kinds.count("gc_closed_page") == 2


def test_lease_expiry_closes_the_page():
  async def go():
    sb = BrowserSandbox(lease_s=0.3, gc_interval_s=3600)
    await sb.start()
    try:
      sid, _ = await sb.open("miniwob/click-test", 0)
      pages = len(sb.slots[0].browser.contexts)
      deadline = time.monotonic() + 30
      while (sid in sb.sessions or sb.slots[0].browser.contexts) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # the reaper forgets the session first, then closes its page
      with pytest.raises(P.LeaseExpired):
        await sb.step(sid, "wait()")
      return pages, len(sb.slots[0].browser.contexts), sb.health()
    finally:
      await sb.stop()
  pages, after, h = run(go())
  assert pages == 1 and after == 0 and h["expired"] == 1 and h["sessions"] == 0 and h["idle_pages"] == 0


def test_idle_pages_reused_only_while_browsers_stay_balanced():
  """An open reuses an idle page only on a browser within `REUSE_IMBALANCE` sessions of the
  least-loaded one; otherwise it makes a fresh page on the least-loaded browser. (Plain reuse put every
  new session on the browser that held the idle pages, e.g. the survivor of a crash.)"""
  async def go():
    sb = BrowserSandbox(n_browsers=2, max_idle_pages=2, gc_interval_s=3600)
    await sb.start()
    try:
      sids = [(await sb.open("miniwob/click-test", i))[0] for i in range(8)]
      on = lambda sid: sb.sessions[sid].pg.slot.index
      placed = [on(s) for s in sids]
      for sid in [s for s in sids if on(s) == 1][:2]:  # browser 1: 2 sessions left, 2 idle pages (pool full)
        await sb.close(sid)
      for sid in [s for s in sids if s in sb.sessions and on(s) == 0]:  # browser 0: none left, pages closed
        await sb.close(sid)
      before = dict(sb.counters), [b["sessions"] for b in sb.health()["browsers"]], sb.health()["idle_pages"]
      a, _ = await sb.open("miniwob/click-test", 100)  # browser 1 is 2 above browser 0: fresh page on 0
      after_a = dict(sb.counters)
      b, _ = await sb.open("miniwob/click-test", 101)  # 2 vs 1: within the slack, browser 1's idle page
      return placed, before, (on(a), after_a), (on(b), dict(sb.counters))
    finally:
      await sb.stop()
  placed, (c0, loads, idle), (a_on, c1), (b_on, c2) = run(go())
  assert sorted(placed) == [0] * 4 + [1] * 4  # fresh pages go to the least-loaded browser
  assert loads == [0, 2] and idle == 2  # the test's premise: 2 above the least-loaded, slack 1
  assert a_on == 0 and c1["pages_created"] == c0["pages_created"] + 1 and c1["pages_reused"] == c0["pages_reused"]
  assert b_on == 1 and c2["pages_reused"] == c1["pages_reused"] + 1 and c2["pages_created"] == c1["pages_created"]
