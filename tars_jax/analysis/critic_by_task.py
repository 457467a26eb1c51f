"""What a critic predicts per task: its value at each episode's first decision against the episode's
success, on a run's recorded rollouts (`<run>/rollouts`, experiments/train.py's records).

The critic of a multi-task PPO run is the baseline of every task's advantages. A critic whose value is one
constant across tasks makes each task's advantages its returns minus the batch's mean success: no bias in
the policy gradient's expectation, but none of the returns' between-task variance removed (issue #37 item 4).
experiments/critic_by_task.py prints the table; the per-token statistics over whole episodes
(explained variance, corr(value, return)) are the trainers' `train/*` metrics.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class TaskValues:
  """One task's episodes: their success rate and the critic's mean value at their first decision."""
  task: str
  episodes: int
  success: float  # fraction of the episodes that succeeded
  value: float  # mean V(first decision)
  value_std: float  # std of V(first decision) over the episodes


def first_decision_values(values: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
  """[B] float32: each row's value at its first model-written target, i.e. V of the state after the
  episode's first observation. values, loss_mask: [B, T-1] (`ppo.critic_values`, `Batch.loss_mask`).
  Raises ValueError for a row without a model-written token (padding rows must be dropped first)."""
  values, loss_mask = np.asarray(values, np.float32), np.asarray(loss_mask) > 0
  if values.shape != loss_mask.shape:
    raise ValueError(f"critic_by_task: values {values.shape} and loss_mask {loss_mask.shape} differ")
  empty = np.nonzero(~loss_mask.any(-1))[0]
  if len(empty):
    raise ValueError(f"critic_by_task: rows {empty.tolist()} have no model-written token")
  return values[np.arange(len(values)), loss_mask.argmax(-1)]


def by_task(tasks: Sequence[str], first_values: np.ndarray, success: Sequence[bool]) -> list[TaskValues]:
  """`TaskValues` per task (sorted by name) of episodes given as parallel sequences [N].
  Raises ValueError when the lengths differ."""
  v, s = np.asarray(first_values, np.float64), np.asarray(success, np.float64)
  if not len(tasks) == len(v) == len(s):
    raise ValueError(f"critic_by_task: {len(tasks)} tasks, {len(v)} values, {len(s)} successes")
  out = []
  for t in sorted(set(tasks)):
    m = np.array([x == t for x in tasks])
    out.append(TaskValues(t, int(m.sum()), float(s[m].mean()), float(v[m].mean()), float(v[m].std())))
  return out


def between_task_share(rows: Sequence[TaskValues]) -> float:
  """Share of the episodes' success variance that the tasks' success rates explain (the explained
  variance of a critic that knew each task's success rate and nothing else): sum_t n_t (p_t - p)^2 /
  (N p (1 - p)); 0 when every episode has the same outcome."""
  n = np.array([r.episodes for r in rows], np.float64)
  p_t = np.array([r.success for r in rows])
  p = float((n * p_t).sum() / n.sum())
  total = n.sum() * p * (1 - p)
  return float((n * (p_t - p) ** 2).sum() / total) if total > 0 else 0.0
