"""Value pretraining: the critic alone, on rollouts of a fixed policy, with Monte-Carlo targets.

UI-TARS-2 report section 2.5.4 ("Value Pretraining"; section 4 observed value estimates negatively
correlated with rewards without it) after VC-PPO (arXiv 2503.01491, section 4.1): before PPO, train
the value model offline on samples of a fixed policy with lambda = 1 (unbiased returns) until its
loss and explained variance are good enough, then start PPO from that critic.

The fixed policy's parameters are not touched here; `experiments/value_pretrain.py` runs the
rollouts, calls `value_update` per batch, stops by `StopRule`, and saves the critic with
`checkpoint.save_tree` for `--config.critic.init=<path>` of the PPO trainer.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tars_jax import sharding
from tars_jax.rl import advantages as adv_lib
from tars_jax.rl.checks import check_finite
from tars_jax.train import ppo
from tars_jax.train.step import ModelInputs


@dataclasses.dataclass(frozen=True)
class StopRule:
  """Stop once `patience` consecutive iterations have, on *fresh* rollouts (before the update on
  them), value loss <= max_value_loss and explained variance >= min_explained_variance.

  Raises: ValueError for patience < 1.
  """

  max_value_loss: float
  min_explained_variance: float
  patience: int = 1

  def __post_init__(self):
    if self.patience < 1:
      raise ValueError(f"patience must be >= 1, got {self.patience}")

  def met(self, value_loss: float, explained_variance: float) -> bool:
    return value_loss <= self.max_value_loss and explained_variance >= self.min_explained_variance

  def streak(self, prev: int, value_loss: float, explained_variance: float) -> int:
    """Consecutive iterations meeting both thresholds, this one included; stop when >= patience."""
    return prev + 1 if self.met(value_loss, explained_variance) else 0


def pretrain_hparams(hp: ppo.PPOHparams, value_clip: float | None = None) -> ppo.PPOHparams:
  """`hp` with lam_critic = 1 (Monte-Carlo returns, VC-PPO), the given value clip (None = off:
  there is no trust region to keep while the policy is fixed) and the critic's vision encoder trained
  (`freeze_vision` off: value pretraining fits the whole critic); no per-task baseline (`task_baseline`
  shapes the policy's advantages, which value pretraining does not use)."""
  return dataclasses.replace(hp, algo="ppo", lam_critic=1.0, value_clip=value_clip, freeze_vision=False,
                             task_baseline=False)


def init_critic_state(critic_params, copt: optax.GradientTransformation) -> dict:
  """{"step", "critic", "critic_opt"}: the state `value_update` transforms, committed (`sharding.committed`)."""
  return sharding.committed({"step": jnp.zeros((), jnp.int32), "critic": critic_params,
                             "critic_opt": copt.init(critic_params)})


@functools.partial(jax.jit, static_argnames=("critic_gd", "copt", "hp", "inputs"), donate_argnames=("state",))
def critic_step(state: dict, mb: dict, *, critic_gd, copt, hp: ppo.PPOHparams, inputs: ModelInputs):
  """One critic-only step on a minibatch (`ppo.critic_update`; needs mb old_values, returns); (state,
  metrics)."""
  new, vm = ppo.critic_update(state, mb, critic_gd, copt, hp, inputs)
  return dict(new, step=state["step"] + 1), vm


def value_update(state: dict, batch: dict[str, np.ndarray], *, critic_gd, copt, hp: ppo.PPOHparams,
                 inputs: ModelInputs, epochs: int, minibatch_size: int, rng: np.random.Generator, n_real: int,
                 minibatch_by_length: bool = False) -> tuple[dict, dict[str, float]]:
  """Critic update on one rollout batch of the fixed policy; returns (state, metrics).

  Metrics: `fresh_value_loss`, `explained_variance`, `value_return_corr` of the critic on this batch
  *before* training on it (the batch is new rollouts, so these are held-out numbers that
  `StopRule` uses), `return_mean`, and the means over minibatch steps of `value_loss`,
  `vf_clipfrac`, `critic_grad_norm`. Use `hp = pretrain_hparams(...)` for lambda = 1. Minibatches as
  `ppo.ppo_update`'s (`ppo.minibatches`; `minibatch_by_length`).
  Raises: NonFiniteError naming NaN/inf positions in rewards or critic values.
  """
  check_finite(rewards=batch["rewards"])
  lengths, images = np.asarray(batch["attn_mask"]).sum(-1), np.asarray(batch["image_mask"]).sum(-1)
  batch = ppo.trim_padding({k: jnp.asarray(v) for k, v in batch.items()}, lengths, images)
  values, _, ret, diag = ppo.prepare(state["critic"], batch, critic_gd=critic_gd, hp=hp, inputs=inputs)
  check_finite(values=values)
  mask = batch["loss_mask"]
  fresh = 0.5 * adv_lib.masked_mean((values - ret) ** 2, mask)
  batch.update(old_values=values, returns=ret)
  # memory: episodes cut into chained rows (`trajectory.collate`); n_real counts episodes, as in ppo_update
  rows = (np.nonzero(np.asarray(batch["row_episode"]) >= 0)[0] if "row_episode" in batch else np.arange(n_real))
  collected = []
  for _ in range(epochs if n_real else 0):
    for _, mb in ppo.minibatches(batch, rows, lengths, images, minibatch_size, rng, minibatch_by_length):
      state, m = critic_step(state, mb, critic_gd=critic_gd, copt=copt, hp=hp, inputs=inputs)
      collected.append(m)
  out = {k: float(np.mean([float(m[k]) for m in collected])) for k in collected[0]} if collected else {}
  out.update(fresh_value_loss=float(fresh), explained_variance=float(diag["explained_variance"]),
             value_return_corr=float(diag["value_return_corr"]), return_mean=float(diag["return_mean"]))
  return state, out
