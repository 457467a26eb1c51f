r"""CPU cost of each page call a sandbox step makes, by process (issue #5 item 5: why ours / ceiling
stays below 0.60).

  source scripts/env.sh
  .venv/bin/python -m benchmarks.page_call_cost [--sessions 16] [--seconds 8] [--rounds 2] [--chromium PATH]

One Chromium (the sandbox's `DEFAULT_CHROMIUM` unless --chromium) through Playwright in this process,
N pages of the MiniWoB click tasks of `env_throughput.py` set up as that benchmark's raw ceilings do.
Each variant loops on every page concurrently for `seconds`; psutil's CPU times of every process
before and after give the CPU per operation, split into Chromium's browser, renderer and GPU
processes, Playwright's node driver and this Python process. Variants, each ending with the CDP
capture a step ends with (`Page.captureScreenshot`):
  capture          the capture alone (the CDP ceiling of `env_throughput.py`)
  noop             a no-op `page.evaluate`, then the capture
  clock            the step's clock advance + reward read (`sessions._advance_and_read`; an episode that
                   ends is restarted as an open would), then the capture
  move             `page.mouse.move` to a random point, then the capture
  click            `executor.execute` of a click (Playwright's `mouse.click`: move, down, up), then the capture
  step             click + clock + capture: the sandbox's step without server or HTTP (env_throughput's raw step)
Variants run in turn, `rounds` times (the machine's speed drifts; compare within a round). The table
gives each variant's median over rounds of ops/s, CPU ms per op by process, and its CPU per op over
the capture's of the same round.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import random
import statistics
import time

import psutil
from playwright.async_api import async_playwright

from benchmarks.command import command_line
from benchmarks.env_throughput import STEP_MS, TASKS, random_click, task_page
from envs_bridge.browser import executor, tasks
from envs_bridge.browser import sessions as S
from envs_bridge.launch import without_tcmalloc
from tars_jax.agent import actions as A

VARIANTS = ("capture", "noop", "clock", "move", "click", "step")
KINDS = ("browser", "renderer", "gpu", "other", "driver", "python")  # other: Chromium's utility processes


def process_kind(cmdline: list[str], pid: int, driver_pid: int | None) -> str | None:
  """Which column a process's CPU goes to: a Chromium process by its --type, Playwright's driver, this
  process; None for anything else."""
  line = " ".join(cmdline)
  if pid == os.getpid():
    return "python"
  if pid == driver_pid:
    return "driver"
  if "chromium" not in line:
    return None
  if "--type=renderer" in line:
    return "renderer"
  if "--type=gpu-process" in line:
    return "gpu"
  return "browser" if "--type=" not in line else "other"


def cpu_by_kind(driver_pid: int | None) -> dict[str, float]:
  """CPU seconds (user + system) so far of this process and its descendants (the driver and its
  Chromium; not other jobs' browsers), summed per `process_kind`."""
  out: dict[str, float] = {}
  me = psutil.Process()
  for p in [me, *me.children(recursive=True)]:
    try:
      kind = process_kind(p.cmdline(), p.pid, driver_pid)
      if kind:
        t = p.cpu_times()
        out[kind] = out.get(kind, 0.0) + t.user + t.system
    except psutil.Error:
      pass  # exited between listing and reading
  return out


async def _op(variant: str, page, cdp, ts: tasks.TaskSpec, rng: random.Random, state: dict) -> None:
  if variant == "noop":
    await page.evaluate("1")
  if variant in ("click", "step"):
    await executor.execute(page, A.parse(random_click(rng), A.CoordSpec()), ts.width, ts.height)
  if variant == "move":
    p = A.to_pixels(A.parse(random_click(rng), A.CoordSpec()), ts.width, ts.height)
    await page.mouse.move(p["x"], p["y"])
  if variant in ("clock", "step"):
    if (await S._advance_and_read(page, STEP_MS, ts.state_script))["done"]:
      state["seed"] += 1
      await S.BrowserSandbox._start_episode(page, ts, state["seed"], "train")
  await cdp.send("Page.captureScreenshot", {"format": "png"})


async def measure(n: int, seconds: float, rounds: int, chromium: str) -> list[dict[str, dict]]:
  """[{variant: {"ops_per_s", kind: CPU ms per op, ..., "total"}} per round]."""
  pw = await async_playwright().start()
  browser = await pw.chromium.launch(executable_path=chromium, args=S.CHROMIUM_ARGS,
                                     env=without_tcmalloc(os.environ))
  driver_pid = next((c.pid for c in psutil.Process().children() if "node" in c.name()), None)
  try:
    pages = []
    for k in range(n):
      ctx, page = await task_page(browser, k)
      pages.append((page, await ctx.new_cdp_session(page), tasks.get(TASKS[k % len(TASKS)]), random.Random(k),
                    {"seed": 1000 * k}))
    out = []
    for _ in range(rounds):
      res = {}
      for v in VARIANTS:
        count = [0]
        t_end = time.perf_counter() + seconds

        async def worker(pg):
          while time.perf_counter() < t_end:
            await _op(v, *pg)
            count[0] += 1

        await asyncio.sleep(0.5)  # the previous variant's last frames
        c0, t0 = cpu_by_kind(driver_pid), time.perf_counter()
        await asyncio.gather(*[worker(pg) for pg in pages])
        dt, c1 = time.perf_counter() - t0, cpu_by_kind(driver_pid)
        row = {k: 1000 * (c1.get(k, 0.0) - c0.get(k, 0.0)) / max(count[0], 1) for k in KINDS}
        row["total"] = sum(row.values())
        row["ops_per_s"] = count[0] / dt
        res[v] = row
        print(f"{v:8s} {row['ops_per_s']:7.1f} ops/s  {row['total']:5.2f} ms CPU per op", flush=True)
      out.append(res)
    return out
  finally:
    await browser.close()
    await pw.stop()


def summarise(rounds: list[dict[str, dict]]) -> dict[str, dict]:
  """Per variant: the median over rounds of every field, and "vs_capture": the median over rounds of
  its total CPU per op over the capture variant's of the same round. Raises ValueError for no rounds."""
  if not rounds:
    raise ValueError("no rounds")
  out = {}
  for v in rounds[0]:
    out[v] = {k: statistics.median(r[v][k] for r in rounds) for k in rounds[0][v]}
    out[v]["vs_capture"] = statistics.median(r[v]["total"] / r["capture"]["total"] for r in rounds)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--sessions", type=int, default=16, help="concurrent pages")
  ap.add_argument("--seconds", type=float, default=8.0, help="measured seconds per variant and round")
  ap.add_argument("--rounds", type=int, default=2, help="times every variant is measured, in turn")
  ap.add_argument("--chromium", default=S.DEFAULT_CHROMIUM, help="Chromium executable")
  a = ap.parse_args(argv)
  table = summarise(asyncio.run(measure(a.sessions, a.seconds, a.rounds, a.chromium)))
  cmd = command_line("benchmarks.page_call_cost",
                     f"--sessions {a.sessions} --seconds {a.seconds:g} --rounds {a.rounds} --chromium {a.chromium}")
  print(f"\nCommand: `{cmd}`. Date: {datetime.date.today()}. Machine: {platform.machine()}, {os.cpu_count()} "
        f"CPU cores, {platform.platform()}, load average {os.getloadavg()[0]:.1f} at the end. Medians of "
        f"{a.rounds} rounds; CPU in ms per operation.\n")
  head = ["variant", "ops/s", *KINDS, "CPU per op", "CPU / capture's"]
  print("| " + " | ".join(head) + " |")
  print("|" + "---|" * len(head))
  for v, r in table.items():
    print("| " + " | ".join([v, f"{r['ops_per_s']:.1f}", *(f"{r[k]:.2f}" for k in KINDS), f"{r['total']:.2f}",
                             f"{r['vs_capture']:.2f}x"]) + " |")


if __name__ == "__main__":
  main()
