"""Crash recovery (issue #5 item 2) with real failures of real Chromium: a renderer crash (CDP
Page.crash), a page stuck in a JavaScript loop, and kill -9 of a Chromium process during a
16-session rollout driven by the client pool, which replays lost episodes from their seeds."""

import asyncio
import dataclasses
import os
import signal

import pytest
from prometheus_client.parser import text_string_to_metric_families

from envs_bridge import protocol as P
from envs_bridge.browser.sessions import BrowserSandbox
from envs_bridge.client import SessionPool
from envs_bridge.launch import launch_server
from _shared import run

pytestmark = pytest.mark.browser


def test_crashed_page_loses_only_its_session():
  async def go():
    sb = BrowserSandbox(gc_interval_s=3600)
    await sb.start()
    try:
      a, _ = await sb.open("miniwob/click-test", 1)
      b, _ = await sb.open("miniwob/click-test", 2)
      cdp = await sb.sessions[a].pg.context.new_cdp_session(sb.sessions[a].page)
      try:
        await cdp.send("Page.crash")  # the renderer really crashes; the call itself may not return
      except Exception:
        pass
      with pytest.raises(P.SessionLost) as e:
        for _ in range(50):  # the crash event may come a moment later
          await sb.step(a, "wait()")
          await asyncio.sleep(0.1)
      ob = await sb.step(b, "wait()")
      c, oc = await sb.open("miniwob/click-test", 3)
      return e.value, ob, oc, sb.health(), sb.events.kinds()
    finally:
      await sb.stop()
  err, ob, oc, h, kinds = run(go())
  assert err.extra["cause"] == "page_crash" and "crashed" in err.reason
  assert ob.info["step"] == 1 and oc.info["step"] == 0  # the other session and new ones work
  assert h["page_crashes"] == 1 and h["lost"] == 1 and h["browser_restarts"] == 0
  assert "page_crashed" in kinds and "session_lost" in kinds


def test_hung_page_is_detected_and_only_its_session_lost():
  async def go():
    sb = BrowserSandbox(gc_interval_s=3600)
    await sb.start()
    try:
      a, _ = await sb.open("miniwob/click-test", 1)
      b, _ = await sb.open("miniwob/click-test", 2)
      # a task timer that never returns: fires on the next clock advance (the step's run_for)
      await sb.sessions[a].page.evaluate("setTimeout(() => { while (true) {} }, 10)")
      # a short timeout only for the hung step: fresh pages on busy CI cores may take over 3 s
      default_timeout, sb.page_timeout_s = sb.page_timeout_s, 3.0
      with pytest.raises(P.SessionLost) as e:
        await sb.step(a, "wait()")
      sb.page_timeout_s = default_timeout
      ob = await sb.step(b, "wait()")
      c, oc = await sb.open("miniwob/click-test", 3)
      return e.value, ob, oc, sb.health(), sb.events.kinds()
    finally:
      await sb.stop()
  err, ob, oc, h, kinds = run(go())
  assert err.extra["cause"] == "page_hang" and "did not answer within 3 s" in err.reason
  assert ob.info["step"] == 1 and oc.info["step"] == 0
  assert h["page_hangs"] == 1 and h["lost"] == 1 and h["sessions"] == 2
  assert h["browsers"][0]["pages"] == 2  # the hung page was closed
  assert "page_hung" in kinds


async def _wait_spare(sb, pages):
  """Polls until the standby holds `pages` pages (no time asserted; 600 s only so it cannot hang)."""
  for _ in range(6000):
    info = sb.spare_info()
    if info is not None and info["pages"] >= pages:
      return info
    await asyncio.sleep(0.1)
  raise AssertionError(f"standby never held {pages} pages: {sb.spare_info()}")


