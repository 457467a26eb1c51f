"""The merge evaluation's arithmetic (report section 2.6; experiments/merge_eval.py): one score per task
set from per-task evaluation summaries, the α candidates of the searched merge, the table and the plot;
and the table over training seeds (experiments/merge_stats.py): pooled success with Wilson intervals and
the table's differences with Newcombe intervals.

A task set's score is the mean over its tasks of each task's score: success rate for MiniWoB++,
desktop and GUI-Browsing tasks, normalised game score / 100 for games (the game suite's reward:
score / reference player's score, `tars_jax/analysis/game_scores.py`), so every set scores in [0, ~1] and the
sets can be averaged when α is searched.
"""

from __future__ import annotations

import itertools
from typing import Mapping, Sequence

GAME_PREFIX = "games/"


def task_score(task: str, summary: Mapping[str, float]) -> float:
  """One task's score from its evaluation summary (`evaluation.summarize`, plus `normalized_score` in
  percent for games). Raises KeyError when a game's summary has no normalized_score."""
  if task.startswith(GAME_PREFIX):
    return float(summary["normalized_score"]) / 100.0
  return float(summary["success"])


def _check_evaluated(tasks: Sequence[str], summaries: Mapping[str, Mapping[str, float]]) -> None:
  missing = [t for t in tasks if t not in summaries]
  if missing:
    raise KeyError(f"no evaluation of {missing}")


def set_score(tasks: Sequence[str], summaries: Mapping[str, Mapping[str, float]]) -> float:
  """Mean `task_score` over `tasks`. Raises KeyError naming a task without a summary (every task of a
  set must be evaluated: a missing one would silently change what the set means)."""
  _check_evaluated(tasks, summaries)
  return sum(task_score(t, summaries[t]) for t in tasks) / len(tasks)


def set_counts(tasks: Sequence[str], summaries: Mapping[str, Mapping[str, float]]) -> tuple[int, int] | None:
  """(successes, episodes) of a set's held-out episodes, summed over `tasks`; None for a set holding a game
  (its score is not a success rate). Raises KeyError naming a task without a summary."""
  _check_evaluated(tasks, summaries)
  if any(t.startswith(GAME_PREFIX) for t in tasks):
    return None
  n = sum(int(summaries[t]["episodes"]) for t in tasks)
  k = sum(round(float(summaries[t]["success"]) * int(summaries[t]["episodes"])) for t in tasks)
  return k, n


def set_interval(tasks: Sequence[str], summaries: Mapping[str, Mapping[str, float]], level: float = 0.95
                 ) -> tuple[float, float] | None:
  """Wilson `level` interval of a set's success rate over its held-out episodes: successes and episodes
  summed over `tasks` (`merge_eval.py` plays each task of a set on equal episodes, so this is the
  interval of `set_score` unless a sandbox lost some). None for a set holding a game (its score is not a
  success rate) or with no episodes.
  Source: Wilson 1927, via scipy.stats.binomtest(...).proportion_ci(method="wilson").
  Raises KeyError naming a task without a summary.
  """
  counts = set_counts(tasks, summaries)
  if counts is None or counts[1] == 0:
    return None
  return wilson_interval(*counts, level=level)


def wilson_interval(successes: int, episodes: int, level: float = 0.95) -> tuple[float, float]:
  """Wilson `level` interval of a success rate (Wilson 1927), via scipy.stats.binomtest(...).proportion_ci.
  Raises ValueError for episodes < 1 or successes outside [0, episodes] (scipy's)."""
  from scipy.stats import binomtest
  ci = binomtest(successes, episodes).proportion_ci(confidence_level=level, method="wilson")
  return float(ci.low), float(ci.high)


