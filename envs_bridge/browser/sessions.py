"""Several Chromium processes, many sessions (one browser context + page each), with leases, a page
GC, crash recovery, snapshots and virtual time (issue #5 items 1-3).

Time is virtual (Playwright `page.clock`): the clock is installed and paused before the task page
loads and only moves when a step advances it by `step_ms`, so the same seed and the same actions give
the same screenshots and rewards, and MiniWoB's 10 s episode time-out takes 10 steps, not 10 s.

A step is three page calls: the action (mouse/keyboard), one `page.evaluate` that advances the clock
(Playwright's own clock controller, `_advance_and_read`) and reads the task state, and one CDP
`Page.captureScreenshot` (byte-equal to `page.screenshot`, `_capture_png_b64`); `page.clock.run_for`
+ state read + `page.screenshot` took about ten protocol round trips.

Pages are reused across episodes of the same task, as MiniWoB itself does: a closed session's page
goes back to an idle pool and the next `open` only cleans it (focus, scroll, pointer, wall-clock
date) and restarts the episode with the seed (no new context, no page load), which is what makes
resets cheap. A reused page gives the same screenshots as a fresh one (tested), except on the few
tasks whose reset leaves something behind (`REUSE_UNSAFE_TASKS`): those always get a fresh page.

Browsers: `n_browsers` Chromium processes (`DEFAULT_CHROMIUM`: Debian's headless shell where
installed); a new session goes to the connected browser with the fewest sessions (an idle page of its
task is reused first). Sessions map id -> (browser, page).

Concurrency: one asyncio loop; each session has its own lock (a step and an observe of the same
session never interleave) and nothing locks across sessions, so N sessions step in parallel.

Failures (each one is an event, a metric, and a `SessionLost` with the reason for the sessions hit):
  - Chromium dies (e.g. kill -9): Playwright's `disconnected` event -> every session on that browser
    is lost, the browser is relaunched at once (`recoveries`, `sandbox_recovery_seconds`).
  - the server or Playwright's driver dies, by any signal, even in the middle of a relaunch: every
    Chromium goes with it (started through `launcher.pdeathsig_wrapper`, parent-death signal SIGKILL).
  - a page's renderer crashes: the page's `crash` event -> its session is lost, its context closed.
  - a page stops answering: every page call of a request runs under `page_timeout_s`; past it the
    session is lost and its context closed; if even closing does not answer in time, its Chromium
    is killed and relaunched (which loses that browser's other sessions too).
Standby browser (`spare_pages` > 0): one more Chromium, launched spare, holds fresh pages (context,
task page loaded, clock paused; no episode started) for the tasks of the live sessions, up to one per
live session and `spare_pages` in all. They are made one at a time and only while no `open` is in
flight (the standby must not slow real sessions). When a browser dies, the standby is promoted in its
place (no launch) and its pages join the idle pool, so the lost sessions' replacements start
episodes on pages that already exist instead of creating 16 pages on a just-relaunched Chromium
(page creation, not detection or relaunch, is most of a recovery's time, above all with the full
browser; benchmarks/RESULTS.md, "Crash recovery with a standby browser").
A new standby is launched after the promotion. A standby page is a fresh page created earlier: the
same seed gives the same screenshot (tests/test_browser_recovery.py). Its memory (PSS of its process
tree) is in /health (`spare.pss_mb`).
Leases: a session idle for `lease_s` is reclaimed (page closed) -> `LeaseExpired`. GC: a browser
context owned by nobody in two passes in a row is closed (leaked page). Owners: a session, an idle
pool, or the call handing the page over (`_transit`: an `open` creating or restarting it, a `close`
returning it to the pool, a discard closing it). Without the hand-over owner a page being created or
reused by a slow `open` was "unowned" at two GC passes and closed under the new session, which then
failed with `SessionLost: page ... has been closed` at its first screenshot (issue #5;
tests/test_browser_stress.py).

Snapshots (`snapshot`/`restore`) are deterministic replays: MiniWoB keeps task state in JavaScript
closures and jQuery handlers that no DOM copy can carry, so a snapshot is the episode's seed, data
mode and the action texts taken so far (invalid ones included, as they advance time). `restore`
restarts the episode on the session's page and replays them under the virtual clock, which restores
the DOM, the task's JS state, the clock, reward/done, `step` and `elapsed_ms`; the screenshot's
SHA-256 taken at snapshot time is checked after the replay (mismatch -> TaskError). Not restored:
the mouse position between actions and anything outside the page (nothing else is kept).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import hashlib
import logging
import os
import signal
import time
import uuid

import psutil
from playwright.async_api import Error as PlaywrightError
from playwright.async_api import async_playwright

from envs_bridge import protocol as P
from envs_bridge.browser import executor
from envs_bridge.browser import launcher
from envs_bridge.browser import tasks
from envs_bridge.browser.telemetry import EventLog, SandboxMetrics
from envs_bridge.games import catalog
from envs_bridge.session_table import SessionTable
from tars_jax.agent import actions as A

# Debian's chromium-headless-shell (same source and version as /usr/bin/chromium, without the
# desktop browser layer; what Playwright itself runs for headless Chromium): it relaunches faster and
# makes pages faster, so crash recovery is several times quicker, steps are faster and a page takes
# less than half the memory (benchmarks/RESULTS.md, "Headless shell").
# The full browser is the fallback where the package is missing (scripts/setup.sh installs it).
HEADLESS_SHELL = "/usr/lib/chromium/chromium-headless-shell"
DEFAULT_CHROMIUM = HEADLESS_SHELL if os.access(HEADLESS_SHELL, os.X_OK) else "/usr/bin/chromium"
# SpareRendererForSitePerProcess off: Chromium keeps one renderer process pre-started for the next
# page and starts another each time it is used; with 16 pages made at once (crash recovery) that churn
# costs noticeably more CPU (benchmarks/RESULTS.md, "Crash recovery with two browsers").
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-features=SpareRendererForSitePerProcess"]
# Wall-clock date every episode starts at (2024-01-01T00:00:00Z): tasks that print dates (terminal)
# look the same on fresh and reused pages. Timers run on the clock's ticks, which this does not move.
EPOCH_MS = 1_704_067_200_000
MAX_PAGE_STEPS = 20_000  # a page is retired after this many steps (each page.clock call adds an init script)
# An idle page is reused only on a browser with at most this many more sessions than the least-loaded
# connected one; else the open makes a fresh page there. Pure reuse piled every session onto the
# browser that survived a crash (its idle pages), so the next kill -9 lost all of them.
REUSE_IMBALANCE = 1
CLOSE_TIMEOUT_S = 10.0  # least time a page's context gets to close before its Chromium is killed
# Visible elements of the task area for the debug `elements` call (experts, grounding data).
ELEMENTS_SCRIPT = """() => {
  // The whole body, not only #wrap: jQuery UI dialogs (click-dialog) are appended to <body>; what lies
  // outside the viewport (MiniWoB's reward panel right of #wrap) is dropped by the clipping below.
  const root = document.body;
  const vw = window.innerWidth, vh = window.innerHeight;
  const clean = t => (t || '').replace(/\\s+/g, ' ').trim().slice(0, 200);
  const visible = el => {  // the box clipped to the viewport and to every scrolling / clipping ancestor
    const r = el.getBoundingClientRect();
    if (r.width < 1 || r.height < 1) return null;
    const st = getComputedStyle(el);
    if (st.visibility === 'hidden' || st.display === 'none' || parseFloat(st.opacity) === 0) return null;
    let x0 = Math.max(0, r.left), y0 = Math.max(0, r.top), x1 = Math.min(vw, r.right), y1 = Math.min(vh, r.bottom);
    for (let p = el.parentElement; p && p !== root; p = p.parentElement) {
      const ps = getComputedStyle(p);
      if (ps.overflowX === 'visible' && ps.overflowY === 'visible') continue;
      const q = p.getBoundingClientRect();
      x0 = Math.max(x0, q.left); y0 = Math.max(y0, q.top); x1 = Math.min(x1, q.right); y1 = Math.min(y1, q.bottom);
    }
    return x1 - x0 >= 1 && y1 - y0 >= 1 ? {x0, y0, x1, y1} : null;
  };
  const out = [], seen = new Map();
  for (const el of root.querySelectorAll('*')) {
    const tag = el.tagName.toLowerCase();
    if (tag === 'script' || tag === 'style') continue;
    const r = visible(el);
    if (!r) continue;
    seen.set(el, out.length);
    const isInput = tag === 'input' || tag === 'textarea' || tag === 'select';
    const box = tag === 'input' && (el.type === 'checkbox' || el.type === 'radio');
    const text = box ? '' : isInput ? clean(el.value || el.placeholder || '') : clean(el.innerText);
    out.push({tag, id: el.id || '', classes: clean(typeof el.className === 'string' ? el.className : ''),
              type: clean(el.getAttribute('type')), text, value: isInput ? String(el.value ?? '') : '',
              checked: !!el.checked, focused: document.activeElement === el, leaf: true,
              x: r.x0, y: r.y0, width: r.x1 - r.x0, height: r.y1 - r.y0});
  }
  for (const [el, i] of seen) {
    let p = el.parentElement;
    while (p && p !== root && !seen.has(p)) p = p.parentElement;
    if (p && seen.has(p)) out[seen.get(p)].leaf = false;
  }
  return out;
}"""

# Caret hidden on every page for good: a caret blinks on real time, so it would make screenshots
# depend on the wall clock. Playwright's page.screenshot hides it only while it shoots (an injected
# `caret-color: transparent` style); the direct CDP screenshot of the step path needs it hidden
# already. Same pixels as page.screenshot (bytes compared in tests/test_step_path.py). Added to every
# page when it is created (`_new_page`).
HIDE_CARET_CSS = "* { caret-color: transparent !important; }"
SNAPSHOT_VERSION = 1
# Tasks whose own reset leaves the previous episode on screen (a price, an open tab or dialog, a
# cube's rotation): their first screenshot on a reused page differs from a fresh page's, so they
# always get a fresh page. Found by `python -m benchmarks.reuse_parity`.
REUSE_UNSAFE_TASKS = frozenset(
    "miniwob/" + t for t in ("book-flight", "book-flight-nodelay", "click-dialog", "click-dialog-2", "click-tab",
                             "click-tab-2", "click-tab-2-easy", "click-tab-2-hard", "click-tab-2-medium",
                             "drag-cube", "simon-says", "stock-market",
                             # its list's scroll settles on the wall clock after a reset: with the
                             # fast (direct CDP) step path the first screenshot comes before that
                             "click-scroll-list"))
log = logging.getLogger("envs_bridge.browser")


@dataclasses.dataclass(eq=False)
class _Slot:
  """One Chromium process (relaunched in place after a crash; `generation` counts launches)."""

  index: int
  browser: object = None
  pid: int | None = None
  generation: int = 0
  sessions: int = 0  # sessions currently on it
  opening: int = 0  # pages being created for new sessions (counted in placement)
  lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
  died_at: float | None = None  # monotonic time the crash was noticed, until relaunched
  dead_generation: int = 0  # last generation whose death was handled

  def load(self) -> int:
    """Sessions on it plus pages being made for new ones: what placement balances."""
    return self.sessions + self.opening

  def up(self) -> bool:
    """Connected, and not already known to be dead (the death may be noticed before Playwright's)."""
    return (self.browser is not None and self.browser.is_connected()
            and self.dead_generation != self.generation)

  def dead(self) -> bool:
    """Down, or its process is gone even if Playwright has not said so yet (checked on error paths:
    a page call can fail before the `disconnected` event arrives)."""
    return not self.up() or (self.pid is not None and not _pid_alive(self.pid))


@dataclasses.dataclass(eq=False)
class _Page:
  context: object
  page: object
  slot: _Slot
  generation: int  # slot generation the page belongs to
  steps: int = 0  # over its whole life, all episodes
  session_id: str | None = None  # the session using it, None while idle
  crashed: str | None = None  # why the page is unusable (renderer crash)
  discarded: bool = False  # its context is being / was closed: never pooled or reused again
  cdp: object = None  # CDPSession of the page for screenshots (made at its first screenshot)

  def usable(self) -> bool:
    return (self.crashed is None and not self.discarded and self.generation == self.slot.generation
            and self.slot.up() and not self.page.is_closed())


@dataclasses.dataclass(eq=False)
class Session:
  id: str
  task: str
  seed: int
  coords: A.CoordSpec
  pg: _Page
  last_used: float
  data_mode: str = "train"
  step: int = 0
  done: bool = False
  instruction: str = ""
  elapsed_ms: int = 0
  actions: list[str] = dataclasses.field(default_factory=list)  # texts of the counted steps (snapshots)
  lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)

  @property
  def page(self):
    return self.pg.page


