r"""Merge evaluation (report section 2.6; issue #26 item 4): the shared SFT start, each vertical agent,
their uniform merge and a merge with searched α, each evaluated on every vertical's task set.

  python -m experiments.merge_eval --config experiments/configs/verticals.py:all --workdir runs/verticals
  python -m experiments.merge_eval --config experiments/configs/verticals.py:all+smoke --workdir /tmp/v \
      --episodes 2 --val_episodes 1

WORKDIR holds the runs of scripts/verticals.sh: `sft/` and one run per vertical (`browsing/`, `general/`,
`game/`: the config's `verticals`, each a task set with its step budget). Written there:
  alpha_search/<i>/        θ = Σ α_k θ_k for each α candidate (`analysis.merge_eval.alpha_candidates`,
                           tars_jax.merge.interpolate; kept on a re-run): 0 is the uniform merge
                           ("merged_uniform"), the best mean validation score over the sets is
                           "merged_searched"
  task_arithmetic/<λ>/     θ_sft + λ Σ_k (θ_k - θ_sft) for each `--ta_lambdas` candidate
                           (tars_jax.merge.task_arithmetic); the best on validation is "task_arithmetic"
  merge_eval.json          {"episodes", "val_episodes", "search": [{alpha, scores, mean}], "alpha",
                            "ta_search": [{lambda, path, scores, mean}], "ta_lambda",
                            "scores": {model: {set: score}}, "tasks": {model: {task: summary}},
                            "intervals": {model: {set: [low, high] (Wilson 95 %) or null for games}}}
  merge_eval.png           grouped bars: one group per set, one bar per model
The table (markdown, each held-out set score with its Wilson 95 % interval over the set's episodes) is
printed. Scores: success rate per task (normalised game score / 100 for games),
averaged over a set's tasks. Held-out evaluation uses `env.eval_seed_offset` seeds in
`env.eval_data_mode` (held-out GUI-Browsing questions); the α search uses other seeds
(`--val_seed_offset`) in training mode, so α is never chosen on the evaluation episodes. Every set is
played with its own step budget (`config.verticals.<set>.max_turns`, capped by the config's
`env.max_turns`) whichever model plays it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os

from absl import app, flags
from ml_collections import config_flags

from envs_bridge.launch import env_fleet
from tars_jax import merge
from tars_jax.analysis import merge_eval as ME
from tars_jax.analysis.game_scores import summarize_with_games
from tars_jax.rollout import evaluation
from tars_jax.train import state as state_lib

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/configs/verticals.py:all",
                                          "Evaluation config: its tasks, grouped into the verticals' sets.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Dir of the sft/ and vertical runs.", required=True)
_EPISODES = flags.DEFINE_integer("episodes", 30, "Held-out episodes per task set, spread evenly over its tasks "
                                  "(at least one per task).")
_VAL_EPISODES = flags.DEFINE_integer("val_episodes", 10, "Validation episodes per task set for each α candidate.")
_VAL_SEED_OFFSET = flags.DEFINE_integer("val_seed_offset", 8_000_000, "Seeds of the α search (training mode); "
                                        "apart from training (0+), demos (2e6+), vpt (5e6+), evaluation (1e7+).")
_ALPHA_STEP = flags.DEFINE_float("alpha_step", 0.25, "Grid spacing of the α candidates (1/m).")
_TA_LAMBDAS = flags.DEFINE_list("ta_lambdas", ["0.5", "1.0"],
                                "Task arithmetic's λ candidates: θ_sft + λ Σ_k (θ_k - θ_sft), one λ for every "
                                "vertical, chosen on the validation episodes (λ = 1/N is the uniform "
                                "interpolation, already evaluated).")
_SERVERS = flags.DEFINE_list("servers", [], "Sandbox server URLs (default: launch the config's env.launch).")


def _kept(out: str, build) -> str:
  """`out`, written by `build(out)` unless a re-run finds it finished (its config.json) already."""
  if not os.path.isfile(os.path.join(out, "config.json")):
    build(out)
  return out


def main(argv):
  del argv
  logging.getLogger().setLevel(logging.WARNING)
  config, wd = _CONFIG.value, _WORKDIR.value
  sets = {v: tuple(x.tasks) for v, x in config.verticals.items()}
  names = list(sets)
  verticals = [os.path.join(wd, v) for v in names]
  models = {"sft": os.path.join(wd, "sft"), **dict(zip(names, verticals))}
  for path in models.values():
    if not os.path.isdir(os.path.join(path, "checkpoints")):
      raise app.UsageError(f"{path}: no run with checkpoints (scripts/verticals.sh makes them)")
  parts = state_lib.build(config)
  init = parts.init_state(config.seed)
  sessions = config.env.num_sessions
  turns = {s: min(config.verticals[s].max_turns, config.env.max_turns) for s in sets}
  # One inference service for every model (weights swapped between them): each episode one session,
  # its later turns only their new tokens (multi-turn KV reuse; episodes run up to 8 turns).
  service = parts.inference_service(init["policy"], slots=sessions, seed=config.seed + 7,
                                    max_turns=max(turns.values()))
  version = itertools.count(1)

  def evaluate(path: str, episodes: int, seed_offset: int, data_mode: str) -> tuple[dict, dict]:
    """({set: score}, {task: summary}) of the policy of run `path`, `episodes` per set."""
    v = next(version)
    service.set_params(state_lib.restore_policy(init, path)[0], v)
    summaries = {}
    for s, tasks in sets.items():
      cfg = dataclasses.replace(parts.loop_cfg, max_turns=turns[s], data_mode=data_mode)
      per_task = ME.episodes_per_task(episodes, len(tasks))
      eps = evaluation.play_sessions(loop, service, clients, evaluation.eval_jobs(list(tasks), per_task, seed_offset),
                                     cfg, parts.tokenizer, sessions=sessions, version=v,
                                     progress=f"{os.path.basename(path)} {s}")
      summaries.update(summarize_with_games(eps))
    return {s: ME.set_score(t, summaries) for s, t in sets.items()}, summaries

  out = {"episodes": _EPISODES.value, "val_episodes": _VAL_EPISODES.value, "sets": sets, "search": []}
  with service, env_fleet(config.env, urls=_SERVERS.value or None) as (loop, clients):
    for i, alpha in enumerate(ME.alpha_candidates(len(names), _ALPHA_STEP.value)):
      path = _kept(os.path.join(wd, "alpha_search", str(i)),
                   lambda o: merge.interpolate(verticals, alpha, o, overwrite=True))
      scores, _ = evaluate(path, _VAL_EPISODES.value, _VAL_SEED_OFFSET.value, "train")
      out["search"].append({"alpha": list(alpha), "scores": scores, "mean": sum(scores.values()) / len(scores)})
      print(f"[merge_eval] α={tuple(round(a, 3) for a in alpha)}: validation {scores}")
    best = max(out["search"], key=lambda r: r["mean"])  # the first (uniform) wins ties
    out["alpha"] = best["alpha"]
    models["merged_uniform"] = os.path.join(wd, "alpha_search", "0")  # alpha_candidates puts uniform first
    models["merged_searched"] = os.path.join(wd, "alpha_search", str(out["search"].index(best)))
    out["ta_search"] = []
    for lam in (float(x) for x in _TA_LAMBDAS.value):
      path = _kept(os.path.join(wd, "task_arithmetic", f"{lam:g}"),
                   lambda o: merge.task_arithmetic(models["sft"], verticals, [lam] * len(verticals), o, overwrite=True))
      scores, _ = evaluate(path, _VAL_EPISODES.value, _VAL_SEED_OFFSET.value, "train")
      out["ta_search"].append({"lambda": lam, "path": path, "scores": scores,
                               "mean": sum(scores.values()) / len(scores)})
      print(f"[merge_eval] task arithmetic λ={lam:g}: validation {scores}")
    if out["ta_search"]:
      best_ta = max(out["ta_search"], key=lambda r: r["mean"])
      out["ta_lambda"] = best_ta["lambda"]
      models["task_arithmetic"] = best_ta["path"]
    out["scores"], out["tasks"] = {}, {}
    for name, path in models.items():
      out["scores"][name], out["tasks"][name] = evaluate(path, _EPISODES.value, config.env.eval_seed_offset,
                                                         config.env.eval_data_mode)
  out["intervals"] = {m: {s: ME.set_interval(t, out["tasks"][m]) for s, t in sets.items()} for m in out["tasks"]}
  with open(os.path.join(wd, "merge_eval.json"), "w") as f:
    json.dump(out, f, indent=2)
  alpha = tuple(round(a, 2) for a in best["alpha"])
  png = ME.plot(out["scores"], names, os.path.join(wd, "merge_eval.png"),
                f"{_EPISODES.value} held-out episodes per set; searched α = {alpha}")
  print(ME.format_table(out["scores"], names, out["intervals"]))
  print(f"[merge_eval] α searched on {_VAL_EPISODES.value} validation episodes per set: {best['alpha']} | "
        f"{wd}/merge_eval.json | {png}")


if __name__ == "__main__":
  app.run(main)
