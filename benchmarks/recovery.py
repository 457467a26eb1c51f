"""Crash-recovery time of the browser sandbox (issue #5 items 2 and 6): kill -9 of Chromium during a
16-session rollout, N times; how long until every session's replacement works again.

  nice -n 10 .venv/bin/python -m benchmarks.recovery [--kills 5] [--sessions 16] [--browsers 1] [--spare-pages 16]
      [--chromium /usr/lib/chromium/chromium-headless-shell]

--spare-pages N starts the server with a standby browser (envs_bridge/browser/sessions.py): the kill
then waits until the standby holds one page per session (or 120 s), and the row says its memory (PSS).

One round: `sessions` workers each open a MiniWoB session and step it (`wait()`, episodes reopened as
they end) over HTTP; once every worker has stepped, the benchmark kill -9s the browser holding the
most sessions (its pid from /health). Each worker whose session is lost (SessionLost, as the client
pool would see it) reopens and steps until that works: on the relaunched Chromium, or (--browsers > 1)
on another one.
Times, all from the server's event log (unix `t` of `browser_crashed`, `browser_recovered`) and the
workers' clocks on the same machine:

  kill -> detected        kill to the server's `browser_crashed` event (Playwright's disconnect)
  detected -> relaunched  the server's `sandbox_recovery_seconds` (`browser_recovered.seconds`)
  detected -> first ok    to the first replacement session that opened and stepped
  detected -> all ok      to the last lost session's replacement that opened and stepped (the
                          recovery time of the rollout; issue target < 5 s)

Every round also checks that each lost session was reported as SessionLost with cause browser_crash
and that the server counted exactly those (nothing disappears silently); a round that does not
account for every session is reported as such. No pass/fail on times: the numbers go to
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import signal
import statistics
import time

from benchmarks.command import command_line
from envs_bridge import protocol as P
from envs_bridge.browser.sessions import DEFAULT_CHROMIUM
from envs_bridge.client import SandboxClient
from envs_bridge.launch import launch_server

TASK = "miniwob/click-test"


async def one_round(url: str, n: int, seed0: int) -> dict:
  """One kill -9 during an n-session rollout -> times (s) and accounting of that round."""
  async with SandboxClient(url, timeout_s=300.0) as c:
    last = (await c.events(0, 10_000) or [{"seq": 0}])[-1]["seq"]
    stepped, all_stepped, killed = [0], asyncio.Event(), asyncio.Event()
    lost_reasons: list[dict] = []
    back_at: list[float] = []

    async def worker(i: int):
      sid, obs = await c.open(TASK, seed0 + i)
      first, after_kill = True, 0
      while True:
        try:
          obs = await c.step(sid, "wait()")
          if obs.done:
            await c.close(sid)
            sid, obs = await c.open(TASK, seed0 + i)
        except P.SessionLost as e:
          lost_reasons.append({"cause": e.extra.get("cause"), "reason": e.reason})
          break
        if first:
          first = False
          stepped[0] += 1
          if stepped[0] == n:
            all_stepped.set()
        if killed.is_set():
          after_kill += 1
          if after_kill >= 3:  # on a browser that was not killed (--browsers > 1): not lost
            await c.close(sid)
            return
      while True:  # the replacement: open + one step, as the client pool's retry would
        try:
          sid, _ = await c.open(TASK, seed0 + i)
          await c.step(sid, "wait()")
          back_at.append(time.time())
          await c.close(sid)
          return
        except P.SessionLost:
          await asyncio.sleep(0.05)  # opened on the dying browser before its death was noticed

    spare_at_kill: list = [None]

    async def killer():
      await all_stepped.wait()
      # with a standby browser: its pages are made while the rollout runs; kill once it holds one
      # per session (the steady state of a long rollout), or after 120 s with what it has
      for _ in range(1200):
        h = await c.health()
        if not h.get("spare_pages") or (h.get("spare") or {}).get("pages", 0) >= n:
          break
        await asyncio.sleep(0.1)
      spare_at_kill[0] = h.get("spare")
      # the browser holding the most sessions (with --browsers > 1, reused idle pages may have put
      # every session on the one that survived the last round)
      victim = max((b for b in h["browsers"] if b["up"]), key=lambda b: b["sessions"])
      t_kill = time.time()
      os.kill(victim["pid"], signal.SIGKILL)
      killed.set()
      return victim, t_kill

    (victim, t_kill), *_ = await asyncio.gather(killer(), *[worker(i) for i in range(n)])
    for _ in range(600):  # the relaunch event may trail the last worker by a moment
      evs = await c.events(last, 10_000)
      if any(e["kind"] == "browser_recovered" for e in evs):
        break
      await asyncio.sleep(0.05)
    crash = next(e for e in evs if e["kind"] == "browser_crashed")
    rec = next(e for e in evs if e["kind"] == "browser_recovered")
    lost_events = [e for e in evs if e["kind"] == "session_lost"]
    return {
        "victim_pid": victim["pid"], "on_victim": crash["sessions_lost"], "lost_seen": len(lost_reasons),
        "lost_counted": len(lost_events),
        "accounted": (len(lost_reasons) == crash["sessions_lost"] == len(lost_events) == len(back_at)
                      and all(r["cause"] == "browser_crash" for r in lost_reasons)),
        "kill_to_detect": crash["t"] - t_kill, "detect_to_relaunch": rec["seconds"],
        "detect_to_first_ok": min(back_at) - crash["t"] if back_at else float("nan"),
        "detect_to_all_ok": max(back_at) - crash["t"] if back_at else float("nan"),
        "spare_at_kill": spare_at_kill[0],
        "promoted": any(e["kind"] == "spare_promoted" for e in evs),
    }


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--kills", type=int, default=5, help="rounds (one kill -9 each)")
  ap.add_argument("--sessions", type=int, default=16, help="concurrent sessions of the rollout")
  ap.add_argument("--browsers", type=int, default=1,
                  help="Chromium processes of the server (the one with the most sessions is killed)")
  ap.add_argument("--spare-pages", type=int, default=0,
                  help="server's standby browser with up to this many pre-made pages (0: none)")
  ap.add_argument("--chromium", default=DEFAULT_CHROMIUM, help="Chromium executable of the server")
  a = ap.parse_args(argv)
  rows = []
  load0 = os.getloadavg()[0]
  with launch_server(step_ms=1000, lease_s=600.0, max_sessions=max(64, 2 * a.sessions), n_browsers=a.browsers,
                     spare_pages=a.spare_pages, chromium=a.chromium) as h:
    for k in range(a.kills):
      r = asyncio.run(one_round(h.url, a.sessions, seed0=1000 * k))
      rows.append(r)
      print(f"kill {k + 1}: {r}", flush=True)
  load1 = os.getloadavg()[0]
  print()
  cmd = command_line("benchmarks.recovery", f"--kills {a.kills} --sessions {a.sessions} --browsers {a.browsers} "
                                            f"--spare-pages {a.spare_pages} --chromium {a.chromium}")
  print(f"Command: `{cmd}`. Date: {datetime.date.today()}. Machine: {platform.machine()}, "
        f"{os.cpu_count()} CPU cores, load average {load0:.1f} before / {load1:.1f} after.")
  print()
  print("| kill | sessions lost | all accounted for | kill -> detected (s) | detected -> relaunched (s) | "
        "detected -> first new session ok (s) | detected -> all replacements ok (s) | standby pages at kill | "
        "standby PSS (MiB) |")
  print("|---|---|---|---|---|---|---|---|---|")
  for k, r in enumerate(rows, 1):
    print(f"| {k} | {r['on_victim']} | {'yes' if r['accounted'] else 'NO'} | {r['kill_to_detect']:.3f} | "
          f"{r['detect_to_relaunch']:.2f} | {r['detect_to_first_ok']:.2f} | {r['detect_to_all_ok']:.2f} | "
          f"{(r['spare_at_kill'] or {}).get('pages', '-')} | {(r['spare_at_kill'] or {}).get('pss_mb', '-')} |")
  med = {k: statistics.median(r[k] for r in rows) for k in ("kill_to_detect", "detect_to_relaunch",
                                                             "detect_to_first_ok", "detect_to_all_ok")}
  print(f"| median | | | {med['kill_to_detect']:.3f} | {med['detect_to_relaunch']:.2f} | "
        f"{med['detect_to_first_ok']:.2f} | {med['detect_to_all_ok']:.2f} | | |")


if __name__ == "__main__":
  main()
