"""Which (task, seed) episodes an iteration plays, and their groups for group-relative baselines."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def rollout_jobs(tasks: Sequence[str], n: int, group_size: int, it: int, seed_offset: int
                 ) -> list[tuple[str, int]]:
  """(task, seed) of the n episodes of iteration `it`.

  n // group_size groups of `group_size` episodes on the same task and seed (the same screen, which
  group-relative baselines need), tasks alternating over the run's groups; iteration `it` uses seeds
  `seed_offset + it * groups + [0, groups)`, so no seed repeats across iterations.
  Raises: ValueError if group_size does not divide n.
  """
  if group_size < 1 or n % group_size:
    raise ValueError(f"rl.group_size={group_size} must divide env.num_sessions={n}")
  groups = n // group_size
  # Tasks cycle over the run's groups (k = it * groups + g), not only within an iteration: with fewer
  # groups per iteration than tasks, every task still gets its turn.
  return [(tasks[(it * groups + g) % len(tasks)], seed_offset + it * groups + g)
          for g in range(groups) for _ in range(group_size)]


def _ids(keys) -> np.ndarray:
  """[B] int32: 0, 1, ... in order of first appearance, one per distinct key."""
  seen: dict = {}
  return np.array([seen.setdefault(k, len(seen)) for k in keys], np.int32)


def group_ids(episodes) -> np.ndarray:
  """[B] int32: one id per distinct (task, seed) among the episodes (their GRPO/RLOO group)."""
  return _ids((e.task, e.seed) for e in episodes)


def task_ids(episodes) -> np.ndarray:
  """[B] int32: one id per distinct task among the episodes (`rl.task_baseline`'s groups)."""
  return _ids(e.task for e in episodes)
