"""Desktop sandbox: real Xvfb + xterm / xedit / xmessage driven through PyAutoGUI over the HTTP
protocol; every task solved with grammar actions and checked by its OSWorld-style evaluator; typed
errors, invalid actions and leases as in the browser sandbox."""

import asyncio
import os
import re
import time

import httpx
import numpy as np
import pytest

from _shared import poll
from envs_bridge import protocol as P
from envs_bridge.client import SandboxClient
from envs_bridge.desktop import checks, tasks
from envs_bridge.desktop.sessions import DesktopSandbox
from envs_bridge.launch import launch_server

W, H = tasks.WIDTH, tasks.HEIGHT


@pytest.fixture(scope="module")
def desk():
  with launch_server("envs_bridge.desktop.server", step_ms=250, lease_s=120.0, max_sessions=4) as h:
    yield h


def pt(x: float, y: float) -> str:
  """Pixel -> the 0-1000 grid point text of an action."""
  return f"'({round(x / W * 1000)},{round(y / H * 1000)})'"


def centre(w: dict) -> str:
  return pt(w["x"] + w["width"] / 2, w["y"] + w["height"] / 2)


def state(url: str, sid: str) -> dict:
  return httpx.get(f"{url}/debug/sessions/{sid}/state", timeout=30).json()


def buttons(windows: list[dict], left: int) -> list[dict]:
  """xmessage's buttons: its lowest row of depth-2 widgets right of `left`, sorted by x."""
  kids = [w for w in windows if w["depth"] == 2 and w["x"] >= left]
  low = max(w["y"] for w in kids)
  return sorted((w for w in kids if w["y"] == low), key=lambda w: w["x"])


def xedit_save_button(windows: list[dict], top: int = 0) -> dict:
  """The second of xedit's four top-row widgets (Quit, Save, Load, file name); `top`: the y of the
  xedit window (its widgets start one border pixel below)."""
  row = sorted((w for w in windows if w["depth"] == 3 and w["y"] == top + 1), key=lambda w: w["x"])
  return row[1]


async def settle(c, sid, obs, n=20):
  """wait() until the episode is done (X programs react in real time: a shell command typed with
  Enter may finish after the step's check; the agent would wait too); at most n steps."""
  while not obs.done and n > 0:
    obs, n = await c.step(sid, "wait()"), n - 1
  return obs


async def _episode(url, task, seed, steps, until_done=False):
  """Opens `task`, plays `steps` (strings, or callables (sid, obs) -> string), returns all observations
  (the last one after waiting for the end of the episode if `until_done`)."""
  async with SandboxClient(url) as c:
    sid, obs = await c.open(task, seed)
    out = [obs]
    try:
      for st in steps:
        out.append(await c.step(sid, st(sid, out[-1]) if callable(st) else st))
      if until_done:
        out[-1] = await settle(c, sid, out[-1])
    finally:
      await c.close(sid)
  return out


def word_of(obs, before: str) -> str:
  return obs.info["instruction"].split(before)[1].split()[0].rstrip(".")


def wait_for_file(url: str, sid: str, rel: str, timeout_s: float = 60.0) -> str:
  """Polls `rel` in the session directory (spending no episode step) until it is non-empty: X programs
  run in real time, so on a slow machine a command typed into the shell may write it steps later (and
  `>` creates it empty first). Returns the text; AssertionError with the last text seen at the deadline."""
  path = os.path.join(state(url, sid)["work"], rel)

  def read():
    try:
      with open(path, encoding="utf-8") as f:
        return f.read()
    except FileNotFoundError:
      return None
  text = poll(read, timeout_s)
  if not text:
    raise AssertionError(f"{rel} after {timeout_s:g} s: {text!r}")
  return text


