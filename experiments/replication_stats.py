r"""Every interval of docs/replication.md rows 1-5, recomputed from the committed result rows.

  python -m experiments.replication_stats benchmarks/results/replication.json
  python -m experiments.replication_stats runs/replication/replication.json --reps 2000
  python -m experiments.replication_stats benchmarks/results/quantized_serving.json --compare ppo_kl_int8:ppo_kl
  python -m experiments.replication_stats benchmarks/results/replication.json \
      benchmarks/results/replication_rerun.json --compare ppo_kl:sft      # the runs of both files pooled
  python -m experiments.replication_stats runs/replication5/replication.json --score think_tokens \
      --compare ppo_thoughts:sft_thoughts                                  # think length (row 5)

Prints per variant the IQM and mean held-out success with 95 % stratified bootstrap CIs, each
comparison's paired difference with its CI and probability of improvement (rliable; see
tars_jax/analysis/replication.py), and per task the mean +- std over training seeds. A variant with
fewer than 3 training seeds gets no interval (refused). Several files pool their runs: a run of file k
(from 0) counts as training seed `seed + 1000 k`, another run than seed `seed` of another file (a re-run
whose SFT checkpoint was re-made is another training run, even at the same seed).
"""

from __future__ import annotations

from absl import app, flags

from tars_jax.analysis import replication as R

_REPS = flags.DEFINE_integer("reps", 10_000, "Bootstrap resamples.")
_SCORE = flags.DEFINE_string("score", "success", "What the intervals are of: held-out success, or a numeric "
                             "field of the rows (think_tokens: mean tokens of a thought per turn, row 5).")
_COMPARE = flags.DEFINE_list("compare", None, "x:y pairs of variants to compare (paired x - y) instead of "
                             "docs/replication.md's comparisons.")


def main(argv):
  if len(argv) < 2:
    raise app.UsageError("usage: python -m experiments.replication_stats <replication.json> [<more.json> ...]")
  rows = [dict(r, seed=int(r["seed"]) + 1000 * k) for k, path in enumerate(argv[1:]) for r in R.load_rows(path)]
  R.check_rows(rows)
  print(f"{', '.join(argv[1:])}: {len(rows)} rows; training seeds per variant: {R.runs_per_variant(rows)}\n")
  comparisons = R.COMPARISONS
  if _COMPARE.value:
    if not all(p.count(":") == 1 for p in _COMPARE.value):
      raise app.UsageError(f"--compare takes x:y pairs, got {_COMPARE.value}")
    comparisons = [("-", *p.split(":"), "as asked") for p in _COMPARE.value]
  print(R.report(rows, reps=_REPS.value, comparisons=comparisons, key=_SCORE.value))
  if _SCORE.value != "success":
    return
  print("\n| variant | task | mean success over seeds | std | seeds |\n|---|---|---|---|---|")
  for v in R.runs_per_variant(rows):
    for task, (m, s, n) in R.per_task(rows, v).items():
      print(f"| {v} | {task} | {m:.3f} | {s:.3f} | {n} |")


if __name__ == "__main__":
  app.run(main)
