r"""Variants x seeds of a config, resumable (issue #37): demonstrations -> SFT per training seed -> value
pretraining -> RL variants from that seed's SFT checkpoint -> held-out evaluation of every checkpoint ->
result rows, intervals (rliable) and curves. `scripts/replicate.sh` runs the replication suite
(experiments/configs/replication.py). A config without an "sft" stage (its module's `STAGES` lacks it,
e.g. experiments/configs/miniwob_ablations.py) runs its variants from the config's own policy init:
no demonstrations or SFT, value pretraining per seed where a variant asks for it.

  python -m experiments.replicate --workdir runs/replication --seeds 0,1,2 \
      --variants ppo,grpo,ppo_novpt,ppo_coupled,ppo_lenadapt,ppo_kl,ppo_thoughts
  python -m experiments.replicate --workdir /tmp/rep --seeds 0,1,2 --variants ppo,grpo --suffix +smoke
  python -m experiments.replicate --workdir runs/replication --report   # tables again, nothing run
  python -m experiments.replicate --workdir runs/replication --status   # each stage's state, while it runs
  python -m experiments.replicate --workdir runs/rl_seeds --seeds 0,1,2 --variants ppo_thoughts --sft_seed 0
      # every RL seed from seed 0's SFT start: one SFT stage, RL's seed variance alone
  python -m experiments.replicate --workdir runs/short --set sft.steps=600 --set sft.decay_steps=800   # a setting changed
  python -m experiments.replicate --config experiments/configs/miniwob_ablations.py --workdir runs/ablations \
      --variants ppo,grpo,ppo_vpt,ppo_coupled,ppo_lenadapt      # RL from the config's init, no SFT stage

Layout of the work dir (every stage a normal run dir of its trainer, resumable):
  replicate.json           the plan: config file, suffix, each stage arg's resolved config (a re-run
                           with another config is refused, naming the differing fields;
                           wall-clock guards may change)
  demos/                   expert demonstrations (shared by every seed and variant)
  sft/seed_<s>/            SFT from the demonstrations (sft_thoughts/ for the thoughts variant)
  vpt/seed_<s>/            value pretraining under that SFT policy (the variant's `vpt.stage` names the dir:
                           vpt_thoughts/, vpt30/ ... for variants that pretrain otherwise; without an
                           SFT stage, under the config's initial policy of seed s)
  <variant>/seed_<s>/      the RL run from sft/seed_<s> (critic from vpt/seed_<s> where the variant
                           pretrains it)
  <run>/eval.json          held-out evaluation (final_eval_episodes seeds per task)
  logs/<stage>.log         stdout + stderr of each stage's process
  replication.json         result rows {variant, seed, task, episodes, successes} (variant "sft" = the
                           SFT start; "sft_thoughts" that of ppo_thoughts)
  summary.md, curves.png   intervals per variant and comparison, curves per variant

Order: the SFT and `ppo` runs of every seed first (the suite's bar), then each further variant on every
seed. A training stage is done when its run dir says so (`tars_jax.train.run.is_done`: done.json
naming a complete checkpoint), the demonstrations and an evaluation when their output exists; a re-run
skips done stages and resumes an interrupted one from its checkpoint, so no run is counted twice. A
stage stopped by its wall-clock guard (a slow or busy host; it checkpointed) is started again to continue,
up to `--guard_retries` times. A failed stage is reported, its dependants skipped, the others still run;
the exit code is 1 if any failed. SIGTERM to the driver stops the sweep for a later resume: it passes the
signal to the running stages (a trainer checkpoints at its next step, tars_jax/train/guard.py), waits
for them and exits with 128 + SIGTERM.
A work dir keeps the way its RL runs were started (`--sft_seed` or not): another is refused.
"""

from __future__ import annotations

import ast
import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import threading
import time

from absl import app, flags

from experiments.configs import load_config, load_module
from tars_jax.analysis import replication as rep
from tars_jax.train import guard as guard_lib
from tars_jax.train import run as run_lib
from tars_jax.train.metrics import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THOUGHTS = "ppo_thoughts"