class BrowserSandbox:
  """Session manager over `n_browsers` Chromium processes.

  Args:
    step_ms: virtual milliseconds advanced after every step.
    lease_s: a session untouched this long is reclaimed (its page closed) -> LeaseExpired.
    max_sessions: concurrent sessions allowed (ServerBusy beyond).
    executable: Chromium binary; None: `DEFAULT_CHROMIUM` (the headless shell where installed).
    max_idle_pages: pages kept for reuse after their session closed (over all tasks).
    max_page_launches: new pages created at once. Unbounded, 64 simultaneous opens on 2 cores each
      take longer than a client's timeout, and the client retries while the server still finishes
      (and holds) the first batch of pages.
    n_browsers: Chromium processes; sessions are spread over them (fewest sessions first).
    page_timeout_s: the page calls of one request (act + clock + state + screenshot) must finish
      within this many seconds, else the page counts as hung (SessionLost).
    gc_interval_s: seconds between passes of the leaked-page collector.
    spare_pages: 0: no standby browser. > 0: a standby Chromium with up to this many pre-made pages
      (see the module docstring), promoted in place of a browser that dies.
  """

  def __init__(self, step_ms: int = 1000, lease_s: float = 300.0, max_sessions: int = 64,
               executable: str | None = None, max_idle_pages: int = 64, max_page_launches: int = 4,
               n_browsers: int = 1, page_timeout_s: float = 60.0, gc_interval_s: float = 30.0,
               spare_pages: int = 0):
    if n_browsers < 1:
      raise ValueError(f"n_browsers must be >= 1, got {n_browsers}")
    if page_timeout_s <= 0:
      raise ValueError(f"page_timeout_s must be > 0, got {page_timeout_s}")
    if spare_pages < 0:
      raise ValueError(f"spare_pages must be >= 0, got {spare_pages}")
    self.spare_pages = spare_pages
    self.spare: _Slot | None = None  # the standby browser (not in `slots`: no sessions are placed on it)
    self.spare_idle: dict[str, list[_Page]] = {}  # task -> standby pages
    self._warmer: asyncio.Task | None = None
    self.step_ms, self.lease_s, self.max_sessions = step_ms, lease_s, max_sessions
    self.executable = executable or DEFAULT_CHROMIUM
    self.page_timeout_s, self.gc_interval_s = page_timeout_s, gc_interval_s
    self.sessions = SessionTable()  # live sessions by id, and the typed errors late callers get
    self.max_idle_pages = max_idle_pages
    self.idle: dict[str, list[_Page]] = {}  # task -> pages ready for the next episode
    self.slots = [_Slot(i) for i in range(n_browsers)]
    self.events = EventLog()
    self.metrics = SandboxMetrics()
    self._pw = None
    self._stopping = False
    self._page_launches = asyncio.Semaphore(max_page_launches)
    self._reaper: asyncio.Task | None = None
    self._background: set[asyncio.Task] = set()
    self._gc_suspects: set = set()
    # Contexts between owners (see the module docstring): an open/close/discard holds them here.
    self._transit: set = set()
    self._last_gc = 0.0
    self.counters = {"steps": 0, "opened": 0, "closed": 0, "expired": 0, "lost": 0, "browser_restarts": 0,
                     "recoveries": 0, "page_crashes": 0, "page_hangs": 0, "gc_closed": 0,
                     "pages_created": 0, "pages_reused": 0, "snapshots": 0, "restores": 0,
                     "spare_promotions": 0, "spare_pages_made": 0}

  # -- lifecycle --------------------------------------------------------------------------------
  async def start(self) -> None:
    self._launch_path = launcher.pdeathsig_wrapper(self.executable)  # Playwright's executable_path
    self._pw = await async_playwright().start()
    await asyncio.gather(*[self._ensure(s) for s in self.slots])
    if self.spare_pages:
      await self._launch_spare()
    self._reaper = asyncio.create_task(self._reap_loop())

  async def stop(self) -> None:
    self._stopping = True
    for t in [self._reaper, self._warmer, *self._background]:
      if t:
        t.cancel()
    for slot in [*self.slots, *([self.spare] if self.spare else [])]:
      if slot.browser is not None:
        try:
          await slot.browser.close()
        except PlaywrightError:
          pass
    if self._pw is not None:
      await self._pw.stop()

  def _spawn(self, coro) -> None:
    t = asyncio.get_running_loop().create_task(coro)
    self._background.add(t)
    t.add_done_callback(self._background.discard)

  async def _ensure(self, slot: _Slot):
    """The slot's connected browser; (re)launches it if needed. Raises: PlaywrightError if launch fails."""
    async with slot.lock:
      if slot.up():
        return slot.browser
      if slot.browser is not None:
        self._browser_died(slot, "browser disconnected")
        self._spawn(_close_browser(slot.browser))  # in case Playwright still holds on to it
      if self.spare is not None and slot is not self.spare and self.spare.up():
        self._promote_spare(slot)
        gen = slot.generation
        browser = slot.browser
        self._spawn(self._launch_spare())  # the next standby
      else:
        browser = await self._pw.chromium.launch(executable_path=self._launch_path, args=CHROMIUM_ARGS)
        slot.browser, slot.generation = browser, slot.generation + 1
        slot.pid = await _browser_pid(browser)
        gen = slot.generation
      browser.on("disconnected", lambda _b: self._on_disconnected(slot, gen))
      self.events.add("browser_launched", browser=slot.index, pid=slot.pid, generation=gen)
      if slot.died_at is not None:  # a relaunch after a crash
        dt = time.monotonic() - slot.died_at
        slot.died_at = None
        self.counters["recoveries"] += 1
        self.metrics.recoveries.inc()
        self.metrics.recovery_s.observe(dt)
        self.events.add("browser_recovered", browser=slot.index, pid=slot.pid, seconds=round(dt, 3))
      self.metrics.browsers_up.set(sum(s.up() for s in self.slots))
      return browser

  # -- standby browser ----------------------------------------------------------------------------
  async def _launch_spare(self) -> None:
    """Launches the standby Chromium (no pages yet; the warmer makes them). Failures are logged: the
    sandbox works without a standby, it only recovers more slowly."""
    if self._stopping:
      return
    try:
      browser = await self._pw.chromium.launch(executable_path=self._launch_path, args=CHROMIUM_ARGS)
    except PlaywrightError as e:
      log.error("standby browser launch failed: %s", e)
      self.events.add("spare_launch_failed", error=str(e)[:300])
      return
    spare = _Slot(len(self.slots), browser=browser, pid=await _browser_pid(browser), generation=1)
    browser.on("disconnected", lambda _b: self._on_spare_lost(spare, 1))
    self.spare, self.spare_idle = spare, {}
    self.events.add("spare_launched", pid=spare.pid)
    self._kick_warmer()

  def _on_spare_lost(self, spare: _Slot, gen: int) -> None:
    """The standby died (not promoted): its pages are dropped and a new one is launched."""
    if self._stopping or spare is not self.spare or spare.generation != gen:
      return
    self.events.add("spare_lost", pid=spare.pid)
    self.spare, self.spare_idle = None, {}
    self._spawn(self._launch_spare())

  def _promote_spare(self, slot: _Slot) -> None:
    """Puts the standby browser in the place of `slot` (whose browser died); its pages join the idle
    pool as pages of `slot`. Called with slot.lock held."""
    spare = self.spare
    spare.generation += 1  # its own disconnected handler no longer applies
    self.spare = None
    slot.browser, slot.pid, slot.generation = spare.browser, spare.pid, slot.generation + 1
    moved = 0
    for task, pages in self.spare_idle.items():
      for pg in pages:
        if pg.crashed is None and not pg.discarded and not pg.page.is_closed():
          pg.slot, pg.generation = slot, slot.generation
          self.idle.setdefault(task, []).append(pg)
          moved += 1
    self.spare_idle = {}
    self.counters["spare_promotions"] += 1
    self.events.add("spare_promoted", browser=slot.index, pid=slot.pid, pages=moved)

  def _spare_deficit(self) -> tuple[str | None, str | None]:
    """(task that needs a standby page or None, task whose surplus page can go or None)."""
    want: dict[str, int] = {}
    for s in self.sessions.values():
      want[s.task] = want.get(s.task, 0) + 1
    for task in list(self.spare_idle):
      self.spare_idle[task] = [pg for pg in self.spare_idle[task]
                               if pg.crashed is None and not pg.discarded and not pg.page.is_closed()]
    have = {t: len(p) for t, p in self.spare_idle.items()}
    need = next((t for t in sorted(want) if want[t] > have.get(t, 0)), None)
    surplus = next((t for t in sorted(have) if have[t] > want.get(t, 0)), None)
    if need is not None and sum(have.values()) >= self.spare_pages:
      return (need, surplus) if surplus is not None else (None, None)
    return need, None

  def _kick_warmer(self) -> None:
    if self.spare_pages and not self._stopping and (self._warmer is None or self._warmer.done()):
      self._warmer = asyncio.get_running_loop().create_task(self._warm())

  async def _warm(self) -> None:
    """Makes standby pages one at a time until the deficit is gone, yielding to any open in flight."""
    while not self._stopping:
      spare = self.spare
      if spare is None or not spare.up():
        return  # a new standby kicks the warmer when it is up
      need, surplus = self._spare_deficit()
      if need is None:
        return
      if any(s.opening for s in self.slots):  # real sessions first
        await asyncio.sleep(0.05)
        continue
      if surplus is not None:
        pg = self.spare_idle[surplus].pop()
        pg.discarded = True
        await _close_context(pg.context, self.page_timeout_s)
        continue
      try:
        pg = await self._new_page(spare, need)
      except (PlaywrightError, TimeoutError) as e:
        log.warning("standby page for %s failed: %s", need, e)
        await asyncio.sleep(0.5)
        continue
      self._transit.discard(pg.context)  # never seen by the GC (it walks `slots` only)
      if spare is self.spare:
        self.spare_idle.setdefault(need, []).append(pg)
        self.counters["spare_pages_made"] += 1
      # else: promoted or lost meanwhile; a promoted browser's page is owned by no one: the GC takes it

  def spare_info(self) -> dict | None:
    """{pid, up, pages, pss_mb} of the standby browser, or None. pss_mb: proportional set size (MiB)
    of its process and children (Linux smaps via psutil; shared pages split, so unlike RSS the
    sum over processes is not inflated by the shared Chromium binary); 0.0 where unreadable."""
    if self.spare is None:
      return None
    return {"pid": self.spare.pid, "up": self.spare.up(), "pages": sum(map(len, self.spare_idle.values())),
            "pss_mb": round(_tree_pss_bytes(self.spare.pid) / 2**20, 1)}

  def _on_disconnected(self, slot: _Slot, gen: int) -> None:
    if self._stopping or gen != slot.generation:
      return
    self._browser_died(slot, "browser disconnected")
    self._spawn(self._recover(slot))

  async def _recover(self, slot: _Slot) -> None:
    """Relaunches a dead browser now (not on the next request), retrying while launches fail."""
    delay = 0.5
    while not self._stopping and not slot.up():
      try:
        await self._ensure(slot)
      except PlaywrightError as e:
        log.error("relaunch of browser %d failed: %s", slot.index, e)
        self.events.add("browser_launch_failed", browser=slot.index, error=str(e)[:300])
        await asyncio.sleep(delay)
        delay = min(delay * 2, 10.0)

  def _browser_died(self, slot: _Slot, why: str) -> None:
    """Book-keeping of a dead Chromium (once per generation): its sessions are lost, its pages dropped."""
    if slot.dead_generation == slot.generation:
      return
    slot.dead_generation = slot.generation
    slot.died_at = time.monotonic()
    reason = f"browser {slot.index} (pid {slot.pid}) crashed ({why}); it is being restarted"
    lost = [s for s in self.sessions.values() if s.pg.slot is slot]
    log.warning("%s; %d sessions lost", reason, len(lost))
    self.counters["browser_restarts"] += 1
    self.metrics.browser_crashes.inc()
    self.events.add("browser_crashed", browser=slot.index, pid=slot.pid, generation=slot.generation,
                    sessions_lost=len(lost))
    for s in lost:
      self._lose(s, reason, "browser_crash")
    for task, pool in self.idle.items():
      self.idle[task] = [pg for pg in pool if pg.slot is not slot]
    self.metrics.browsers_up.set(sum(s.up() for s in self.slots))

  def _register(self, s: Session) -> None:
    self.sessions[s.id] = s
    s.pg.session_id = s.id
    s.pg.slot.sessions += 1
    self.metrics.sessions.set(len(self.sessions))

  def _forget(self, sid: str, err: P.SandboxError) -> None:
    s = self.sessions.forget(sid, err)
    if s is not None:
      s.pg.slot.sessions -= 1
      self.metrics.sessions.set(len(self.sessions))

  def _lose(self, s: Session, reason: str, cause: str) -> None:
    """Marks a live session lost (counted once); later calls on it raise SessionLost(reason)."""
    if self.sessions.get(s.id) is not s:
      return
    self._forget(s.id, P.SessionLost(reason, cause=cause))
    self.counters["lost"] += 1
    self.metrics.lost.labels(cause).inc()
    self.events.add("session_lost", session=s.id, browser=s.pg.slot.index, task=s.task, seed=s.seed,
                    cause=cause, reason=reason)

  async def _reap_loop(self):
    while True:
      await asyncio.sleep(max(0.05, min(5.0, self.lease_s / 4, self.gc_interval_s)))
      try:
        self.metrics.sample()
        now = time.monotonic()
        for sid, s in self.sessions.expired(self.lease_s, now):
          log.info("lease expired: %s", sid)
          self.counters["expired"] += 1
          self.metrics.events.labels("expired").inc()
          self.events.add("session_expired", session=sid, browser=s.pg.slot.index, lease_s=self.lease_s)
          self._forget(sid, P.LeaseExpired(f"session {sid} reclaimed after {self.lease_s:g} s idle"))
          await self._discard_page(s.pg)
        if now - self._last_gc >= self.gc_interval_s:
          self._last_gc = now
          await self.collect_garbage()
      except Exception:  # the reaper must outlive any one failure
        log.exception("lease reaper")

  async def collect_garbage(self) -> int:
    """One GC pass: sessions whose page closed under them are lost; dead idle pages are dropped; a
    context owned by no session and no idle pool in this pass and the previous one is closed.

    Returns: the number of leaked contexts closed in this pass.
    """
    for s in list(self.sessions.values()):
      if s.page.is_closed() and not s.lock.locked():
        self._lose(s, "page was closed outside the sandbox", "page_closed")
    for task, pool in self.idle.items():
      self.idle[task] = [pg for pg in pool if pg.usable()]
    suspects, closed = set(), 0
    for slot in self.slots:
      if not slot.up():
        continue
      for ctx in list(slot.browser.contexts):
        # Ownership is read afresh for every context: the closes below yield to the event loop, in
        # which opens and closes hand pages over.
        if self._owned(ctx):
          continue
        if ctx in self._gc_suspects:  # unowned two passes in a row: leaked
          await _close_context(ctx, self.page_timeout_s)
          closed += 1
          self.events.add("gc_closed_page", browser=slot.index)
        else:
          suspects.add(ctx)
    self._gc_suspects = suspects
    if closed:
      log.warning("GC closed %d leaked pages", closed)
      self.counters["gc_closed"] += closed
      self.metrics.gc_closed.inc(closed)
    return closed

  def _owned(self, ctx) -> bool:
    """True if a session, an idle pool or a hand-over in progress (`_transit`) holds `ctx`."""
    return (ctx in self._transit or any(s.pg.context is ctx for s in self.sessions.values())
            or any(pg.context is ctx for pool in self.idle.values() for pg in pool))

  # -- session API ------------------------------------------------------------------------------
  async def open(self, task: str, seed: int, coords: str = "relative1000",
                 data_mode: str = "train") -> tuple[str, P.Observation]:
    """Starts an episode of `task` with `seed` on a fresh or reused page -> (id, first observation).

    Raises: UnknownTask, ServerBusy, TaskError (the page failed to start), SessionLost (browser died
    or the page hung).
    """
    ts = tasks.get(task)  # UnknownTask with the list
    if len(self.sessions) >= self.max_sessions:
      raise P.ServerBusy(f"{len(self.sessions)} sessions open (max {self.max_sessions})")
    if ts.prepare is not None:  # browse: question generation (seconds, once) off the event loop
      await asyncio.to_thread(ts.prepare)
    t0 = time.perf_counter()
    spec = A.CoordSpec(coords, ts.width, ts.height) if coords == "absolute" else A.CoordSpec()
    while True:
      pg = self._take_idle(task)
      if pg is None:
        slot = await self._pick_slot()
        # waiting for a relaunch may have promoted the standby, whose pages joined the idle pool
        pg = self._take_idle(task)
      reused = pg is not None
      if reused:
        slot = pg.slot
      slot.opening += 1  # until registered: concurrent opens must see each other, or all pick one browser
      try:
        if pg is None:
          async with self._page_launches:
            pg = await self._new_page(slot, task)
        async with asyncio.timeout(self.page_timeout_s):
          instruction = await self._start_episode(pg.page, ts, seed, data_mode)
        break
      except (PlaywrightError, TimeoutError) as e:
        slot.opening -= 1
        if pg is not None:
          await self._discard_page(pg)
          self._transit.discard(pg.context)
        if reused:  # an idle page that went bad (e.g. its renderer crashed): try another
          continue
        why = f"page did not answer within {self.page_timeout_s:g} s" if isinstance(e, TimeoutError) else str(e)
        dead = slot.dead()
        if not dead and not isinstance(e, TimeoutError):
          raise P.TaskError(f"could not start {task}: {why}") from e
        if dead:
          self._browser_died(slot, f"while opening {task}")
          self._spawn(self._recover(slot))
        raise P.SessionLost(f"could not open {task} on browser {slot.index}: {why}") from e
      except BaseException:  # cancelled (client went away): the page is left to the GC
        slot.opening -= 1
        if pg is not None:
          self._transit.discard(pg.context)
        raise
    slot.opening -= 1
    self.counters["pages_reused" if reused else "pages_created"] += 1
    sid = uuid.uuid4().hex
    s = Session(sid, task, seed, spec, pg, time.monotonic(), data_mode=data_mode, instruction=instruction)
    self._register(s)
    self._transit.discard(pg.context)  # owned by the session from here on
    self.counters["opened"] += 1
    self.metrics.events.labels("opened").inc()
    self.events.add("session_opened", session=sid, browser=slot.index, task=task, seed=seed, reused=reused)
    self._kick_warmer()
    async with s.lock:
      obs = await self._observation(s, 0.0, {})
      s.last_used = time.monotonic()  # idle (lease) time counts from the end of a call
    self.metrics.op("open").observe(time.perf_counter() - t0)
    return sid, obs

  def _take_idle(self, task: str) -> _Page | None:
    """An idle page of `task` on the least-loaded browser that has one (removed from the pool); None
    when there is none, or when that browser has more than `REUSE_IMBALANCE` sessions above the
    least-loaded connected browser (a fresh page there keeps sessions spread over the browsers)."""
    pool = self.idle.get(task)
    if not pool:
      return None
    pool[:] = [pg for pg in pool if pg.usable()]
    if not pool:
      return None
    best = min(range(len(pool)), key=lambda i: pool[i].slot.load())
    floor = min((s.load() for s in self.slots if s.up()), default=0)
    if pool[best].slot.load() > floor + REUSE_IMBALANCE:
      return None
    pg = pool.pop(best)
    self._transit.add(pg.context)  # the calling open owns it until the session is registered
    return pg

  async def _pick_slot(self) -> _Slot:
    """The connected browser with the fewest sessions (waits for a relaunch if none is up)."""
    up = [s for s in self.slots if s.up()]
    slot = min(up or self.slots, key=lambda s: (s.load(), s.index))
    if not up:
      await self._ensure(slot)
    return slot

  async def _new_page(self, slot: _Slot, task: str) -> _Page:
    if slot.index >= len(self.slots):  # the standby: never relaunched here (a lost one is replaced)
      if not slot.browser.is_connected():
        raise PlaywrightError("standby browser disconnected")
      browser = slot.browser
    else:
      browser = await self._ensure(slot)
    ts = tasks.get(task)
    ctx = await browser.new_context(viewport={"width": ts.width, "height": ts.height}, device_scale_factor=1,
                                    timezone_id="UTC", locale="en-US")
    self._transit.add(ctx)  # the calling open owns it until the session is registered
    try:
      async with asyncio.timeout(self.page_timeout_s):
        if ts.init_script:  # browse: in every document the page loads, before its scripts
          await ctx.add_init_script(ts.init_script)
        page = await ctx.new_page()
        await page.clock.install(time=EPOCH_MS)
        await page.clock.pause_at(EPOCH_MS + 1000)  # paused: from now on only steps move time
        await page.goto(ts.url)
        # the caret style goes in before the first episode: added after a task built its page, a
        # `*` rule restyles it (click-collapsible, multi-layouts then differ from a reused page)
        await page.add_style_tag(content=(ts.css or "") + HIDE_CARET_CSS)
    except PlaywrightError:
      await _close_context(ctx, self.page_timeout_s)
      self._transit.discard(ctx)
      raise
    except BaseException:  # cancelled: no one will register it, so the GC may take it
      self._transit.discard(ctx)
      raise
    pg = _Page(ctx, page, slot, slot.generation)
    page.on("crash", lambda _p: self._on_page_crash(pg))
    self.events.add("page_created", browser=slot.index, task=task)
    return pg

  def _on_page_crash(self, pg: _Page) -> None:
    pg.crashed = f"page renderer crashed (browser {pg.slot.index})"
    self.counters["page_crashes"] += 1
    self.metrics.page_crashes.inc()
    self.events.add("page_crashed", browser=pg.slot.index, session=pg.session_id)
    s = self.sessions.get(pg.session_id) if pg.session_id else None
    if s is not None and s.pg is pg:
      self._lose(s, pg.crashed, "page_crash")
    if not self._stopping:
      self._spawn(self._discard_page(pg))

  @staticmethod
  async def _start_episode(page, ts: tasks.TaskSpec, seed: int, data_mode: str) -> str:
    """Cleans what a previous episode may have left on the page, then restarts it with `seed`.

    Three page calls: (wall-clock date + clean), pointer move, (start + instruction read); browse
    tasks first load the episode's start page.
    """
    if ts.start_url is not None:
      await _goto(page, ts, ts.start_url(seed, data_mode))
    if page.main_frame.child_frames:  # Playwright's clock call sets the date in every frame
      await page.clock.set_system_time(EPOCH_MS)
      await page.evaluate(ts.clean_script)
    else:
      await page.evaluate(_set_date_and_clean_script(ts.clean_script), EPOCH_MS)
    await page.mouse.move(0, 0)  # no element stays hovered (the instruction bar has no hover style)
    return await page.evaluate(_start_and_read_script(ts.start_script(seed, data_mode), ts.utterance_script))

  async def step(self, sid: str, text: str) -> P.Observation:
    """Parses and executes one action string, advances virtual time by step_ms, observes.

    Unparseable actions (and unknown keys) give an observation with info.error, reward 0.
    Raises: UnknownSession, LeaseExpired, SessionLost (browser/page crashed or hung).
    """
    t0 = time.perf_counter()
    s = self.sessions.lease(sid)
    async with s.lock:
      if s.done:
        return await self._observation(s, 0.0, {"error": "episode already done"})
      self.counters["steps"] += 1
      self.metrics.count_step()
      try:
        async with asyncio.timeout(self.page_timeout_s):
          reward, info = await self._act(s, text)
      except (PlaywrightError, TimeoutError) as e:
        await self._page_failed(s, e, "step")
      obs = await self._observation(s, reward, info)
      s.last_used = time.monotonic()
    self.metrics.op("step").observe(time.perf_counter() - t0)
    return obs

  async def _act(self, s: Session, text: str) -> tuple[float, dict]:
    """One counted step on the page (no screenshot) -> (reward, info). Raises: PlaywrightError."""
    if s.pg.crashed:
      raise PlaywrightError(s.pg.crashed)
    s.step += 1
    s.pg.steps += 1
    s.actions.append(text[:P.MAX_ACTION_CHARS + 1])  # longer ones only need to stay too long on replay
    info: dict = {}
    end = False
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
    ts = tasks.get(s.task)
    st = await _advance_and_read(s.page, self.step_ms, ts.state_script)
    if st.get("nav"):  # browse: a followed link / submitted form the init script held back
      await _goto(s.page, ts, st["nav"])
      st = await _advance_and_read(s.page, self.step_ms, ts.state_script)  # the new page's timers
    if end and ts.judge is not None:  # browse: the answer in finished(content=...) is scored here
      r, why = ts.judge(s.seed, s.data_mode, action, st.get("page"))
      st = {**st, "done": True, "reward": r, "raw_reward": r, "reason": why}
    s.elapsed_ms += self.step_ms
    s.done = bool(st["done"]) or end  # finished()/call_user(): ends with what the page has scored
    # The reward of the step that ends the episode, also by finished(): a game's current score /
    # reference; MiniWoB's reward global is 0 until the page ends the episode.
    reward = float(st["reward"]) if s.done else 0.0
    info.update(raw_reward=float(st["raw_reward"]) if s.done else 0.0, reason=st["reason"], **ts.info(st))
    return reward, info

  async def observe(self, sid: str) -> P.Observation:
    """The current screenshot; no action, no time passes; reward 0 (rewards come with steps)."""
    t0 = time.perf_counter()
    s = self.sessions.lease(sid)
    async with s.lock:
      obs = await self._observation(s, 0.0, {})
      s.last_used = time.monotonic()
    self.metrics.op("observe").observe(time.perf_counter() - t0)
    return obs

  async def close(self, sid: str) -> None:
    """Ends a session; its page goes back to the idle pool of its task (or is closed).

    Idempotent for sessions that already ended (closed, expired, lost). Raises: UnknownSession for
    ids never opened.
    """
    t0 = time.perf_counter()
    s = self.sessions.to_close(sid)
    if s is None:
      return
    self._forget(sid, P.UnknownSession(f"session {sid} was closed"))
    self.counters["closed"] += 1
    self.metrics.events.labels("closed").inc()
    self.events.add("session_closed", session=sid, browser=s.pg.slot.index, steps=s.step)
    pg = s.pg
    self._transit.add(pg.context)  # between the session and the idle pool: owned by this close
    try:
      async with s.lock:  # let a step in flight finish before the page changes hands
        pg.session_id = None
        pool = self.idle.setdefault(s.task, [])
        if (pg.usable() and pg.steps < MAX_PAGE_STEPS and s.task not in REUSE_UNSAFE_TASKS
            and sum(map(len, self.idle.values())) < self.max_idle_pages and pg not in pool):
          pool.append(pg)
        else:
          await self._discard_page(pg)
    finally:
      self._transit.discard(pg.context)
    self.metrics.op("close").observe(time.perf_counter() - t0)

  async def snapshot(self, sid: str) -> dict:
    """A replay snapshot of the session (see the module docstring) -> `protocol.Snapshot` fields.

    Raises: the typed session errors.
    """
    t0 = time.perf_counter()
    s = self.sessions.lease(sid)
    async with s.lock:
      png = await self._screenshot(s)
      snap = {"version": SNAPSHOT_VERSION, "kind": "replay", "task": s.task, "seed": s.seed,
              "data_mode": s.data_mode, "coords": s.coords.mode, "step_ms": self.step_ms,
              "actions": list(s.actions), "step": s.step, "elapsed_ms": s.elapsed_ms, "done": s.done,
              "screenshot_sha256": hashlib.sha256(png).hexdigest()}
    self.counters["snapshots"] += 1
    self.metrics.op("snapshot").observe(time.perf_counter() - t0)
    return snap

  async def restore(self, sid: str, snap: dict) -> P.Observation:
    """Puts the session into the state of `snap` (made by `snapshot` on any server with the same
    step_ms and task) by restarting its episode and replaying the snapshot's actions.

    Returns: the observation at the restored state (reward 0).
    Raises: InvalidAction (another task, step_ms or version); TaskError (the replay did not reach
      the snapshot's screenshot); the typed session errors.
    """
    t0 = time.perf_counter()
    s = self.sessions.lease(sid)
    if snap.get("version") != SNAPSHOT_VERSION or snap.get("kind") != "replay":
      raise P.InvalidAction(f"unsupported snapshot version/kind {snap.get('version')}/{snap.get('kind')}")
    if snap["task"] != s.task:
      raise P.InvalidAction(f"snapshot of {snap['task']!r} cannot be restored into a {s.task!r} session")
    if snap["step_ms"] != self.step_ms:
      raise P.InvalidAction(f"snapshot taken at step_ms={snap['step_ms']}, this server runs {self.step_ms}")
    async with s.lock:
      try:
        async with asyncio.timeout(self.page_timeout_s * (1 + len(snap["actions"]))):
          if s.pg.crashed:
            raise PlaywrightError(s.pg.crashed)
          ts = tasks.get(s.task)
          s.instruction = await self._start_episode(s.page, ts, snap["seed"], snap["data_mode"])
          s.seed, s.data_mode, s.step, s.elapsed_ms, s.done, s.actions = \
              snap["seed"], snap["data_mode"], 0, 0, False, []
          s.coords = A.CoordSpec(snap["coords"], ts.width, ts.height) if snap["coords"] == "absolute" \
              else A.CoordSpec()
          for text in snap["actions"]:
            await self._act(s, text)
      except (PlaywrightError, TimeoutError) as e:
        await self._page_failed(s, e, "restore")
      png = await self._screenshot(s)
      if hashlib.sha256(png).hexdigest() != snap["screenshot_sha256"]:
        raise P.TaskError(f"restore of {s.task} seed {s.seed} replayed {len(snap['actions'])} actions but the "
                          "screenshot differs from the snapshot's")
      obs = self._make_obs(s, png, 0.0, {})
    self.counters["restores"] += 1
    self.events.add("session_restored", session=sid, task=s.task, steps=s.step)
    self.metrics.op("restore").observe(time.perf_counter() - t0)
    return obs

  async def elements(self, sid: str) -> list[dict]:
    """Every visible element of the page, in document order, as
    {tag, id, classes, type, text, value, checked, focused, leaf, x, y, width, height}: box in
    screenshot pixels clipped to the viewport (= MiniWoB's #wrap) and to scrolling ancestors, `text` the element's rendered text (innerText, or
    value / placeholder of inputs; whitespace collapsed, at most 200 characters), `leaf` True when no
    visible element is inside it. What scripted experts and grounding data read (tars_jax/data/);
    agents only ever see screenshots.

    Raises: the typed session errors.
    """
    s = self.sessions.lease(sid)
    async with s.lock:
      try:
        async with asyncio.timeout(self.page_timeout_s):
          return await s.page.evaluate(ELEMENTS_SCRIPT)
      except (TimeoutError, PlaywrightError) as e:
        await self._page_failed(s, e, "elements")

  async def game_state(self, sid: str) -> dict:
    """DEBUG / EXPERTS ONLY: the privileged state of a game session (`GAME.debugState()`, the JSON the
    reference players of envs_bridge/games/reference.py read). Raises: InvalidAction for a session
    that is not a game; the typed session errors."""
    s = self.sessions.lease(sid)
    if not s.task.startswith(catalog.PREFIX):
      raise P.InvalidAction(f"game_state: session {sid} runs {s.task!r}, not a game ({catalog.PREFIX}...)")
    async with s.lock:
      try:
        async with asyncio.timeout(self.page_timeout_s):
          return await s.page.evaluate(catalog.DEBUG_STATE_SCRIPT)
      except (TimeoutError, PlaywrightError) as e:
        await self._page_failed(s, e, "game_state")

  async def element_box(self, sid: str, selector: str) -> dict | None:
    """Bounding box {x, y, width, height} (px) of the first element matching a CSS `selector`, or
    None. An inspection aid for tests and debugging; agents only ever see screenshots.

    Raises: InvalidAction for a selector that does not parse; the typed session errors.
    """
    s = self.sessions.lease(sid)
    async with s.lock:
      try:
        async with asyncio.timeout(self.page_timeout_s):
          el = await s.page.query_selector(selector)
          return None if el is None else await el.bounding_box()
      except TimeoutError as e:
        await self._page_failed(s, e, "element_box")
      except PlaywrightError as e:
        if s.page.is_closed() or s.pg.crashed or s.pg.slot.dead():
          await self._page_failed(s, e, "element_box")
        raise P.InvalidAction(f"selector {selector!r}: {e}") from e

  def health(self) -> dict:
    """{ok, sessions, config (step_ms, ..., chromium: the executable), browsers: [{index, pid, up,
    generation, sessions, pages}], idle_pages, spare_pages, spare ({pid, up, pages, pss_mb} of the
    standby browser or None), **counters}; ok is False when no browser is connected."""
    browsers = [{"index": s.index, "pid": s.pid, "up": s.up(), "generation": s.generation,
                 "sessions": s.sessions, "pages": len(s.browser.contexts) if s.up() else 0} for s in self.slots]
    return {"ok": any(b["up"] for b in browsers), "sessions": len(self.sessions), "step_ms": self.step_ms,
            "lease_s": self.lease_s, "max_sessions": self.max_sessions, "n_browsers": len(self.slots),
            "page_timeout_s": self.page_timeout_s, "chromium": self.executable, "browsers": browsers,
            "idle_pages": sum(map(len, self.idle.values())), "spare_pages": self.spare_pages,
            "spare": self.spare_info(), **self.counters}

  def metrics_text(self) -> bytes:
    """Prometheus text exposition of the sandbox metrics."""
    for s in self.slots:
      self.metrics.pages.labels(str(s.index)).set(len(s.browser.contexts) if s.up() else 0)
    self.metrics.browsers_up.set(sum(s.up() for s in self.slots))
    return self.metrics.render()

  # -- internals --------------------------------------------------------------------------------
  async def _page_failed(self, s: Session, e: BaseException, during: str):
    """Maps a page failure to SessionLost with the most precise cause, cleans up, raises."""
    slot = s.pg.slot
    if slot.dead():
      self._browser_died(slot, f"noticed during {during}")
      self._spawn(self._recover(slot))
    elif s.pg.crashed:
      self._lose(s, s.pg.crashed, "page_crash")
    elif isinstance(e, TimeoutError):
      self.counters["page_hangs"] += 1
      self.metrics.page_hangs.inc()
      self.events.add("page_hung", browser=slot.index, session=s.id, during=during, timeout_s=self.page_timeout_s)
      self._lose(s, f"page did not answer within {self.page_timeout_s:g} s during {during}", "page_hang")
    else:
      self._lose(s, f"page failed during {during}: {str(e)[:300]}", "page_error")
    await self._discard_page(s.pg)
    err = self.sessions.gone.get(s.id)
    raise err if isinstance(err, P.SessionLost) else P.SessionLost(f"page failed during {during}: {e}")

  async def _discard_page(self, pg: _Page) -> None:
    """Closes a page's context; one that does not close in time takes its Chromium down with it."""
    pg.discarded = True
    for task, pool in self.idle.items():
      if pg in pool:
        pool.remove(pg)
    if pg.generation != pg.slot.generation or not pg.slot.up():
      return  # its browser is gone already
    self._transit.add(pg.context)  # being closed here: not the GC's (it would count it as leaked)
    try:
      # killing the Chromium loses all its sessions: give the close at least CLOSE_TIMEOUT_S, even
      # under a short page timeout (a hung renderer's context may close slowly on busy cores)
      closed = await _close_context(pg.context, max(self.page_timeout_s, CLOSE_TIMEOUT_S))
    finally:
      self._transit.discard(pg.context)
    if not closed:
      slot = pg.slot
      log.error("a page of browser %d did not close; killing that Chromium (pid %s)", slot.index, slot.pid)
      self.events.add("browser_killed", browser=slot.index, pid=slot.pid, why="page did not close")
      if slot.pid:
        try:
          os.kill(slot.pid, signal.SIGKILL)  # -> disconnected -> sessions lost, relaunch
        except ProcessLookupError:
          pass

  async def _screenshot_b64(self, s: Session) -> str:
    """PNG of the viewport (exactly MiniWoB's #wrap), base64. Raises: SessionLost."""
    try:
      async with asyncio.timeout(self.page_timeout_s):
        if s.pg.crashed:
          raise PlaywrightError(s.pg.crashed)
        return await _capture_png_b64(s.pg)
    except (PlaywrightError, TimeoutError) as e:
      await self._page_failed(s, e, "screenshot")

  async def _screenshot(self, s: Session) -> bytes:
    return base64.b64decode(await self._screenshot_b64(s))

  async def _observation(self, s: Session, reward: float, info: dict) -> P.Observation:
    return self._make_obs(s, await self._screenshot_b64(s), reward, info)

  @staticmethod
  def _make_obs(s: Session, png: bytes | str, reward: float, info: dict) -> P.Observation:
    """Observation of session `s`; `png` as bytes or already base64 (the CDP screenshot is)."""
    full = {"instruction": s.instruction, "step": s.step, "elapsed_ms": s.elapsed_ms, "raw_reward": 0.0,
            "reason": None, "error": None, "task": s.task, "seed": s.seed}
    full.update(info)
    b64 = png if isinstance(png, str) else base64.b64encode(png).decode()
    return P.Observation(screenshot_png_b64=b64, reward=reward, done=s.done, info=full)


