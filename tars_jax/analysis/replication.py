"""Statistics of the replication suite (issue #37; docs/replication.md rows 1-5).

Input: result rows `{"variant": "ppo", "seed": 0, "task": "miniwob/...", "episodes": 100, "successes": 57}`
(variant "sft" = the shared SFT start of that training seed), as written by experiments/replicate.py to
`<workdir>/replication.json` and committed as benchmarks/results/replication.json.

A run's score on a task is its held-out success rate (successes / episodes). Aggregates follow Agarwal
et al. 2021 ("Deep RL at the edge of the statistical precipice") through `rliable`: IQM and mean over
the [training seeds x tasks] score matrix, 95 % stratified bootstrap confidence intervals (runs
resampled with replacement within each task), and the probability of improvement P(X > Y). The gain
of an RL variant over its SFT start is the mean of the paired differences (same training seed, same
task), with its own stratified bootstrap interval. Fewer than `MIN_SEEDS` training seeds: refused.
"""

from __future__ import annotations

import json
from typing import Iterable, Sequence

import numpy as np

MIN_SEEDS = 3
FIELDS = ("variant", "seed", "task", "episodes", "successes")


class TooFewSeeds(ValueError):
  """An interval was asked of fewer than MIN_SEEDS training seeds."""


class BadRows(ValueError):
  """Result rows that are malformed, duplicated or do not cover every (seed, task) of a variant."""


def load_rows(path: str) -> list[dict]:
  """Rows of a results JSON (a list of dicts with FIELDS). Raises BadRows (see `check_rows`)."""
  with open(path) as f:
    rows = json.load(f)
  check_rows(rows)
  return rows


def check_rows(rows: Sequence[dict]) -> None:
  """Raises BadRows for a row without FIELDS, successes outside [0, episodes], or a (variant, seed,
  task) that occurs twice (a run counted twice)."""
  seen = set()
  for r in rows:
    missing = [k for k in FIELDS if k not in r]
    if missing:
      raise BadRows(f"replication row {r} lacks {missing}")
    if not 0 <= int(r["successes"]) <= int(r["episodes"]) or int(r["episodes"]) <= 0:
      raise BadRows(f"replication row {r}: successes must lie in [0, episodes] and episodes > 0")
    key = (r["variant"], int(r["seed"]), r["task"])
    if key in seen:
      raise BadRows(f"replication rows hold {key} twice")
    seen.add(key)


def rows_of_eval(variant: str, seed: int, results: dict) -> list[dict]:
  """Result rows of one evaluation: `results` is the "results" dict of an `experiments/eval.py --json`
  file ({task: {"success", "episodes", ...}}); one row per task with episodes, sorted by task, with the
  evaluation's mean think tokens per turn as "think_tokens" where it has them."""
  return [{"variant": variant, "seed": int(seed), "task": task, "episodes": int(r["episodes"]),
           "successes": int(round(r["success"] * r["episodes"])),
           **({"think_tokens": float(r["think_tokens"])} if "think_tokens" in r else {})}
          for task, r in sorted(results.items()) if r["episodes"]]


def _score(r: dict, key: str) -> float:
  if key == "success":
    return r["successes"] / r["episodes"]
  if key not in r:
    raise BadRows(f"replication row {r} has no {key!r} (an evaluation from before it was recorded)")
  return float(r[key])


