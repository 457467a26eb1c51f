"""The real sandbox server with real Chromium and real MiniWoB++ pages.

The right button of a task is found through the DOM (the server's debug element_box endpoint) and
clicked through the action grammar, so rewards are the page's own, not ours.
"""

import os
import re
import signal

import httpx
import numpy as np
import pytest

from envs_bridge import protocol as P
from envs_bridge.client import SandboxClient
from envs_bridge.launch import launch_server
from _shared import grid, poll, run

pytestmark = pytest.mark.browser
W, H = 160, 210


async def _click_element(c, sid, selector):
  x, y = grid(await c.element_box(sid, selector))
  return await c.step(sid, f"Thought: click it\nAction: click(start_box='({x},{y})')")


def test_click_on_button_rewards_and_ends(server):
  async def go():
    async with SandboxClient(server.url) as c:
      sid, obs0 = await c.open("miniwob/click-test", 3)
      assert obs0.info["instruction"] == "Click the button." and not obs0.done
      assert obs0.image().shape == (H, W, 3) and obs0.image().dtype == np.uint8
      obs = await _click_element(c, sid, "#subbtn")
      assert obs.done and obs.reward == pytest.approx(1.0)  # clicked at virtual t=0: no time discount
      assert obs.info["raw_reward"] == 1.0 and obs.info["error"] is None
      assert obs.info["action"].startswith("click(start_box=")
      # click-test-2: the right button (ONE) +1, the wrong one (TWO) -1
      sid, o2 = await c.open("miniwob/click-test-2", 5)
      assert o2.info["instruction"] == "Click button ONE."
      ok = await _click_element(c, sid, "#subbtn")
      assert ok.done and ok.reward > 0
      sid, _ = await c.open("miniwob/click-test-2", 5)
      bad = await _click_element(c, sid, "#subbtn2")
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
      assert not obs.done and obs.reward == 0.0 and obs.info["elapsed_ms"] == 1000
      # later click on the button: reward discounted by one virtual second (1 - 1000/10000)
      obs = await _click_element(c, sid, "#subbtn")
      assert obs.done and obs.reward == pytest.approx(0.9) and obs.info["raw_reward"] == 1.0
  run(go())


def test_typing_into_enter_text(server):
  async def go():
    async with SandboxClient(server.url) as c:
      sid, o = await c.open("miniwob/enter-text", 4)
      word = re.search(r'Enter "(.+?)"', o.info["instruction"]).group(1)
      await _click_element(c, sid, "#tt")
      o = await c.step(sid, f"Action: type(content='{word}')")
      assert not o.done
      o = await _click_element(c, sid, "#subbtn")
      assert o.done and o.info["raw_reward"] == 1.0 and o.reward == pytest.approx(0.8)  # clicked at t = 2 s
      sid, _ = await c.open("miniwob/enter-text", 4)
      await _click_element(c, sid, "#tt")
      await c.step(sid, f"type(content='{word}x')")
      o = await _click_element(c, sid, "#subbtn")
      assert o.done and o.reward == -1.0
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
      assert o.info["elapsed_ms"] == 10_000 and o.info["step"] == 10
      # the session is done: further steps report done, reward 0, and are not counted
      o = await c.step(sid, "wait()")
      assert o.done and o.reward == 0.0 and o.info["error"] == "episode already done" and o.info["step"] == 10
  run(go())


def test_invalid_action_is_an_observation(server):
  async def go():
    async with SandboxClient(server.url) as c:
      sid, _ = await c.open("miniwob/click-test", 2)
      o = await c.step(sid, "Thought: hmm\nAction: jump(high='yes')")
      assert not o.done and o.reward == 0.0
      assert o.info["error"].startswith("invalid action: unknown action 'jump'")
      assert o.info["step"] == 1 and o.info["elapsed_ms"] == 1000  # counted, time passed
      o = await c.step(sid, "hotkey(key='ctrl nosuchkey')")
      assert not o.done and o.info["error"] == "invalid action: unknown key 'nosuchkey'"
      o = await c.step(sid, "x" * (P.MAX_ACTION_CHARS + 1))
      assert not o.done and "longer than" in o.info["error"]
      o = await c.step(sid, "wait()")
      assert o.info["error"] is None and o.info["step"] == 4
      o = await _click_element(c, sid, "#subbtn")  # the episode went on normally
      assert o.done and o.reward == pytest.approx(0.6)  # clicked at t = 4 s
  run(go())


