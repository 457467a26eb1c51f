r"""One batch of training-like episodes played two ways from a run's checkpoint, side by side: the lockstep
sampler (`evaluation.play`: every turn prefills each episode's whole history, screenshots included) and
the inference service with one session per episode (`evaluation.play_sessions`: a later turn runs only its
new tokens into the slot that holds the episode's context, multi-turn KV reuse).

  .venv/bin/python -m benchmarks.rollout_kv_reuse --run runs/mt/sft/seed_1 [--episodes 32] [--repeats 3] \
      [--context_len 0]

The jobs are the run's tasks in turn with seeds 5000, 5001, ... (`--episodes` of them, all at once: the
RL stage's `env.num_sessions`); one real sandbox server. Each repeat plays the batch once per mode, the
modes alternating (a change of the machine's load hits both alike); the first repeat compiles. The
service's cache holds `--context_len` positions per slot (0: the run's `Parts.context_capacity`).
Prints per mode and repeat: seconds, turns played, training-like success (sampled at the run's
temperature; the two modes draw different samples, so success differs by sampling only).
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags
import ml_collections as mlc
import numpy as np

from benchmarks.command import command_line
from envs_bridge.launch import env_fleet
from tars_jax.rollout import evaluation
from tars_jax.train import state as state_lib

_RUN = flags.DEFINE_string("run", None, "Run directory with config.json and checkpoints.", required=True)
_EPISODES = flags.DEFINE_integer("episodes", 32, "Episodes per batch (played at once).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Batches per mode, alternating (the first compiles).")
_CONTEXT = flags.DEFINE_integer("context_len", 0, "The service's cache positions per slot (0: the run's capacity).")


def main(argv):
  del argv
  with open(os.path.join(_RUN.value, "config.json")) as f:
    config = mlc.ConfigDict(json.load(f))
  if _CONTEXT.value:
    config.rollout.context_len = _CONTEXT.value
  parts = state_lib.build(config)
  params, step, _ = state_lib.restore_policy(parts.init_state(config.seed), _RUN.value)
  tasks, n = list(config.tasks), _EPISODES.value
  jobs = [(tasks[k % len(tasks)], 5000 + k) for k in range(n)]
  policy = parts.batched_policy(params, batch_size=n, seed=3)
  service = parts.inference_service(params, slots=n, seed=3)
  rows = []
  with service, env_fleet(config.env, urls=()) as (loop, clients):
    for rep in range(_REPEATS.value):
      for mode in ("lockstep", "service"):
        t0 = time.perf_counter()
        if mode == "lockstep":
          policy.start_iteration(rep)
          eps = evaluation.play(loop, policy.act, clients, jobs, parts.loop_cfg, parts.tokenizer, sessions=n,
                                version=step)
        else:
          eps = evaluation.play_sessions(loop, service, clients, jobs, parts.loop_cfg, parts.tokenizer, sessions=n,
                                         version=step)
        rows.append((rep, mode, time.perf_counter() - t0, sum(len(e.turns) for e in eps),
                     float(np.mean([e.success for e in eps]))))
        print(f"[kv_reuse] repeat {rep} {mode}: {rows[-1][2]:.1f} s", flush=True)
    stats = service.stats
  print(command_line("benchmarks.rollout_kv_reuse", f"--run {_RUN.value} --episodes {n} --repeats {_REPEATS.value} "
                     f"--context_len {_CONTEXT.value}"))
  print(f"checkpoint {step}; service cache {service.context_len} positions x {n} slots; {stats.reused} of "
        f"{stats.requests} requests extended their session's context")
  print("| repeat | mode | s | turns | success |")
  print("|---|---|---|---|---|")
  for rep, mode, s, turns, succ in rows:
    print(f"| {rep} | {mode} | {s:.1f} | {turns} | {succ:.2f} |")


if __name__ == "__main__":
  app.run(main)
