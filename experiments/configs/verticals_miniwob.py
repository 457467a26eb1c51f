r"""Vertical agents at the replication suite's scale (report section 2.6, issue #40 item 1): three MiniWoB++
task sets, each trained by PPO from one shared SFT checkpoint (the multi-turn suite's, with its
value-pretrained critic), then merged by interpolation and task arithmetic and every model played on
every set. The question of the report's merge table, on a policy that learns within this machine's
budget: the report's own verticals (GUI-Browsing, GUI-General, Game; experiments/configs/verticals.py)
made 1-3 PPO iterations in their budgets here, and its browsing PPO pilot did not improve its start.

  SFT=runs/mt/sft/seed_1 CRITIC=runs/mt/vpt/seed_1/critic RUN=runs/vmw/seed_1 \
      CFG=experiments/configs/verticals_miniwob.py bash scripts/verticals.sh

The sets (`VERTICALS`): tasks on which the multi-turn suite's SFT start is partial and RL moved the
one-screen ones up (+0.09 to +0.19 under `ppo` on seed 1; benchmarks/RESULTS.md, "The multi-turn suite's
SFT start as one 1400-update run"), none of them the suite's typing tasks (RL eroded them):
  click       click-test, click-test-2                      (1 turn; SFT 0.50 / 0.24 on seed 1)
  focus       focus-text, focus-text-2                      (1 turn; 0.30 / 0.21)
  checkboxes  click-checkboxes, click-checkboxes-transfer   (2-4 turns; 0.55 / 0.63 from seed 0's start)

Every stage is the multi-turn suite's `ppo` (model, grammar, PPO and its budget of 30 iterations x 32
episodes, held-out seeds) with the vertical's tasks; "all" holds every set (the merge evaluation).
Args: "click", "focus", "checkboxes" (PPO of that vertical), "all"; "+smoke" appended = the suite's tiny
model and budgets, one task per set.
"""

import ml_collections as mlc

from experiments.configs import miniwob_pipeline, replication_multiturn, verticals

VERTICALS = {"click": ("miniwob/click-test", "miniwob/click-test-2"),
             "focus": ("miniwob/focus-text", "miniwob/focus-text-2"),
             "checkboxes": ("miniwob/click-checkboxes", "miniwob/click-checkboxes-transfer")}
SMOKE_VERTICALS = {"click": ("miniwob/click-test",), "focus": ("miniwob/focus-text",),
                   "checkboxes": ("miniwob/click-checkboxes",)}
STAGES = (*VERTICALS, "all")
ARGS = (*STAGES, *(s + "+smoke" for s in STAGES))


def get_config(arg: str | None = None) -> mlc.ConfigDict:
  """Config of one stage; raises ValueError for an unknown arg."""
  stage, smoke = miniwob_pipeline.stage_arg(arg, STAGES)
  c = replication_multiturn.get_config("ppo+smoke" if smoke else "ppo")
  sets = SMOKE_VERTICALS if smoke else VERTICALS
  c.tasks = sets[stage] if stage in sets else tuple(t for ts in sets.values() for t in ts)
  c.verticals = verticals.vertical_sets(sets, {v: c.env.max_turns for v in sets})
  return c