def score_matrix(rows: Iterable[dict], variant: str, seeds: Sequence[int] | None = None,
                 tasks: Sequence[str] | None = None, key: str = "success") -> tuple[np.ndarray, list[int], list[str]]:
  """Scores of `variant`: ([n_seeds, n_tasks] float64, seeds, tasks), seeds and tasks sorted (or as
  given). `key`: "success" (successes / episodes) or another numeric field of the rows ("think_tokens").
  Raises BadRows when a (seed, task) cell has no row (or a row lacks `key`), or the variant has no rows."""
  by = {(int(r["seed"]), r["task"]): _score(r, key) for r in rows if r["variant"] == variant}
  if not by:
    raise BadRows(f"no rows of variant {variant!r}")
  seeds = sorted({s for s, _ in by}) if seeds is None else list(seeds)
  tasks = sorted({t for _, t in by}) if tasks is None else list(tasks)
  missing = [(s, t) for s in seeds for t in tasks if (s, t) not in by]
  if missing:
    raise BadRows(f"variant {variant!r} has no result for (seed, task) {missing[:4]}"
                  + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
  return np.array([[by[(s, t)] for t in tasks] for s in seeds], np.float64), seeds, tasks


def _need_seeds(n: int, what: str) -> None:
  if n < MIN_SEEDS:
    raise TooFewSeeds(f"{what}: {n} training seed(s); an interval needs at least {MIN_SEEDS} "
                      f"(run more seeds: experiments/replicate.py --seeds)")


def aggregate(scores: np.ndarray, reps: int = 10_000, seed: int = 0) -> dict[str, float]:
  """IQM and mean of a [n_seeds, n_tasks] score matrix with 95 % stratified bootstrap CIs (rliable).

  Returns {iqm, iqm_lo, iqm_hi, mean, mean_lo, mean_hi, seeds}. Raises TooFewSeeds below MIN_SEEDS.
  """
  from rliable import library as rly
  from rliable import metrics
  _need_seeds(scores.shape[0], "aggregate")
  np.random.seed(seed)  # rliable draws its bootstrap from numpy's global generator
  point, ci = rly.get_interval_estimates(
      {"x": scores}, lambda x: np.array([metrics.aggregate_iqm(x), metrics.aggregate_mean(x)]), reps=reps)
  (iqm, mean), ((iqm_lo, mean_lo), (iqm_hi, mean_hi)) = point["x"], ci["x"]
  return {"iqm": float(iqm), "iqm_lo": float(iqm_lo), "iqm_hi": float(iqm_hi), "mean": float(mean),
          "mean_lo": float(mean_lo), "mean_hi": float(mean_hi), "seeds": int(scores.shape[0])}


def compare(rows: Sequence[dict], x: str, y: str, reps: int = 10_000, seed: int = 0,
            key: str = "success") -> dict[str, float]:
  """Variant `x` against `y` on the training seeds and tasks both have, scored by `key` (as `score_matrix`).

  Returns {diff, diff_lo, diff_hi}: mean over seeds and tasks of the paired difference x - y with its
  95 % stratified bootstrap CI; {poi, poi_lo, poi_hi}: probability of improvement P(x > y) (rliable,
  per task, averaged) with its CI; `verdict`: "x better" / "y better" when the difference's CI excludes
  0 ("x higher <key>" for another key than success), else "inconclusive"; `seeds`, `tasks`. Raises TooFewSeeds, BadRows.
  """
  from rliable import library as rly
  from rliable import metrics
  sx = {int(r["seed"]) for r in rows if r["variant"] == x}
  sy = {int(r["seed"]) for r in rows if r["variant"] == y}
  seeds = sorted(sx & sy)
  _need_seeds(len(seeds), f"{x} vs {y}")
  tx = {r["task"] for r in rows if r["variant"] == x}
  tasks = sorted(tx & {r["task"] for r in rows if r["variant"] == y})
  a, _, _ = score_matrix(rows, x, seeds, tasks, key)
  b, _, _ = score_matrix(rows, y, seeds, tasks, key)
  np.random.seed(seed)
  point, ci = rly.get_interval_estimates({"d": a - b}, lambda d: np.array([metrics.aggregate_mean(d)]), reps=reps)
  diff, lo, hi = float(point["d"][0]), float(ci["d"][0, 0]), float(ci["d"][1, 0])
  np.random.seed(seed)
  ppoint, pci = rly.get_interval_estimates({"p": (a, b)}, metrics.probability_of_improvement, reps=reps)
  more = "better" if key == "success" else f"higher {key}"
  verdict = f"{x} {more}" if lo > 0 else f"{y} {more}" if hi < 0 else "inconclusive"
  poi_lo, poi_hi = np.ravel(pci["p"])
  return {"diff": diff, "diff_lo": lo, "diff_hi": hi, "poi": float(ppoint["p"]), "poi_lo": float(poi_lo),
          "poi_hi": float(poi_hi), "verdict": verdict, "seeds": len(seeds), "tasks": len(tasks)}


def runs_per_variant(rows: Sequence[dict]) -> dict[str, int]:
  """{variant: number of training seeds with at least one row}."""
  out: dict[str, set] = {}
  for r in rows:
    out.setdefault(r["variant"], set()).add(int(r["seed"]))
  return {v: len(s) for v, s in sorted(out.items())}


def per_task(rows: Sequence[dict], variant: str) -> dict[str, tuple[float, float, int]]:
  """{task: (mean success over seeds, std over seeds, seeds)} of `variant` (no interval: any seed count)."""
  out = {}
  for task in sorted({r["task"] for r in rows if r["variant"] == variant}):
    v = [r["successes"] / r["episodes"] for r in rows if r["variant"] == variant and r["task"] == task]
    out[task] = (float(np.mean(v)), float(np.std(v)), len(v))
  return out


# The comparisons docs/replication.md reports: (row, x, y, what the report claims).
COMPARISONS = (
    (1, "ppo", "sft", "RL (critic PPO, decoupled GAE, value pretraining) improves on its SFT start"),
    (2, "ppo", "grpo", "PPO beats GRPO"),
    (2, "grpo", "sft", "GRPO improves on its SFT start"),
    (3, "ppo", "ppo_novpt", "value pretraining helps PPO"),
    (1, "ppo_kl", "sft", "PPO with a KL penalty to the SFT policy improves on its SFT start"),
    (1, "ppo_kl", "ppo", "the KL penalty to the SFT policy helps PPO"),
    (1, "ppo_topent", "ppo", "the policy gradient on the top 20 % entropy tokens helps PPO"),
    (1, "ppo_kl_topent", "sft", "PPO with the KL penalty and the top-20 % entropy policy gradient improves on SFT"),
    (1, "ppo_kl_topent", "ppo_kl", "the top-20 % entropy policy gradient helps PPO with the KL penalty"),
    (1, "ppo_kl_1ep", "sft", "PPO with the KL penalty, 1 epoch and 50 iterations improves on its SFT start"),
    (1, "ppo_kl_1ep", "ppo_kl", "at the same wall budget, 1 epoch over 50 iterations beats 2 epochs over 30"),
    ("3b", "ppo_kl_mc", "ppo_kl", "with the KL penalty: lam_policy 1 (Monte-Carlo advantages) vs 0.95"),
    (1, "ppo_kl_mc", "sft", "PPO with the KL penalty and lam_policy 1 improves on its SFT start"),
    (1, "ppo_kl_ptx", "sft", "PPO with the KL penalty and PPO-ptx (SFT loss on demonstrations) improves on SFT"),
    (1, "ppo_kl_ptx", "ppo_kl", "PPO-ptx (SFT loss on the demonstrations in each policy step) helps PPO with KL"),
    (1, "ppo_ptx", "sft", "PPO with PPO-ptx and no KL penalty improves on its SFT start"),
    (1, "ppo_ptx", "ppo_kl_ptx", "with PPO-ptx, dropping the KL penalty helps"),
    (1, "ppo_ptx", "ppo", "PPO-ptx (SFT loss on the demonstrations in each policy step) helps PPO"),
    (5, "ppo_thoughts", "sft_thoughts", "PPO on the SFT start that writes thoughts improves on it"),
    (2, "ppo_kl", "grpo_kl", "PPO beats GRPO, both with the KL penalty to the SFT policy"),
    ("3b", "ppo", "ppo_coupled", "decoupled GAE (lam_critic 1, lam_policy 0.95) beats coupled lam 0.95"),
    ("3b", "ppo_lenadapt", "ppo", "length-adaptive GAE helps"),
    (1, "ppo_notext", "ppo", "no policy gradient on the typed characters helps PPO (keeps the copies)"),
    (1, "ppo_notext", "sft", "PPO without the policy gradient on the typed characters improves on SFT"),
    (1, "ppo_lr1e4", "ppo", "a third of PPO's learning rate helps PPO (keeps the skills RL does not reinforce)"),
    (1, "ppo_lr1e4", "sft", "PPO at lr 1e-4 improves on its SFT start"),
    (1, "ppo_lr1e4_fv", "ppo_lr1e4", "frozen vision encoders learn what the full update learns (PPO at lr 1e-4)"),
    (1, "ppo_lr1e4_fv", "sft", "PPO at lr 1e-4 with frozen vision encoders improves on its SFT start"),
    (3, "ppo_lr1e4_vpt30", "ppo_lr1e4", "30 value-pretraining iterations instead of 10 help PPO (lr 1e-4)"),
    (1, "ppo_lr1e4_task", "ppo_lr1e4", "a per-task baseline on top of the critic helps PPO (lr 1e-4)"),
    (1, "ppo_lr1e4_task", "sft", "PPO at lr 1e-4 with a per-task baseline improves on its SFT start"),
    (1, "ppo_lr1e4_ptx", "ppo_lr1e4", "PPO-ptx helps PPO at lr 1e-4 (the demonstrations anchor the copied names)"),
    (1, "ppo_lr1e4_ptx", "sft", "PPO at lr 1e-4 with PPO-ptx improves on its SFT start"),
    (1, "ppo_lr1e4_ptx50", "ppo_lr1e4_ptx", "50 RL iterations instead of 30 help PPO-ptx at lr 1e-4"),
    (1, "ppo_lr1e4_ptx50", "sft", "PPO-ptx at lr 1e-4 for 50 iterations improves on its SFT start"),
)


def report(rows: Sequence[dict], reps: int = 10_000, comparisons: Sequence[tuple] = COMPARISONS,
           key: str = "success") -> str:
  """Markdown: per-variant IQM / mean of `key` (as `score_matrix`) with CIs, then each comparison
  (row, x, y, claim) of `comparisons` whose variants have >= MIN_SEEDS shared seeds (the others are
  listed as not run, never given an interval). With another key than success, variants whose rows lack
  it are listed as such. Raises BadRows where a compared variant's rows lack `key`."""
  lines = [f"| variant | runs (seeds) | IQM of {key} [95% CI] | mean of {key} [95% CI] |", "|---|---|---|---|"]
  counts = runs_per_variant(rows)
  if key != "success":
    counts = {v: n for v, n in counts.items() if all(key in r for r in rows if r["variant"] == v)}
  for v, n in counts.items():
    if n < MIN_SEEDS:
      lines.append(f"| {v} | {n} | refused: < {MIN_SEEDS} seeds | refused: < {MIN_SEEDS} seeds |")
      continue
    a = aggregate(score_matrix(rows, v, key=key)[0], reps)
    lines.append(f"| {v} | {n} | {a['iqm']:.3f} [{a['iqm_lo']:.3f}, {a['iqm_hi']:.3f}] | "
                 f"{a['mean']:.3f} [{a['mean_lo']:.3f}, {a['mean_hi']:.3f}] |")
  lines += ["", "| row | comparison | seeds | mean difference [95% CI] | P(improvement) [95% CI] | verdict |",
            "|---|---|---|---|---|---|"]
  for row, x, y, claim in comparisons:
    if x not in counts or y not in counts:
      lines.append(f"| {row} | {x} vs {y} ({claim}) | - | not run{'' if key == 'success' else f' (or no {key})'} | - "
                   "| not measured |")
      continue
    try:
      c = compare(rows, x, y, reps, key=key)
    except TooFewSeeds as e:
      lines.append(f"| {row} | {x} vs {y} ({claim}) | - | refused: {e} | - | not measured |")
      continue
    lines.append(f"| {row} | {x} vs {y} ({claim}) | {c['seeds']} | {c['diff']:+.3f} [{c['diff_lo']:+.3f}, "
                 f"{c['diff_hi']:+.3f}] | {c['poi']:.2f} [{c['poi_lo']:.2f}, {c['poi_hi']:.2f}] | {c['verdict']} |")
  return "\n".join(lines)
