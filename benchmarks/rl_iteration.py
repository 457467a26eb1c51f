r"""The RL stage's iteration, two checkouts side by side in one run (issue #37 item 1): where an
iteration's time goes and episodes per second, before and after a change, on the same seeds.

  .venv/bin/python -m benchmarks.rl_iteration --trees /work/base,. --init runs/replication/sft/seed_0 \
      --critic runs/replication/vpt/seed_0/critic [--config experiments/configs/replication.py:ppo] \
      [--iterations 5] [--repeats 2]
  # the main job's RL stage as a fresh user runs it: 20 iterations, nothing compiled beforehand; a third
  # column with a config override
  .venv/bin/python -m benchmarks.rl_iteration --trees /work/base,.,. --tree_flags ",,model.moe_impl=grouped" \
      --init runs/main/sft --critic runs/main/vpt/critic --config experiments/configs/miniwob_pipeline.py \
      --iterations 20 --cold

Each checkout (a git worktree of another commit, or this one) runs the RL trainer as a user would
(`python -m experiments.train`, its own code on PYTHONPATH) from the same SFT checkpoint, for
`--iterations` iterations of the config's episodes against its own real sandbox server; the checkouts
alternate `--repeats` times (A B A B), so a busy host slows both alike. Per iteration after the first
(compilations) the trainer's `metrics.jsonl` gives: rollout (sampling, waiting for the sandboxes),
the update, and the rest of the iteration (collating, metrics, checkpoint, logging: the wall time
between rows minus both, per iteration). Prints one table of medians per checkout, episodes per second
(episodes of an iteration / its wall time), the update and iteration times of the fastest half of the
iterations (`steady_*`: those that compiled no new minibatch or prompt shape) and the ratio to the first checkout, plus the training success of each
iteration (the same seeds: equal within sampling noise). The stage columns are the whole trainer
process: its episodes over its wall time, start-up and compilations included (`--cold`: each run with
its own empty compilation cache, as a user's first run; otherwise one cache shared by all runs).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from benchmarks.command import command_line

_TREES = flags.DEFINE_list("trees", None, "Checkouts to compare (the first is the baseline).", required=True)
_INIT = flags.DEFINE_string("init", None, "Run dir of the SFT checkpoint to start from.", required=True)
_CRITIC = flags.DEFINE_string("critic", None, "Pretrained critic (value pretraining's <run>/critic), for "
                               "configs with vpt.enabled.")
_CONFIG = flags.DEFINE_string("config", "experiments/configs/replication.py:ppo", "Config, relative to a tree.")
_ITERS = flags.DEFINE_integer("iterations", 5, "RL iterations per run (the first is not timed).")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Runs per checkout, alternating.")
_JSON = flags.DEFINE_string("json", None, "Write the per-run rows here.")
_TREE_FLAGS = flags.DEFINE_list("tree_flags", None, "Per tree (same order and count as --trees): config "
                                "overrides 'a.b=v' joined by ';' ('' for none), passed as --config.a.b=v.")
_COLD = flags.DEFINE_bool("cold", False, "Each run compiles from an empty compilation cache of its own.")


def run_once(tree: str, workdir: str, cache: str, overrides: str = "") -> dict:
  """One trainer process in `tree` with config `overrides` ('a.b=v;c=w'); returns its per-iteration
  rows and wall time (seconds)."""
  env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), JAX_COMPILATION_CACHE_DIR=cache)
  argv = [sys.executable, "-m", "experiments.train", "--config", _CONFIG.value, "--workdir", workdir,
          f"--config.policy.init={os.path.abspath(_INIT.value)}", f"--config.iterations={_ITERS.value}",
          "--config.eval_every=0", "--config.seed=0", f"--config.ckpt_every={_ITERS.value}",
          "--config.log_trajectories=0"] + (
              [f"--config.critic.init={os.path.abspath(_CRITIC.value)}"] if _CRITIC.value else []) + [
                  f"--config.{o.strip()}" for o in overrides.split(";") if o.strip()]
  t0 = time.time()
  p = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True)
  wall = time.time() - t0
  if p.returncode:
    raise RuntimeError(f"trainer in {tree} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  return {"tree": tree, "rows": rows, "wall_s": wall}


def summarize(run: dict) -> dict:
  rows = run["rows"][1:]  # the first iteration compiles
  wall = [r["perf/wall_min"] * 60 for r in run["rows"]]
  iter_s = [b - a for a, b in zip(wall, wall[1:])]
  med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
  out = {"rollout_s": med("perf/rollout_s"), "policy_s": med("perf/policy_s"), "env_wait_s": med("perf/env_wait_s"),
         "update_s": med("perf/train_s"), "iteration_s": statistics.median(iter_s)}
  # per iteration, then the median: a difference of medians taken over different iterations is not a time
  out["rest_s"] = statistics.median(d - r["perf/rollout_s"] - r["perf/train_s"] for d, r in zip(iter_s, rows))
  # iterations that compile nothing new (the fastest half): where the time goes once every shape is compiled
  steady = sorted(zip(iter_s, rows), key=lambda p: p[0])[:max(1, len(rows) // 2)]
  out["steady_iteration_s"] = statistics.median(d for d, _ in steady)
  out["steady_update_s"] = statistics.median(r["perf/train_s"] for _, r in steady)
  episodes = run["rows"][1]["episodes_total"] - run["rows"][0]["episodes_total"]
  out["episodes_per_s"] = episodes / out["iteration_s"]
  out["success"] = [round(r["success_rate"], 3) for r in run["rows"]]
  out["stage_s"] = run["wall_s"]
  out["stage_episodes_per_s"] = run["rows"][-1]["episodes_total"] / run["wall_s"]
  return out


def main(_):
  trees = _TREES.value
  tree_flags = _TREE_FLAGS.value or [""] * len(trees)
  if len(tree_flags) != len(trees):
    raise app.UsageError(f"--tree_flags has {len(tree_flags)} entries for {len(trees)} trees")
  runs = []
  with tempfile.TemporaryDirectory(dir=os.path.abspath("runs") if os.path.isdir("runs") else None) as tmp:
    shared = os.path.abspath(os.path.join("runs", "bench_rl_iteration_cache"))
    for r in range(_REPEATS.value):
      for i, tree in enumerate(trees):
        cache = os.path.join(tmp, f"cache_r{r}_t{i}") if _COLD.value else shared
        run = run_once(tree, os.path.join(tmp, f"r{r}_t{i}"), cache, tree_flags[i])
        run.update(summarize(run), repeat=r, column=i, flags=tree_flags[i])
        runs.append(run)
        print(f"[rl_iteration] {tree} {tree_flags[i]} repeat {r}: {run['episodes_per_s']:.2f} episodes/s "
              f"(iteration {run['iteration_s']:.1f} s), stage {run['stage_episodes_per_s']:.2f} episodes/s "
              f"({run['stage_s']:.0f} s)", flush=True)
  print(command_line("benchmarks.rl_iteration", " ".join(sys.argv[1:])))
  keys = ("rollout_s", "policy_s", "env_wait_s", "update_s", "rest_s", "iteration_s", "episodes_per_s",
          "steady_update_s", "steady_iteration_s", "stage_s", "stage_episodes_per_s")
  print("| checkout | " + " | ".join(keys) + " | x baseline (iteration, stage) | training success per iteration |")
  print("|---" * (len(keys) + 3) + "|")
  base = None
  for i, tree in enumerate(trees):
    mine = [r for r in runs if r["column"] == i]
    m = {k: statistics.median(r[k] for r in mine) for k in keys}
    base = base or m
    succ = " / ".join(",".join(f"{s:.2f}" for s in r["success"]) for r in mine)
    ratio = (f"{m['episodes_per_s'] / base['episodes_per_s']:.2f}, "
             f"{m['stage_episodes_per_s'] / base['stage_episodes_per_s']:.2f}")
    print(f"| {tree} {tree_flags[i]} | " + " | ".join(f"{m[k]:.2f}" for k in keys) + f" | {ratio} | {succ} |")
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump([{k: v for k, v in r.items() if k != "rows"} | {"rows": r["rows"]} for r in runs], f, indent=1)


if __name__ == "__main__":
  app.run(main)
