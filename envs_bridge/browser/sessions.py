"""One Chromium, many sessions (one browser context + page each), with leases and virtual time.

Time is virtual (Playwright `page.clock`): the clock is installed and paused before the task page
loads and only moves when a step advances it by `step_ms`, so the same seed and the same actions give
the same screenshots and rewards, and MiniWoB's 10 s episode time-out takes 10 steps, not 10 s.

Pages are reused across episodes of the same task, as MiniWoB itself does: a closed session's page
goes back to an idle pool and the next `open` only cleans it (focus, scroll, pointer, wall-clock
date) and restarts the episode with the seed (no new context, no page load), which is what makes
resets cheap. A reused page gives the same screenshots as a fresh one (tested).

Concurrency: one asyncio loop; each session has its own lock (a step and an observe of the same
session never interleave) and nothing locks across sessions, so N sessions step in parallel.
Failures: a Playwright error on a page -> that session is `SessionLost`; a dead Chromium is relaunched
on the next request and every session on it is `SessionLost`.
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
from envs_bridge.browser import tasks
from tars_jax.agent import actions as A

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
# Wall-clock date every episode starts at (2024-01-01T00:00:00Z): tasks that print dates (terminal)
# look the same on fresh and reused pages. Timers run on the clock's ticks, which this does not move.
EPOCH_MS = 1_704_067_200_000
MAX_PAGE_STEPS = 20_000  # a page is retired after this many steps (each clock call adds an init script)
log = logging.getLogger("envs_bridge.browser")


@dataclasses.dataclass
class _Page:
  context: object
  page: object
  generation: int  # browser generation the page belongs to
  steps: int = 0  # over its whole life, all episodes


@dataclasses.dataclass
class Session:
  id: str
  task: str
  seed: int
  coords: A.CoordSpec
  pg: _Page
  last_used: float
  step: int = 0
  done: bool = False
  instruction: str = ""
  elapsed_ms: int = 0
  lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)

  @property
  def page(self):
    return self.pg.page


class BrowserSandbox:
  """Session manager over one Chromium process.

  Args:
    step_ms: virtual milliseconds advanced after every step.
    lease_s: a session untouched this long is reclaimed (its page closed) -> LeaseExpired.
    max_sessions: concurrent sessions allowed (ServerBusy beyond).
    executable: Chromium binary.
    max_idle_pages: pages kept for reuse after their session closed (over all tasks).
    max_page_launches: new pages created at once. Unbounded, 64 simultaneous opens on 2 cores each
      take longer than a client's timeout, and the client retries while the server still finishes
      (and holds) the first batch of pages.
  """

  def __init__(self, step_ms: int = 1000, lease_s: float = 300.0, max_sessions: int = 64,
               executable: str = "/usr/bin/chromium", max_idle_pages: int = 64, max_page_launches: int = 4):
    self.step_ms, self.lease_s, self.max_sessions, self.executable = step_ms, lease_s, max_sessions, executable
    self.sessions: dict[str, Session] = {}
    self.max_idle_pages = max_idle_pages
    self.idle: dict[str, list[_Page]] = {}  # task -> pages ready for the next episode
    self.gone: dict[str, P.SandboxError] = {}  # id -> the typed error late callers get
    self._pw = None
    self._browser = None
    self._generation = 0
    self._launch_lock = asyncio.Lock()
    self._page_launches = asyncio.Semaphore(max_page_launches)
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
        log.warning("chromium disconnected; relaunching")
        self.counters["browser_restarts"] += 1
        for sid, s in list(self.sessions.items()):
          if s.pg.generation == self._generation:
            self._forget(sid, P.SessionLost("browser crashed and was restarted"))
            self.counters["lost"] += 1
        self.idle.clear()
      self._browser = await self._pw.chromium.launch(executable_path=self.executable, args=CHROMIUM_ARGS)
      self._generation += 1
      return self._browser

  def _forget(self, sid: str, err: P.SandboxError) -> None:
    self.sessions.pop(sid, None)
    self.gone[sid] = err
    if len(self.gone) > 10_000:  # bounded memory of dead ids
      self.gone.pop(next(iter(self.gone)))

  async def _reap_loop(self):
    while True:
      await asyncio.sleep(max(0.05, min(5.0, self.lease_s / 4)))
      try:
        now = time.monotonic()
        for sid, s in list(self.sessions.items()):
          if now - s.last_used > self.lease_s and not s.lock.locked():
            log.info("lease expired: %s", sid)
            self.counters["expired"] += 1
            self._forget(sid, P.LeaseExpired(f"session {sid} reclaimed after {self.lease_s:g} s idle"))
            await _close_context(s.pg.context)
      except Exception:  # the reaper must outlive any one failure
        log.exception("lease reaper")

  # -- session API ------------------------------------------------------------------------------
  async def open(self, task: str, seed: int, coords: str = "relative1000",
                 data_mode: str = "train") -> tuple[str, P.Observation]:
    """Starts an episode of `task` with `seed` on a fresh or reused page -> (id, first observation).

    Raises: UnknownTask, ServerBusy, TaskError (the page failed to start), SessionLost (browser died).
    """
    ts = tasks.get(task)  # UnknownTask with the list
    if len(self.sessions) >= self.max_sessions:
      raise P.ServerBusy(f"{len(self.sessions)} sessions open (max {self.max_sessions})")
    spec = A.CoordSpec(coords, ts.width, ts.height) if coords == "absolute" else A.CoordSpec()
    browser = await self._ensure_browser()
    pool = self.idle.setdefault(task, [])
    while True:
      reused = bool(pool)
      pg = pool.pop() if reused else None
      try:
        if pg is None:
          async with self._page_launches:
            pg = await self._new_page(browser, task)
        instruction = await self._start_episode(pg.page, ts, seed, data_mode)
        break
      except PlaywrightError as e:
        if pg is not None:
          await _close_context(pg.context)
        if reused:  # an idle page that went bad (e.g. its renderer crashed): try another
          continue
        if self._browser is not None and self._browser.is_connected():
          raise P.TaskError(f"could not start {task}: {e}") from e
        await self._ensure_browser()
        raise P.SessionLost(f"browser died while opening {task}: {e}") from e
    self.counters["pages_reused" if reused else "pages_created"] += 1
    sid = uuid.uuid4().hex
    s = Session(sid, task, seed, spec, pg, time.monotonic(), instruction=instruction)
    self.sessions[sid] = s
    self.counters["opened"] += 1
    async with s.lock:
      return sid, await self._observation(s, 0.0, {})

  async def _new_page(self, browser, task: str) -> _Page:
    ts = tasks.get(task)
    ctx = await browser.new_context(viewport={"width": ts.width, "height": ts.height}, device_scale_factor=1,
                                    timezone_id="UTC", locale="en-US")
    try:
      page = await ctx.new_page()
      await page.clock.install(time=EPOCH_MS)
      await page.clock.pause_at(EPOCH_MS + 1000)  # paused: from now on only steps move time
      await page.goto(ts.url)
      if ts.css:
        await page.add_style_tag(content=ts.css)
    except PlaywrightError:
      await _close_context(ctx)
      raise
    return _Page(ctx, page, self._generation)

  @staticmethod
  async def _start_episode(page, ts: tasks.TaskSpec, seed: int, data_mode: str) -> str:
    """Cleans what a previous episode may have left on the page, then restarts it with `seed`."""
    await page.clock.set_system_time(EPOCH_MS)
    await page.evaluate(ts.clean_script)
    await page.mouse.move(0, 0)  # no element stays hovered (the instruction bar has no hover style)
    await page.evaluate(ts.start_script(seed, data_mode))
    return await page.evaluate(ts.utterance_script)

  def _get(self, sid: str) -> Session:
    s = self.sessions.get(sid)
    if s is None:
      raise self.gone.get(sid) or P.UnknownSession(f"no session {sid!r}")
    s.last_used = time.monotonic()
    return s

  async def step(self, sid: str, text: str) -> P.Observation:
    """Parses and executes one action string, advances virtual time by step_ms, observes.

    Unparseable actions (and unknown keys) give an observation with info.error, reward 0.
    Raises: UnknownSession, LeaseExpired, SessionLost.
    """
    s = self._get(sid)
    async with s.lock:
      if s.done:
        return await self._observation(s, 0.0, {"error": "episode already done"})
      s.step += 1
      s.pg.steps += 1
      self.counters["steps"] += 1
      info: dict = {}
      end = False
      try:
        try:
          if len(text) > P.MAX_ACTION_CHARS:
            raise A.ActionParseError(f"action longer than {P.MAX_ACTION_CHARS} characters")
          action = A.parse(text, s.coords)
          info["action"] = A.format_action(action, s.coords)
          ts = tasks.get(s.task)
          end = await executor.execute(s.page, action, ts.width, ts.height)
        except (A.ActionParseError, executor.InvalidKey) as e:
          # A malformed action is an observation (and a format signal), never a crash.
          info["error"] = f"invalid action: {getattr(e, 'reason', None) or e}"
        await s.page.clock.run_for(self.step_ms)
        s.elapsed_ms += self.step_ms
        st = await s.page.evaluate(tasks.get(s.task).state_script)
      except PlaywrightError as e:
        await self._lost(s, f"page failed during step: {e}")
      s.done = bool(st["done"]) or end  # finished()/call_user(): ends with what the page has scored
      reward = float(st["reward"]) if st["done"] else 0.0
      info.update(raw_reward=float(st["raw_reward"]) if st["done"] else 0.0, reason=st["reason"],
                  **tasks.get(s.task).info(st))
      return await self._observation(s, reward, info)

  async def observe(self, sid: str) -> P.Observation:
    """The current screenshot; no action, no time passes; reward 0 (rewards come with steps)."""
    s = self._get(sid)
    async with s.lock:
      return await self._observation(s, 0.0, {})

  async def close(self, sid: str) -> None:
    """Ends a session; its page goes back to the idle pool of its task (or is closed).

    Idempotent for sessions that already ended (closed, expired, lost). Raises: UnknownSession for
    ids never opened.
    """
    s = self.sessions.get(sid)
    if s is None:
      if sid in self.gone:
        return
      raise P.UnknownSession(f"no session {sid!r}")
    self._forget(sid, P.UnknownSession(f"session {sid} was closed"))
    self.counters["closed"] += 1
    async with s.lock:  # let a step in flight finish before the page changes hands
      pg = s.pg
      if (pg.generation == self._generation and not pg.page.is_closed() and pg.steps < MAX_PAGE_STEPS
          and sum(map(len, self.idle.values())) < self.max_idle_pages):
        self.idle.setdefault(s.task, []).append(pg)
      else:
        await _close_context(pg.context)

  async def element_box(self, sid: str, selector: str) -> dict | None:
    """Bounding box {x, y, width, height} (px) of the first element matching a CSS `selector`, or
    None. An inspection aid for tests and debugging; agents only ever see screenshots.

    Raises: InvalidAction for a selector that does not parse; the typed session errors.
    """
    s = self._get(sid)
    async with s.lock:
      try:
        el = await s.page.query_selector(selector)
        return None if el is None else await el.bounding_box()
      except PlaywrightError as e:
        if s.page.is_closed():
          await self._lost(s, f"page failed: {e}")
        raise P.InvalidAction(f"selector {selector!r}: {e}") from e

  # -- internals --------------------------------------------------------------------------------
  async def _observation(self, s: Session, reward: float, info: dict) -> P.Observation:
    try:
      png = await s.page.screenshot(type="png")  # the viewport is exactly MiniWoB's #wrap
    except PlaywrightError as e:
      await self._lost(s, f"screenshot failed: {e}")
    full = {"instruction": s.instruction, "step": s.step, "elapsed_ms": s.elapsed_ms, "raw_reward": 0.0,
            "reason": None, "error": None, "task": s.task, "seed": s.seed}
    full.update(info)
    return P.Observation(screenshot_png_b64=base64.b64encode(png).decode(), reward=reward, done=s.done,
                         info=full)

  async def _lost(self, s: Session, reason: str):
    self.counters["lost"] += 1
    self._forget(s.id, P.SessionLost(reason))
    await _close_context(s.pg.context)
    await self._ensure_browser()
    raise P.SessionLost(reason)


async def _close_context(ctx) -> None:
  try:
    await ctx.close()
  except PlaywrightError:
    pass
