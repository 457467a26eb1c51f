"""Environment throughput: our sandbox's steps/s on MiniWoB click tasks at 1, 4, 16, 32 sessions,
beside the raw Playwright ceiling on the same pages and BrowserGym's MiniWoB env (issue #5 item 5).

  .venv/bin/python -m benchmarks.env_throughput [--sessions 1,4,16,32] [--seconds 8] [--browsers 1]
      [--browsergym 1,4,16] [--browsergym-profiles default,no-delay] [--chromium PATH]

All three run the same Chromium executable (--chromium, default the sandbox's DEFAULT_CHROMIUM: Debian's
headless shell where installed).

Ours: a sandbox server subprocess (`launch_server`) driven over HTTP by the async client; every
session loops: step with a click at a random point of the task (a seeded RNG), and when the episode
ends, close it and open the next (resets are inside the measured time, not counted as steps). One step
= parse + mouse click + virtual clock advance + reward read + PNG screenshot + JSON/base64 over HTTP.

Raw ceiling: in this process, one Chromium through Playwright with N contexts showing the same task
pages (same viewport, virtual clock installed), taking PNG screenshots concurrently and nothing else:
no actions, no HTTP, no clock, no JSON. A step can never be cheaper than its screenshot, so ours / raw
is the fraction of the ceiling we reach. Two ceilings: `page.screenshot` (Playwright's API, the
issue's definition) and CDP `Page.captureScreenshot` on a CDPSession (what our step uses since it
makes one protocol call instead of about six: the stricter ceiling).

Raw step: in this process, the same pages driven by the sandbox's own page calls for a step (the
executor's click, the virtual-clock advance + reward read, the CDP capture) and, when an episode ends,
for an open (episode restart + capture): a step with no server, HTTP, JSON or session bookkeeping.
raw step / raw is therefore the most any server making these page calls could reach of the ceiling
(column "bound"), and ours / raw step what our server and client cost on top.

BrowserGym: `benchmarks/browsergym_env.py` (its own venv under runs/bench_venvs/, made on first use;
see there how it is pointed at the same Chromium executable and the miniwob wheel's HTML): N envs in N processes,
`env.step("mouse_click(x, y)")`, resets inside the measured time, profiles "default" (as shipped) and
"no-delay" (its 0.5 s pre-observation sleep and 100 ms slow_mo set to 0). Its window is longer
(--browsergym-seconds, 30 s) because one of its resets takes seconds. Its envs start
--browsergym-setup-concurrency at a time (2: all 16 at once fail their first reset on 2 cores); resets
or steps that raise inside the window are counted (column "failures") and the env reset again.

All of a point's runs are made one after the other, on the same machine, so the ratios are comparable
even when the machine is loaded. With `--rounds R` (default 3) ours, the two raw ceilings and the raw
step are measured R times in turn (ours, raw, raw CDP, raw step, ours, ...) and each round's ratio is
taken from the runs of that round, seconds apart: the table gives the median of each column and, for
the ratios, the median and the range over the rounds. (On this 2-core VM the ceiling alone moved
between 119 and 203 shots/s within an hour, so a single pair of runs gave ratios from 0.42 to 0.68
for the same code.)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import os
import platform
import random
import statistics
import time

from playwright.async_api import async_playwright

from benchmarks import browsergym_env
from benchmarks.command import command_line
from envs_bridge.browser import executor, tasks
from envs_bridge.browser import miniwob_tasks as mw
from envs_bridge.browser import sessions as S
from envs_bridge.browser.sessions import CHROMIUM_ARGS, DEFAULT_CHROMIUM, EPOCH_MS, HIDE_CARET_CSS
from envs_bridge.client import SandboxClient
from envs_bridge.launch import launch_server, without_tcmalloc
from tars_jax.agent import actions as A

# Memory one BrowserGym env holds (worker + Playwright driver + two Chromium with their renderer, GPU and
# utility processes), measured on 2026-11-23: 16 envs had taken 6.7 GB while still starting up.
BROWSERGYM_ENV_BYTES = 650 * 2**20
TASKS = ("miniwob/click-test", "miniwob/click-test-2", "miniwob/click-button", "miniwob/click-link")


STEP_MS = 1000  # virtual ms per step, the server's and the raw step's


def random_click(rng: random.Random) -> str:
  """A click at a random point of the task area (below the instruction), relative-1000 coordinates."""
  x, y = rng.randrange(20, 980), rng.randrange(260, 980)
  return f"click(start_box='({x},{y})')"


async def ours(url: str, n: int, seconds: float, warmup_s: float) -> dict:
  """steps/s of n concurrent sessions for `seconds` after `warmup_s` (episodes reset as they end)."""
  async with SandboxClient(url, timeout_s=300.0) as c:
    counts = [0] * n
    resets = [0] * n
    lat: list[float] = []
    sids = [(await c.open(TASKS[k % len(TASKS)], 1000 * k))[0] for k in range(n)]  # pages exist before timing
    start = time.perf_counter()
    t_measure, t_end = start + warmup_s, start + warmup_s + seconds

    async def worker(k: int):
      rng = random.Random(k)
      seed, sid = 1000 * k, sids[k]
      while (now := time.perf_counter()) < t_end:
        o = await c.step(sid, random_click(rng))
        done_at = time.perf_counter()
        if now >= t_measure and done_at <= t_end:
          counts[k] += 1
          lat.append(done_at - now)
        if o.done:
          await c.close(sid)
          seed += 1
          resets[k] += 1
          sid, _ = await c.open(TASKS[k % len(TASKS)], seed)
      await c.close(sid)

    await asyncio.gather(*[worker(k) for k in range(n)])
    lat.sort()
    return {"steps_per_s": sum(counts) / seconds, "steps": sum(counts), "resets": sum(resets),
            "p50_ms": 1000 * lat[len(lat) // 2] if lat else float("nan")}


async def task_page(browser, k: int):
  """The k-th raw page: a fresh context on `TASKS[k % 4]` with the sandbox's viewport, caret style and
  paused virtual clock, its episode started with seed 1000 * k -> (context, page)."""
  ctx = await browser.new_context(viewport={"width": mw.WIDTH, "height": mw.HEIGHT}, device_scale_factor=1)
  page = await ctx.new_page()
  await page.clock.install(time=EPOCH_MS)
  await page.clock.pause_at(EPOCH_MS + 1000)
  await page.goto(mw.task_url(TASKS[k % len(TASKS)]))
  await page.add_style_tag(content=mw.LOCK_VIEWPORT_CSS + HIDE_CARET_CSS)  # as the sandbox's pages
  await page.evaluate(mw.start_script(1000 * k))
  return ctx, page


async def raw(n: int, seconds: float, warmup_s: float, method: str = "playwright",
              chromium: str = DEFAULT_CHROMIUM) -> dict:
  """Screenshots/s of n pages of the same tasks in one Chromium, taken concurrently (the ceiling), or
  with method "step" the sandbox's page calls of a step (see the module docstring) -> {"shots_per_s"}
  (for "step": steps/s, episode restarts inside the time and not counted, as ours).

  method: "playwright" (page.screenshot), "cdp" (Page.captureScreenshot on a CDPSession, caret
  hidden by a style as in the sandbox) or "step".
  """
  pw = await async_playwright().start()
  # the system malloc, as the sandbox server's Chromium (`launch_server` takes tcmalloc out of its env)
  browser = await pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS,
                                     env=without_tcmalloc(os.environ))
  try:
    pages = []
    for k in range(n):
      ctx, page = await task_page(browser, k)
      if method == "cdp":
        cdp = await ctx.new_cdp_session(page)
        pages.append(lambda cdp=cdp: cdp.send("Page.captureScreenshot", {"format": "png"}))
      elif method == "step":
        cdp = await ctx.new_cdp_session(page)
        pages.append(functools.partial(_raw_step, page, cdp, tasks.get(TASKS[k % len(TASKS)]), random.Random(k),
                                       {"seed": 1000 * k}))
      else:
        pages.append(lambda page=page: page.screenshot(type="png"))
    counts = [0] * n
    start = time.perf_counter()
    t_measure, t_end = start + warmup_s, start + warmup_s + seconds

    async def worker(k: int):
      while (now := time.perf_counter()) < t_end:
        await pages[k]()
        if now >= t_measure and time.perf_counter() <= t_end:
          counts[k] += 1

    await asyncio.gather(*[worker(k) for k in range(n)])
    return {"shots_per_s": sum(counts) / seconds}
  finally:
    await browser.close()
    await pw.stop()


async def _raw_step(page, cdp, ts: tasks.TaskSpec, rng: random.Random, state: dict) -> None:
  """One step of the raw-step mode: the page calls of `BrowserSandbox.step` (executor, clock advance +
  reward read, CDP capture) and, when the episode ends, of `BrowserSandbox.open` on a reused page."""
  action = A.parse(random_click(rng), A.CoordSpec())
  await executor.execute(page, action, ts.width, ts.height)
  st = await S._advance_and_read(page, STEP_MS, ts.state_script)
  await cdp.send("Page.captureScreenshot", {"format": "png"})
  if st["done"]:
    state["seed"] += 1
    await S.BrowserSandbox._start_episode(page, ts, state["seed"], "train")
    await cdp.send("Page.captureScreenshot", {"format": "png"})


def combine_rounds(rounds: list[tuple[dict, ...]]) -> tuple[dict, ...]:
  """[(ours, raw, raw CDP[, raw step]) per round] -> the same tuple with each number the median over
  the rounds (resets: the sum), and per-round ratios, sorted: ours["ratio_raw"] / ["ratio_cdp"] /
  ["ratio_step"] (ours over the round's own raw, raw CDP, raw step) and, with a raw step, its
  ["ratio_raw"] (raw step / raw: the bound). Every raw dict has "shots_per_s" (steps/s for the raw
  step). Raises ValueError for no rounds or rounds of different lengths."""
  if not rounds:
    raise ValueError("no rounds to combine")
  width = len(rounds[0])
  if width not in (3, 4) or any(len(x) != width for x in rounds):
    raise ValueError(f"rounds must all be (ours, raw, raw CDP[, raw step]); got lengths {[len(x) for x in rounds]}")
  med = lambda xs: statistics.median(xs) if xs else float("nan")
  def ratios(num, j):  # num(round) over the round's own raw j, per round (a failed raw gives none)
    return sorted(num(x) / x[j]["shots_per_s"] for x in rounds if x[j]["shots_per_s"])

  o = {"steps_per_s": med([x[0]["steps_per_s"] for x in rounds]), "steps": sum(x[0]["steps"] for x in rounds),
       "resets": sum(x[0]["resets"] for x in rounds), "p50_ms": med([x[0]["p50_ms"] for x in rounds])}
  for key, j in (("ratio_raw", 1), ("ratio_cdp", 2), ("ratio_step", 3))[:width - 1]:
    o[key] = ratios(lambda x: x[0]["steps_per_s"], j)
  out = [o] + [{"shots_per_s": med([x[j]["shots_per_s"] for x in rounds])} for j in range(1, width)]
  if width == 4:
    out[3]["ratio_raw"] = ratios(lambda x: x[3]["shots_per_s"], 1)
  return tuple(out)


def _ratio_cell(ratios: list[float]) -> str:
  """'0.55' for one round, '0.55 (0.50-0.61)' = median (min-max) for several, '-' for none."""
  if not ratios:
    return "-"
  m = f"{statistics.median(ratios):.2f}"
  return m if len(ratios) == 1 else f"{m} ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def _mem_available() -> int:
  """MemAvailable of /proc/meminfo in bytes (Linux)."""
  with open("/proc/meminfo") as f:
    return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))


def _fmt(x: float, spec: str = ".1f") -> str:
  return "-" if x != x else format(x, spec)  # NaN: not measured


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--sessions", default="1,4,16,32", help="comma-separated session counts")
  ap.add_argument("--seconds", type=float, default=8.0, help="measured seconds per point")
  ap.add_argument("--warmup-s", type=float, default=2.0, help="unmeasured seconds before each point")
  ap.add_argument("--browsers", type=int, default=1, help="Chromium processes of the sandbox server")
  ap.add_argument("--chromium", default=DEFAULT_CHROMIUM, help="Chromium executable (server and raw ceilings)")
  ap.add_argument("--rounds", type=int, default=3,
                  help="alternating rounds of ours / raw / raw CDP / raw step per point (ratios: median and range)")
  ap.add_argument("--browsergym", default="1,4,16",
                  help="session counts at which BrowserGym is measured ('' = none; it runs 2 Chromium per env)")
  ap.add_argument("--browsergym-profiles", default="default,no-delay", help="BrowserGym profiles to run")
  ap.add_argument("--browsergym-seconds", type=float, default=30.0,
                  help="measured seconds per BrowserGym point (its reset launches two Chromium: seconds each)")
  ap.add_argument("--browsergym-setup-concurrency", type=int, default=browsergym_env.SETUP_CONCURRENCY,
                  help="BrowserGym envs that start at the same time")
  a = ap.parse_args(argv)
  ns = [int(x) for x in a.sessions.split(",")]
  bg_ns = {int(x) for x in a.browsergym.split(",") if x}
  profiles = [p for p in a.browsergym_profiles.split(",") if p]
  nan = float("nan")
  rows = []
  with launch_server(step_ms=STEP_MS, lease_s=600.0, max_sessions=max(64, max(ns)), n_browsers=a.browsers,
                     chromium=a.chromium) as h:
    for n in ns:
      rounds = []
      for _ in range(a.rounds):  # alternating: each round's ratio compares runs seconds apart
        rounds.append((asyncio.run(ours(h.url, n, a.seconds, a.warmup_s)),
                       *(asyncio.run(raw(n, a.seconds, a.warmup_s, m, a.chromium)) for m in ("playwright", "cdp", "step"))))
      o, r, rc, rs = combine_rounds(rounds)
      bg = {}
      for prof in profiles if n in bg_ns else ():
        if _mem_available() < n * BROWSERGYM_ENV_BYTES + 2 * 2**30:  # on a shared machine: no OOM kills
          print(f"n={n}: BrowserGym {prof} skipped: {_mem_available() / 2**30:.1f} GiB available, "
                f"{n} envs need about {n * BROWSERGYM_ENV_BYTES / 2**30:.1f} GiB", flush=True)
          continue
        bg[prof] = browsergym_env.measure(n, a.browsergym_seconds, a.warmup_s, TASKS, mw.HTML_DIR, CHROMIUM_ARGS, prof,
                                          executable=a.chromium, setup_concurrency=a.browsergym_setup_concurrency)
        if bg[prof]["env_errors"]:
          raise RuntimeError(f"BrowserGym envs failed: {bg[prof]['env_errors']}")
      rows.append((n, o, r, rc, rs, bg))
      print(f"n={n}: ours {o['steps_per_s']:.1f} steps/s (p50 {o['p50_ms']:.0f} ms, {o['resets']} resets), "
            f"raw {r['shots_per_s']:.1f} shots/s, raw cdp {rc['shots_per_s']:.1f} shots/s, raw step "
            f"{rs['shots_per_s']:.1f} steps/s (medians of {a.rounds} rounds; ours / raw per round "
            f"{[round(x, 2) for x in o['ratio_raw']]}, raw step / raw {[round(x, 2) for x in rs['ratio_raw']]})"
            + "".join(f", BrowserGym {p} {b['steps_per_s']:.2f} steps/s (p50 {b['p50_ms']:.0f} ms, "
                      f"{b['resets']} resets, {b['failures']} failures, start-up {b['startup_s']:.0f} s"
                      + (f", first failure: {b['first_failure']}" if b.get("first_failure") else "") + ")"
                      for p, b in bg.items()), flush=True)
  print()
  cmd = command_line("benchmarks.env_throughput",
                     f"--sessions {a.sessions} --seconds {a.seconds:g} --rounds {a.rounds} --browsers {a.browsers} "
                     f"--chromium {a.chromium} "
                     f"--browsergym '{a.browsergym}' --browsergym-profiles '{a.browsergym_profiles}' "
                     f"--browsergym-seconds {a.browsergym_seconds:g} "
                     f"--browsergym-setup-concurrency {a.browsergym_setup_concurrency}")
  print(f"Command: `{cmd}`. "
        f"Date: {datetime.date.today()}. Machine: {platform.machine()}, {os.cpu_count()} CPU cores, "
        f"{platform.platform()}, load average {os.getloadavg()[0]:.1f} at the end.")
  print()
  head = ["sessions", "ours steps/s", "step p50 (ms)", "resets", "raw page.screenshot/s", "ours / raw",
          "raw CDP shots/s", "ours / raw CDP", "raw step/s", "bound: raw step / raw", "ours / raw step"]
  for p in profiles:
    head += [f"BrowserGym {p} steps/s", f"BrowserGym {p} failures", f"ours / BrowserGym {p}"]
  print("| " + " | ".join(head) + " |")
  print("|" + "---|" * len(head))
  for n, o, r, rc, rs, bg in rows:
    cells = [str(n), _fmt(o["steps_per_s"]), _fmt(o["p50_ms"], ".0f"), str(o["resets"]), _fmt(r["shots_per_s"]),
             _ratio_cell(o["ratio_raw"]), _fmt(rc["shots_per_s"]), _ratio_cell(o["ratio_cdp"]),
             _fmt(rs["shots_per_s"]), _ratio_cell(rs["ratio_raw"]), _ratio_cell(o["ratio_step"])]
    for p in profiles:
      b = bg.get(p, {}).get("steps_per_s", nan)
      cells += [_fmt(b, ".2f"), str(bg[p]["failures"]) if p in bg else "",
                _fmt(o["steps_per_s"] / b if b else nan, ".1f") + ("x" if b == b and b else "")]
    print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
  main()