@functools.lru_cache(maxsize=None)
def _advance_and_read_script(state_script: str) -> str:
  return f"async (ms) => {{ await globalThis.__pwClock.controller.runFor(ms); return ({state_script})(); }}"


@functools.lru_cache(maxsize=64)
def _set_date_and_clean_script(clean_script: str) -> str:
  # `controller.setSystemTime` is what page.clock.set_system_time evaluates (see _advance_and_read).
  return f"(ms) => {{ globalThis.__pwClock.controller.setSystemTime(ms); ({clean_script})(); }}"


def _start_and_read_script(start_script: str, utterance_script: str) -> str:
  # start scripts are synchronous statements (miniwob_tasks.start_script, games catalog.start_script)
  return f"() => {{ {start_script}\n; return ({utterance_script})(); }}"


async def _advance_and_read(page, step_ms: int, state_script: str) -> dict:
  """Advances the page's virtual clock by `step_ms` ms, then runs `state_script` -> its result.

  One page.evaluate instead of `page.clock.run_for` + `page.evaluate(state_script)`: run_for makes
  Playwright add a log init script to the context (replayed only if the page navigates, which task
  pages do not after their load) and then evaluate `__pwClock.controller.runFor(ms)` in every frame's
  main world; here the same controller call runs in the page's main world, followed by the state read
  in the same evaluate. Pages with child frames keep Playwright's call (it advances every frame).
  Source: Playwright 1.65 server `Clock.runFor` (packages/playwright-core/src/server/clock.ts).
  Raises: PlaywrightError (page gone, or a timer threw, as run_for would).
  """
  if page.main_frame.child_frames:
    await page.clock.run_for(step_ms)
    return await page.evaluate(state_script)
  return await page.evaluate(_advance_and_read_script(state_script), step_ms)


