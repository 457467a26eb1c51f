"""One Chromium, many sessions (one browser context + page each), with leases and virtual time.

Time is virtual (Playwright `page.clock`): the clock is installed and paused before the task page
loads and only moves when a step advances it by `step_ms`, so the same seed and the same actions give
the same screenshots and rewards, and MiniWoB's 10 s episode time-out takes 10 steps, not 10 s.

Pages are reused across episodes of the same task, as MiniWoB itself does: a closed session's page
goes back to an idle pool and the next `open` only re-seeds it and calls `core.startEpisodeReal()`
(no new context, no page load), which is what makes resets cheap.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import time
import uuid

from playwright.async_api import Error as PlaywrightError
from playwright.async_api import async_playwright

from envs_bridge import protocol as P
from envs_bridge.browser import executor
from envs_bridge.browser import miniwob_tasks as mw
from tars_jax.agent import actions as A

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
log = logging.getLogger("envs_bridge.browser")


@dataclasses.dataclass
class Session:
  id: str
  task: str
  seed: int
  coords: A.CoordSpec
  context: object
  page: object
  generation: int  # browser generation the page belongs to
  last_used: float
  step: int = 0
  done: bool = False
  instruction: str = ""
  virtual_ms: int = 0
  lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)


class BrowserSandbox:
  """Session manager over one Chromium process.

  Args:
    step_ms: virtual milliseconds advanced after every step.
    lease_s: a session untouched this long is reclaimed (its page closed) -> LeaseExpired.
    max_sessions: concurrent sessions allowed (ServerBusy beyond).
    executable: Chromium binary.
  """

  def __init__(self, step_ms: int = 1000, lease_s: float = 300.0, max_sessions: int = 64,
               executable: str = "/usr/bin/chromium", max_idle_pages: int = 64):
    self.step_ms, self.lease_s, self.max_sessions, self.executable = step_ms, lease_s, max_sessions, executable
    self.sessions: dict[str, Session] = {}
    self.max_idle_pages = max_idle_pages
    self.idle: dict[str, list[tuple[object, object, int]]] = {}  # task -> [(context, page, generation)]
    self.expired: dict[str, str] = {}  # id -> reason, so late callers get a typed error
    self._pw = None
    self._browser = None
    self._generation = 0
    self._launch_lock = asyncio.Lock()
    self._reaper: asyncio.Task | None = None
    self.counters = {"steps": 0, "opened": 0, "closed": 0, "expired": 0, "lost": 0, "browser_restarts": 0,
                     "pages_created": 0, "pages_reused": 0}

  # -- lifecycle --------------------------------------------------------------------------------
  async def start(self) -> None:
    self._pw = await async_playwright().start()
    await self._ensure_browser()
    self._reaper = asyncio.create_task(self._reap_loop())

  async def stop(self) -> None:
    if self._reaper:
      self._reaper.cancel()
    for sid in list(self.sessions):
      await self.close(sid)
    if self._browser is not None:
      try:
        await self._browser.close()
      except PlaywrightError:
        pass
    if self._pw is not None:
      await self._pw.stop()

  async def _ensure_browser(self):
    async with self._launch_lock:
      if self._browser is not None and self._browser.is_connected():
        return self._browser
      if self._browser is not None:  # Chromium died: every page on it is gone
        self.counters["browser_restarts"] += 1
        for sid, s in list(self.sessions.items()):
          if s.generation == self._generation:
            self._forget(sid, "browser crashed and was restarted")
            self.counters["lost"] += 1
      self._browser = await self._pw.chromium.launch(executable_path=self.executable, args=CHROMIUM_ARGS)
      self._generation += 1
      return self._browser

  def _forget(self, sid: str, reason: str) -> None:
    self.sessions.pop(sid, None)
    self.expired[sid] = reason
    if len(self.expired) > 10_000:  # bounded memory of dead ids
      self.expired.pop(next(iter(self.expired)))

  async def _reap_loop(self):
    while True:
      await asyncio.sleep(max(0.05, min(5.0, self.lease_s / 4)))
      now = time.monotonic()
      for sid, s in list(self.sessions.items()):
        if now - s.last_used > self.lease_s and not s.lock.locked():
          log.info("lease expired: %s", sid)
          self.counters["expired"] += 1
          self._forget(sid, f"lease expired after {self.lease_s:g} s idle")
          await self._close_page(s)

  # -- session API ------------------------------------------------------------------------------
  async def open(self, task: str, seed: int, coords: str = "relative1000") -> tuple[str, P.Observation]:
    if task not in mw.task_names():
      raise P.UnknownTask(f"unknown task {task!r}", tasks=list(mw.task_names()))
    if len(self.sessions) >= self.max_sessions:
      raise P.ServerBusy(f"{len(self.sessions)} sessions open (max {self.max_sessions})")
    spec = A.CoordSpec(coords, mw.WIDTH, mw.HEIGHT) if coords == "absolute" else A.CoordSpec()
    browser = await self._ensure_browser()
    gen = self._generation
    pool = self.idle.setdefault(task, [])
    while pool and pool[-1][2] != gen:  # pages of a dead browser
      pool.pop()
    ctx = page = None
    try:
      if pool:
        ctx, page, _ = pool.pop()
        self.counters["pages_reused"] += 1
      else:
        ctx = await browser.new_context(viewport={"width": mw.WIDTH, "height": mw.HEIGHT})
        page = await ctx.new_page()
        await page.clock.install(time=0)
        await page.clock.pause_at(1000)
        await page.goto(mw.task_url(task))
        self.counters["pages_created"] += 1
      await page.evaluate(mw.start_script(seed))
      instruction = await page.evaluate(mw.UTTERANCE_SCRIPT)
    except PlaywrightError as e:
      if ctx is not None:
        await self._close_context(ctx)
      await self._ensure_browser()
      raise P.SessionLost(f"could not open {task}: {e}") from e
    sid = uuid.uuid4().hex
    s = Session(sid, task, seed, spec, ctx, page, gen, time.monotonic(), instruction=instruction)
    self.sessions[sid] = s
    self.counters["opened"] += 1
    return sid, await self._observation(s, 0.0, False, {})

  def _get(self, sid: str) -> Session:
    s = self.sessions.get(sid)
    if s is None:
      reason = self.expired.get(sid)
      if reason is None:
        raise P.UnknownSession(f"no session {sid!r}")
      if reason.startswith("lease expired"):
        raise P.LeaseExpired(reason)
      raise P.SessionLost(reason)
    s.last_used = time.monotonic()
    return s

  async def step(self, sid: str, text: str) -> P.Observation:
    s = self._get(sid)
    async with s.lock:
      if s.done:
        return await self._observation(s, 0.0, True, {"error": "episode already done"})
      s.step += 1
      self.counters["steps"] += 1
      try:
        action = A.parse(text, s.coords)
      except A.ActionParseError as e:
        # A malformed action is an observation (and a format signal), never a crash.
        await self._advance(s)
        st = await self._state(s)
        return await self._finish(s, st, {"error": f"invalid action: {e.reason}"})
      try:
        end = await executor.execute(s.page, action, mw.WIDTH, mw.HEIGHT)
        await self._advance(s)
        st = await self._state(s)
      except PlaywrightError as e:
        await self._lost(s, f"page failed during step: {e}")
      if end:  # finished()/call_user(): the episode ends with whatever the page has scored
        st["done"] = True
      return await self._finish(s, st, {"action": A.format_action(action, s.coords)})

  async def observe(self, sid: str) -> P.Observation:
    s = self._get(sid)
    async with s.lock:
      try:
        st = await self._state(s)
      except PlaywrightError as e:
        await self._lost(s, f"page failed: {e}")
      return await self._observation(s, st["reward"] if st["done"] else 0.0, s.done, {})

  async def close(self, sid: str) -> None:
    s = self.sessions.pop(sid, None)
    if s is None:
      self._get(sid)  # raises the right typed error
      return
    self.expired[sid] = "session closed"
    self.counters["closed"] += 1
    pool = self.idle.setdefault(s.task, [])
    if s.generation == self._generation and sum(map(len, self.idle.values())) < self.max_idle_pages:
      pool.append((s.context, s.page, s.generation))  # reused by the next open of this task
    else:
      await self._close_page(s)

  async def element_box(self, sid: str, selector: str) -> dict | None:
    """Bounding box (pixels) of the first element matching `selector` (inspection/test aid)."""
    s = self._get(sid)
    el = await s.page.query_selector(selector)
    return None if el is None else await el.bounding_box()

  # -- internals --------------------------------------------------------------------------------
  async def _advance(self, s: Session) -> None:
    await s.page.clock.run_for(self.step_ms)
    s.virtual_ms += self.step_ms

  async def _state(self, s: Session) -> dict:
    return await s.page.evaluate(mw.STATE_SCRIPT)

  async def _finish(self, s: Session, st: dict, info: dict) -> P.Observation:
    s.done = bool(st["done"])
    reward = float(st["reward"]) if s.done else 0.0
    info.update(raw_reward=float(st["raw_reward"]) if s.done else 0.0, reason=st["reason"])
    return await self._observation(s, reward, s.done, info)

  async def _observation(self, s: Session, reward: float, done: bool, info: dict) -> P.Observation:
    try:
      png = await s.page.screenshot(type="png")
    except PlaywrightError as e:
      await self._lost(s, f"screenshot failed: {e}")
    info = dict(info, instruction=s.instruction, step=s.step, virtual_ms=s.virtual_ms, task=s.task, seed=s.seed)
    return P.Observation(screenshot_png_b64=base64.b64encode(png).decode(), reward=reward, done=done, info=info)

  async def _lost(self, s: Session, reason: str):
    self.counters["lost"] += 1
    self._forget(s.id, reason)
    await self._close_page(s)
    await self._ensure_browser()
    raise P.SessionLost(reason)

  async def _close_page(self, s: Session) -> None:
    await self._close_context(s.context)

  @staticmethod
  async def _close_context(ctx) -> None:
    try:
      await ctx.close()
    except PlaywrightError:
      pass