def difference_interval(a: tuple[int, int], b: tuple[int, int], level: float = 0.95
                        ) -> tuple[float, float, float]:
  """The difference of two success rates, a - b, with Newcombe's hybrid score interval (Wilson intervals
  of each rate combined; Newcombe 1998, "Interval estimation for the difference between independent
  proportions", method 10), via statsmodels' `confint_proportions_2indep(method="newcomb")`.

  `a`, `b`: (successes, episodes) with episodes > 0 (`set_counts`). Returns (difference, low, high).
  The interval treats the two samples as independent; where both models played the same held-out seeds
  (merge_eval does) their outcomes correlate positively and the interval is conservative.
  Raises ValueError for a sample without episodes or with successes outside [0, episodes].
  """
  for k, n in (a, b):
    if n <= 0 or not 0 <= k <= n:
      raise ValueError(f"a success count needs 0 <= successes <= episodes and episodes > 0; got {k} / {n}")
  from statsmodels.stats.proportion import confint_proportions_2indep
  low, high = confint_proportions_2indep(a[0], a[1], b[0], b[1], method="newcomb", compare="diff",
                                         alpha=1.0 - level)
  return a[0] / a[1] - b[0] / b[1], float(low), float(high)


ALL = "all"  # the pseudo-set of every set's episodes together (equal episodes per set: their mean)


def pooled_counts(tables: Sequence[Mapping], model: str, set_name: str) -> tuple[int, int]:
  """(successes, episodes) of `model` on `set_name` summed over `tables` (merge_eval.json of several
  training seeds; `ALL` = over every set). Equal episodes per table make the pooled rate the mean over
  training seeds. Raises KeyError naming a model or set a table lacks, ValueError for a game set."""
  k = n = 0
  for t in tables:
    if model not in t["tasks"]:
      raise KeyError(f"no model {model!r} in a merge table (it has {sorted(t['tasks'])})")
    names = list(t["sets"]) if set_name == ALL else [set_name]
    for name in names:
      if name not in t["sets"]:
        raise KeyError(f"no task set {name!r} in a merge table (it has {sorted(t['sets'])})")
      counts = set_counts(t["sets"][name], t["tasks"][model])
      if counts is None:
        raise ValueError(f"task set {name!r} holds games: its score is not a success rate")
      k, n = k + counts[0], n + counts[1]
  return k, n


def check_same_sets(tables: Sequence[Mapping], names: Sequence[str]) -> None:
  """Raises ValueError naming the first of `tables` (merge_eval.json, named by `names`) whose task sets
  differ from the first's: their episodes are not of one question and cannot be pooled."""
  for t, name in zip(tables[1:], names[1:]):
    if t["sets"] != tables[0]["sets"]:
      raise ValueError(f"{name}: task sets {t['sets']} differ from {names[0]}'s {tables[0]['sets']}")


def comparisons(sets: Sequence[str], models: Sequence[str]) -> list[tuple[str, str, str, str]]:
  """The merge table's questions (report section 2.6) as (a, b, set, question), a - b on `set`: each
  vertical against the shared start on its own set; the uniform merge against the start (each set and
  `ALL`) and against each vertical on that vertical's set (does it keep the skill); the searched α and
  task arithmetic against the uniform merge on `ALL`. Models absent from `models` are left out."""
  out = [(v, "sft", v, "the vertical improves on its own set") for v in sets]
  out += [("merged_uniform", "sft", s, "the uniform merge improves on the start") for s in (*sets, ALL)]
  out += [("merged_uniform", v, v, "the uniform merge keeps the vertical's skill") for v in sets]
  out += [(m, "merged_uniform", ALL, "another merge beats the uniform one")
          for m in ("merged_searched", "task_arithmetic")]
  return [c for c in out if c[0] in models and c[1] in models]


def pooled_rate(tables: Sequence[Mapping], model: str, set_name: str) -> float:
  """Success rate of `pooled_counts` (raises as it does, ZeroDivisionError for no episodes)."""
  k, n = pooled_counts(tables, model, set_name)
  return k / n


