r"""Result rows from evaluations: each `experiments/eval.py --json` file named as variant:seed=path becomes
one row per task ({"variant", "seed", "task", "episodes", "successes"}), the input of
`experiments.replication_stats` (tars_jax/analysis/replication.py). For runs made outside the replication
suite's driver (which writes its own `replication.json`), e.g. the ORM arms of experiments/configs/orm.py:

  python -m experiments.result_rows --out benchmarks/results/orm_ppo.json \
      sft:0=runs/replication3/sft/seed_0/eval.json grpo_orm:0=runs/orm_rep/ppo_orm/seed_0/eval.json ...
  python -m experiments.replication_stats benchmarks/results/orm_ppo.json --compare grpo_orm:grpo_verifier

`--append` keeps the rows already in --out and adds these (a sweep finished on another machine or day:
its earlier evaluations need not be at hand):

  python -m experiments.result_rows --append --out benchmarks/results/replication_multiturn_v2.json \
      sft:2=runs/mt/sft/seed_2/eval.json ppo_lr1e4:2=runs/mt/ppo_lr1e4/seed_2/eval.json

Raises (usage error) on an argument not of the form variant:seed=path; BadRows when a (variant, seed,
task) would occur twice (with --append: also against the rows already there).
"""

from __future__ import annotations

import json
import os
import re

from absl import app, flags

from tars_jax.analysis import replication as rep

_OUT = flags.DEFINE_string("out", None, "The rows JSON to write.", required=True)
_APPEND = flags.DEFINE_bool("append", False, "Keep the rows already in --out (if it exists) and add these.")
_ARG = re.compile(r"^([\w.+-]+):(\d+)=(.+)$")


def main(argv):
  old = rep.load_rows(_OUT.value) if _APPEND.value and os.path.exists(_OUT.value) else []
  rows = []
  for a in argv[1:]:
    m = _ARG.match(a)
    if m is None:
      raise app.UsageError(f"{a!r}: expected variant:seed=path/to/eval.json")
    with open(m.group(3)) as f:
      rows += rep.rows_of_eval(m.group(1), int(m.group(2)), json.load(f)["results"])
  rows = old + rows
  rep.check_rows(rows)
  with open(_OUT.value, "w") as f:
    json.dump(rows, f, indent=1)
  print(f"[result_rows] {len(rows) - len(old)} rows of {len(argv) - 1} evaluations"
        f"{f' added to {len(old)}' if old else ''} -> {_OUT.value}; "
        f"training seeds per variant: {rep.runs_per_variant(rows)}")


if __name__ == "__main__":
  app.run(main)
