"""How faithfully a policy copies the text its instruction quotes: for each episode of a typing task
(`Enter "Kasie" into the text field ...`), whether its first type() action typed exactly the quoted text,
another episode's quoted text (a rewarded output re-used), or something else; counted per block of
training iterations of a run's saved rollouts (`<run>/rollouts`, train.py's rollout records).

The replication suite's RL variants lose enter-text (benchmarks/RESULTS.md, "Replication suite:
Monte-Carlo advantages"); this tells whether the copying or the clicks went.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Sequence

from tars_jax.agent import actions

_QUOTED = re.compile(r'"([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Fidelity:
  """Counts over the episodes of one block of iterations [first, last] (1-based, inclusive)."""
  first: int
  last: int
  episodes: int  # episodes of the block whose instruction quotes a text and that typed at all
  exact: int  # first type() content == the quoted text
  other_target: int  # != the quoted text, == another episode's quoted text
  no_type: int  # episodes with a quoted text that never typed (not in `episodes`)
  exact_success: int  # episodes of `exact` that succeeded (the clicks around the copy went right too)


def first_typed(turn_texts: Sequence[str]) -> str | None:
  """The content of the first turn whose reply parses as type(content=...), or None."""
  for text in turn_texts:
    try:
      _, action = actions.parse_response(text)
    except actions.ActionParseError:
      continue
    if isinstance(action, actions.Type):
      return action.content
  return None


def fidelity(episodes: Iterable[tuple[int, str, Sequence[str], bool]], block: int = 10) -> list[Fidelity]:
  """Per block of `block` iterations: `Fidelity` counts of (iteration >= 1, instruction, turn texts,
  success) tuples; episodes whose instruction quotes no text are skipped. Raises ValueError on block < 1."""
  if block < 1:
    raise ValueError(f"typing_fidelity: block must be >= 1, got {block}")
  eps = [(it, m.group(1), first_typed(texts), ok) for it, instr, texts, ok in episodes
         if (m := _QUOTED.search(instr)) is not None]
  targets = {t for _, t, _, _ in eps}
  out = []
  for first in range(1, max((e[0] for e in eps), default=0) + 1, block):
    last = first + block - 1
    mine = [(t, typed, ok) for it, t, typed, ok in eps if first <= it <= last]
    typed = [(t, y, ok) for t, y, ok in mine if y is not None]
    out.append(Fidelity(first, last, len(typed), sum(y == t for t, y, _ in typed),
                        sum(y != t and y in targets for t, y, _ in typed), len(mine) - len(typed),
                        sum(y == t and ok for t, y, ok in typed)))
  return out


def rollout_episodes(run_rollouts: str, task: str) -> list[tuple[int, str, list[str], bool]]:
  """(iteration, instruction, turn texts, success) of `task`'s episodes in a run's rollout records
  (`iter_<n>-<k>.array_record` shards of `<run>/rollouts`; the iteration from each shard's name).
  Raises FileNotFoundError when the directory holds no dataset.json."""
  from tars_jax.analysis.run_data import rollout_episodes as iteration_episodes
  return [(it, ep.instruction, [t.text for t in ep.turns], bool(ep.success))
          for it, ep in iteration_episodes(run_rollouts) if ep.task == task]
