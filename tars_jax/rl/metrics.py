"""Diagnostics of the critic over masked tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tars_jax.rl.advantages import masked_mean, masked_var


def explained_variance(returns: jax.Array, values: jax.Array, mask: jax.Array) -> jax.Array:
  """1 - Var[returns - values] / Var[returns] over masked tokens (1 = perfect critic, 0 = constant)."""
  return 1.0 - masked_var(returns - values, mask) / jnp.maximum(masked_var(returns, mask), 1e-8)


def masked_corr(x: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
  """Pearson correlation of x and y over masked tokens."""
  xm, ym = x - masked_mean(x, mask), y - masked_mean(y, mask)
  cov = masked_mean(xm * ym, mask)
  return cov * jax.lax.rsqrt(jnp.maximum(masked_mean(xm ** 2, mask) * masked_mean(ym ** 2, mask), 1e-16))
