r"""Generative outcome reward model (ORM; UI-TARS-2 report sections 2.5.2 and 3.3, issue #28 item 4):
train the policy's model to answer "Did the agent complete the task?" on verifier-labelled
trajectories, measure it on held-out ones (F1, precision, recall, false-positive rate), then train PPO
with its rewards only and compare held-out success with the same run on the verifier's rewards.

The ORM has the pipeline's model, prompt and grammar (experiments/configs/miniwob_pipeline.py) and
starts from its SFT policy (the report's ORM is the policy model itself). Commands, after the main job
(`bash scripts/demo.sh`: runs/main/{sft,demos,ppo}):

  # 1. the verifier arm; its rollouts (recorded by default: <run>/rollouts) are labelled trajectories
  python -m experiments.train --config experiments/configs/orm.py:ppo_verifier --workdir runs/orm/ppo_verifier
  # 2. the ORM: rollouts (successes and failures) + demonstrations (successes); 20 % of the (task, seed)
  #    groups held out; table printed and written to runs/orm/orm/orm.json
  python -m experiments.orm --config experiments/configs/orm.py --workdir runs/orm/orm \
      --config.orm.data="('runs/orm/ppo_verifier/rollouts','runs/main/ppo/rollouts','runs/main/demos')"
  # 3. the ORM arm: the same PPO run, rewards from the ORM's P(yes) only
  python -m experiments.train --config experiments/configs/orm.py:ppo_orm --workdir runs/orm/ppo_orm \
      --config.rl.orm_run=runs/orm/orm
  # 4. held-out success of both arms (200 seeds never trained on)
  python -m experiments.eval --run runs/orm/ppo_verifier --episodes 200 --json runs/orm/eval_verifier.json
  python -m experiments.eval --run runs/orm/ppo_orm --episodes 200 --json runs/orm/eval_orm.json

  # tiny versions of each (tests): "+smoke" appended, e.g.
  python -m experiments.orm --config experiments/configs/orm.py:+smoke --workdir /tmp/orm \
      --config.orm.data="('/tmp/records',)"

The two PPO arms differ only in `rl.orm_run`: GRPO (4 episodes per screen) on `miniwob/click-test-2`
from the SFT policy, the same seeds, iterations and budget. GRPO, not critic PPO: a critic pretrained
on the verifier's returns would carry them into the ORM arm, and a group baseline makes the ORM's
calibration offset (its high false-positive rate shifts every P(yes) up) irrelevant: only the order of
a group's episodes matters.

Replication-suite ORM (arg "replication"; issue #40 item 6, docs/replication.md row 10): the model of
the replication suite (experiments/configs/replication.py:sft) from its SFT checkpoint of training seed
0, on the verifier-labelled rollouts of seeds 0-2 of seven RL variants (30 iterations x 32 episodes each,
5 MiniWoB++ tasks; 20 160 episodes), balanced by length (`orm.balance = "length"`: equal successes and
failures within each (task, number of turns) stratum, so the turn count alone has AUROC 0.5), 20 % of
the (task, seed) groups held out (a screen's episodes of every variant and seed on one side), 95 %
bootstrap intervals over held-out (task, seed) groups within each task:

  ln -s <the suite's run dir> runs/replication3     # e.g. /work/main/runs/replication3 (bash scripts/replicate.sh)
  python -m experiments.orm --config experiments/configs/orm.py:replication --workdir runs/orm_rep/orm

Its PPO arms ("replication_ppo_orm" / "replication_ppo_verifier"): the suite's `grpo` variant (groups
of 4, no critic; see above) from the SFT checkpoint of training seed s, rewards from the ORM's P(yes)
(success reward range (0, 1), as the suite's `rl.outcome = "success"`) or from the verifier, on training
screens the ORM never saw (`env.train_seed_offset` 7 000 000: the suite's rollouts, hence the ORM's
training data, are seeds 0-959), then held-out success on the suite's 100 evaluation seeds per task:

  for s in 0 1 2; do for arm in orm verifier; do
    python -m experiments.train --config experiments/configs/orm.py:replication_ppo_$arm --config.seed=$s \
        --config.policy.init=runs/replication3/sft/seed_$s --workdir runs/orm_rep/ppo_$arm/seed_$s
    python -m experiments.eval --run runs/orm_rep/ppo_$arm/seed_$s --episodes 100 \
        --json runs/orm_rep/ppo_$arm/seed_$s/eval.json
  done; done

Args (`ARGS`): "" = the ORM stage (experiments/orm.py); "replication" = the same on the replication
suite; "ppo_orm" / "ppo_verifier" = the two PPO arms (experiments/train.py); "replication_ppo_orm" /
"replication_ppo_verifier" = the replication suite's; "+smoke" appended (or "smoke" = "+smoke") = tiny
model and budgets.
"""

