r"""Every interval of docs/replication.md rows 1-5, recomputed from the committed result rows.

  python -m experiments.replication_stats benchmarks/results/replication.json
  python -m experiments.replication_stats runs/replication/replication.json --reps 2000

Prints per variant the IQM and mean held-out success with 95 % stratified bootstrap CIs, each
comparison's paired difference with its CI and probability of improvement (rliable; see
tars_jax/analysis/replication.py), and per task the mean +- std over training seeds. A variant with
fewer than 3 training seeds gets no interval (refused).
"""

from __future__ import annotations

from absl import app, flags

from tars_jax.analysis import replication as R

_REPS = flags.DEFINE_integer("reps", 10_000, "Bootstrap resamples.")


def main(argv):
  if len(argv) != 2:
    raise app.UsageError("usage: python -m experiments.replication_stats <replication.json>")
  rows = R.load_rows(argv[1])
  print(f"{argv[1]}: {len(rows)} rows; training seeds per variant: {R.runs_per_variant(rows)}\n")
  print(R.report(rows, reps=_REPS.value))
  print("\n| variant | task | mean success over seeds | std | seeds |\n|---|---|---|---|---|")
  for v in R.runs_per_variant(rows):
    for task, (m, s, n) in R.per_task(rows, v).items():
      print(f"| {v} | {task} | {m:.3f} | {s:.3f} | {n} |")


if __name__ == "__main__":
  app.run(main)