def test_kill9_promotes_the_standby_and_its_pages_equal_fresh_ones():
  """kill -9 with a standby browser: it takes the dead browser's place, the lost sessions are still
  reported, and an episode on a standby page is byte-identical to one on a page created after the
  crash (same seed, same action)."""
  task = "miniwob/click-test-2"

  async def go():
    sb = BrowserSandbox(gc_interval_s=3600, spare_pages=2)
    await sb.start()
    try:
      a, _ = await sb.open(task, 1)
      b, _ = await sb.open(task, 2)
      spare = await _wait_spare(sb, 2)
      victim = sb.slots[0].pid
      os.kill(victim, signal.SIGKILL)
      with pytest.raises(P.SessionLost) as e:
        for _ in range(100):  # the disconnect may be noticed a moment later
          await sb.step(a, "wait()")
          await asyncio.sleep(0.1)
      created = sb.counters["pages_created"]
      out = []
      for seed in (7, 8, 7):  # two standby pages, then a page created now
        sid, ob = await sb.open(task, seed)
        ob2 = await sb.step(sid, "click(start_box='(300,500)')")
        out.append((ob.png(), ob2.png(), ob2.reward))
      created_after = sb.counters["pages_created"]
      with pytest.raises(P.SessionLost):
        await sb.step(b, "wait()")
      new_spare = await _wait_spare(sb, 0)  # a new standby was launched
      return (e.value, spare, victim, created, created_after, out, sb.health(), new_spare,
              [ev for ev in sb.events.since(0, 10_000)])
    finally:
      await sb.stop()

  err, spare, victim, created, created_after, out, h, new_spare, evs = run(go())
  assert err.extra["cause"] == "browser_crash"
  assert spare["pid"] != victim and spare["pss_mb"] > 0
  # the standby's pages served the first two replacements; the third page was made after the crash
  assert created_after == created + 1
  promoted = [ev for ev in evs if ev["kind"] == "spare_promoted"]
  assert len(promoted) == 1 and promoted[0]["pages"] == 2 and promoted[0]["pid"] == spare["pid"]
  opened = [ev for ev in evs if ev["kind"] == "session_opened"][-3:]
  assert [ev["reused"] for ev in opened] == [True, True, False]
  assert out[0] == out[2] and out[0][0] != out[1][0]  # same seed same pixels; another seed differs
  assert h["browsers"][0]["pid"] == spare["pid"] and h["recoveries"] == 1 and h["lost"] == 2
  assert h["spare_promotions"] == 1 and new_spare["pid"] not in (spare["pid"], victim)


# Fixed actions by step (the policy depends only on the observation), on click-test-2 whose two
# buttons move with the seed: some seeds score, some do not. The first one never ends an episode,
# so every session reaches the barrier at step 1.
ACTIONS = ["wait()", "click(start_box='(300,500)')", "click(start_box='(700,700)')", "click(start_box='(500,850)')"]


def _policy(barrier=None):
  async def policy(sess):
    step = sess.observation.info["step"]
    if barrier is not None and step == 1:
      await barrier(sess)
    return ACTIONS[step] if step < len(ACTIONS) else None
  return policy


