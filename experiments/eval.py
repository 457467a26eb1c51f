r"""Held-out evaluation of a run's policy: per-task success over seeds never used in training.

  python -m experiments.eval --run runs/miniwob_ppo --tasks miniwob/click-test,miniwob/click-test-2 \
      --episodes 200 --json runs/miniwob_ppo/eval.json [--checkpoint STEP]
  python -m experiments.eval --run runs/games --episodes 50 --json runs/games/eval.json
  python -m experiments.eval --run runs/games --episodes 50 --checkpoint 0   # the untrained baseline
  python -m experiments.eval --run runs/main --json runs/main/eval.json   # pipeline: its newest stage
  python -m experiments.eval --run runs/main/sft --json runs/main/eval_sft.json   # one stage

Actions are the policy's own samples (same temperature and constrained grammar as in training).
Game tasks ('games/<name>') also get their normalised score: 100 x mean over episodes of the game's
score at the end of the episode / the reference player's score (envs_bridge/games/reference.py;
report section 2.2 normalises to human play), and the JSON lists each game episode (seed, score,
actions) so the scores can be replayed.
"""

from __future__ import annotations

import json
import logging
import os

from absl import app, flags
import ml_collections as mlc

from envs_bridge.launch import env_fleet
from experiments.game_scores import format_games, game_episode_records, game_scores
from tars_jax.rollout.evaluation import eval_jobs, format_table, play, resolve_run, summarize
from tars_jax.train import checkpoint as ckpt
from tars_jax.train import state as state_lib

_RUN = flags.DEFINE_string("run", None, "Run directory (has config.json and checkpoints/).")
_CKPT = flags.DEFINE_integer("checkpoint", None, "Checkpoint step (default: latest); 0 without a step-0 "
                             "checkpoint = the untrained policy (the run's random init).")
_TASKS = flags.DEFINE_string("tasks", None, "Comma-separated task names (default: the config's tasks).")
_EPISODES = flags.DEFINE_integer("episodes", 200, "Held-out episodes (seeds) per task.")
_JSON = flags.DEFINE_string("json", None, "Write the per-task results here.")
_SERVERS = flags.DEFINE_list("servers", [], "Sandbox server URLs (default: launch one).")
_SESSIONS = flags.DEFINE_integer("sessions", None, "Concurrent episodes (default: config.env.num_sessions).")


def evaluate(run: str, tasks: list[str] | None, episodes: int, step: int | None = None,
             servers: list[str] | None = None, sessions: int | None = None,
             episodes_out: list | None = None) -> tuple[int, dict]:
  """Returns (checkpoint step, {task: {success, episodes, ...}}) for the run's policy; game tasks
  also get normalized_score, mean_score and reference_score (`game_scores`). `episodes_out`, if
  given, receives every evaluated Episode. `step = 0` with no checkpoint 0 evaluates the policy the
  run started from (`init_state(config.seed)`, what iteration 1 sampled with): the untrained
  baseline the trained checkpoints are compared with.

  Episodes lost on every attempt (the sandbox went away: `rollout.agent_loop.run_episodes`) are not
  scored: each task's `lost` counts them and `episodes` counts only the scored ones.

  Raises:
    FileNotFoundError: the run has no config.json or no checkpoint.
    envs_bridge.protocol.SandboxError: a sandbox error no retry fixes, at once (UnknownTask for a
      misspelt task name, Unauthorized for a wrong token, ...).
  """
  run = resolve_run(run)
  with open(os.path.join(run, "config.json")) as f:
    config = mlc.ConfigDict(json.load(f))
  parts = state_lib.build(config)
  init = parts.init_state(config.seed)
  mngr = ckpt.manager(run)
  if step == 0 and 0 not in mngr.all_steps():
    state = init
  else:
    step, state, _ = ckpt.restore(mngr, init, step)
  tasks = tasks or list(config.tasks)
  sessions = sessions or config.env.num_sessions
  policy = parts.batched_policy(state["policy"], batch_size=sessions, seed=config.seed + 7)
  jobs = eval_jobs(tasks, episodes, config.env.eval_seed_offset)
  with env_fleet(config.env, urls=servers or ()) as (loop, clients):
    results = play(loop, policy.act, clients, jobs, parts.loop_cfg, parts.tokenizer, sessions=sessions,
                   version=step, progress="eval")
  if episodes_out is not None:
    episodes_out.extend(results)
  summary = summarize(results)
  for task, g in game_scores(results).items():
    summary[task].update(normalized_score=g["normalized_score"], mean_score=g["mean_score"],
                         reference_score=g["reference_score"])
  return step, summary


def main(argv):
  del argv
  logging.getLogger().setLevel(logging.WARNING)  # no per-request httpx lines under the progress bar
  tasks = _TASKS.value.split(",") if _TASKS.value else None
  eps: list = []
  step, summary = evaluate(_RUN.value, tasks, _EPISODES.value, _CKPT.value, _SERVERS.value,
                           _SESSIONS.value, episodes_out=eps)
  print(f"checkpoint {step} of {resolve_run(_RUN.value)}, {_EPISODES.value} held-out seeds per task")
  print(format_table(summary))
  lost = {task: r["lost"] for task, r in summary.items() if r["lost"]}
  if lost:
    print(f"[eval] lost (sandbox unavailable on every attempt; not scored): "
          f"{', '.join(f'{t} {n}' for t, n in lost.items())}")
  games = game_scores(eps)
  if games:
    print(format_games(games))
  if _JSON.value:
    out = {"checkpoint": step, "results": summary, **summary}
    if games:
      out.update(games=games, game_episodes=game_episode_records(eps))
    with open(_JSON.value, "w") as f:
      json.dump(out, f, indent=2)
    print(f"[eval] wrote {_JSON.value}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["run"])
  app.run(main)