def test_terminal_write_file_wrong_then_right(desk):
  def typed_nope(sid, o):  # once the shell has written the wrong answer, a step's check must see it
    wait_for_file(desk.url, sid, "answer.txt")
    return "Action: wait()"
  obs = asyncio.run(_episode(desk.url, "desktop/terminal-write-file", 3, [
      f"Action: click(start_box={pt(200, 150)})",
      "Action: type(content='echo nope > answer.txt\\n')", typed_nope,
      lambda sid, o: f"Thought: now the word\nAction: type(content='echo {word_of(o, 'word ')} > answer.txt\\n')"],
      until_done=True))
  first, click, typed, wrong, right = obs
  assert (typed.reward, typed.done) == (0.0, False)
  assert first.image().shape == (H, W, 3) and not first.done
  assert (wrong.reward, wrong.done) == (0.0, False)
  w = word_of(first, "word ")
  assert wrong.info["reason"] == f"exact_match(file_content='nope\\n', expected='{w}') -> 0"
  assert (right.reward, right.done, right.info["raw_reward"]) == (1.0, True, 1.0)
  # the screenshot is the real screen: xterm (white, 80x24 at +0+0) on Xvfb's black root window
  img = right.image()
  assert (img[300, 450] == 255).all() and (img[H - 5, W - 5] == 0).all()
  assert (img[:40, :200] < 128).any()  # the typed commands are drawn in the terminal


@pytest.mark.parametrize("task,pattern,command", [
    ("desktop/terminal-mkdir", r"directory named (\w+)\.", "mkdir {w}"),
    ("desktop/terminal-rename", r"to (\w+)\.txt\.", "mv draft.txt {w}.txt")])
def test_terminal_tasks(desk, task, pattern, command):
  obs = asyncio.run(_episode(desk.url, task, 5, [
      lambda sid, o: f"type(content='{command.format(w=re.search(pattern, o.info['instruction']).group(1))}\\n')"],
      until_done=True))
  assert (obs[-1].reward, obs[-1].done) == (1.0, True), obs[-1].info


def test_editor_type_and_save_with_the_save_button(desk):
  async def go():
    async with SandboxClient(desk.url) as c:
      sid, obs = await c.open("desktop/editor-type-save", 2)
      w = word_of(obs, "type ")
      wins = state(desk.url, sid)["windows"]
      typed = [await c.step(sid, f"click(start_box={pt(200, 200)})"), await c.step(sid, f"type(content='{w}')")]
      saved = await settle(c, sid, await c.step(sid, f"click(start_box={centre(xedit_save_button(wins))})"))
      await c.close(sid)
      return w, typed, saved
  w, typed, saved = asyncio.run(go())
  assert typed[1].reward == 0.0 and not typed[1].done  # typed but not saved: the file is still empty
  assert (saved.reward, saved.done) == (1.0, True)
  assert saved.info["reason"] == f"exact_match(file_content='{w}', expected='{w}') -> 1"


@pytest.mark.parametrize("pick_right", [True, False])
def test_dialog_choose(desk, pick_right):
  spec, _ = tasks.make("desktop/dialog-choose", 7)
  labels = spec.programs[0].argv[spec.programs[0].argv.index("-buttons") + 1].split(",")
  target = spec.evaluator["expected"]
  pick = target if pick_right else next(x for x in labels if x != target)

  async def go():
    async with SandboxClient(desk.url) as c:
      sid, obs = await c.open("desktop/dialog-choose", 7)
      btn = buttons(state(desk.url, sid)["windows"], left=200)[labels.index(pick)]
      out = await settle(c, sid, await c.step(sid, f"click(start_box={centre(btn)})"))
      after = await c.step(sid, "wait()")
      await c.close(sid)
      return out, after
  out, after = asyncio.run(go())
  assert out.done and out.reward == (1.0 if pick_right else 0.0)
  assert out.info["reason"] == f"exact_match(program_output='{pick}\\n', expected='{target}') -> {int(pick_right)}"
  assert after.info["error"] == "episode already done" and after.reward == 0.0


def test_invalid_actions_are_observations_and_finished_ends(desk):
  obs = asyncio.run(_episode(desk.url, "desktop/terminal-mkdir", 0, [
      "click(start_box='(2000,1)')", "hotkey(key='ctrl nosuchkey')", "Thought: no action", "finished(content='done')"]))
  off, key, none, fin = obs[1:]
  assert off.info["error"].startswith("invalid action: coordinates (2000,1) outside the screenshot")
  assert key.info["error"] == "invalid action: unknown key 'nosuchkey'"
  assert none.info["error"] == "invalid action: no 'Action:' in the reply"
  assert not (off.done or key.done or none.done) and [o.info["step"] for o in obs[1:]] == [1, 2, 3, 4]
  assert fin.done and fin.reward == 0.0 and fin.info["reason"].endswith("-> 0")