def test_finished_ends_the_episode_with_the_page_reward(server):
  async def go():
    async with SandboxClient(server.url) as c:
      sid, _ = await c.open("miniwob/click-test", 6)
      o = await c.step(sid, "Thought: I am done\nAction: finished(content='done')")
      assert o.done and o.reward == 0.0 and o.info["reason"] is None  # the page never scored it
      o = await c.step(sid, "wait()")
      assert o.done and o.info["error"] == "episode already done"
  run(go())


def test_absolute_coordinates(server):
  async def go():
    async with SandboxClient(server.url) as c:
      sid, _ = await c.open("miniwob/click-test", 8, coords="absolute")
      b = await c.element_box(sid, "#subbtn")
      x, y = round(b["x"] + b["width"] / 2), round(b["y"] + b["height"] / 2)
      o = await c.step(sid, f"click(start_box='({x},{y})')")
      assert o.done and o.reward == pytest.approx(1.0)
      sid, _ = await c.open("miniwob/click-test", 8, coords="absolute")
      o = await c.step(sid, "click(start_box='(170,10)')")  # off the 160 px wide screenshot
      assert "outside the screenshot" in o.info["error"]
  run(go())


ACTIONS = ["click(start_box='(500,500)')", "wait()", "click(start_box='(100,900)')",
           "type(content='abc')", "scroll(start_box='(500,600)', direction='down')"]


async def _episode(c, task, seed, actions=ACTIONS):
  sid, o = await c.open(task, seed)
  shots = [o.screenshot_png_b64]
  for a in actions:
    o = await c.step(sid, a)
    shots.append(o.screenshot_png_b64)
  await c.close(sid)
  return shots


def test_same_seed_same_actions_same_screenshots(server):
  async def go():
    async with SandboxClient(server.url) as c:
      before = (await c.health())["pages_created"]
      a = await _episode(c, "miniwob/click-checkboxes", 77)  # the first page of this task: fresh
      assert (await c.health())["pages_created"] == before + 1
      b = await _episode(c, "miniwob/click-checkboxes", 77)  # the same page, reused
      assert (await c.health())["pages_created"] == before + 1
      other = await _episode(c, "miniwob/click-checkboxes", 78)
      return a, b, other
  a, b, other = run(go())
  assert a == b
  assert other[0] != a[0]  # a different seed gives a different task


def test_scrolling_never_shows_the_reward_panel(server):
  # MiniWoB's page is wider than #wrap; its reward panel must not scroll into the screenshot.
  async def go():
    async with SandboxClient(server.url) as c:
      x = await _episode(c, "miniwob/click-test", 21, ["wait()", "wait()"])
      y = await _episode(c, "miniwob/click-test", 21,
                         ["scroll(start_box='(900,900)', direction='right')", "hotkey(key='end')"])
      return x, y
  x, y = run(go())
  assert x == y


def test_errors_are_typed(server):
  async def go():
    async with SandboxClient(server.url) as c:
      tasks = await c.tasks()
      assert "miniwob/click-test" in tasks and len(tasks) > 100 and tasks == sorted(tasks)
      with pytest.raises(P.UnknownTask) as e:
        await c.open("miniwob/no-such-task", 0)
      assert "miniwob/click-test" in e.value.extra["tasks"]
      with pytest.raises(P.UnknownSession):
        await c.step("deadbeef", "wait()")
      with pytest.raises(P.UnknownSession):
        await c.observe("deadbeef")
      sid, _ = await c.open("miniwob/click-test", 0)
      o = await c.observe(sid)
      assert o.info["step"] == 0 and not o.done
      await c.close(sid)
      await c.close(sid)  # idempotent
      with pytest.raises(P.UnknownSession, match="closed"):
        await c.step(sid, "wait()")
      with pytest.raises(P.SandboxError) as e:  # FastAPI validation: not a typed error
        await c.open("miniwob/click-test", -1)
      assert e.value.status == 422
  run(go())
  r = httpx.post(server.url + "/sessions", content=b"{not json", headers={"content-type": "application/json"})
  assert r.status_code == 422
  r = httpx.post(server.url + "/sessions", json={"task": "miniwob/nope"})
  assert r.status_code == 404 and r.json()["error"] == "UnknownTask"
  assert httpx.get(server.url + "/health").json()["ok"]
  assert "/sessions/{sid}/step" in httpx.get(server.url + "/openapi.json").json()["paths"]