async def _goto(page, ts: tasks.TaskSpec, url: str, settle_s: float = 5.0) -> None:
  """Loads `url` in a task page (browse tasks navigate): waits for the load event, adds the task's
  style and HIDE_CARET_CSS to the new document, and waits (at most settle_s) until the page's jQuery
  requests are done (the search page's glossary), so the next screenshot does not race them.
  Raises: PlaywrightError (failed load)."""
  await page.goto(url)
  await page.add_style_tag(content=(ts.css or "") + HIDE_CARET_CSS)
  for _ in range(int(settle_s / 0.01)):
    if await page.evaluate("() => !window.jQuery || jQuery.active === 0"):
      return
    await asyncio.sleep(0.01)


async def _capture_png_b64(pg: _Page) -> str:
  """Viewport PNG (base64) by CDP `Page.captureScreenshot` on the page's own CDP session.

  One protocol call where `page.screenshot` makes about six (viewport size, hide caret and fonts.ready
  in every frame, layout metrics, capture, restore); with the caret hidden for good (HIDE_CARET_CSS,
  put in by `_new_page`) the bytes are the same. Raises: PlaywrightError if the page is gone.
  """
  if pg.cdp is None:
    pg.cdp = await pg.context.new_cdp_session(pg.page)
  return (await pg.cdp.send("Page.captureScreenshot", {"format": "png"}))["data"]


