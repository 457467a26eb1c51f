r"""Value pretraining (report section 2.5.4): the critic alone on rollouts of a fixed policy, lambda = 1.

  python -m experiments.value_pretrain --config experiments/configs/value_pretrain.py --workdir runs/vpt
  python -m experiments.value_pretrain --config experiments/configs/value_pretrain.py:smoke --workdir /tmp/vpt
  python -m experiments.train --config experiments/configs/miniwob_ablations.py:ppo \
      --config.critic.init=runs/vpt/critic --workdir runs/ppo_vpt

Arg: "" = the multi-step ablation tasks and model of `miniwob_ablations.py` (variant "ppo_vpt";
the PPO run must use the same model config and seed); "smoke" = the smoke config of `miniwob_ppo.py`;
any other arg is passed to `miniwob_ablations.get_config` (e.g. "ppo_vpt+smoke").
The `vpt` section: see `add_vpt`.
"""

import ml_collections as mlc


def add_vpt(c: mlc.ConfigDict, smoke: bool = False) -> mlc.ConfigDict:
  """Adds the `vpt` section (value-pretraining stage) to a training config `c` in place."""
  c.vpt = mlc.ConfigDict()
  c.vpt.enabled = False  # experiments/sweep.py runs value pretraining before PPO when True
  c.vpt.policy_run = ""  # run dir whose latest checkpoint is the fixed policy; "" = initial policy
  c.vpt.max_iterations = 2 if smoke else 30
  c.vpt.max_minutes = 5.0 if smoke else 20.0
  # Stop when `patience` consecutive fresh batches have value loss <= .. and explained var >= ..
  c.vpt.stop_value_loss = 0.02
  c.vpt.stop_explained_variance = 0.6
  c.vpt.patience = 2
  c.vpt.lr = 1e-3  # critic learning rate of this stage (rl.critic_lr is the PPO stage's)
  c.vpt.epochs = 1 if smoke else 2
  c.vpt.minibatch_size = 4 if smoke else 8
  c.vpt.value_clip = 0.0  # <= 0: no value clipping (the policy is fixed, no trust region needed)
  c.vpt.seed_offset = 5_000_000  # rollout seeds apart from training and evaluation seeds
  return c


def get_config(arg: str | None = None) -> mlc.ConfigDict:
  arg = arg or ""
  if arg == "smoke":
    from experiments.configs import miniwob_ppo
    return add_vpt(miniwob_ppo.get_config("smoke"), smoke=True)
  from experiments.configs import miniwob_ablations
  return miniwob_ablations.get_config(arg or "ppo_vpt")
