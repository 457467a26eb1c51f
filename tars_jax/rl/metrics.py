"""Diagnostics of the critic over masked tokens (scalars for logging; jittable and vmappable)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tars_jax.rl.advantages import masked_mean, masked_var


def explained_variance(returns: jax.Array, values: jax.Array, mask: jax.Array) -> jax.Array:
  """1 - Var[returns - values] / Var[returns] over masked tokens; scalar float32.

  returns, values, mask: [B, T]. 1 = perfect critic, 0 = no better than the mean return, < 0 = worse.
  When the returns are constant the denominator is floored at 1e-8 (stays finite, so it is logged);
  with no masked token at all it is 0 (nothing explained), not 1.
  Source: verl `trainer/ppo/metric_utils.py` (`critic/vf_explained_var`).
  """
  returns, values = jnp.asarray(returns, jnp.float32), jnp.asarray(values, jnp.float32)
  ev = 1.0 - masked_var(returns - values, mask) / jnp.maximum(masked_var(returns, mask), 1e-8)
  return jnp.where(jnp.asarray(mask, jnp.float32).sum() > 0, ev, 0.0)


def masked_corr(x: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
  """Pearson correlation of x and y ([B, T]) over masked tokens; scalar float32 (0 if one is constant)."""
  x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
  xm, ym = x - masked_mean(x, mask), y - masked_mean(y, mask)
  cov = masked_mean(xm * ym, mask)
  var = masked_mean(xm ** 2, mask) * masked_mean(ym ** 2, mask)
  return cov * jax.lax.rsqrt(jnp.maximum(var, 1e-16))


# |advantage| (reward units, before whitening) below which a critic-PPO episode counts as carrying
# no signal: 1% of a success reward. A critic is never exact, so 0 (the group baselines' test) would
# count every episode; a critic that has learnt a collapsed policy's returns leaves advantages of
# this size or less.
PPO_INFORMATIVE_EPS = 1e-2


def informative_fraction(advantages: jax.Array, free: jax.Array, eps: float = PPO_INFORMATIVE_EPS
                         ) -> jax.Array:
  """Fraction of episodes whose mean |advantage| over their free decisions exceeds `eps`; scalar float32.

  The critic-PPO analogue of the group baselines' `informative_fraction` (episodes of groups whose
  returns differ): an episode whose decisions all have advantage ~0 moves nothing.
  Args:
    advantages: [B, T] float32, per-token GAE advantages before whitening (whitening shifts them by
      the batch mean, so every episode would look informative).
    free: [B, T] {0, 1} mask of sampled decisions (`losses.decision_mask`); rows without any (padding
      rows) are not episodes and are left out of the fraction.
    eps: threshold in reward units.
  Returns 0 when no row has a free decision.
  """
  adv, free = jnp.asarray(advantages, jnp.float32), jnp.asarray(free, jnp.float32)
  n = free.sum(-1)
  mean_abs = jnp.abs(adv * free).sum(-1) / jnp.maximum(n, 1.0)
  rows = (n > 0).astype(jnp.float32)
  return ((mean_abs > eps) * rows).sum() / jnp.maximum(rows.sum(), 1.0)