def test_unknown_task_and_session_are_typed(desk):
  async def go():
    async with SandboxClient(desk.url) as c:
      with pytest.raises(P.UnknownTask) as e:
        await c.open("desktop/nope")
      with pytest.raises(P.UnknownSession):
        await c.step("deadbeef", "wait()")
      return e.value, await c.tasks()
  err, names = asyncio.run(go())
  assert err.extra["tasks"] == names and len([n for n in names if n.startswith("desktop/")]) == 5


def test_lease_expiry_reclaims_the_display():
  async def go():
    sb = DesktopSandbox(step_ms=50, lease_s=0.5)
    await sb.start()
    try:
      sid, _ = await sb.open("desktop/terminal-mkdir", 0)
      xvfb = sb.sessions[sid].display.proc
      deadline = time.monotonic() + 30
      while sid in sb.sessions and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
      with pytest.raises(P.LeaseExpired):
        await sb.step(sid, "wait()")
      # The session is forgotten first, then torn down (programs, MCP servers, Xvfb) off the loop.
      while xvfb.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
      return xvfb.poll(), sb.counters["expired"]
    finally:
      await sb.stop()
  code, expired = asyncio.run(go())
  assert code is not None and expired == 1


def test_metrics():
  assert checks.exact_match(" a\n", "a") == 1.0 and checks.exact_match(True, True) == 1.0
  assert checks.number_match("1,234\n", 1234) == 1.0 and checks.number_match("12x", 12) == 0.0
  assert checks.set_equal(["b", "a"], ["a", "b"]) == 1.0 and checks.contains("xyz", "y") == 1.0
  st = checks.CheckState("/nonexistent", {"dialog": "Red\n"})
  assert checks.evaluate({"func": "exact_match", "result": {"type": "program_output", "program": "dialog"},
                          "expected": "Red"}, st)[0] == 1.0
  assert checks.get_file_content(st, {"path": "../etc/passwd"}) is None


def test_agent_loop_and_evaluation_run_unchanged_on_the_desktop(desk):
  """The trainer's rollout loop and the evaluator's summary, as they are, against the desktop server
  (a scripted policy in place of the model: it reads the word from its prompt tokens)."""
  from tars_jax.agent.tokenizer import ByteTokenizer
  from tars_jax.rollout.agent_loop import run_episodes
  from tars_jax.rollout.episode import LoopConfig
  from tars_jax.rollout.evaluation import summarize
  tok = ByteTokenizer()

  def act(prompts, images):
    out = []
    for ids, imgs in zip(prompts, images):
      assert imgs[-1].shape == (224, 168, 3)  # the loop resized the 480 x 640 desktop screenshot
      m = re.search(r"save the word (\w+) into", tok.decode(ids))
      reply = (f"Thought: type it\nAction: type(content='echo {m.group(1)} > answer.txt\\n')" if len(imgs) == 1
               else "Action: wait()")
      r = tok.encode(reply) + [tok.eos_id]
      out.append((r, np.zeros(len(r), np.float32), np.zeros(len(r), np.int32)))
    return out

  async def go():
    async with SandboxClient(desk.url) as c:
      return await run_episodes(act, [c], [("desktop/terminal-write-file", 11), ("desktop/terminal-write-file", 12)],
                                LoopConfig(max_turns=8), tok)
  eps = asyncio.run(go())
  assert [e.success for e in eps] == [True, True]
  assert summarize(eps)["desktop/terminal-write-file"]["success"] == 1.0


