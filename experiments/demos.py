r"""Scripted-expert demonstrations: measure the experts and record their successful episodes.

Each task's expert (tars_jax/data/sources/experts.py) plays `--seeds` seeds from `--seed_offset` through the
sandbox, in the trajectory format of the policy that `--config` builds (prompt, image size, grammar,
coordinate format, step budget: tars_jax/data/sources/demos.py). Prints a table of expert success per task,
writes it to OUT/experts.json, and records ONLY the successful episodes under OUT (source 'expert').

  python -m experiments.demos --config experiments/configs/miniwob_pipeline.py --out runs/x/demos  # main job
  python -m experiments.demos --config experiments/configs/miniwob_ppo.py \
      --config.env.max_turns=8 --config.grammar.actions="('click','type')" \
      --config.grammar.max_thought_bytes=48 \
      --tasks miniwob/click-test,miniwob/click-test-2,miniwob/login-user --seeds 100 --out runs/demos
  python -m experiments.demos --config experiments/configs/miniwob_ppo.py --thoughts=false \
      --tasks miniwob/click-test,miniwob/click-test-2 --seeds 100 --out runs/demos_click  # main config as is
  python -m experiments.demos --config experiments/configs/games.py:same-game,shapes \
      --config.grammar.max_thought_bytes=48 --seeds 100 --out runs/demos_games

The config must be able to express every expert reply (its grammar's actions, thought and content
lengths): a reply outside it stops the run with `ReplyNotInGrammar`. Multi-step tasks need a step
budget of their length (login-user: 5 turns; click-checkboxes: up to 7): the experts get
max(env.max_turns, data.demo_max_turns) (`demos.DemoSpec.from_parts`).
Seeds must stay below the config's evaluation seeds (`env.eval_seed_offset`, 10_000_000).
"""

from __future__ import annotations

import json
import logging as std_logging
import os
import time

from absl import app, flags, logging
from ml_collections import config_flags

from envs_bridge.launch import env_fleet
from tars_jax.data.sources import demos
from tars_jax.train import state as state_lib

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/configs/miniwob_ppo.py",
                                          "Config of the policy the demos are for (get_config(arg)).")
_TASKS = flags.DEFINE_list("tasks", None, "Tasks (default: the config's data.demo_tasks, else its tasks).")
_SEEDS = flags.DEFINE_integer("seeds", None, "Seeds (episodes) per task (default: data.demo_seeds).")
_SEED_OFFSET = flags.DEFINE_integer("seed_offset", None, "Seeds are seed_offset + k, k < seeds (default: "
                                    "data.demo_seed_offset); below the config's evaluation seeds.")
_OUT = flags.DEFINE_string("out", None, "Output directory (experts.json and the records).", required=True)
_THOUGHTS = flags.DEFINE_bool("thoughts", True, "False: empty thoughts (`Thought: \\nAction: ...`).")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 32, "Episodes played at once.")
_SERVERS = flags.DEFINE_list("servers", [], "Sandbox server URLs (default: launch one).")


def _jsonable(counts) -> dict:
  """Writer counts with their keys as text ((source, task) tuples joined by '/')."""
  return {"/".join(map(str, k)) if isinstance(k, tuple) else str(k): v for k, v in dict(counts or {}).items()}


def main(argv):
  del argv
  std_logging.getLogger("httpx").setLevel(std_logging.WARNING)  # one line per request otherwise
  config = _CONFIG.value
  parts = state_lib.build(config)
  spec = demos.DemoSpec.from_parts(parts, thoughts=_THOUGHTS.value)
  d = config.data
  tasks = list(_TASKS.value or d.demo_tasks or config.tasks)
  if _SEEDS.value is None:  # the config's counts: RL tasks, other tasks, per-task overrides
    seeds_of = demos.seeds_per_task(tasks, config.tasks, seeds=d.demo_seeds, rl_seeds=d.demo_seeds_rl_tasks,
                                    by_task=d.demo_seeds_by_task)
  else:  # --seeds: the same count for every task
    seeds_of = {t: _SEEDS.value for t in tasks}
  offset = d.demo_seed_offset if _SEED_OFFSET.value is None else _SEED_OFFSET.value
  jobs = [j for t in tasks for j in demos.jobs_for([t], seeds_of[t], offset, config.env.eval_seed_offset)]
  os.makedirs(_OUT.value, exist_ok=True)
  t0 = time.perf_counter()
  with env_fleet(config.env, urls=_SERVERS.value) as (loop, clients):
    writer = demos.open_writer(_OUT.value, spec)
    try:
      stats = loop.run_until_complete(demos.collect(clients, jobs, spec, writer, concurrency=_CONCURRENCY.value))
    finally:
      counts = writer.close()
  wall = time.perf_counter() - t0
  print(demos.format_stats(stats))
  print(f"{len(jobs)} episodes in {wall:.0f} s; written: {counts}")
  out = {"tasks": {t: s.as_dict() for t, s in stats.items()}, "seeds": seeds_of, "seed_offset": offset,
         "thoughts": _THOUGHTS.value, "max_turns": spec.loop.max_turns,
         "coord_format": spec.coord_format, "wall_s": wall, "written": _jsonable(counts)}
  with open(os.path.join(_OUT.value, "experts.json"), "w") as f:
    json.dump(out, f, indent=1)
  logging.info("wrote %s", os.path.join(_OUT.value, "experts.json"))


if __name__ == "__main__":
  app.run(main)
