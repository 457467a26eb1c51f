"""Desktop sessions: one Xvfb display, real X programs, PyAutoGUI actions, the SDK on a shared directory.

Each session owns a display (`xserver.XDisplay`), a directory `<root>/<id>/work` that is at once the
terminal's cwd, the editor's folder, the browser's download directory and the SDK's root (the shared
file system of the report's GUI-SDK setting), and a private `<root>/<id>/private` (browser profile).
A step parses the action with the grammar (`tars_jax.agent.actions.parse`), runs a GUI action through
PyAutoGUI or an SDK action through `envs_bridge.sdk`, waits `step_ms` real milliseconds for the
programs to redraw, evaluates the task's check (OSWorld getter + metric) and screenshots.

Episode end: the check passes (reward 1), the agent says finished()/call_user() or a dialog the task
waits for is answered (reward = check score, 0 or 1), or `max_steps` is reached (reward 0). Protocol,
leases and typed errors are those of the browser sandbox (`envs_bridge/protocol.py`); X time is real,
not virtual (X programs have no clock to pause), so screenshots may differ in timing details.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
import uuid

from envs_bridge import protocol as P
from envs_bridge.desktop import checks, executor, tasks
from envs_bridge.desktop.webfiles import WebFiles
from envs_bridge.desktop.xserver import ProgramMissing, XDisplay, XServerError
from envs_bridge.sdk import SdkSession
from envs_bridge.sdk.terminal import Limits
from envs_bridge.session_table import SessionTable
from tars_jax.agent import actions as A

log = logging.getLogger("envs_bridge.desktop")
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--no-default-browser-check", "--password-store=basic",
                 "--disable-dev-shm-usage", "--test-type"]  # --test-type: no "--no-sandbox" warning bar over the page


@dataclasses.dataclass
class Session:
  id: str
  task: str
  seed: int
  spec: tasks.TaskSpec
  gui_only: bool
  coords: A.CoordSpec
  home: str  # <root>/<id>: work/ (shared with the agent) + private/
  work: str
  display: XDisplay
  actor: executor.Actor
  sdk: SdkSession
  procs: dict
  web_token: str | None
  last_used: float
  started: float
  step: int = 0
  done: bool = False
  outputs: dict = dataclasses.field(default_factory=dict)
  lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)


class DesktopSandbox:
  """Session manager of desktop / hybrid tasks.

  Args:
    step_ms: real milliseconds waited after each action before checking and screenshotting.
    lease_s: a session untouched this long is reclaimed -> LeaseExpired.
    max_sessions: concurrent sessions (ServerBusy beyond); each has its own Xvfb.
    width, height: screen pixels.
    root: where session directories go (default: a fresh temp dir, removed on stop).
    gui_only: disable SDK actions in every session (they become "invalid action" observations).
    limits: confinement of terminal commands (`sdk.terminal.Limits`).
    mcp_servers: {name: {'command', 'args', 'env'}} stdio MCP servers every session may call (a
      task's own `mcp_servers` add to these and win on name clashes); started on first use.
  """

  def __init__(self, step_ms: int = 300, lease_s: float = 300.0, max_sessions: int = 8,
               width: int = tasks.WIDTH, height: int = tasks.HEIGHT, root: str | None = None,
               gui_only: bool = False, limits: Limits = Limits(), mcp_servers: dict | None = None,
               window_timeout_s: float = 60.0):
    self.step_ms, self.lease_s, self.max_sessions = step_ms, lease_s, max_sessions
    self.window_timeout_s = window_timeout_s
    self.width, self.height, self.gui_only, self.limits = width, height, gui_only, limits
    self.mcp_servers = dict(mcp_servers or {})
    self._own_root = root is None
    self.root = root or tempfile.mkdtemp(prefix="tars-desktop-")
    self.sessions = SessionTable()  # live sessions by id, and the typed errors of ended ones
    self.web: WebFiles | None = None
    self._reaper: asyncio.Task | None = None
    self._opening = 0
    self.counters = {"steps": 0, "opened": 0, "closed": 0, "expired": 0, "lost": 0, "sdk_calls": 0,
                     "start_failed": 0}

  # -- lifecycle --------------------------------------------------------------------------------
  async def start(self) -> None:
    os.makedirs(self.root, exist_ok=True)
    self.web = WebFiles()
    self._reaper = asyncio.create_task(self._reap_loop())

  async def stop(self) -> None:
    if self._reaper:
      self._reaper.cancel()
    for sid in list(self.sessions):
      s = self.sessions.pop(sid)
      await self._teardown(s)
    if self.web:
      self.web.close()
    if self._own_root:
      shutil.rmtree(self.root, ignore_errors=True)

  async def _reap_loop(self):
    while True:
      await asyncio.sleep(max(0.05, min(5.0, self.lease_s / 4)))
      try:
        for sid, s in self.sessions.expired(self.lease_s):
          self.counters["expired"] += 1
          self.sessions.forget(sid, P.LeaseExpired(f"session {sid} reclaimed after {self.lease_s:g} s idle"))
          await self._teardown(s)
      except Exception:  # the reaper must outlive any one failure
        log.exception("lease reaper")

  # -- session API ------------------------------------------------------------------------------
  async def open(self, task: str, seed: int, coords: str = "relative1000",
                 data_mode: str = "train") -> tuple[str, P.Observation]:
    """Starts an episode: session directory with the task's files, Xvfb, the task's programs.

    Raises: UnknownTask, ServerBusy; TaskError (Xvfb or a task's program is not installed: no replay
    fixes that); SessionLost (Xvfb did not come up, or a program exited or did not open its window
    within `window_timeout_s`: the host's trouble, so a replay may succeed; counted `start_failed`).
    """
    try:
      spec, gui_only = tasks.make(task, seed)
    except KeyError:
      raise P.UnknownTask(f"unknown task {task!r}", tasks=list(tasks.task_names())) from None
    if len(self.sessions) + self._opening >= self.max_sessions:
      raise P.ServerBusy(f"{len(self.sessions)} sessions open and {self._opening} starting "
                         f"(max {self.max_sessions})")
    spec_c = A.CoordSpec(coords, self.width, self.height) if coords == "absolute" else A.CoordSpec()
    sid = uuid.uuid4().hex
    self._opening += 1
    try:
      s = await asyncio.to_thread(self._start_session, sid, task, seed, spec, gui_only or self.gui_only, spec_c)
    finally:
      self._opening -= 1
    self.sessions[sid] = s
    self.counters["opened"] += 1
    async with s.lock:
      return sid, await self._observation(s, 0.0, {})

  def _start_session(self, sid, task, seed, spec: tasks.TaskSpec, gui_only, coords) -> Session:
    home = os.path.join(self.root, sid)
    work, private = os.path.join(home, "work"), os.path.join(home, "private")
    os.makedirs(work)
    os.makedirs(private)
    for rel, text in spec.files.items():
      path = os.path.join(work, rel)
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    display = None
    token = None
    try:
      display = XDisplay(self.width, self.height)
      base_url = ""
      if spec.web:
        token = uuid.uuid4().hex
        base_url = self.web.add(token, spec.web)
      procs = {}
      for i, prog in enumerate(spec.programs):
        argv = [a.replace("{web}", base_url) for a in prog.argv]
        if argv[0] == "chromium":
          argv = self._chromium_argv(argv, private, work)
        procs[prog.label] = display.launch(argv, cwd=work, env=dict(prog.env),
                                           stdout=subprocess.PIPE if prog.capture_stdout else subprocess.DEVNULL)
        # One at a time: without a window manager the stacking order is the mapping order, so
        # waiting for each window makes the first screenshot the same in every episode.
        if not display.wait_for_windows(i + 1, timeout_s=self.window_timeout_s):
          code = procs[prog.label].poll()
          raise XServerError(f"{prog.label} of {task} " + (f"exited with status {code} before opening its window"
                             if code is not None else f"did not open its window in {self.window_timeout_s:g} s"))
      time.sleep(self.step_ms / 1000)  # let them draw their first frame
      actor = executor.Actor(display.name, self.width, self.height)
    except Exception as e:  # Xvfb, a program or Xlib failed: leave nothing behind
      if display is not None:
        display.close()
      if token:
        self.web.remove(token)
      shutil.rmtree(home, ignore_errors=True)
      if isinstance(e, ProgramMissing):
        raise P.TaskError(f"could not start {task}: {e}") from e
      self.counters["start_failed"] += 1
      raise P.SessionLost(f"could not start {task} seed {seed}: {e}") from e
    sdk = SdkSession(work, self.limits, {**self.mcp_servers, **spec.mcp_servers})
    now = time.monotonic()
    return Session(sid, task, seed, spec, gui_only, coords, home, work, display, actor, sdk, procs, token, now, now)

  def _chromium_argv(self, argv: list[str], private: str, work: str) -> list[str]:
    """Chromium on the session display (top 2/5 of the screen), downloads saved into the shared work
    directory without asking."""
    profile = os.path.join(private, "chromium")
    os.makedirs(os.path.join(profile, "Default"), exist_ok=True)
    prefs = {"download": {"default_directory": work, "prompt_for_download": False, "directory_upgrade": True},
             "savefile": {"default_directory": work}}
    with open(os.path.join(profile, "Default", "Preferences"), "w") as f:
      json.dump(prefs, f)
    return [CHROMIUM, *CHROMIUM_ARGS, f"--user-data-dir={profile}", "--window-position=0,0",
            f"--window-size={self.width},{self.height * 2 // 5}", *argv[1:]]

  async def step(self, sid: str, text: str) -> P.Observation:
    """Parses and runs one action, waits step_ms, checks the task, observes.

    Unparseable actions, unknown keys and SDK calls in GUI-only sessions give an observation with
    info.error; SDK results come back in info.tool_output (and info.tool_error when refused).
    Raises: UnknownSession, LeaseExpired, SessionLost (the display died).
    """
    s = self.sessions.lease(sid)
    async with s.lock:
      if s.done:
        return await self._observation(s, 0.0, {"error": "episode already done"})
      s.step += 1
      self.counters["steps"] += 1
      info: dict = {}
      end = False
      try:
        if len(text) > P.MAX_ACTION_CHARS:
          raise A.ActionParseError(f"action longer than {P.MAX_ACTION_CHARS} characters")
        action = A.parse(text, s.coords, sdk=True)  # GUI-only sessions refuse SDK calls below, with the reason
        info["action"] = A.format_action(action, s.coords)
        if A.is_sdk(action):
          if s.gui_only:
            raise A.ActionParseError("SDK functions are disabled in this session (GUI-only)")
          self.counters["sdk_calls"] += 1
          res = await s.sdk.execute(action)
          info.update(tool_output=res.text, tool_error=res.error)
        else:
          end = await asyncio.to_thread(s.actor.run, action)
      except (A.ActionParseError, executor.InvalidKey) as e:
        info["error"] = f"invalid action: {getattr(e, 'reason', None) or e}"
      except Exception as e:  # Xlib / connection errors: the display is gone
        if not s.display.alive():
          await self._lost(s, f"display died during step: {e!r}")
        raise
      await asyncio.sleep(self.step_ms / 1000)
      if not s.display.alive():
        await self._lost(s, "the X display died")
      # Exit first, then the check: a dialog that exits in between is then both collected by the
      # check and seen as exited (the other order scores it 0 without its output).
      exited = s.spec.end_on_exit is not None and s.procs[s.spec.end_on_exit].poll() is not None
      score, reason = self._check(s)
      reward = 0.0
      if score >= 1.0 or end or exited:
        s.done, reward = True, score
      elif s.step >= s.spec.max_steps:
        s.done, reason = True, f"step limit ({s.spec.max_steps}); {reason}"
      info.update(raw_reward=reward, reason=reason)
      return await self._observation(s, reward, info)

  def _check(self, s: Session) -> tuple[float, str]:
    for label, p in s.procs.items():  # collect what answered dialogs printed
      if p.stdout is not None and label not in s.outputs and p.poll() is not None:
        s.outputs[label] = p.stdout.read().decode(errors="replace")
    return checks.evaluate(s.spec.evaluator, checks.CheckState(s.work, s.outputs))

  async def observe(self, sid: str) -> P.Observation:
    """The current screenshot; no action; reward 0."""
    s = self.sessions.lease(sid)
    async with s.lock:
      return await self._observation(s, 0.0, {})

  async def close(self, sid: str) -> None:
    """Ends a session: kills its programs and Xvfb, stops its MCP servers, removes its directory.

    Idempotent for sessions that already ended. Raises: UnknownSession for ids never opened.
    """
    s = self.sessions.to_close(sid)
    if s is None:
      return
    self.sessions.forget(sid, P.UnknownSession(f"session {sid} was closed"))
    self.counters["closed"] += 1
    async with s.lock:
      await self._teardown(s)

  async def debug_state(self, sid: str) -> dict:
    """TESTS / EXPERTS / DEBUGGING ONLY (never shown to the agent): the session directory `work`, the
    display name, captured program `outputs` {label: text}, the `windows` tree (`XDisplay.windows`,
    pixels), the screen `width` / `height` (pixels), the task's `programs` {label: argv}, its
    `evaluator` (the check, with the expected value) and `entries` (sorted names in `work`)."""
    s = self.sessions.lease(sid)
    async with s.lock:
      wins = await asyncio.to_thread(s.display.windows)
      try:
        entries = sorted(os.listdir(s.work))
      except OSError:
        entries = []
      return {"work": s.work, "display": s.display.name, "outputs": dict(s.outputs), "windows": wins,
              "width": self.width, "height": self.height,
              "programs": {p.label: list(p.argv) for p in s.spec.programs}, "evaluator": s.spec.evaluator,
              "entries": entries}

  # -- internals --------------------------------------------------------------------------------
  async def _observation(self, s: Session, reward: float, info: dict) -> P.Observation:
    try:
      png = await asyncio.to_thread(s.display.screenshot_png)
    except OSError as e:
      await self._lost(s, f"screenshot failed: {e}")
    full = {"instruction": s.spec.instruction, "step": s.step,
            "elapsed_ms": int((time.monotonic() - s.started) * 1000), "raw_reward": 0.0, "reason": None,
            "error": None, "task": s.task, "seed": s.seed, "gui_only": s.gui_only,
            "mcp_servers": sorted(s.sdk.mcp.specs)}
    full.update(info)
    return P.Observation(screenshot_png_b64=base64.b64encode(png).decode(), reward=reward, done=s.done, info=full)

  async def _lost(self, s: Session, reason: str):
    self.counters["lost"] += 1
    self.sessions.forget(s.id, P.SessionLost(reason))
    await self._teardown(s)
    raise P.SessionLost(reason)

  async def _teardown(self, s: Session) -> None:
    try:
      await s.sdk.aclose()
    except Exception:
      log.exception("closing MCP servers of %s", s.id)
    s.actor.close()
    await asyncio.to_thread(s.display.close)
    if s.web_token:
      self.web.remove(s.web_token)
    await asyncio.to_thread(shutil.rmtree, s.home, True)
