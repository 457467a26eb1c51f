"""The real sandbox server with real Chromium and real MiniWoB++ pages."""

import asyncio

import httpx
import numpy as np
import pytest

from envs_bridge import protocol as P
from envs_bridge.client import SandboxClient

pytestmark = pytest.mark.browser
W, H = 160, 210


def run(coro):
  return asyncio.new_event_loop().run_until_complete(coro)


def grid(box):
  """Centre of a pixel box -> 0-1000 grid coordinates."""
  return round((box["x"] + box["width"] / 2) / W * 1000), round((box["y"] + box["height"] / 2) / H * 1000)


async def _click_element(c, task, seed, selector):
  sid, obs = await c.open(task, seed)
  box = await c.element_box(sid, selector)
  x, y = grid(box)
  return sid, obs, await c.step(sid, f"Thought: click it\nAction: click(start_box='({x},{y})')")


def test_click_on_button_rewards_and_ends(server):
  async def go():
    async with SandboxClient(server.url) as c:
      sid, obs0, obs = await _click_element(c, "miniwob/click-test", 3, "#subbtn")
      assert obs0.info["instruction"] == "Click the button."
      assert obs0.image().shape == (H, W, 3)
      assert obs.done and obs.reward == pytest.approx(1.0)  # clicked at virtual t=0: no time discount
      # click-test-2: the right button (ONE) +1, the wrong one (TWO) -1
      _, o2, ok = await _click_element(c, "miniwob/click-test-2", 5, "#subbtn")
      assert o2.info["instruction"] == "Click button ONE." and ok.done and ok.reward > 0
      _, _, bad = await _click_element(c, "miniwob/click-test-2", 5, "#subbtn2")
      assert bad.done and bad.reward == -1.0
  run(go())


def test_click_on_empty_space_does_not_end(server):
  async def go():
    async with SandboxClient(server.url) as c:
      sid, _ = await c.open("miniwob/click-test", 11)
      box = await c.element_box(sid, "#subbtn")
      # a point of the task area outside the button
      px = 5 if box["x"] > 20 else 155
      py = 205 if box["y"] + box["height"] < 195 else 55
      obs = await c.step(sid, f"click(start_box='({round(px / W * 1000)},{round(py / H * 1000)})')")
      assert not obs.done and obs.reward == 0.0
      # later click on the button: reward discounted by one virtual second (1 - 1000/10000)
      x, y = grid(box)
      obs = await c.step(sid, f"click(start_box='({x},{y})')")
      assert obs.done and obs.reward == pytest.approx(0.9)
  run(go())


def test_virtual_time_timeout_gives_minus_one(server):
  async def go():
    async with SandboxClient(server.url) as c:
      sid, _ = await c.open("miniwob/click-test", 1)
      rewards = []
      for _ in range(10):
        o = await c.step(sid, "Action: wait()")
        rewards.append((o.done, o.reward))
      assert rewards[:9] == [(False, 0.0)] * 9
      assert rewards[9] == (True, -1.0) and o.info["reason"] == "timed out"
  run(go())


def test_invalid_action_is_an_observation(server):
  async def go():
    async with SandboxClient(server.url) as c:
      sid, _ = await c.open("miniwob/click-test", 2)
      o = await c.step(sid, "Thought: hmm\nAction: jump(high='yes')")
      assert not o.done and o.info["error"].startswith("invalid action: unknown action 'jump'")
      assert o.info["step"] == 1
      o = await c.step(sid, "wait()")
      assert "error" not in o.info and o.info["step"] == 2
  run(go())


def test_same_seed_same_actions_same_screenshots(server):
  async def episode():
    async with SandboxClient(server.url) as c:
      sid, o = await c.open("miniwob/click-test-2", 77)
      shots = [o.screenshot_png_b64]
      for a in ["click(start_box='(500,500)')", "wait()", "click(start_box='(100,900)')"]:
        shots.append((await c.step(sid, a)).screenshot_png_b64)
      return shots
  a, b = run(episode()), run(episode())
  assert a == b
  # and a different seed gives a different first screenshot
  async def other():
    async with SandboxClient(server.url) as c:
      return (await c.open("miniwob/click-test-2", 78))[1].screenshot_png_b64
  assert run(other()) != a[0]


def test_errors_are_typed(server):
  async def go():
    async with SandboxClient(server.url) as c:
      assert "miniwob/click-test" in await c.tasks() and len(await c.tasks()) > 100
      with pytest.raises(P.UnknownTask) as e:
        await c.open("miniwob/no-such-task", 0)
      assert "miniwob/click-test" in e.value.extra["tasks"]
      with pytest.raises(P.UnknownSession):
        await c.step("deadbeef", "wait()")
      sid, _ = await c.open("miniwob/click-test", 0)
      await c.close(sid)
      with pytest.raises(P.SandboxError):
        await c.step(sid, "wait()")
  run(go())
  r = httpx.post(server.url + "/sessions", content=b"{not json", headers={"content-type": "application/json"})
  assert r.status_code == 422
  r = httpx.post(server.url + "/sessions", json={"task": "miniwob/click-test", "seed": -1})
  assert r.status_code == 422
  assert httpx.get(server.url + "/health").json()["ok"]


def test_lease_expiry_reclaims_session():
  from envs_bridge.launch import launch_server
  async def go(url):
    async with SandboxClient(url) as c:
      sid, _ = await c.open("miniwob/click-test", 0)
      assert (await c.health())["sessions"] == 1
      await asyncio.sleep(3.0)  # lease_s = 1: the reaper closes the page
      assert (await c.health())["sessions"] == 0
      with pytest.raises(P.LeaseExpired):
        await c.step(sid, "wait()")
  with launch_server(lease_s=1.0) as h:
    run(go(h.url))