def seeds_table(tables: Sequence[Mapping], names: Sequence[str]) -> dict:
  """The merge table over training seeds (`experiments/merge_stats.py`, notebooks/merging.ipynb), from one
  merge_eval.json per seed (`names` label them in errors):
    {"sets": [...the sets..., ALL], "models": [models every table holds],
     "table": {model: {set: {"rate", "ci" (Wilson 95 %, pooled episodes), "per_seed": [rate per table]}}},
     "comparisons": [{"a", "b", "set", "question", "difference", "ci" (Newcombe 95 %), "per_seed": [a - b]}]}
  Raises ValueError for tables of different task sets (`check_same_sets`), none, or a set holding games
  (its score is not a success rate: no binomial interval)."""
  if not tables:
    raise ValueError("no merge tables")
  check_same_sets(tables, names)
  sets = [*tables[0]["sets"], ALL]
  models = [m for m in tables[0]["tasks"] if all(m in t["tasks"] for t in tables)]
  table = {}
  for m in models:
    for s in sets:
      k, n = pooled_counts(tables, m, s)  # once per cell: its rate and its interval
      table.setdefault(m, {})[s] = {"rate": k / n, "ci": list(wilson_interval(k, n)),
                                    "per_seed": [pooled_rate([t], m, s) for t in tables]}
  rows = []
  for a, b, s, q in comparisons(sets[:-1], models):
    d, lo, hi = difference_interval(pooled_counts(tables, a, s), pooled_counts(tables, b, s))
    rows.append({"a": a, "b": b, "set": s, "question": q, "difference": d, "ci": [lo, hi],
                 "per_seed": [pooled_rate([t], a, s) - pooled_rate([t], b, s) for t in tables]})
  return {"sets": sets, "models": models, "table": table, "comparisons": rows}


def alpha_candidates(n: int, step: float = 0.25) -> list[tuple[float, ...]]:
  """The α of the searched merge: every point of the simplex grid with spacing `step` whose weights are
  all > 0 (a zero weight drops a vertical: that is not a merge of all N), uniform first.

  n=3, step=0.25 -> uniform (1/3, 1/3, 1/3) and the 3 permutations of (0.5, 0.25, 0.25).
  Raises ValueError when 1/step is not an integer >= n.
  """
  k = round(1 / step)
  if k < n or abs(k * step - 1) > 1e-9:
    raise ValueError(f"step {step} must be 1/m with an integer m >= n = {n}")
  out = [tuple([1.0 / n] * n)]
  for parts in itertools.product(range(1, k + 1), repeat=n):
    if sum(parts) == k:
      a = tuple(p / k for p in parts)
      if a not in out:
        out.append(a)
  return out


def episodes_per_task(set_episodes: int, n_tasks: int) -> int:
  """Episodes per task so that a set of `n_tasks` tasks gets about `set_episodes` (ceil, >= 1): sets of
  few tasks (GUI-Browsing: 2) are measured on as many episodes as sets of many (Game: 13).
  Raises ValueError for n_tasks < 1."""
  if n_tasks < 1:
    raise ValueError("a task set needs at least one task")
  return max(1, -(-set_episodes // n_tasks))


def format_table(rows: Mapping[str, Mapping[str, float]], sets: Sequence[str],
                 intervals: Mapping[str, Mapping[str, tuple[float, float] | None]] | None = None) -> str:
  """Markdown table: one row per model, one column per task set plus their mean; with `intervals`
  ({model: {set: (low, high) or None}}, `set_interval`) each set's cell also shows its interval."""
  head = "| model | " + " | ".join(sets) + " | mean |"
  lines = [head, "|" + "---|" * (len(sets) + 2)]
  for name, scores in rows.items():
    vals = [scores[s] for s in sets]
    cells = []
    for s, v in zip(sets, vals):
      ci = (intervals or {}).get(name, {}).get(s)
      cells.append(f"{v:.3f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""))
    lines.append(f"| {name} | " + " | ".join(cells) + f" | {sum(vals) / len(vals):.3f} |")
  return "\n".join(lines)


def plot(rows: Mapping[str, Mapping[str, float]], sets: Sequence[str], path: str, title: str = "") -> str:
  """Grouped bars, one group per task set, one bar per model; writes `path` (PNG) and returns it."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  names = list(rows)
  width = 0.8 / max(1, len(names))
  fig, ax = plt.subplots(figsize=(1.6 + 1.8 * len(sets), 3.6))
  for i, name in enumerate(names):
    xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(sets))]
    ax.bar(xs, [rows[name][s] for s in sets], width, label=name)
  ax.set_xticks(range(len(sets)), list(sets))
  ax.set_ylabel("score (success; games: score / reference)")
  ax.set_ylim(0, max(1.0, max((v for r in rows.values() for v in r.values()), default=1.0) * 1.05))
  ax.legend(fontsize=7, ncol=2)
  if title:
    ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