def test_lease_expiry_reclaims_session():
  with launch_server(lease_s=1.0) as h:
    async def go():
      async with SandboxClient(h.url) as c:
        sid, _ = await c.open("miniwob/click-test", 0)
        return sid
    sid = run(go())
    assert poll(lambda: httpx.get(h.url + "/health").json()["sessions"] == 0)

    async def history():
      async with SandboxClient(h.url) as c:
        return [(e["kind"], e.get("session")) for e in await c.events()]
    # the session was live, then the reaper (not a close) ended it; read from the event log, not a
    # /health poll that a 1 s lease on busy cores could outrun
    mine = [k for k, s in run(history()) if s == sid]
    assert mine == ["session_opened", "session_expired"], mine
    assert httpx.get(h.url + "/health").json()["opened"] == 1

    async def late():
      async with SandboxClient(h.url) as c:
        with pytest.raises(P.LeaseExpired):
          await c.step(sid, "wait()")
    run(late())


def _descendants(pid):
  """Pids of all processes below `pid` (Linux /proc)."""
  children = {}
  for d in os.listdir("/proc"):
    if d.isdigit():
      try:
        with open(f"/proc/{d}/stat") as f:
          ppid = int(f.read().rsplit(")", 1)[1].split()[1])
      except (OSError, IndexError, ValueError):
        continue
      children.setdefault(ppid, []).append(int(d))
  out, todo = [], [pid]
  while todo:
    for c in children.get(todo.pop(), []):
      out.append(c)
      todo.append(c)
  return out


def _chromium_main(server_pid):
  for p in _descendants(server_pid):
    try:
      with open(f"/proc/{p}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    except OSError:
      continue
    if b"chromium" in argv[0] and not any(a.startswith(b"--type=") for a in argv):
      return p
  return None


def test_chromium_crash_loses_sessions_and_recovers():
  with launch_server() as h:
    async def go():
      async with SandboxClient(h.url) as c:
        sid, _ = await c.open("miniwob/click-test", 0)
        pid = _chromium_main(h.proc.pid)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(P.SessionLost) as e:
          for _ in range(50):  # the server notices the dead browser (event or pid) by the next call
            await c.step(sid, "wait()")
        assert e.value.extra["cause"] == "browser_crash" and f"pid {pid}" in e.value.reason
        sid2, _ = await c.open("miniwob/click-test", 3)  # a new Chromium serves new sessions
        o = await _click_element(c, sid2, "#subbtn")
        assert o.done and o.reward == pytest.approx(1.0)
        health = await c.health()
        assert health["browser_restarts"] == 1 and health["lost"] == 1 and health["recoveries"] == 1
        assert health["browsers"][0]["pid"] != pid
    run(go())


def test_elements_lists_visible_elements_with_their_text_and_boxes(server):
  """The debug `elements` call (experts, grounding data) agrees with element_box and the page: the
  click-test-2 button whose text the instruction names is where clicking rewards."""
  async def go():
    async with SandboxClient(server.url) as c:
      sid, obs = await c.open("miniwob/click-test-2", 3)
      els = await c.elements(sid)
      label = re.search(r"button (\w+)", obs.info["instruction"]).group(1)
      buttons = {e["text"]: e for e in els if e["tag"] == "button"}
      assert set(buttons) == {"ONE", "TWO"} and all(b["leaf"] for b in buttons.values())
      target = buttons[label]
      box = await c.element_box(sid, "#" + target["id"])
      assert [target[k] for k in ("x", "y", "width", "height")] == pytest.approx(
          [box[k] for k in ("x", "y", "width", "height")], abs=1.0)
      query = next(e for e in els if e["id"] == "query")
      assert query["text"] == obs.info["instruction"] and (query["x"], query["y"]) == (0, 0)
      assert all(0 <= e["x"] and e["x"] + e["width"] <= W + 1e-6 and e["y"] + e["height"] <= H + 1e-6
                 for e in els)
      x, y = grid(target)
      obs = await c.step(sid, f"Thought: the {label} button\nAction: click(start_box='({x},{y})')")
      assert obs.done and obs.reward > 0
      sid2, _ = await c.open("miniwob/click-checkboxes", 3)
      boxes = [e for e in await c.elements(sid2) if e["type"] == "checkbox"]
      assert boxes and all(e["text"] == "" and not e["checked"] for e in boxes)
  run(go())
