"""Soak test of the browser sandbox (issue #5 item 6; not in CI): N sessions playing MiniWoB episodes
for a long time; memory of the server and of Chromium over time, pages vs sessions, leaks at the end.

  nice -n 10 .venv/bin/python -m benchmarks.soak [--sessions 32] [--duration-s 3600] [--interval-s 30] \
      [--warmup-s 120] [--browsers 1] [--out benchmarks/soak]

Workload: every session loops: open a task (one of TASKS, seeds counting up), click random points
(a seeded RNG) until the episode ends or 12 steps, close; so pages are created, reused through the
idle pool and closed all the time (REUSE_UNSAFE click-tab pages are closed on every close).
Samples every `interval_s` (psutil, /proc): RSS of the server (Python) process; of the Playwright
driver (node); of all Chromium processes, as the sum of their RSS and the sum of their PSS (RSS
counts pages shared between Chromium processes once per process, PSS splits them, so PSS is the real
footprint); Chromium process count; sessions, pages (browser contexts) and idle pages from /health.
At the end all sessions are closed and the server is asked for its page count: leaked pages =
contexts that are neither a session's nor in the idle pool (target 0), and the GC's own count of
leaked pages it had to close during the run (`gc_closed`, target 0).
RSS growth = last sample / first sample after `warmup_s` - 1 (target < 10 %); the warm-up excludes
the ramp while the idle pool fills.

Chromium's memory follows its page count (the idle pool fills up to `max_idle_pages` as tasks come
and go), so the table also gives Chromium PSS per page: flat = no per-page leak.

Writes `<out>.json` (all samples), `<out>.png` (memory and pages over time) and prints a markdown
table for benchmarks/RESULTS.md (`--report <out>.json` prints it again from a saved run).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import time

import httpx
import psutil

from benchmarks.command import command_line
from envs_bridge import protocol as P
from envs_bridge.client import SandboxClient
from envs_bridge.launch import launch_server

TASKS = ("miniwob/click-test", "miniwob/click-test-2", "miniwob/click-button", "miniwob/click-link",
         "miniwob/click-tab")
MAX_STEPS = 12


def _memory(server_pid: int) -> dict:
  """Memory (MiB) of the server process tree: server, driver, Chromium (RSS sum and PSS sum)."""
  out = {"server_rss": 0.0, "driver_rss": 0.0, "chromium_rss": 0.0, "chromium_pss": 0.0, "chromium_procs": 0}
  try:
    root = psutil.Process(server_pid)
    out["server_rss"] = root.memory_info().rss / 2**20
    procs = root.children(recursive=True)
  except psutil.NoSuchProcess:
    return out
  for p in procs:
    try:
      name = " ".join(p.cmdline()[:1])
      if "chrom" in name:
        mi = p.memory_full_info()  # pss: proportional share of shared pages (Linux smaps)
        out["chromium_rss"] += mi.rss / 2**20
        out["chromium_pss"] += getattr(mi, "pss", mi.rss) / 2**20
        out["chromium_procs"] += 1
      elif "node" in name or "playwright" in name:
        out["driver_rss"] += p.memory_info().rss / 2**20
    except (psutil.NoSuchProcess, psutil.AccessDenied):
      continue
  return out


async def soak(url: str, server_pid: int, n: int, duration_s: float, interval_s: float) -> dict:
  samples: list[dict] = []
  errors: dict[str, int] = {}
  episodes = [0]
  stop = asyncio.Event()
  async with SandboxClient(url, timeout_s=300.0) as c:
    async def worker(i: int):
      rng = random.Random(i)
      seed = i * 1_000_000
      while not stop.is_set():
        task = TASKS[rng.randrange(len(TASKS))]
        seed += 1
        sid = None
        try:
          sid, obs = await c.open(task, seed)
          for _ in range(MAX_STEPS):
            if obs.done or stop.is_set():
              break
            obs = await c.step(sid, f"click(start_box='({rng.randrange(1000)},{rng.randrange(1000)})')")
          episodes[0] += 1
        except (P.SandboxError, httpx.TransportError) as e:  # counted and reported; the soak goes on
          errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
        finally:
          if sid is not None:
            try:
              await c.close(sid)
            except (P.SandboxError, httpx.TransportError):
              pass

    async def sampler():
      t0 = time.monotonic()
      while True:
        h = await c.health()
        samples.append({"t_s": round(time.monotonic() - t0, 1), **_memory(server_pid),
                        "sessions": h["sessions"], "pages": sum(b["pages"] for b in h["browsers"]),
                        "idle_pages": h["idle_pages"], "steps": h["steps"], "episodes": episodes[0]})
        s = samples[-1]
        print(f"t={s['t_s']:7.1f}s server {s['server_rss']:6.1f} MiB  chromium pss {s['chromium_pss']:7.1f} MiB "
              f"({s['chromium_procs']} procs)  sessions {s['sessions']:3d}  pages {s['pages']:3d}  "
              f"steps {s['steps']}", flush=True)
        if s["t_s"] >= duration_s:
          return
        await asyncio.sleep(min(interval_s, max(0.0, duration_s - s["t_s"])))

    workers = [asyncio.create_task(worker(i)) for i in range(n)]
    await sampler()
    stop.set()
    await asyncio.gather(*workers)
    for _ in range(600):  # closes are done; wait for the last page closes to land (no timing asserted)
      h = await c.health()
      if h["sessions"] == 0 and sum(b["pages"] for b in h["browsers"]) == h["idle_pages"]:
        break
      await asyncio.sleep(0.1)
    end = {"sessions": h["sessions"], "pages": sum(b["pages"] for b in h["browsers"]), "idle_pages": h["idle_pages"],
           "gc_closed": h["gc_closed"], "lost": h["lost"], "expired": h["expired"], "steps": h["steps"],
           "opened": h["opened"], "closed": h["closed"], "pages_created": h["pages_created"],
           "pages_reused": h["pages_reused"], "browser_restarts": h["browser_restarts"]}
  end["leaked_pages"] = end["pages"] - end["idle_pages"]
  return {"samples": samples, "end": end, "errors": errors, "episodes": episodes[0]}


def _growth(samples: list[dict], key: str, warmup_s: float) -> tuple[float, float, float]:
  """(value at the first sample after warm-up, last value, last / first - 1)."""
  after = [s for s in samples if s["t_s"] >= warmup_s] or samples
  first, last = after[0][key], samples[-1][key]
  return first, last, (last / first - 1.0) if first else float("nan")


def _plot(samples: list[dict], path: str, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  t = [s["t_s"] / 60 for s in samples]
  fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
  a.plot(t, [s["server_rss"] for s in samples], label="server RSS (Python)")
  a.plot(t, [s["chromium_pss"] for s in samples], label="Chromium PSS (all processes)")
  a.plot(t, [s["driver_rss"] for s in samples], label="Playwright driver RSS")
  a.set_ylabel("MiB")
  a.set_ylim(bottom=0)
  a.legend(loc="lower right", fontsize=8)
  a.set_title(title, fontsize=9)
  b.plot(t, [s["pages"] for s in samples], label="pages (browser contexts)")
  b.plot(t, [s["sessions"] for s in samples], label="sessions")
  b.plot(t, [s["idle_pages"] for s in samples], label="idle pages")
  b.set_xlabel("minutes")
  b.set_ylabel("count")
  b.set_ylim(bottom=0)
  b.legend(loc="lower right", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def report(run: dict, warmup_s: float, out: str) -> None:
  """Prints the markdown summary of a soak run (the dict written to <out>.json)."""
  s, e = run["samples"], run["end"]
  for x in s:
    x["pss_per_page"] = x["chromium_pss"] / x["pages"] if x["pages"] else float("nan")
  print(f"Command: `{run['command']}`. Date: {run['date']}. Machine: {run['machine']}, load average at the end "
        f"{run['loadavg_end'][0]:.1f}. Episodes: {run['episodes']}, steps: {e['steps']}, "
        f"errors: {run['errors'] or 'none'}.")
  print()
  print("| quantity | after warm-up | end | growth |")
  print("|---|---|---|---|")
  for key, label in (("server_rss", "server RSS (MiB)"), ("chromium_pss", "Chromium PSS, all processes (MiB)"),
                     ("chromium_rss", "Chromium RSS sum (MiB)"), ("driver_rss", "Playwright driver RSS (MiB)"),
                     ("chromium_procs", "Chromium processes"), ("pages", "pages (contexts)"),
                     ("pss_per_page", "Chromium PSS per page (MiB)")):
    first, last, g = _growth(s, key, warmup_s)
    print(f"| {label} | {first:.1f} | {last:.1f} | {100 * g:+.1f} % |")
  print()
  print(f"At the end: sessions {e['sessions']}, pages {e['pages']}, idle pages {e['idle_pages']}, "
        f"**leaked pages {e['leaked_pages']}**, pages the GC closed during the run {e['gc_closed']}, "
        f"sessions lost {e['lost']}, expired {e['expired']}, browser restarts {e['browser_restarts']}; "
        f"pages created {e['pages_created']}, reused {e['pages_reused']}. Samples: {out}.json, plot: {out}.png.")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--sessions", type=int, default=32)
  ap.add_argument("--duration-s", type=float, default=3600.0)
  ap.add_argument("--interval-s", type=float, default=30.0, help="seconds between memory samples")
  ap.add_argument("--warmup-s", type=float, default=120.0, help="growth is measured from the first sample after this")
  ap.add_argument("--browsers", type=int, default=1)
  ap.add_argument("--out", default="benchmarks/soak", help="writes <out>.json and <out>.png")
  ap.add_argument("--report", default=None, help="only print the summary of a saved <out>.json")
  a = ap.parse_args(argv)
  if a.report:
    with open(a.report) as f:
      return report(json.load(f), a.warmup_s, a.report.removesuffix(".json"))
  with launch_server(step_ms=1000, lease_s=600.0, max_sessions=max(64, a.sessions), n_browsers=a.browsers) as h:
    r = asyncio.run(soak(h.url, h.proc.pid, a.sessions, a.duration_s, a.interval_s))
  cmd = command_line("benchmarks.soak", f"--sessions {a.sessions} --duration-s {a.duration_s:g} --interval-s "
                     f"{a.interval_s:g} --warmup-s {a.warmup_s:g} --browsers {a.browsers}")
  meta = {"command": cmd, "date": str(datetime.date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
          "loadavg_end": os.getloadavg()}
  with open(a.out + ".json", "w") as f:
    json.dump({**meta, **r}, f, indent=1)
  _plot(r["samples"], a.out + ".png", f"soak: {a.sessions} sessions, {a.duration_s / 60:g} min, "
        f"{a.browsers} Chromium ({meta['date']})")
  print()
  report({**meta, **r}, a.warmup_s, a.out)


if __name__ == "__main__":
  main()
