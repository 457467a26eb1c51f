r"""The replication suite with three multi-turn RL tasks (issue #37 item 3): the suite of
experiments/configs/replication.py (same model, variants, budgets and demonstration mix) with two more RL
tasks whose text comes from MiniWoB++'s fifty first names, as enter-text's does (the suite's policy
copies those; the 5-step typing tasks' random passwords it never copies):

  miniwob/enter-text-2   click the field, type the name in the asked case, Submit (3 turns)
  miniwob/search-engine  click the search box, type the name, Search, the result's page when it is past
                         the 3rd, the k-th result (4-5 turns)

240 expert demonstrations of each (as of the typing tasks) join the suite's demonstrations, and SFT runs
1400 updates instead of the suite's 800: after 800 every typing task was at 0.01-0.02 held out (sampled);
one 1400-update run (training seed 1) put every task in 0.2-0.7: enter-text 0.65, enter-text-2 0.28,
search-engine 0.22 (benchmarks/RESULTS.md, "The multi-turn suite's SFT start as one 1400-update run").

  RUN=runs/multiturn CONFIG=experiments/configs/replication_multiturn.py VARIANTS=ppo_ptx SEEDS=0 \
      bash scripts/replicate.sh --jobs 2

Args: those of replication.py (its `STAGES`), "+smoke" appended = its tiny model and budgets (the smoke
tasks are replication.py's).
"""

import ml_collections as mlc

from experiments.configs import miniwob_pipeline, replication

VARIANTS, STAGES, ARGS = replication.VARIANTS, replication.STAGES, replication.ARGS
MULTI_TURN = ("miniwob/enter-text-2", "miniwob/search-engine")
TASKS = (*replication.TASKS, *MULTI_TURN)
DEMO_TASKS = (*replication.DEMO_TASKS, *MULTI_TURN)
TYPING = (*replication.TYPING, *MULTI_TURN)


def get_config(arg: str | None = None) -> mlc.ConfigDict:
  c = replication.get_config(arg)
  if miniwob_pipeline.stage_arg(arg or "ppo", STAGES)[1]:  # smoke: replication.py's tasks
    return c
  c.tasks = TASKS
  c.data.demo_tasks = DEMO_TASKS
  c.data.demo_seeds_by_task = tuple((t, 240) for t in TYPING)
  c.sft.steps = 1400  # the copied names sharpen late (train ce_free 0.39 at 800, 0.03 at 1400)
  c.sft.max_minutes = 120.0  # guard only: 1400 updates took 63 min here (1.5-3.5 s each)
  return c