import ml_collections as mlc

from experiments.configs import miniwob_pipeline
from experiments.configs import replication

STAGES = ("", "replication", "ppo_orm", "ppo_verifier", "replication_ppo_orm", "replication_ppo_verifier")
# the replication suite's run dir (bash scripts/replicate.sh) and the RL variants whose rollouts train it
REPLICATION_RUN = "runs/replication3"
REPLICATION_VARIANTS = ("ppo", "grpo", "ppo_kl", "grpo_kl", "ppo_novpt", "ppo_coupled", "ppo_lenadapt")
REPLICATION_SEEDS = (0, 1, 2)
ARGS = (*STAGES, *(s + "+smoke" for s in STAGES), "smoke")


def get_config(arg: str | None = None) -> mlc.ConfigDict:
  arg = "+smoke" if arg == "smoke" else arg
  stage, smoke = miniwob_pipeline.stage_arg(arg, STAGES)
  if stage == "replication":
    return _replication(smoke)
  if stage in ("replication_ppo_orm", "replication_ppo_verifier"):
    return _replication_ppo(stage == "replication_ppo_orm", smoke)
  c = miniwob_pipeline.get_config("+smoke" if smoke else "")
  sft = "" if smoke else "runs/main/sft"  # the main job's SFT policy (scripts/demo.sh)

  # --- The ORM stage (experiments/orm.py): from the SFT policy, which already reads the screens ----
  c.policy.init = sft
  o = c.orm
  o.data = () if smoke else ("runs/orm/ppo_verifier/rollouts", "runs/main/ppo/rollouts", "runs/main/demos")
  o.lr = 1e-3 if smoke else 3e-4  # fine-tuning a trained policy
  o.balance = "none" if smoke else "length"  # the label independent of (task, episode length)

  # --- The two PPO arms: GRPO from the SFT policy on click-test-2 (SFT alone: ~0.72 held-out) ------
  if stage in ("ppo_orm", "ppo_verifier"):
    c.tasks = ("miniwob/click-test-2",)
    c.rl.algo, c.rl.group_size = "grpo", 4
    c.critic.init = ""
    # the same number of updates in both arms (the ORM's forward pass costs the ORM arm time)
    c.iterations = 2 if smoke else 30
    c.max_minutes = 30.0 if smoke else 60.0  # guard only
    c.eval_every = 0 if smoke else 10
    c.eval_episodes = 2 if smoke else 32
    c.rl.orm_run = ("runs/orm_smoke/orm" if smoke else "runs/orm/orm") if stage == "ppo_orm" else ""
  return c


def _replication(smoke: bool) -> mlc.ConfigDict:
  """The ORM on the replication suite's rollouts, from its SFT checkpoint of training seed 0."""
  c = replication.get_config("sft+smoke" if smoke else "sft")  # the suite's model, prompt and grammar
  c.policy.init = "" if smoke else f"{REPLICATION_RUN}/sft/seed_0"
  o = c.orm
  o.data = () if smoke else tuple(f"{REPLICATION_RUN}/{v}/seed_{s}/rollouts"
                                  for v in REPLICATION_VARIANTS for s in REPLICATION_SEEDS)
  o.balance = "length"
  o.lr = 1e-3 if smoke else 3e-4  # fine-tuning a trained policy
  o.steps = 6 if smoke else 300  # updates of 16 episodes (a budget in counts; ~1 epoch of the 4 808 balanced training episodes)
  o.warmup_steps = 2 if smoke else 30
  o.eval_every = 0  # the held-out set (all of it, ~1 250 episodes) is scored at the end only
  o.eval_examples = 100_000  # every held-out episode (a sample would undo the balance)
  o.ckpt_every = 3 if smoke else 100
  o.max_minutes = 30.0 if smoke else 120.0  # guard only
  return c


def _replication_ppo(orm: bool, smoke: bool) -> mlc.ConfigDict:
  """The replication suite's GRPO from its SFT checkpoint of `seed` (pass --config.seed and
  --config.policy.init together), outcome reward from the ORM (`orm`) or the verifier."""
  c = replication.get_config("grpo+smoke" if smoke else "grpo")
  c.policy.init = "" if smoke else f"{REPLICATION_RUN}/sft/seed_0"
  c.env.train_seed_offset = 7_000_000  # screens the ORM never saw (its data: the suite's seeds 0-959)
  c.rl.orm_run = ("runs/orm_rep_smoke/orm" if smoke else "runs/orm_rep/orm") if orm else ""
  c.rl.orm_reward_range = (0.0, 1.0)  # the suite's outcome: success 1, failure 0 (rl.outcome = "success")
  return c
