"""Environment throughput: our sandbox's steps/s on MiniWoB click tasks at 1, 4, 16, 32 sessions,
beside the raw Playwright ceiling on the same pages (issue #5 item 5).

  .venv/bin/python -m benchmarks.env_throughput [--sessions 1,4,16,32] [--seconds 8] [--browsers 1]

Ours: a sandbox server subprocess (`launch_server`) driven over HTTP by the async client; every
session loops: step with a click at a random point of the task (a seeded RNG), and when the episode
ends, close it and open the next (resets are inside the measured time, not counted as steps). One step
= parse + mouse click + virtual clock advance + reward read + PNG screenshot + JSON/base64 over HTTP.

Raw ceiling: in this process, one Chromium through Playwright with N contexts showing the same task
pages (same viewport, virtual clock installed), taking PNG screenshots concurrently and nothing else:
no actions, no HTTP, no clock, no JSON. A step can never be cheaper than its screenshot, so ours / raw
is the fraction of the ceiling we reach. The two are run one after the other, on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import random
import time

from playwright.async_api import async_playwright

from envs_bridge.browser import miniwob_tasks as mw
from envs_bridge.browser.sessions import CHROMIUM_ARGS, EPOCH_MS
from envs_bridge.client import SandboxClient
from envs_bridge.launch import launch_server

TASKS = ("miniwob/click-test", "miniwob/click-test-2", "miniwob/click-button", "miniwob/click-link")


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
        x, y = rng.randrange(20, 980), rng.randrange(260, 980)  # the task area, below the instruction
        o = await c.step(sid, f"click(start_box='({x},{y})')")
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


async def raw(n: int, seconds: float, warmup_s: float) -> dict:
  """Screenshots/s of n pages of the same tasks in one Chromium, taken concurrently (the ceiling)."""
  pw = await async_playwright().start()
  browser = await pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
  try:
    pages = []
    for k in range(n):
      ctx = await browser.new_context(viewport={"width": mw.WIDTH, "height": mw.HEIGHT}, device_scale_factor=1)
      page = await ctx.new_page()
      await page.clock.install(time=EPOCH_MS)
      await page.clock.pause_at(EPOCH_MS + 1000)
      await page.goto(mw.task_url(TASKS[k % len(TASKS)]))
      await page.evaluate(mw.start_script(1000 * k))
      pages.append(page)
    counts = [0] * n
    start = time.perf_counter()
    t_measure, t_end = start + warmup_s, start + warmup_s + seconds

    async def worker(k: int):
      while (now := time.perf_counter()) < t_end:
        await pages[k].screenshot(type="png")
        if now >= t_measure and time.perf_counter() <= t_end:
          counts[k] += 1

    await asyncio.gather(*[worker(k) for k in range(n)])
    return {"shots_per_s": sum(counts) / seconds}
  finally:
    await browser.close()
    await pw.stop()


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--sessions", default="1,4,16,32", help="comma-separated session counts")
  ap.add_argument("--seconds", type=float, default=8.0, help="measured seconds per point")
  ap.add_argument("--warmup-s", type=float, default=2.0, help="unmeasured seconds before each point")
  ap.add_argument("--browsers", type=int, default=1, help="Chromium processes of the sandbox server")
  a = ap.parse_args(argv)
  ns = [int(x) for x in a.sessions.split(",")]
  rows = []
  with launch_server(step_ms=1000, lease_s=600.0, max_sessions=max(64, max(ns)), n_browsers=a.browsers) as h:
    for n in ns:
      o = asyncio.run(ours(h.url, n, a.seconds, a.warmup_s))
      r = asyncio.run(raw(n, a.seconds, a.warmup_s))
      rows.append((n, o, r))
      print(f"n={n}: ours {o['steps_per_s']:.1f} steps/s (p50 {o['p50_ms']:.0f} ms, {o['resets']} resets), "
            f"raw {r['shots_per_s']:.1f} shots/s", flush=True)
  print()
  print(f"Command: `.venv/bin/python -m benchmarks.env_throughput --sessions {a.sessions} --seconds {a.seconds:g} "
        f"--browsers {a.browsers}`. Date: {datetime.date.today()}. Machine: {platform.machine()}, "
        f"{os.cpu_count()} CPU cores, {platform.platform()}.")
  print()
  print("| sessions | ours steps/s | step p50 (ms) | resets | raw Playwright screenshots/s | ours / raw |")
  print("|---|---|---|---|---|---|")
  for n, o, r in rows:
    ratio = o["steps_per_s"] / r["shots_per_s"] if r["shots_per_s"] else float("nan")
    print(f"| {n} | {o['steps_per_s']:.1f} | {o['p50_ms']:.0f} | {o['resets']} | {r['shots_per_s']:.1f} | "
          f"{ratio:.2f} |")


if __name__ == "__main__":
  main()