def test_a_dead_display_is_session_lost_and_the_sandbox_lives_on():
  async def go():
    sb = DesktopSandbox(step_ms=50)
    await sb.start()
    try:
      a, _ = await sb.open("desktop/terminal-mkdir", 0)
      b, _ = await sb.open("desktop/terminal-mkdir", 1)
      sb.sessions[a].display.proc.kill()  # Xvfb of session a dies
      sb.sessions[a].display.proc.wait()
      with pytest.raises(P.SessionLost):
        await sb.step(a, "wait()")
      with pytest.raises(P.SessionLost):  # and stays lost
        await sb.observe(a)
      return (await sb.step(b, "wait()")), sb.counters["lost"]
    finally:
      await sb.stop()
  other, lost = asyncio.run(go())
  assert lost == 1 and other.image().shape == (H, W, 3) and other.info["error"] is None


_RACER = """
import os, sys
from envs_bridge.desktop.xserver import XDisplay
from Xlib import display
x = XDisplay(width=int(sys.argv[1]))
os.environ.update(x.env())
d = display.Display(x.name)  # connects: the server listens when XDisplay returns
print("READY", x.name, d.screen().width_in_pixels, flush=True)
d.close()
sys.stdin.readline()
x.close()
"""


def _ready_line(proc) -> list[str]:
  for line in proc.stdout:
    if line.startswith("READY "):
      return line.split()[1:]
  return []


def test_processes_starting_displays_at_once_each_get_their_own_ready_server():
  """Six processes start an Xvfb each at the same moment (every search starts at :0), each of its own
  screen width: each ends on a distinct display, accepting connections when XDisplay returns, and the
  server it reaches there is its own (its screen width). Choosing the number in Python and waiting for
  the socket file gave two of six processes one display when their searches started together."""
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  widths = [W + 8 * i for i in range(6)]
  procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(w)], cwd=root, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=root)) for w in widths]
  try:
    lines = [_ready_line(p) for p in procs]  # python-xlib warns on stdout about the empty Xauthority
  finally:
    outs = [p.communicate("\n", timeout=60) for p in procs]
  assert all(p.returncode == 0 for p in procs), outs
  assert len({name for name, _ in lines}) == len(widths), lines
  assert [int(w) for _, w in lines] == widths


def test_a_session_that_cannot_start_is_lost_and_retryable_a_missing_program_is_a_task_error(monkeypatch):
  """Starting a session's programs on a real Xvfb: a program that exits before opening its window, or
  opens none in time, loses the attempt (SessionLost: retryable, counted `start_failed`, nothing left
  behind) and the sandbox serves the next session; an executable that is not installed is a TaskError
  (no replay fixes it)."""
  from envs_bridge.desktop import sessions as S
  real_make = tasks.make
  broken = {
      "test/exits": tasks.Program("dialog", ("sh", "-c", "exit 3")),
      "test/no-window": tasks.Program("dialog", ("sleep", "30")),
      "test/missing": tasks.Program("dialog", ("no-such-program-tars",)),
  }

  def make(name, seed):
    if name in broken:
      return tasks.TaskSpec("never", {}, (broken[name],), {}), False
    return real_make(name, seed)
  monkeypatch.setattr(S.tasks, "make", make)

  async def go():
    sb = DesktopSandbox(step_ms=50, window_timeout_s=3.0)
    await sb.start()
    try:
      errs = {}
      for name in broken:
        t0 = time.monotonic()
        with pytest.raises(P.SandboxError) as e:
          await sb.open(name, 7)
        errs[name] = (e.value, time.monotonic() - t0)
      assert not sb.sessions and not os.listdir(sb.root)  # no session, no directory left behind
      sid, obs = await sb.open("desktop/terminal-mkdir", 0)  # the sandbox goes on serving
      return errs, obs, dict(sb.counters)
    finally:
      await sb.stop()
  errs, obs, counters = asyncio.run(go())
  exits, no_window, missing = (errs[n][0] for n in broken)
  assert isinstance(exits, P.SessionLost) and "exited with status 3 before opening its window" in str(exits)
  assert errs["test/exits"][1] < 3.0  # found at once, not after the window timeout
  assert isinstance(no_window, P.SessionLost) and "did not open its window in 3 s" in str(no_window)
  assert P.is_retryable(exits) and P.is_retryable(no_window)
  assert isinstance(missing, P.TaskError) and "program not installed: no-such-program-tars" in str(missing)
  assert not P.is_retryable(missing)
  assert counters["start_failed"] == 2 and counters["opened"] == 1 and obs.image().shape == (H, W, 3)
