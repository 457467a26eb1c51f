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
  tables = []
  for p in paths:
    with open(p) as f:
      tables.append(json.load(f))
  out = ME.seeds_table(tables, paths)
  print(f"{len(paths)} training seed{'s' * (len(paths) > 1)} ({', '.join(os.path.basename(p) for p in paths)}); "
        "rates over pooled held-out episodes, Wilson / Newcombe 95 % intervals over episodes\n")
  print("| model | " + " | ".join(out["sets"]) + " |\n|" + "---|" * (len(out["sets"]) + 1))
  for m, row in out["table"].items():
    cells = [f"{c['rate']:.3f} [{c['ci'][0]:.2f}, {c['ci'][1]:.2f}] ({' / '.join(f'{x:.2f}' for x in c['per_seed'])})"
             for c in row.values()]
    print(f"| {m} | " + " | ".join(cells) + " |")
  print("\n| a - b | set | pooled difference [95 %] | per seed | question |\n|---|---|---|---|---|")
  for r in out["comparisons"]:
    lo, hi = r["ci"]
    bold = "**" if lo > 0 or hi < 0 else ""  # the interval excludes 0
    print(f"| {r['a']} - {r['b']} | {r['set']} | {bold}{r['difference']:+.3f} [{lo:+.3f}, {hi:+.3f}]{bold} | "
          f"{' / '.join(f'{x:+.2f}' for x in r['per_seed'])} | {r['question']} |")
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump({"files": paths, **out}, f, indent=2)


if __name__ == "__main__":
  app.run(main)
