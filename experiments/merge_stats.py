r"""The merge table (docs/replication.md row 6) over training seeds, with intervals, from merge_eval.json files.

  python -m experiments.merge_stats benchmarks/results/merge_eval_vmw_seed1.json \
      benchmarks/results/merge_eval_vmw_seed2.json

Each file is one training seed's `experiments/merge_eval.py` output (one shared SFT start, its verticals and
their merges, every model on every set). Prints, per model and set, the success rate over the files' held-out
episodes pooled (equal episodes per file: the mean over training seeds) with its Wilson 95 % interval and each
seed's rate; then the table's questions (`tars_jax.analysis.merge_eval.comparisons`): the difference of pooled
rates with Newcombe's 95 % interval, and each seed's difference. The intervals are over held-out episodes:
with two or three training seeds they do not cover the variance between training seeds, which the per-seed
columns show (the replication suite's seed-level bootstrap, `experiments.replication_stats`, needs >= 3).
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from tars_jax.analysis import merge_eval as ME

_JSON = flags.DEFINE_string("json", None, "Also write the table and comparisons here.")


def main(argv):
  paths = argv[1:]
  if not paths:
    raise app.UsageError("usage: python -m experiments.merge_stats <merge_eval.json> [<more.json> ...]")
  if len({os.path.realpath(p) for p in paths}) < len(paths):
    raise app.UsageError(f"a file given twice would count one training seed twice: {paths}")
  tables = [json.load(open(p)) for p in paths]
  ME.check_same_sets(tables, paths)
  sets = list(tables[0]["sets"])
  models = [m for m in tables[0]["tasks"] if all(m in t["tasks"] for t in tables)]
  names = [os.path.basename(p) for p in paths]
  print(f"{len(paths)} training seed{'s' * (len(paths) > 1)} ({', '.join(names)}); rates over pooled held-out episodes, "
        "Wilson / Newcombe 95 % intervals over episodes\n")
  print("| model | " + " | ".join(f"{s}" for s in (*sets, ME.ALL)) + " |")
  print("|" + "---|" * (len(sets) + 2))
  table = {}
  for m in models:
    cells = []
    for s in (*sets, ME.ALL):
      k, n = ME.pooled_counts(tables, m, s)
      lo, hi = _wilson(k, n)
      per_seed = [ME.pooled_counts([t], m, s) for t in tables]
      table.setdefault(m, {})[s] = {"rate": k / n, "ci": [lo, hi], "per_seed": [a / b for a, b in per_seed]}
      cells.append(f"{k / n:.3f} [{lo:.2f}, {hi:.2f}] ({' / '.join(f'{a / b:.2f}' for a, b in per_seed)})")
    print(f"| {m} | " + " | ".join(cells) + " |")
  print("\n| a - b | set | pooled difference [95 %] | per seed | question |\n|---|---|---|---|---|")
  rows = []
  for a, b, s, q in ME.comparisons(sets, models):
    d, lo, hi = ME.difference_interval(ME.pooled_counts(tables, a, s), ME.pooled_counts(tables, b, s))
    per = [ME.pooled_counts([t], a, s)[0] / ME.pooled_counts([t], a, s)[1]
           - ME.pooled_counts([t], b, s)[0] / ME.pooled_counts([t], b, s)[1] for t in tables]
    rows.append({"a": a, "b": b, "set": s, "difference": d, "ci": [lo, hi], "per_seed": per, "question": q})
    verdict = "**" if lo > 0 or hi < 0 else ""
    print(f"| {a} - {b} | {s} | {verdict}{d:+.3f} [{lo:+.3f}, {hi:+.3f}]{verdict} | "
          f"{' / '.join(f'{x:+.2f}' for x in per)} | {q} |")
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump({"files": paths, "table": table, "comparisons": rows}, f, indent=2)


def _wilson(k: int, n: int) -> tuple[float, float]:
  from scipy.stats import binomtest
  ci = binomtest(k, n).proportion_ci(method="wilson")
  return float(ci.low), float(ci.high)


if __name__ == "__main__":
  app.run(main)
