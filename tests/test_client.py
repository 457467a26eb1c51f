"""Many concurrent sessions through the async client, and the round-robin session pool."""

import asyncio

import pytest

from envs_bridge import protocol as P
from envs_bridge.client import SandboxClient, SessionPool
from _shared import grid, run

pytestmark = pytest.mark.browser


async def _solve_click_test(c, seed):
  """Waits one step, then clicks the button; returns (reward, done, screenshots)."""
  sid, o0 = await c.open("miniwob/click-test", seed)
  o1 = await c.step(sid, "wait()")
  box = await c.element_box(sid, "#subbtn")
  x, y = grid(box)
  o2 = await c.step(sid, f"click(start_box='({x},{y})')")
  await c.close(sid)
  return o2.reward, o2.done, [o.screenshot_png_b64 for o in (o0, o1, o2)]


def test_eight_concurrent_sessions(server):
  async def go():
    async with SandboxClient(server.url) as c:
      conc = await asyncio.gather(*[_solve_click_test(c, s) for s in range(8)])
      seq = [await _solve_click_test(c, s) for s in range(8)]
      return conc, seq
  conc, seq = run(go())
  # every session scored by its own page (clicked after one virtual second: 1 - 1000/10000)
  assert [(r, d) for r, d, _ in conc] == [(pytest.approx(0.9), True)] * 8
  # sessions are isolated: running them concurrently changes nothing, and seeds differ
  assert [s for _, _, s in conc] == [s for _, _, s in seq]
  assert len({s[0] for _, _, s in conc}) > 1


def test_session_pool_round_robin(server):
  async def go():
    async with SessionPool([server.url, server.url + "/"]) as pool:
      sessions = await asyncio.gather(*[pool.open("miniwob/click-test-2", seed=s) for s in range(4)])
      assert [pool.clients.index(s.client) for s in sessions] == [0, 1, 0, 1]
      assert all(s.observation.info["instruction"].startswith("Click button") for s in sessions)
      outs = await asyncio.gather(*[s.step("wait()") for s in sessions])
      assert [o.info["step"] for o in outs] == [1] * 4 and sessions[0].observation is outs[0]
      assert (await pool.health())[0]["sessions"] >= 4
      for s in sessions:
        await s.close()
      with pytest.raises(P.UnknownSession):
        await sessions[0].observe()
  run(go())


def test_pool_needs_urls():
  with pytest.raises(ValueError):
    SessionPool([])