async def _browser_pid(browser) -> int | None:
  """The Chromium browser process id (CDP SystemInfo.getProcessInfo), None if unavailable."""
  try:
    cdp = await browser.new_browser_cdp_session()
    info = await cdp.send("SystemInfo.getProcessInfo")
    await cdp.detach()
    return next((p["id"] for p in info["processInfo"] if p["type"] == "browser"), None)
  except (PlaywrightError, KeyError):
    return None


async def _close_browser(browser) -> None:
  try:
    async with asyncio.timeout(10):
      await browser.close()
  except (PlaywrightError, TimeoutError):
    pass


def _tree_pss_bytes(pid: int | None) -> int:
  """PSS (bytes) of process `pid` and its descendants (psutil `memory_full_info`, Linux smaps); 0 if
  unknown, processes that vanish or cannot be read count 0."""
  if pid is None:
    return 0
  try:
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
  except psutil.Error:
    return 0
  total = 0
  for p in procs:
    try:
      total += p.memory_full_info().pss
    except psutil.Error:
      pass
  return total


def _pid_alive(pid: int) -> bool:
  """False if the process is gone or a zombie (Linux /proc; True where /proc is unavailable)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False
  except (OSError, IndexError):
    return True


async def _close_context(ctx, timeout_s: float = 60.0) -> bool:
  """Closes a browser context; False if it did not close within `timeout_s`."""
  try:
    async with asyncio.timeout(timeout_s):
      await ctx.close()
  except PlaywrightError:
    pass
  except TimeoutError:
    return False
  return True
