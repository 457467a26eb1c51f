"""BrowserGym's MiniWoB env measured the way its users run it, for `benchmarks/env_throughput.py`
(issue #5 item 5: "BrowserGym's MiniWoB env, installed by the script into its own venv").

Project side (imports only the standard library, so the worker half below runs in the other venv):
  `ensure_venv()` makes `runs/bench_venvs/browsergym` with `python -m venv` and pip-installs
  `browsergym-miniwob==0.14.3` (PyPI) into it, never into the project venv; `measure()` runs this
  file with that venv's Python and returns its JSON.

Worker side (`python benchmarks/browsergym_env.py --n 16 ...` inside the BrowserGym venv):
  N processes (spawned), one `gymnasium.make("browsergym/miniwob.<task>")` each (one env per process
  is how BrowserGym / AgentLab run episodes in parallel: its Playwright instance is a per-process
  global and not thread-safe). The task pages are the MiniWoB++ HTML of the project's `miniwob`
  wheel (MINIWOB_URL=file://.../miniwob/). Actions: `mouse_click(x, y)` of BrowserGym's "coord"
  action set at a seeded random point of the task area; when an episode ends, `env.reset(seed)`
  inside the measured time (as ours does). A step counts if it started after the warm-up and ended
  before the end of the window. Start-up is staggered: at most `setup_concurrency` envs (default 2,
  the core count here) run `gym.make` + their first reset at a time, because 16 envs starting together
  on 2 cores make BrowserGym's own 5 s `page.goto` timeout fire in the first reset. A reset or step that
  raises inside the window (the same timeout under load) is counted in `failures` and the worker
  resets with the next seed, as a training loop would; the first message is kept.

Chromium: Playwright cannot download its browsers here, and BrowserGym launches two Chromium per env
(the task browser, and its chat window in `browsergym.core.chat.Chat`, which takes no launch
arguments), so `_use_system_chromium` wraps `playwright.sync_api.BrowserType.launch` in each worker
process before BrowserGym is imported: `executable_path` (the caller's Chromium) unless given, plus the
project's Chromium flags (`--no-sandbox --disable-gpu ...`) after BrowserGym's own. Nothing in the
venv's files is changed.

Profiles: "default" is BrowserGym as shipped (its MiniWoB tasks set Playwright `slow_mo=100` ms, and
`BrowserEnv.step` sleeps `pre_observation_delay=0.5` s before extracting the observation);
"no-delay" overrides both to 0 (env kwargs `slow_mo=0, pre_observation_delay=0`), leaving the
observation work itself (DOM snapshot, accessibility tree, screenshot to numpy).
Source: BrowserGym 0.14.3 `browsergym/core/src/browsergym/core/env.py`, `chat.py`,
`browsergym/miniwob/src/browsergym/miniwob/base.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import time

PIN = "browsergym-miniwob==0.14.3"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(ROOT, "runs", "bench_venvs", "browsergym")
SETUP_TIMEOUT_S = 900.0  # 16 envs start 32 Chromium (task + chat window each): minutes on 2 cores
SETUP_CONCURRENCY = 2  # envs starting at once (gym.make + first reset)
PROFILES = {"default": {}, "no-delay": {"slow_mo": 0, "pre_observation_delay": 0.0}}


class BrowserGymUnavailable(RuntimeError):
  """The BrowserGym venv could not be made (no package registry, pip failed)."""


# -- project side ---------------------------------------------------------------------------------
def ensure_venv(path: str = VENV, pin: str = PIN) -> str:
  """Creates the BrowserGym venv at `path` if needed (python -m venv + pip install `pin`).

  Returns: the venv's python executable. Raises: BrowserGymUnavailable with pip's output tail.
  """
  py = os.path.join(path, "bin", "python")
  marker = os.path.join(path, "installed.txt")
  if os.path.exists(marker) and open(marker).read().strip() == pin and os.path.exists(py):
    return py
  steps = [[sys.executable, "-m", "venv", "--clear", path],
           [py, "-m", "pip", "install", "--disable-pip-version-check", "-q", pin]]
  for cmd in steps:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
      raise BrowserGymUnavailable(f"{' '.join(cmd)} failed ({r.returncode}): {(r.stdout + r.stderr)[-2000:]}")
  with open(marker, "w") as f:
    f.write(pin + "\n")
  return py


def measure(n: int, seconds: float, warmup_s: float, tasks: tuple[str, ...], miniwob_html_dir: str,
            chromium_args: list[str], profile: str = "default", executable: str = "/usr/bin/chromium",
            python: str | None = None, timeout_s: float = 1200.0,
            setup_concurrency: int = SETUP_CONCURRENCY) -> dict:
  """steps/s of `n` BrowserGym MiniWoB envs in `n` processes -> {steps_per_s, steps, resets, p50_ms,
  action_errors, failures, first_failure, setup_s (the slowest env), startup_s (all envs), env_errors}.

  tasks: MiniWoB names ('miniwob/click-test'); miniwob_html_dir: the wheel's html/ directory.
  Raises: BrowserGymUnavailable (venv), RuntimeError (the worker failed; its output tail).
  """
  py = python or ensure_venv()
  cmd = [py, os.path.abspath(__file__), "--n", str(n), "--seconds", str(seconds), "--warmup-s", str(warmup_s),
         "--tasks", ",".join(t.split("/", 1)[1] for t in tasks), "--profile", profile,
         "--executable", executable, "--chromium-args", json.dumps(chromium_args),
         "--setup-concurrency", str(setup_concurrency)]
  env = dict(os.environ, MINIWOB_URL="file://" + os.path.join(miniwob_html_dir, "miniwob") + "/")
  env.pop("PYTHONPATH", None)  # nothing of the project venv may leak into BrowserGym's
  r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
  lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
  if r.returncode or not lines:
    raise RuntimeError(f"BrowserGym worker failed ({r.returncode}): {(r.stdout + r.stderr)[-3000:]}")
  return json.loads(lines[-1])


# -- worker side (BrowserGym venv) ----------------------------------------------------------------
def _use_system_chromium(executable: str, extra_args: list[str]) -> None:
  """Makes every `playwright.sync_api.BrowserType.launch` of this process use `executable` and
  `extra_args` (see the module docstring)."""
  from playwright.sync_api import BrowserType
  orig = BrowserType.launch
  if getattr(orig, "_bench_patched", False):
    return

  def launch(self, *a, **kw):
    kw.setdefault("executable_path", executable)
    kw["args"] = [*(kw.get("args") or []), *extra_args]
    return orig(self, *a, **kw)

  launch._bench_patched = True
  BrowserType.launch = launch


def _worker(k: int, task: str, a: dict, barrier, setup_slots, out) -> None:
  _use_system_chromium(a["executable"], a["chromium_args"])
  import gymnasium as gym
  import browsergym.miniwob  # noqa: F401  (registers the browsergym/miniwob.* envs)
  from browsergym.core.action.highlevel import HighLevelActionSet

  res = {"steps": 0, "resets": 0, "lat": [], "errors": 0, "failures": 0, "setup_s": 0.0}
  env, seed = None, 1000 * k
  try:
    with setup_slots:  # staggered start-up (module docstring)
      t0 = time.monotonic()
      env = gym.make(f"browsergym/miniwob.{task}",
                     action_mapping=HighLevelActionSet(subsets=["coord"]).to_python_code, **PROFILES[a["profile"]])
      env.reset(seed=seed)
      res["setup_s"] = time.monotonic() - t0
  except Exception as e:  # noqa: BLE001  (reported, the barrier must still be passed)
    res["error"] = f"{type(e).__name__}: {e}"[:500]
  try:
    # every worker waits for the slowest setup (16 envs = 32 Chromium launches on a loaded machine
    # can take minutes); a broken or timed-out barrier is reported, not a silent exit
    barrier.wait(timeout=a["setup_timeout_s"])
    res["ready_at"] = time.time()  # wall clock: comparable with the parent's start time
    if env is not None:
      _run_steps(env, k, seed, a, res)
  except Exception as e:  # noqa: BLE001  (the parent must get a result from every worker)
    res.setdefault("error", f"worker {k} ({task}): {type(e).__name__}: {e}"[:500])
  finally:
    try:
      if env is not None:
        env.close()
    except Exception:  # noqa: BLE001
      pass
    out.put(res)


def _run_steps(env, k: int, seed: int, a: dict, res: dict) -> None:
  """The measured window of one worker: steps (and resets) until warm-up + seconds are over."""
  import random

  rng = random.Random(k)
  start = time.monotonic()
  t_measure, t_end = start + a["warmup_s"], start + a["warmup_s"] + a["seconds"]
  while (now := time.monotonic()) < t_end:
    # BrowserGym's MiniWoB screenshot is the page at 1.5x (`_bgym_scale_factor`) and mouse_click maps
    # its coordinates back: this is MiniWoB's 160 x 160 task area under the 50 px bar (page px 5..155, 53..203)
    x, y = rng.randrange(8, 232), rng.randrange(80, 305)
    try:
      _, _, terminated, truncated, info = env.step(f"mouse_click({x}, {y})")
    except Exception as e:  # noqa: BLE001  (counted; the episode is abandoned and the env reset)
      _failed(res, e)
      terminated = True
    else:
      done_at = time.monotonic()
      res["errors"] += bool(env.unwrapped.last_action_error)
      if now >= t_measure and done_at <= t_end:
        res["steps"] += 1
        res["lat"].append(done_at - now)
    while (terminated or truncated) and time.monotonic() < t_end:
      seed += 1
      try:
        env.reset(seed=seed)
        res["resets"] += 1
        terminated = truncated = False
      except Exception as e:  # noqa: BLE001  (BrowserGym's goto timeout under load: counted, retried)
        _failed(res, e)


def _failed(res: dict, e: Exception) -> None:
  res["failures"] += 1
  res.setdefault("first_failure", f"{type(e).__name__}: {e}"[:300])


def _worker_main(argv=None) -> None:
  import multiprocessing as mp

  ap = argparse.ArgumentParser()
  ap.add_argument("--n", type=int, required=True)
  ap.add_argument("--seconds", type=float, default=8.0)
  ap.add_argument("--warmup-s", type=float, default=2.0)
  ap.add_argument("--tasks", default="click-test,click-test-2,click-button,click-link")
  ap.add_argument("--profile", choices=sorted(PROFILES), default="default")
  ap.add_argument("--executable", default="/usr/bin/chromium")
  ap.add_argument("--chromium-args", default="[]", help="JSON list of extra Chromium flags")
  ap.add_argument("--setup-timeout-s", type=float, default=SETUP_TIMEOUT_S,
                  help="seconds every env may take to start (gym.make + first reset) before the run is abandoned")
  ap.add_argument("--setup-concurrency", type=int, default=SETUP_CONCURRENCY,
                  help="envs that start (gym.make + first reset) at the same time")
  a = ap.parse_args(argv)
  cfg = {"executable": a.executable, "chromium_args": json.loads(a.chromium_args), "profile": a.profile,
         "warmup_s": a.warmup_s, "seconds": a.seconds, "setup_timeout_s": a.setup_timeout_s}
  tasks = a.tasks.split(",")
  ctx = mp.get_context("spawn")
  barrier, setup_slots, out = ctx.Barrier(a.n), ctx.Semaphore(max(1, a.setup_concurrency)), ctx.Queue()
  procs = [ctx.Process(target=_worker, args=(k, tasks[k % len(tasks)], cfg, barrier, setup_slots, out))
           for k in range(a.n)]
  t_start = time.time()
  for p in procs:
    p.start()
  results, deadline = [], time.monotonic() + a.setup_timeout_s + 120 + a.warmup_s + a.seconds
  while len(results) < len(procs) and time.monotonic() < deadline:
    try:
      results.append(out.get(timeout=5))
    except queue.Empty:
      if not any(p.is_alive() for p in procs) and out.empty():
        break  # a worker died without reporting (e.g. killed for memory): say so, do not wait
  for p in procs:
    p.join(timeout=60)
  lost = len(procs) - len(results)
  if lost:
    codes = [p.exitcode for p in procs]
    results.append({"steps": 0, "resets": 0, "lat": [], "errors": 0, "setup_s": 0.0,
                    "error": f"{lost} of {len(procs)} workers gave no result (exit codes {codes})"})
  lat = sorted(x for r in results for x in r["lat"])
  t_startup = max((r["ready_at"] for r in results if "ready_at" in r), default=float("nan")) - t_start
  errs = [r["error"] for r in results if "error" in r]
  print(json.dumps({"n": a.n, "profile": a.profile, "steps_per_s": sum(r["steps"] for r in results) / a.seconds,
                    "steps": sum(r["steps"] for r in results), "resets": sum(r["resets"] for r in results),
                    "p50_ms": 1000 * lat[len(lat) // 2] if lat else float("nan"),
                    "action_errors": sum(r["errors"] for r in results),
                    "failures": sum(r.get("failures", 0) for r in results),
                    "first_failure": next((r["first_failure"] for r in results if "first_failure" in r), None),
                    "setup_s": max(r["setup_s"] for r in results), "startup_s": t_startup, "env_errors": errs}))


if __name__ == "__main__":
  _worker_main()
