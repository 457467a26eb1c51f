r"""Held-out evaluation of a run's policy: per-task success over seeds never used in training.

  python -m experiments.eval --run runs/miniwob_ppo --tasks miniwob/click-test,miniwob/click-test-2 \
      --episodes 200 --json runs/miniwob_ppo/eval.json [--checkpoint STEP]
  python -m experiments.eval --run runs/games --episodes 50 --json runs/games/eval.json
  python -m experiments.eval --run runs/games --episodes 50 --checkpoint 0   # the untrained baseline
  python -m experiments.eval --run runs/main --json runs/main/eval.json   # pipeline: its newest stage
  python -m experiments.eval --run runs/main/sft --json runs/main/eval_sft.json   # one stage
  python -m experiments.eval --run runs/main --max_turns 2,4,8,16 --json runs/main/eval_budgets.json \
      --plot runs/main/eval_budgets.png   # success against the step budget
  python -m experiments.eval --run runs/main --inference http://127.0.0.1:8800   # sampled by experiments/serve.py
  python -m experiments.eval --run runs/main --episodes 10 --trajectories runs/main/eval_episodes   # to look at

Actions are the policy's own samples (same temperature and constrained grammar as in training).
Game tasks ('games/<name>') also get their normalised score: 100 x mean over episodes of the game's
score at the end of the episode / the reference player's score (envs_bridge/games/reference.py;
report section 2.2 normalises to human play), and the JSON lists each game episode (seed, score,
actions) so the scores can be replayed.

Step-budget scaling (UI-TARS-2 report section 3, inference-time scaling with the step budget):
`--max_turns 2,4,8,16` plays the same held-out seeds once per budget (maximum turns per episode; the
loop config of each is `dataclasses.replace(parts.eval_loop_cfg, max_turns=b)`, nothing global changes),
prints success per task per budget with the mean steps, writes `--json` as
`{"checkpoint": step, "budgets": {"2": {task: summary}, ...}}` and `--plot` a PNG of success against
budget (log2 axis). With one budget, or none (the run's `config.env.max_turns`), the output is the
single-budget one above.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Sequence

from absl import app, flags
import ml_collections as mlc

from envs_bridge.launch import env_fleet
from tars_jax.agent.trajectory import Episode
from tars_jax.analysis.game_scores import format_games, game_episode_records, game_scores, summarize_with_games
from tars_jax.models.inference import quant
from tars_jax.rollout.agent_loop import ActFn
from tars_jax.rollout.evaluation import eval_jobs, format_table, resolve_run
from tars_jax.rollout.step_budget import (budget_loop_cfgs, budgets_json, format_budget_table, parse_budgets,
                                          play_budgets, plot_budgets)
from tars_jax.train import checkpoint as ckpt
from tars_jax.train import state as state_lib
from tars_jax.train.metrics import think_tokens_per_task, write_json
from tars_jax.train.trajectories import save_episodes

_RUN = flags.DEFINE_string("run", None, "Run directory (has config.json and checkpoints/).")
_CKPT = flags.DEFINE_integer("checkpoint", None, "Checkpoint step (default: latest); 0 without a step-0 "
                             "checkpoint = the untrained policy (the run's random init).")
_TASKS = flags.DEFINE_string("tasks", None, "Comma-separated task names (default: the config's tasks).")
_EPISODES = flags.DEFINE_integer("episodes", 200, "Held-out episodes (seeds) per task.")
_JSON = flags.DEFINE_string("json", None, "Write the per-task results here.")
_SERVERS = flags.DEFINE_list("servers", [], "Sandbox server URLs (default: launch one).")
_SESSIONS = flags.DEFINE_integer("sessions", None, "Concurrent episodes (default: config.env.num_sessions).")
_MAX_TURNS = flags.DEFINE_list("max_turns", None, "Step budgets (turns per episode), comma-separated positive "
                               "ints; several = one evaluation per budget on the same seeds (default: the "
                               "run's config.env.max_turns).")
_TEMPERATURE = flags.DEFINE_float("temperature", None, "Sampling temperature (default: the run's "
                                   "config.sampling.temperature); 0 = greedy decoding.")
_INFERENCE = flags.DEFINE_string("inference", None, "URL of an experiments/serve.py process of the same model "
                                 "that samples the episodes (it is sent the evaluated weights); default: this process.")
_QUANTIZE = flags.DEFINE_string("quantize", None, "Serving weights of the sampler: a quant.MODES name (int8 = "
                                "W8A8, int4 = W4A8, int8_weight_only, ...) or 'none' (as trained); default the "
                                "run's config.sampling.quantize.")
_TRAJECTORIES = flags.DEFINE_string(
    "trajectories", None, "Save every evaluated episode here (screenshots the policy saw, its replies, rewards): "
    "<dir>/<task>/ep_<k>/ in seed order (`tars_jax.train.trajectories.save_episodes`); with several "
    "--max_turns, <dir>/turns_<b>/<task>/.")
_PLOT = flags.DEFINE_string("plot", None, "With several --max_turns: write success against budget here (PNG).")


def evaluate(run: str, tasks: list[str] | None, episodes: int, step: int | None = None,
             servers: list[str] | None = None, sessions: int | None = None,
             episodes_out: list | None = None, max_turns: int | None = None,
             temperature: float | None = None, inference: str | None = None,
             quantize: str | None = None) -> tuple[int, dict]:
  """Returns (checkpoint step, {task: {success, episodes, ..., think_tokens}}) for the run's policy
  (think_tokens: mean tokens of a reply's thought per turn, `metrics.think_tokens`); game tasks
  also get normalized_score, mean_score and reference_score (`game_scores`). `episodes_out`, if
  given, receives every evaluated Episode. `step = 0` with no checkpoint 0 evaluates the policy the
  run started from (`init_state(config.seed)`, what iteration 1 sampled with): the untrained
  baseline the trained checkpoints are compared with. `max_turns`: the step budget (turns per
  episode; default the run's config.env.max_turns). `temperature`: the sampler's (default the run's
  config.sampling.temperature; 0 = greedy, how much of a policy's failure is sampling noise).
  `quantize`: the sampler's serving weights (a `quant.MODES` name, or "none" for float; default the
  run's config.sampling.quantize; report section 3, quantised serving).
  `inference`: the URL of an `experiments/serve.py` process of the same model that samples instead of
  this process, each episode one session there (`evaluation.play_sessions`, multi-turn KV reuse); it
  is sent the evaluated weights (it serves them afterwards: do not share it with a
  running trainer).

  Episodes lost on every attempt (the sandbox went away: `rollout.agent_loop.run_episodes`) are not
  scored: each task's `lost` counts them and `episodes` counts only the scored ones.

  Raises:
    FileNotFoundError: the run has no config.json or no checkpoint.
    ValueError: max_turns is not a positive int.
    inference_remote.ModelMismatch: the `inference` server builds another model (or temperature).
    envs_bridge.protocol.SandboxError: a sandbox error no retry fixes, at once (UnknownTask for a
      misspelt task name, Unauthorized for a wrong token, ...).
  """
  out = {} if episodes_out is not None else None
  step, summaries = evaluate_budgets(run, tasks, episodes, None if max_turns is None else [max_turns], step,
                                     servers, sessions, episodes_out=out, temperature=temperature,
                                     inference=inference, quantize=quantize)
  (summary,) = summaries.values()
  if episodes_out is not None:
    (eps,) = out.values()
    episodes_out.extend(eps)
  return step, summary


def evaluate_budgets(run: str, tasks: list[str] | None, episodes: int, budgets: Sequence[int] | None,
                     step: int | None = None, servers: list[str] | None = None, sessions: int | None = None,
                     episodes_out: dict | None = None, temperature: float | None = None,
                     inference: str | None = None, quantize: str | None = None) -> tuple[int, dict[int, dict]]:
  """`evaluate` once per step budget (turns per episode; report section 3, step-budget scaling), the
  same held-out seeds at every budget: returns (checkpoint step, {budget: {task: summary}}), budgets
  in the given order (None: the run's config.env.max_turns alone). The policy's sampler starts from
  the same seed at each budget. `episodes_out`, if given, receives {budget: [Episode]}.
  Raises: as `evaluate`; ValueError for a budget that is not a positive int."""
  run = resolve_run(run)
  with open(os.path.join(run, "config.json")) as f:
    config = mlc.ConfigDict(json.load(f))
  if temperature is not None:
    config.sampling.temperature = float(temperature)
  if quantize is not None:
    config.sampling.quantize = None if quantize == "none" else quantize  # an unknown name: QuantizationError
  parts = state_lib.build(config)
  budgets = list(budgets) if budgets else [parts.eval_loop_cfg.max_turns]
  budget_loop_cfgs(parts.eval_loop_cfg, budgets)  # a bad budget fails before the checkpoint and the browser
  init = parts.init_state(config.seed)
  if step == 0 and 0 not in ckpt.manager(run).all_steps():
    params = init["policy"]  # the initial policy: a run's evaluation before its first update
  else:
    path = run if step is None else os.path.join(run, "checkpoints", str(step))
    params, step, _ = state_lib.restore_policy(init, path)
  tasks = tasks or list(config.tasks)
  sessions = sessions or config.env.num_sessions
  jobs = eval_jobs(tasks, episodes, config.env.eval_seed_offset)
  policy = parts.batched_policy(params, batch_size=sessions, seed=config.seed + 7)
  remote = parts.remote_policy(params, step or 0, url=inference) if inference else None

  def act_for(budget: int) -> ActFn:  # image slots: the config's (as in training), or more for a longer budget
    return dataclasses.replace(policy, max_images=max(budget, policy.max_images)).act

  try:
    with env_fleet(config.env, urls=servers or ()) as (loop, clients):
      # with a server, each episode is one session there: its later turns reuse its KV cache
      results = play_budgets(loop, act_for, clients, jobs, parts.eval_loop_cfg, parts.tokenizer, budgets,
                             sessions=sessions, version=step, progress="eval", service=remote)
  finally:
    if remote is not None:
      remote.close()
  if episodes_out is not None:
    episodes_out.update(results)
  summaries = {b: summarize_with_games(eps) for b, eps in results.items()}
  for b, eps in results.items():  # think length on held-out episodes (docs/replication.md row 5)
    for task, n in think_tokens_per_task(eps, parts.tokenizer).items():
      summaries[b][task]["think_tokens"] = n
  return step, summaries


def save_by_task(directory: str, episodes: Sequence[Episode]) -> dict[str, int]:
  """Writes `episodes` under `<directory>/<task>/ep_<k>/` (task names' "/" kept as folders), each task's
  in seed order. Returns {task: episodes written}."""
  by_task: dict[str, list[Episode]] = {}
  for ep in sorted(episodes, key=lambda e: (e.task, e.seed)):
    by_task.setdefault(ep.task, []).append(ep)
  for task, eps in by_task.items():
    save_episodes(os.path.join(directory, task), eps)
  return {task: len(eps) for task, eps in by_task.items()}


def main(argv):
  del argv
  logging.getLogger().setLevel(logging.WARNING)  # no per-request httpx lines under the progress bar
  tasks = _TASKS.value.split(",") if _TASKS.value else None
  try:
    budgets = parse_budgets(_MAX_TURNS.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  if _QUANTIZE.value not in (None, "none", *quant.MODES):
    raise app.UsageError(f"--quantize {_QUANTIZE.value!r}: one of {['none', *quant.MODES]}")
  if budgets and len(budgets) > 1:
    return main_budgets(tasks, budgets)
  if _PLOT.value:
    raise app.UsageError("--plot needs several --max_turns (success against step budget)")
  eps: list = []
  step, summary = evaluate(_RUN.value, tasks, _EPISODES.value, _CKPT.value, _SERVERS.value,
                           _SESSIONS.value, episodes_out=eps, max_turns=budgets[0] if budgets else None,
                           temperature=_TEMPERATURE.value, inference=_INFERENCE.value, quantize=_QUANTIZE.value)
  print(f"checkpoint {step} of {resolve_run(_RUN.value)}, {_EPISODES.value} held-out seeds per task"
        + (f", step budget {budgets[0]} turns" if budgets else "")
        + (f", serving weights {_QUANTIZE.value}" if _QUANTIZE.value else ""))
  print(format_table(summary))
  lost = {task: r["lost"] for task, r in summary.items() if r["lost"]}
  if lost:
    print(f"[eval] lost (sandbox unavailable on every attempt; not scored): "
          f"{', '.join(f'{t} {n}' for t, n in lost.items())}")
  games = game_scores(eps)
  if games:
    print(format_games(games))
  if _TRAJECTORIES.value:
    saved = save_by_task(_TRAJECTORIES.value, eps)
    print(f"[eval] wrote {sum(saved.values())} episodes under {_TRAJECTORIES.value}")
  if _JSON.value:
    out = {"checkpoint": step, "results": summary, **summary}
    if games:
      out.update(games=games, game_episodes=game_episode_records(eps))
    write_json(_JSON.value, out)  # atomic: experiments/replicate.py counts an existing eval.json as done
    print(f"[eval] wrote {_JSON.value}")


def main_budgets(tasks: list[str] | None, budgets: list[int]) -> None:
  """`main` with several step budgets: the table of `format_budget_table`, `--json` as
  `budgets_json`, `--plot` as `plot_budgets`."""
  eps: dict[int, list[Episode]] = {}
  step, summaries = evaluate_budgets(_RUN.value, tasks, _EPISODES.value, budgets, _CKPT.value, _SERVERS.value,
                                     _SESSIONS.value, episodes_out=eps, temperature=_TEMPERATURE.value,
                                     inference=_INFERENCE.value, quantize=_QUANTIZE.value)
  run = resolve_run(_RUN.value)
  print(f"checkpoint {step} of {run}, {_EPISODES.value} held-out seeds per task (the same at every budget)")
  print(format_budget_table(summaries))
  lost = {f"{t} @{b}": r["lost"] for b, s in summaries.items() for t, r in s.items() if r["lost"]}
  if lost:
    print(f"[eval] lost (sandbox unavailable on every attempt; not scored): "
          f"{', '.join(f'{k} {n}' for k, n in lost.items())}")
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(budgets_json(step, summaries), f, indent=2)
    print(f"[eval] wrote {_JSON.value}")
  if _PLOT.value:
    print(f"[eval] wrote {plot_budgets(summaries, _PLOT.value, f'{run}, checkpoint {step}')}")
  if _TRAJECTORIES.value:
    n = sum(sum(save_by_task(os.path.join(_TRAJECTORIES.value, f"turns_{b}"), e).values()) for b, e in eps.items())
    print(f"[eval] wrote {n} episodes under {_TRAJECTORIES.value}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["run"])
  app.run(main)
