r"""Value pretraining (report section 2.5.4): the critic alone on rollouts of a fixed policy, lambda = 1.

  python -m experiments.value_pretrain --config experiments/configs/value_pretrain.py --workdir runs/vpt
  python -m experiments.value_pretrain --config experiments/configs/value_pretrain.py:smoke --workdir /tmp/vpt
  python -m experiments.train --config experiments/configs/miniwob_ablations.py:ppo \
      --config.critic.init=runs/vpt/critic --workdir runs/ppo_vpt

Args (`ARGS`): "" = the multi-step ablation tasks and model of `miniwob_ablations.py` (variant "ppo_vpt";
the PPO run must use the same model config and seed); "smoke" = the smoke config of `miniwob_ppo.py`;
any other arg is passed to `miniwob_ablations.get_config` (e.g. "ppo_vpt+smoke").
The `vpt` section (`miniwob_ppo.vpt_section`) is part of every training config.
"""

import ml_collections as mlc

from experiments.configs import miniwob_ablations, miniwob_ppo

ARGS = ("smoke", *miniwob_ablations.ARGS)  # miniwob_ablations.ARGS includes "" (= "ppo_vpt" here)


def get_config(arg: str | None = None) -> mlc.ConfigDict:
  arg = arg or ""
  if arg == "smoke":
    return miniwob_ppo.get_config("smoke")
  return miniwob_ablations.get_config(arg or "ppo_vpt")
