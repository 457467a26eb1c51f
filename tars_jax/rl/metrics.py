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