class ConfigMismatch(ValueError):
  """The work dir holds runs of another config."""


class WorkdirBusy(RuntimeError):
  """Another driver process is running on the work dir."""


def lock_workdir(workdir: str):
  """An exclusive lock on `<workdir>/replicate.lock` held while the returned file stays open
  (`run.exclusive_lock`). Raises WorkdirBusy if another driver holds it: two drivers would run the same
  stage twice into one run dir."""
  f, _ = run_lib.exclusive_lock(os.path.join(workdir, "replicate.lock"), f"replicate.py (pid {os.getpid()})")
  if f is None:
    raise WorkdirBusy(f"another experiments/replicate.py runs on {workdir}; wait for it or stop it first")
  return f


def _flat(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def parse_overrides(overrides: list[str]) -> dict[str, object]:
  """{"sft.steps": 600} of ["sft.steps=600"]: each value a Python literal (600, 1e-3, True, ('a',)),
  else the string itself. Raises ValueError for an override without '='."""
  out = {}
  for o in overrides:
    key, eq, val = o.partition("=")
    if not eq or not key:
      raise ValueError(f"override {o!r} is not key=value")
    try:
      out[key] = ast.literal_eval(val)
    except (ValueError, SyntaxError):
      out[key] = val
  return out


def load_stage_config(config: str, arg: str, overrides: list[str] = ()):
  """`load_config(config, arg)` with the `--set` overrides applied, as the stage's process applies them
  (`--config.<key>=<value>`). Raises ValueError (bad override) or ml_collections' errors (unknown key,
  wrong type)."""
  c = load_config(config, arg)
  c.lock()  # as config_flags: only settings the config has (unlocked, a typo would add one)
  for key, value in parse_overrides(list(overrides)).items():
    try:
      c.update_from_flattened_dict({key: value})
    except KeyError as e:
      raise KeyError(f"{arg}: the config has no setting {key!r}") from e
  return c


def resolved(config: str, args: list[str], overrides: list[str] = ()) -> dict[str, dict]:
  """{arg: flat dict of its resolved config, overrides applied} (JSON round trip: tuples as lists)."""
  return {a: _flat(json.loads(load_stage_config(config, a, overrides).to_json_best_effort())) for a in args}


BOOKKEEPING = ("max_minutes", "ckpt_every")


def is_bookkeeping(key: str) -> bool:
  """Whether a flat config key says how a stage is guarded or checkpointed, never what it trains: a
  wall-clock guard (`max_minutes`, tars_jax/train/guard.py) or the checkpoint cadence (`ckpt_every`: a
  resumed run repeats the same steps, its randomness derived from (seed, step)). A resumed sweep may
  change them (`--set sft.max_minutes=120`, as the guard's own message advises)."""
  return key.rsplit(".", 1)[-1] in BOOKKEEPING


def check_same(old: dict, new: dict) -> list[str]:
  """Raises ConfigMismatch naming the differing fields of the stage args both plans hold (guards and
  checkpoint cadences, `is_bookkeeping`, not compared). Returns the fields only one side has (a setting
  added to or removed from the code since the work dir's plan: not compared, listed for the log)."""
  diffs, one_sided = [], set()
  for arg in sorted(set(old) & set(new)):
    for k in sorted(set(old[arg]) | set(new[arg])):
      if is_bookkeeping(k):
        continue
      if (k in old[arg]) != (k in new[arg]):
        one_sided.add(k)
      elif old[arg][k] != new[arg][k]:
        diffs.append(f"{arg}: {k} = {old[arg][k]!r} there, {new[arg][k]!r} now")
  if diffs:
    raise ConfigMismatch("the work dir holds runs of another config; use another --workdir. Differing fields: "
                         + "; ".join(diffs[:12]) + (f" (and {len(diffs) - 12} more)" if len(diffs) > 12 else ""))
  return sorted(one_sided)


def check_same_vpt(vpt_of: dict[str, tuple[str, dict]], stage: str, variant: str, c) -> None:
  """Records `variant`'s value pretraining (its `vpt` section, bookkeeping aside) under its stage name
  `stage` in `vpt_of` {stage: (first variant, section)}; raises ConfigMismatch when a variant recorded
  before under the same name pretrains otherwise (one run dir per name and seed: the second would reuse
  the first's critic), naming both variants and the differing fields."""
  mine = {k: v for k, v in c.vpt.to_dict().items() if not is_bookkeeping(k) and k != "policy_run"}
  first, theirs = vpt_of.setdefault(stage, (variant, mine))
  diffs = [f"vpt.{k}: {theirs.get(k)!r} ({first}) vs {mine.get(k)!r} ({variant})"
           for k in sorted(set(theirs) | set(mine)) if theirs.get(k) != mine.get(k)]
  if diffs:
    raise ConfigMismatch(f"value pretraining stage {stage!r} is shared by {first} and {variant}, which pretrain "
                         f"differently: {'; '.join(diffs)}; give one of them its own vpt.stage")


def sft_name(variant: str) -> str:
  """The SFT stage (and its row variant) a variant starts from."""
  return "sft_thoughts" if variant == THOUGHTS else "sft"


def has_sft(config: str) -> bool:
  """Whether the config's variants start from an SFT stage it defines (its module's `STAGES` holds "sft")."""
  return "sft" in getattr(load_module(config), "STAGES", ())


def stage_args(variants: list[str], from_sft: bool) -> list[str]:
  """The config args a plan resolves: the variants and, with an SFT stage (`has_sft`), "sft" (the
  demonstrations' config) and the SFT stages they start from."""
  return sorted({*variants, *(("sft", *(sft_name(v) for v in variants)) if from_sft else ())})


def plan(config: str, workdir: str, seeds: list[int], variants: list[str], suffix: str,
         sft_seed: int | None = None, overrides: list[str] = ()) -> list[dict]:
  """The stages in run order: [{name, argv, done (path that exists once done, or {"run": dir} of a
  training stage), after (names of the stages it needs), dir}]. `sft_seed`: None = each training seed
  `s` has its own SFT start (and value pretraining); an int = every RL seed starts from the SFT start
  and value-pretrained critic of that training seed. `overrides`: "key=value" settings every training
  stage gets (`--config.key=value`). A config without an SFT stage (`has_sft`): each RL run starts from
  the config's policy init, after value pretraining under that policy where the variant asks for it.
  Raises ValueError for `sft_seed` with such a config. Pure: reads the config files, runs nothing."""
  py, sets = sys.executable, [f"--config.{o}" for o in overrides]
  cfg = lambda a: f"{config}:{a}{suffix}"  # noqa: E731
  W = lambda *p: os.path.join(workdir, *p)  # noqa: E731
  stages, have = [], set()
  from_sft = has_sft(config)
  if sft_seed is not None and not from_sft:
    raise ValueError(f"--sft_seed {sft_seed}: {config} has no SFT stage")
  loaded = {a: load_stage_config(config, a + suffix, overrides) for a in stage_args(variants, from_sft)}

  def add(name, argv, done, after=(), run_dir=None, heavy=False):
    if name not in have:
      have.add(name)
      stages.append({"name": name, "argv": argv, "done": done, "after": list(after), "dir": run_dir,
                     "heavy": heavy})

  def evaluate(run_name, run_dir, arg, after):
    episodes = loaded[arg].final_eval_episodes
    # the suite's tasks, named: an SFT run's own config may list others (its training ignores them)
    add(f"eval/{run_name}", [py, "-m", "experiments.eval", "--run", run_dir, "--episodes", str(episodes),
                             "--tasks", ",".join(loaded[arg].tasks), "--json", os.path.join(run_dir, "eval.json")],
        os.path.join(run_dir, "eval.json"), [after])

  if from_sft:
    add("demos", [py, "-m", "experiments.demos", "--config", cfg("sft"), *sets, "--out", W("demos")],
        W("demos", "experts.json"))
  order = ["ppo"] + [v for v in variants if v != "ppo"] if "ppo" in variants else list(variants)
  vpt_of: dict[str, tuple[str, dict]] = {}
  for variant in order:
    for s in seeds:
      t = s if sft_seed is None else sft_seed  # the training seed of this RL run's SFT start
      seed, sft_cfg_seed = f"--config.seed={s}", f"--config.seed={t}"
      c = loaded[variant]
      rdir = W(variant, f"seed_{s}")
      train = [py, "-m", "experiments.train", "--config", cfg(variant), *sets, seed, "--workdir", rdir]
      after, start = [], []
      if from_sft:
        sft = sft_name(variant)
        sdir = W(sft, f"seed_{t}")
        add(f"{sft}/seed_{t}", [py, "-m", "experiments.sft", "--config", cfg(sft), *sets, sft_cfg_seed, "--workdir",
                                sdir, f"--config.sft.data=('{W('demos')}',)"], {"run": sdir}, ["demos"], sdir,
            heavy=True)  # ~15 GB at batch 16 of multi-turn episodes: beside an RL run it exhausts 24 GB
        evaluate(f"{sft}/seed_{t}", sdir, sft, f"{sft}/seed_{t}")
        train.append(f"--config.policy.init={sdir}")
        after, start = [f"{sft}/seed_{t}"], [f"--config.vpt.policy_run={sdir}"]
      if c.rl.ptx_coef > 0:  # PPO-ptx trains on the suite's demonstrations too
        if not from_sft:
          raise ValueError(f"{variant}: rl.ptx_coef needs the demonstrations of an SFT stage; {config} has none")
        train.append(f"--config.rl.ptx_data=('{W('demos')}',)")
      if c.vpt.enabled:
        vname = f"{c.vpt.stage}/seed_{t}"
        check_same_vpt(vpt_of, c.vpt.stage, variant, c)
        vdir = W(vname)
        # value pretraining is the same for every variant of a start (lam_critic = 1, the start's policy)
        add(vname, [py, "-m", "experiments.value_pretrain", "--config", cfg(variant), *sets, sft_cfg_seed, "--workdir",
                    vdir, *start], {"run": vdir}, after, vdir)
        train.append(f"--config.critic.init={os.path.join(vdir, 'critic')}")
        after = after + [vname]
      add(f"{variant}/seed_{s}", train, {"run": rdir}, after, rdir, heavy=True)  # ~7 GB
      evaluate(f"{variant}/seed_{s}", rdir, variant, f"{variant}/seed_{s}")
  return stages


def is_done(done) -> bool:
  """`done` is a path that exists once the stage is done, or {"run": dir} of a training stage."""
  return run_lib.is_done(done["run"]) if isinstance(done, dict) else os.path.exists(done)


def _run_stage(st: dict, workdir: str, env: dict, timeout_min: float, procs: dict,
               stopping: threading.Event) -> int:
  """Runs one stage's process (in `procs` by stage name while it runs; SIGTERM'd at once if the sweep is
  `stopping`), its output appended to logs/<stage>.log; its exit status, 124 when it ran past
  `timeout_min` (then killed)."""
  log = os.path.join(workdir, "logs", st["name"].replace("/", "_") + ".log")
  with open(log, "a") as f:
    f.write(f"[replicate] $ {' '.join(st['argv'])}\n")
    f.flush()
    p = subprocess.Popen(st["argv"], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    procs[st["name"]] = p
    if stopping.is_set():  # started as the driver was stopped: `stop` may have missed it
      p.send_signal(signal.SIGTERM)
    try:
      return p.wait(timeout=timeout_min * 60)
    except subprocess.TimeoutExpired:  # killed; its sandbox server dies with it (parent-death signal)
      p.kill()
      p.wait()
      return 124
    finally:
      procs.pop(st["name"], None)


def execute(stages: list[dict], workdir: str, timeout_min: float, jobs: int = 1, guard_retries: int = 0
            ) -> dict[str, str]:
  """Runs the stages not done, up to `jobs` at once (one `heavy` stage at a time), each as soon as
  the stages it needs have run, in plan order otherwise; {name: "done" | "ran" | "failed (rc N)" |
  "skipped: needs X"}. A stage that exits with `guard.EXIT_TRIPPED` (its wall-clock guard tripped
  after a checkpoint) is started again, resuming there, up to `guard_retries` times; then it counts as
  failed."""
  os.makedirs(os.path.join(workdir, "logs"), exist_ok=True)
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(workdir, "jax_cache"))  # same shapes in every run
  status = {st["name"]: "done" for st in stages if is_done(st["done"])}
  todo = [st for st in stages if st["name"] not in status]
  t0, running, trips, procs, stopping = {}, {}, {}, {}, threading.Event()

  def stop(signum, frame):  # the pool's exit below waits for the stages to checkpoint and end
    stopping.set()
    print(f"[replicate] {signal.Signals(signum).name}: stopping {len(procs)} running stage(s) at their next step "
          "(checkpointed); run the same command to resume", flush=True)
    for p in list(procs.values()):
      p.send_signal(signal.SIGTERM)
    sys.exit(128 + signum)

  previous = signal.signal(signal.SIGTERM, stop)
  try:
    with cf.ThreadPoolExecutor(max(1, jobs)) as pool:
      while todo or running:
        for st in list(todo):
          if len(running) >= max(1, jobs):
            break
          failed = [a for a in st["after"] if status.get(a, "").startswith(("failed", "skipped"))]
          if failed:
            todo.remove(st)
            status[st["name"]] = f"skipped: needs {failed[0]}"
          elif all(status.get(a) in ("done", "ran") for a in st["after"]) and not (
              st["heavy"] and any(r["heavy"] for r, _ in running.values())):
            todo.remove(st)
            t0[st["name"]] = time.time()
            print(f"[replicate] start {st['name']} ({len(todo)} stages after it)", flush=True)
            running[st["name"]] = (st, pool.submit(_run_stage, st, workdir, env, timeout_min, procs, stopping))
        if not running:  # nothing runs and nothing can start: what is left needs a stage outside the plan
          for st in todo:
            status[st["name"]] = "skipped: needs a stage that cannot run"
          break
        finished, _ = cf.wait([f for _, f in running.values()], return_when=cf.FIRST_COMPLETED)
        for name, (st, fut) in list(running.items()):
          if fut in finished:
            rc = fut.result()
            del running[name]
            if rc == guard_lib.EXIT_TRIPPED and trips.get(name, 0) < guard_retries:
              trips[name] = trips.get(name, 0) + 1
              print(f"[replicate] {name}: wall-clock guard tripped after {(time.time() - t0[name]) / 60:.1f} min; "
                    f"resuming from its checkpoint (retry {trips[name]} of {guard_retries})", flush=True)
              todo.insert(0, st)
              continue
            status[name] = "ran" if rc == 0 and is_done(st["done"]) else f"failed (rc {rc})"
            print(f"[replicate] {name}: {status[name]} in {(time.time() - t0[name]) / 60:.1f} min", flush=True)
  finally:
    signal.signal(signal.SIGTERM, previous)
  return status


def _pid_alive(holder: str) -> bool:
  """Whether the process named in a lock file's holder text ('<stage> (pid N)') is alive."""
  pid = holder.rpartition("(pid ")[2].rstrip(")\n ")
  return pid.isdigit() and os.path.exists(f"/proc/{pid}")


def _tail_rows(path: str) -> list[dict]:
  """The complete JSON lines of a metrics.jsonl's last 64 KiB ([] when there is none)."""
  try:
    with open(path, "rb") as f:
      f.seek(max(0, os.path.getsize(path) - 65536))
      lines = f.read().decode(errors="replace").splitlines()
  except OSError:
    return []
  rows = []
  for line in lines:
    try:
      rows.append(json.loads(line))
    except ValueError:  # the first line cut by the seek, or a last one half-written
      continue
  return rows


def _minutes_per_step(rows: list[dict]) -> float | None:
  """Minutes per step of the process that wrote the last rows: over the trailing rows whose
  `perf/wall_min` rises with the step (a resumed stage's process starts its clock at 0, so earlier
  processes' rows are left out); None with fewer than two such rows."""
  timed = [(r["step"], r["perf/wall_min"]) for r in rows
           if isinstance(r.get("step"), int) and isinstance(r.get("perf/wall_min"), (int, float))]
  first = len(timed) - 1
  while first > 0 and timed[first - 1][0] < timed[first][0] and timed[first - 1][1] < timed[first][1]:
    first -= 1
  if first >= len(timed) - 1:
    return None
  (s0, m0), (s1, m1) = timed[first], timed[-1]
  return (m1 - m0) / (s1 - s0)


def _eval_summary(path: str) -> str:
  """'success 0.336 (5 tasks x 100)': the mean held-out success over the tasks of an evaluation's
  eval.json (experiments/eval.py), from the rows a finished sweep will have (`rep.rows_of_eval`: tasks
  with episodes); '' if it cannot be read."""
  try:
    with open(path) as f:
      rows = rep.rows_of_eval("", 0, json.load(f)["results"])
    mean = sum(r["successes"] / r["episodes"] for r in rows) / len(rows)
  except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
    return ""
  eps = sorted({r["episodes"] for r in rows})
  return f"success {mean:.3f} ({len(rows)} tasks x {'/'.join(map(str, eps))})"


def stage_state(st: dict, workdir: str) -> tuple[str, str]:
  """(state, progress) of one planned stage, read from its files without touching them (no lock is
  taken, so a running sweep is never disturbed): "done" (an evaluation's progress: `_eval_summary`);
  "running" (its run dir's lock names a live process; progress "step k / budget, m min (~r min left)"
  from metrics.jsonl and run.json, the time left at the pace of its current process,
  `_minutes_per_step`); "started" (a log or a run dir but no live process: interrupted, or an
  evaluation in progress, which holds no lock); "pending"; "corrupt" (done.json names a missing
  checkpoint; progress = the error)."""
  try:
    if is_done(st["done"]):
      return "done", _eval_summary(st["done"]) if st["name"].startswith("eval/") else ""
  except run_lib.CorruptRun as e:
    return "corrupt", str(e)
  rdir = st["dir"]
  progress = ""
  if rdir and os.path.exists(os.path.join(rdir, run_lib.RUN_FILE)):
    rows = _tail_rows(os.path.join(rdir, "metrics.jsonl"))
    row = rows[-1] if rows else {}
    try:
      with open(os.path.join(rdir, run_lib.RUN_FILE)) as f:
        budget = json.load(f).get("budget")  # what its metrics' `step` counts up to (run_lib.start)
    except (OSError, ValueError):  # being written
      budget = None
    eta = ""
    if row:
      step, minutes = row.get("step"), row.get("perf/wall_min")
      progress = f"step {step}" + (f" / {budget}" if budget is not None else "")
      if minutes is not None:
        progress += f", {minutes:.1f} min"
        pace = _minutes_per_step(rows)
        if budget and isinstance(step, int) and step < budget and pace is not None:
          eta = f" (~{pace * (budget - step):.0f} min left)"
    try:
      with open(os.path.join(rdir, run_lib.LOCK_FILE)) as f:
        holder = f.read()
    except OSError:
      holder = ""
    if _pid_alive(holder):
      return "running", progress + eta
    return "started", progress
  log = os.path.join(workdir, "logs", st["name"].replace("/", "_") + ".log")
  return ("started", "") if os.path.exists(log) else ("pending", "")


def status_table(workdir: str) -> str:
  """A table of every stage of the work dir's plan (replicate.json: config, seeds, variants, suffix,
  sft start) with `stage_state`, the counts per state and whether a driver holds the work dir.
  Raises FileNotFoundError when the work dir has no plan."""
  with open(os.path.join(workdir, "replicate.json")) as f:
    m = json.load(f)
  stages = plan(m["config"], workdir, m["seeds"], m["variants"], m.get("suffix", ""), m.get("sft_seed"))
  try:
    with open(os.path.join(workdir, "replicate.lock")) as f:
      driver = f.read().strip()
  except OSError:
    driver = ""
  states = [(st["name"], *stage_state(st, workdir)) for st in stages]
  counts = {}
  for _, state, _ in states:
    counts[state] = counts.get(state, 0) + 1
  width = max(len(n) for n, _, _ in states)
  lines = [f"# {workdir}: {os.path.basename(m['config'])}{m.get('suffix', '')}, seeds "
           f"{','.join(map(str, m['seeds']))}, variants {','.join(m['variants'])}; driver: "
           f"{driver if _pid_alive(driver) else 'not running'}",
           ", ".join(f"{k} {v}" for k, v in counts.items())]
  lines += [f"{n:<{width}}  {state:<8} {prog}".rstrip() for n, state, prog in states]
  return "\n".join(lines)


def collect(stages: list[dict], sft_seed: int | None = None, seeds: list[int] = ()) -> list[dict]:
  """Result rows of every finished evaluation: one per (run, task), variant = the run dir's parent name.
  With one SFT start for every RL seed (`sft_seed`), every row names it ("sft_seed") and the SFT
  start's rows stand once for each RL seed of `seeds` (the pairs of the paired differences: the
  intervals then cover RL's seed variance, not SFT's)."""
  rows = []
  for st in stages:
    if not st["name"].startswith("eval/") or not is_done(st["done"]):
      continue
    variant, seed = st["name"][len("eval/"):].split("/seed_")
    with open(st["done"]) as f:
      results = json.load(f)["results"]
    shared_start = sft_seed is not None and variant in ("sft", sft_name(THOUGHTS))
    named = {} if sft_seed is None else {"sft_seed": sft_seed}
    for s in seeds if shared_start else [int(seed)]:
      rows += [dict(r, **named) for r in rep.rows_of_eval(variant, s, results)]
  return rows


def check_same_start(old_manifest: dict, sft_seed: int | None) -> None:
  """Raises ConfigMismatch when the work dir's runs started from SFT starts chosen otherwise (one per
  training seed vs one `--sft_seed` for all): their RL runs would be mixed under one name."""
  if old_manifest and old_manifest.get("sft_seed") != sft_seed:
    how = lambda x: "one SFT start per training seed" if x is None else f"every RL seed from sft seed {x}"  # noqa: E731
    raise ConfigMismatch(f"the work dir's RL runs started from {how(old_manifest.get('sft_seed'))}, this call "
                         f"asks for {how(sft_seed)}; use another --workdir")


def main(argv):
  del argv
  F = flags.FLAGS
  workdir, config = os.path.abspath(F.workdir), os.path.abspath(F.config)
  if F.status:  # read-only: no lock, nothing written, a running sweep undisturbed
    if not os.path.exists(os.path.join(workdir, "replicate.json")):
      raise app.UsageError(f"--status: {workdir} has no replicate.json (no sweep has started there)")
    print(status_table(workdir))
    return
  cfg_mod = load_module(config)
  variants = list(F.variants or cfg_mod.VARIANTS)
  unknown = [v for v in variants if v not in cfg_mod.VARIANTS]
  if unknown:
    raise app.UsageError(f"unknown variants {unknown}; the config has {list(cfg_mod.VARIANTS)}")
  seeds = [int(s) for s in F.seeds]
  os.makedirs(workdir, exist_ok=True)
  lock = lock_workdir(workdir)  # held until the end of main (or of the process)
  try:
    stages = plan(config, workdir, seeds, variants, F.suffix, F.sft_seed, F.set)
  except (KeyError, TypeError) as e:  # an unknown key, a value of the wrong type
    raise app.UsageError(f"--set: {e}") from None
  except ValueError as e:  # an override not key=value, --sft_seed without an SFT stage (each message names it)
    raise app.UsageError(str(e)) from None
  conf = resolved(config, [a + F.suffix for a in stage_args(variants, has_sft(config))], F.set)
  manifest_path = os.path.join(workdir, "replicate.json")
  old = {}
  if os.path.exists(manifest_path):
    with open(manifest_path) as f:
      old = json.load(f)
    check_same_start(old, F.sft_seed)
    one_sided = check_same(old.get("configs", {}), conf)
    if one_sided:
      print(f"[replicate] settings the work dir's plan does not have, or no longer has (not compared): "
            f"{', '.join(one_sided)}")
  manifest = {"config": config, "suffix": F.suffix, "configs": {**old.get("configs", {}), **conf},
              "seeds": sorted(set(old.get("seeds", [])) | set(seeds)),
              "variants": sorted(set(old.get("variants", [])) | set(variants)), "sft_seed": F.sft_seed}
  write_json(manifest_path, manifest)

  status = {} if F.report else execute(stages, workdir, F.stage_timeout_min, F.jobs, F.guard_retries)
  rows = collect(stages, F.sft_seed, seeds)
  write_json(os.path.join(workdir, "replication.json"), rows)
  finished = rep.runs_per_variant(rows)
  summary = [f"# {os.path.basename(config)} variants x seeds: {workdir}", "",
             "Finished runs per variant (seeds with a held-out evaluation): "
             + ", ".join(f"{v} {n}" for v, n in finished.items()), "", rep.report(rows)]
  if F.sft_seed is not None:
    summary[2:2] = [f"Every RL seed started from the SFT start of training seed {F.sft_seed}: the intervals "
                    "cover RL's seed variance, not SFT's.", ""]
  with open(os.path.join(workdir, "summary.md"), "w") as f:
    f.write("\n".join(summary) + "\n")
  from experiments import plot
  curves = plot.plot_replication(workdir, [f"{v}/seed_{s}" for v in variants for s in seeds],
                                 os.path.join(workdir, "curves.png"))
  print("\n".join(summary))
  lock.close()
  failed = {k: v for k, v in status.items() if v.startswith(("failed", "skipped"))}
  for k, v in failed.items():
    print(f"[replicate] {k}: {v}", file=sys.stderr)
  print(f"[replicate] done: {len(rows)} rows in {workdir}/replication.json | summary.md | "
        f"{curves or 'no curves yet'} | {len(failed)} stage(s) failed or skipped")
  if failed:
    sys.exit(1)


def define_flags() -> None:
  """The command line, defined only when run as a script: importing this module (tests, notebooks)
  defines no flags that could clash with another script's."""
  flags.DEFINE_string("config", "experiments/configs/replication.py", "The config file (its VARIANTS; an "
                      "SFT stage first where its STAGES hold 'sft').")
  flags.DEFINE_string("workdir", None, "Work dir of the suite (created; resumed).", required=True)
  flags.DEFINE_list("seeds", ["0", "1", "2"], "Training seeds (config.seed of SFT and RL).")
  flags.DEFINE_list("variants", None, "RL variants (default: the config's VARIANTS).")
  flags.DEFINE_string("suffix", "", "Appended to every config arg: '+smoke' for tiny budgets.")
  flags.DEFINE_bool("report", False, "Only collect the rows and write the tables and curves.")
  flags.DEFINE_bool("status", False, "Only print each stage's state (done, running with its step, started, "
                    "pending) from the work dir's plan; takes no lock, so it can watch a running sweep.")
  flags.DEFINE_float("stage_timeout_min", 180.0, "Kill a stage's process after this many minutes.")
  flags.DEFINE_integer("jobs", 1, "Stages run at once (each its own process and sandbox).")
  flags.DEFINE_integer("guard_retries", 2, "Times a stage stopped by its wall-clock guard (a slow or busy "
                       "host; it checkpointed) is started again to continue, before it counts as failed.")
  flags.DEFINE_multi_string("set", [], "key=value config setting of every training stage (--config.key=value), "
                            "e.g. sft.steps=600; kept in replicate.json's resolved configs.")
  flags.DEFINE_integer("sft_seed", None, "Every RL seed starts from this training seed's SFT start and "
                       "value-pretrained critic (default: each seed its own SFT start).")


if __name__ == "__main__":
  define_flags()
  app.run(main)