def _metrics(text):
  return {(s.name, tuple(sorted(s.labels.items()))): s.value
          for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.mark.slow  # ~40 s each on 2 busy cores (two 16-episode rollouts); the fast kill -9 test is in test_browser_server
@pytest.mark.parametrize("spare_pages", [0, 16])  # 16: the lost sessions' replacements run on standby pages
def test_kill9_during_16_session_rollout_every_episode_accounted_for(spare_pages):
  n = 16
  with launch_server(n_browsers=2, spare_pages=spare_pages) as h:
    async def go():
      async with SessionPool([h.url], max_retries=2) as pool:
        c = pool.clients[0]
        ref = await asyncio.gather(*[pool.run_episode("miniwob/click-test-2", s, _policy()) for s in range(n)])
        ref_stats = dataclass_copy(pool.stats)
        health = await c.health()
        victim = health["browsers"][0]
        arrived, go_on, killed, spare_at_kill = [0], asyncio.Event(), [], []

        async def barrier(sess):
          # every session has taken one step: kill -9 browser 0 in the middle of the rollout
          arrived[0] += 1
          if arrived[0] == n:
            for _ in range(6000):  # a standby holding one page per live session (no time asserted)
              spare = (await c.health())["spare"]
              if spare is None or spare["pages"] >= n:
                break
              await asyncio.sleep(0.1)
            spare_at_kill.append(spare)
            on_victim = (await c.health())["browsers"][0]["sessions"]
            os.kill(victim["pid"], signal.SIGKILL)
            killed.append(on_victim)
            go_on.set()
          await asyncio.wait_for(go_on.wait(), 300)  # fail rather than hang if one never arrives

        out = await asyncio.gather(*[pool.run_episode("miniwob/click-test-2", s, _policy(barrier))
                                     for s in range(n)])
        for _ in range(300):  # the relaunch runs in the background: wait for it (no timing asserted)
          hh = await c.health()
          if hh["recoveries"] == 1 and hh["ok"]:
            break
          await asyncio.sleep(0.1)
        return ref, ref_stats, out, pool.stats, killed[0], victim, hh, _metrics(await c.metrics()), \
            await c.events(0, 10_000), _metrics(pool.metrics_text().decode()), spare_at_kill[0]
    ref, ref_stats, out, stats, on_victim, victim, hh, m, evs, pm, spare = run(go())
  assert ref_stats.episodes == n and ref_stats.episodes_lost == 0
  assert on_victim >= 1
  # every episode finished, and exactly as without the crash (virtual time: replays are exact)
  assert [o.lost for o in out] == [False] * n
  assert [[x.png() for x in o.observations] for o in out] == [[x.png() for x in r.observations] for r in ref]
  assert [(o.reward, o.done, o.actions) for o in out] == [(r.reward, r.done, r.actions) for r in ref]
  # every loss counted: the sessions on the killed browser, once each, each retried once
  retried = [o for o in out if o.attempts == 2]
  assert len(retried) == on_victim and all(o.attempts in (1, 2) for o in out)
  assert all("SessionLost" in o.lost_reasons[0] and "crashed" in o.lost_reasons[0] for o in retried)
  assert stats.episodes == 2 * n and stats.episodes_lost == on_victim == stats.episodes_retried
  assert stats.episodes_failed == 0
  assert pm[("sandbox_pool_episodes_lost_total", ())] == on_victim
  assert pm[("sandbox_pool_episodes_retried_total", ())] == on_victim
  # server side: one crash, one recovery, the lost sessions by cause, a new Chromium in its place
  assert hh["ok"] and hh["browser_restarts"] == 1 and hh["recoveries"] == 1 and hh["lost"] == on_victim
  assert hh["browsers"][0]["pid"] != victim["pid"] and hh["browsers"][0]["generation"] == 2
  assert hh["sessions"] == 0
  assert m[("sandbox_browser_crashes_total", ())] == 1 and m[("sandbox_recoveries_total", ())] == 1
  assert m[("sandbox_sessions_lost_total", (("cause", "browser_crash"),))] == on_victim
  assert m[("sandbox_recovery_seconds_count", ())] == 1
  crash = [e for e in evs if e["kind"] == "browser_crashed"]
  assert len(crash) == 1 and crash[0]["pid"] == victim["pid"] and crash[0]["sessions_lost"] == on_victim
  assert any(e["kind"] == "browser_recovered" and e["browser"] == 0 for e in evs)
  promoted = [e for e in evs if e["kind"] == "spare_promoted"]
  if spare_pages:
    # the standby took the dead browser's place with its 16 pages; the replayed episodes above ran
    # on them (and on browser 1's idle pages) and matched the reference pixel for pixel
    assert spare["pages"] == n and spare["pss_mb"] > 0
    assert len(promoted) == 1 and promoted[0]["pages"] == n and hh["browsers"][0]["pid"] == spare["pid"]
    assert hh["spare_promotions"] == 1
  else:
    assert spare is None and not promoted


def dataclass_copy(x):
  return dataclasses.replace(x)
