"""Normalised game scores of evaluated episodes (report section 2.2: scores normalised to a reference
player), for `experiments/eval.py`, notebooks and tests."""

from __future__ import annotations

import numpy as np

from envs_bridge.games import catalog
from tars_jax.rollout.evaluation import summarize


def game_scores(episodes) -> dict[str, dict[str, float]]:
  """{game task: {normalized_score, mean_score, reference_score, episodes}} over the finished
  episodes of game tasks; other tasks are skipped.

  An episode's score is the game's score in the verifier record of its last step (Observation.info
  'score'), whether the game ended, the agent called finished() or the step budget ran out.
  normalized_score = 100 x mean score / reference score (float, percent of the reference player).
  Raises: KeyError if a game episode's last step carries no 'score' (not a game observation).
  """
  out = {}
  for task in sorted({e.task for e in episodes if e.task.startswith(catalog.PREFIX)}):
    eps = [e for e in episodes if e.task == task and not e.lost and e.turns]
    if not eps:
      continue
    scores = [float(e.turns[-1].info["score"]) for e in eps]
    ref = catalog.reference_scores()[catalog.game_name(task)]
    out[task] = {"normalized_score": 100.0 * float(np.mean(scores)) / ref, "mean_score": float(np.mean(scores)),
                 "reference_score": ref, "episodes": len(eps)}
  return out


def game_episode_records(episodes) -> list[dict]:
  """[{task, seed, score, done, actions}] of the finished game episodes (actions = the replies)."""
  return [{"task": e.task, "seed": e.seed, "score": float(e.turns[-1].info["score"]),
           "done": bool(e.turns[-1].done), "actions": [t.text for t in e.turns]}
          for e in episodes if e.task.startswith(catalog.PREFIX) and not e.lost and e.turns]


def format_games(scores: dict[str, dict[str, float]]) -> str:
  """Plain-text table of `game_scores` output."""
  head = f"{'game':32s} {'normalized':>10s} {'score':>9s} {'reference':>9s} {'episodes':>9s}"
  rows = [head, "-" * len(head)]
  for task, r in scores.items():
    rows.append(f"{task:32s} {r['normalized_score']:10.1f} {r['mean_score']:9.2f} {r['reference_score']:9.1f} "
                f"{r['episodes']:9d}")
  return "\n".join(rows)


def summarize_with_games(episodes) -> dict:
  """`evaluation.summarize` of `episodes`, game tasks with their normalised scores (`game_scores`):
  {task: {success, episodes, ..., [normalized_score, mean_score, reference_score]}}."""
  summary = summarize(episodes)
  for task, g in game_scores(episodes).items():
    summary[task].update(normalized_score=g["normalized_score"], mean_score=g["mean_score"],
                         reference_score=g["reference_score"])
  return summary
