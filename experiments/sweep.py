r"""Runs a config over variants x seeds into one parent run dir, then plots the comparison.

  python -m experiments.sweep --config experiments/configs/miniwob_ablations.py \
      --variants ppo,grpo,ppo_vpt,ppo_coupled,ppo_lenadapt --seeds 0,1,2 --workdir runs/ablations
  python -m experiments.sweep --config experiments/configs/miniwob_ablations.py --variants ppo,grpo \
      --seeds 0 --suffix +smoke --set iterations=2 --workdir /tmp/sweep       # tiny dry run

Each variant is a config arg (`<config>:<variant><suffix>`); every run gets `--config.seed=<seed>` and
the `--set key=value` overrides (as `--config.key=value`). Layout:
  <workdir>/sweep.json                  the plan: config, variants, seeds, overrides, per-run command,
                                        exit code and minutes
  <workdir>/<variant>/seed_<s>/         a normal run dir of experiments/train.py (resumable)
  <workdir>/<variant>/seed_<s>/value_pretrain/   first stage when the variant's `vpt.enabled` is True
                                        (experiments/value_pretrain.py; PPO then starts from its critic)
  <workdir>/<variant>/seed_<s>.log      stdout + stderr of the run's processes
  <workdir>/summary.json, comparison.png   final success per run and mean/std per variant; curves
Runs go one at a time (`--parallel` for more), seed-major (every variant on seed 0, then seed 1, ...);
re-running the command resumes unfinished runs and skips finished stages (value pretraining whose critic exists,
training with a complete checkpoint at its last iteration). Runs share
a JAX compilation cache (<workdir>/jax_cache, unless JAX_COMPILATION_CACHE_DIR is set): same model
and shapes, so later runs load compiled programs. Exit code 1 if any run failed (the others still run).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time

from absl import app, flags

from experiments.configs import load_config
from tars_jax.train import run as run_lib

_CONFIG = flags.DEFINE_string("config", None, "Config file path (variants are its args).")
_VARIANTS = flags.DEFINE_list("variants", None, "Config args to compare, e.g. ppo,grpo.")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds (config.seed) of every variant.")
_SUFFIX = flags.DEFINE_string("suffix", "", "Appended to every variant's config arg (e.g. +smoke).")
_SET = flags.DEFINE_multi_string("set", [], "key=value config override applied to every run.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Parent run directory.")
_PARALLEL = flags.DEFINE_integer("parallel", 1, "Runs at once (each launches its own sandbox).")
_TIMEOUT = flags.DEFINE_float("run_timeout_min", 24 * 60.0, "Kill a run stage after this many minutes.")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _truthy(v: str) -> bool:
  return v.strip().lower() in ("1", "true", "yes")


def plan(config: str, variants: list[str], seeds: list[int], suffix: str, overrides: list[str],
         workdir: str) -> list[dict]:
  """The runs of a sweep: [{variant, seed, dir, log, stages: [[argv...], ...]}].

  A variant whose config (after `vpt.enabled=` overrides) has `vpt.enabled` gets a value-pretraining
  stage before training, and training starts from its critic.
  Raises: ValueError for an override without '=' or an empty variant/seed list.
  """
  if not variants or not seeds:
    raise ValueError("need at least one variant and one seed")
  for o in overrides:
    if "=" not in o:
      raise ValueError(f"override {o!r} is not key=value")
  sets = [f"--config.{o}" for o in overrides]
  vpt, iters = {}, {}
  for variant in variants:
    cfg = load_config(config, variant + suffix)
    vpt[variant] = bool(cfg.vpt.enabled)
    iters[variant] = int(cfg.iterations)
    for o in overrides:
      key, val = o.split("=", 1)
      if key == "vpt.enabled":
        vpt[variant] = _truthy(val)
      elif key == "iterations":
        iters[variant] = int(val)
  runs = []
  # Seed-major order: a sweep cut short (deadline, crash) still has every variant on its first seeds.
  for seed in seeds:
    for variant in variants:
      arg, vpt_on = variant + suffix, vpt[variant]
      d = os.path.join(workdir, variant, f"seed_{seed}")
      common = ["--config", f"{config}:{arg}", f"--config.seed={seed}", *sets]
      stages = []
      train = [sys.executable, "-m", "experiments.train", *common, "--workdir", d]
      if vpt_on:
        vd = os.path.join(d, "value_pretrain")
        stages.append([sys.executable, "-m", "experiments.value_pretrain", *common, "--workdir", vd])
        train.append(f"--config.critic.init={os.path.join(vd, 'critic')}")
      stages.append(train)
      runs.append({"variant": variant, "seed": seed, "dir": d, "log": d + ".log", "stages": stages,
                   "iterations": iters[variant]})
  return runs


def _execute(run: dict, timeout_min: float, cache_dir: str | None = None) -> dict:
  os.makedirs(run["dir"], exist_ok=True)
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  if cache_dir:  # runs share model shapes: later runs load compiled XLA programs instead of recompiling
    env.setdefault("JAX_COMPILATION_CACHE_DIR", cache_dir)
  t0, rc = time.time(), 0
  with open(run["log"], "a") as log:
    for argv in run["stages"]:
      # a re-run skips finished stages instead of paying each one's start-up again
      if run_lib.is_done(argv[argv.index("--workdir") + 1]):
        log.write(f"[sweep] skip finished stage: {' '.join(argv)}\n")
        continue
      log.write(f"[sweep] $ {' '.join(argv)}\n")
      log.flush()
      try:
        rc = subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            timeout=timeout_min * 60).returncode
      except subprocess.TimeoutExpired:  # subprocess.run kills the child; its sandbox dies with it
        rc = 124
      if rc:
        break
  return dict(run, rc=rc, minutes=(time.time() - t0) / 60)


def summarize(runs: list[dict], last: int = 10) -> dict:
  """Final training success (mean of the last `last` iterations) per run, mean/std per variant."""
  import numpy as np
  from tars_jax.train.metrics import read_metrics
  per_run, per_variant = [], {}
  for r in runs:
    rows = read_metrics(r["dir"])
    final = float(np.mean([x["success_rate"] for x in rows[-last:]])) if rows else float("nan")
    per_run.append({"variant": r["variant"], "seed": r["seed"], "iterations": len(rows),
                    "final_success": final, "rc": r.get("rc")})
    per_variant.setdefault(r["variant"], []).append(final)
  return {"last_iterations": last, "runs": per_run,
          "variants": {v: {"mean": float(np.mean(x)), "std": float(np.std(x)), "seeds": len(x)}
                       for v, x in per_variant.items()}}


def main(argv):
  del argv
  if not (_CONFIG.value and _VARIANTS.value and _WORKDIR.value):
    raise app.UsageError("--config, --variants and --workdir are required")
  workdir = os.path.abspath(_WORKDIR.value)
  config = os.path.abspath(_CONFIG.value)
  os.makedirs(workdir, exist_ok=True)
  runs = plan(config, _VARIANTS.value, [int(s) for s in _SEEDS.value], _SUFFIX.value, _SET.value, workdir)
  manifest = {"config": config, "variants": _VARIANTS.value, "seeds": [int(s) for s in _SEEDS.value],
              "suffix": _SUFFIX.value, "overrides": _SET.value, "runs": runs}

  def dump():
    with open(os.path.join(workdir, "sweep.json"), "w") as f:
      json.dump(manifest, f, indent=2)

  dump()
  done = []
  with cf.ThreadPoolExecutor(max(1, _PARALLEL.value)) as pool:
    cache = os.path.join(workdir, "jax_cache")
    for res in pool.map(lambda r: _execute(r, _TIMEOUT.value, cache), runs):
      done.append(res)
      print(f"[sweep] {res['variant']} seed {res['seed']}: rc={res['rc']} ({res['minutes']:.1f} min) "
            f"-> {res['dir']}", flush=True)
  manifest["runs"] = done
  dump()
  summary = summarize(done)
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  from experiments import plot
  ok = [r for r in done if os.path.exists(os.path.join(r["dir"], "metrics.jsonl"))]
  if ok:
    out = plot.plot_sweep(ok, os.path.join(workdir, "comparison.png"))
    print(f"[sweep] wrote {out}")
  for v, s in summary["variants"].items():
    print(f"[sweep] {v}: final success {s['mean']:.3f} +- {s['std']:.3f} over {s['seeds']} seeds")
  failed = [r for r in done if r["rc"]]
  if failed:
    print(f"[sweep] {len(failed)} run(s) failed; see their .log files", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
