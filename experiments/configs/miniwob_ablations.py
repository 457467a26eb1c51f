r"""Ablations of the report's RL recipe (section 2.5.4) on multi-step MiniWoB++ tasks.

Variants (the config arg), identical in tasks, model, episodes per iteration, budget and seeds:
  ppo           PPO with critic, decoupled GAE (lam_policy 0.95, lam_critic 1.0; VC-PPO)
  grpo          GRPO (no critic; 4 episodes per screen, same episodes per iteration)
  ppo_vpt       ppo + value pretraining first (vpt.enabled; experiments/replicate.py runs it)
  ppo_coupled   ppo with coupled lambda (lam_policy = lam_critic = 0.95)
  ppo_lenadapt  ppo with length-adaptive lam_policy (VAPO alpha = 0.05)
Append "+smoke" for a tiny model and budget (tests, dry runs): e.g. "grpo+smoke"; "" = "ppo".
`ARGS` lists every accepted arg. `ppo_vpt` needs its value-pretraining stage: experiments/train.py
refuses it without `critic.init` (experiments/replicate.py runs the stage and passes its critic).
The module has no `STAGES` with "sft": experiments/replicate.py runs every variant from the config's own
policy init (no demonstrations or SFT stage), evaluates each run on `final_eval_episodes` held-out seeds
per task, and gives the intervals of the variants' comparisons (>= 3 seeds).

  python -m experiments.replicate --config experiments/configs/miniwob_ablations.py \
      --variants ppo,grpo,ppo_vpt,ppo_coupled,ppo_lenadapt --seeds 0,1,2 --workdir runs/ablations
  python -m experiments.train --config experiments/configs/miniwob_ablations.py:grpo --workdir runs/grpo

The tasks need several actions (click a field, type, click submit; tick boxes then submit), so the
grammar allows `click` and `type` and episodes get up to 5 steps: credit assignment over turns matters.
"""

import ml_collections as mlc

from experiments.configs import miniwob_ppo

VARIANTS = ("ppo", "grpo", "ppo_vpt", "ppo_coupled", "ppo_lenadapt")
ARGS = ("", *VARIANTS, *(v + "+smoke" for v in VARIANTS))
TASKS = ("miniwob/click-dialog", "miniwob/enter-text", "miniwob/focus-text", "miniwob/click-checkboxes")


def get_config(arg: str | None = None) -> mlc.ConfigDict:
  variant, _, mod = (arg or "ppo").partition("+")
  if variant not in VARIANTS or mod not in ("", "smoke"):
    raise ValueError(f"unknown arg {arg!r}; expected one of {VARIANTS}, optionally with '+smoke'")
  smoke = mod == "smoke"
  c = miniwob_ppo.get_config("smoke" if smoke else "ppo")
  c.tasks = TASKS
  c.grammar.actions = ("click", "type")
  c.grammar.max_content_bytes = 12
  c.env.max_turns = 5
  c.env.num_sessions = 4 if smoke else 16
  c.rl.group_size = 1
  c.rl.minibatch_size = 4 if smoke else 8
  c.iterations = 1 if smoke else 300
  c.max_minutes = 30.0 if smoke else 240.0  # guard only (tars_jax/train/guard.py): the budget is the count above
  c.length_multiple = 128

  if variant == "grpo":
    c.rl.algo = "grpo"
    c.rl.group_size = 2 if smoke else 4
  elif variant == "ppo_vpt":
    c.vpt.enabled = True
  elif variant == "ppo_coupled":
    c.rl.lam_policy = c.rl.lam_critic = 0.95
  elif variant == "ppo_lenadapt":
    c.rl.length_adaptive_alpha = 0.05
  return c
