"""Advantage estimators as pure JAX functions over `[B, T]` token arrays.

`mask` is 1 on model-written tokens and 0 on observation / prompt / padding tokens. Token-level GAE
skips masked tokens: on them the running advantage and the next value carry across unchanged, so a
multi-turn trajectory is one MDP over the model's tokens (verl `compute_gae_advantage_return` with a
response mask; tunix `compute_gae_advantages`). UI-TARS-2 report section 2.5.4.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_mean(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
  """Mean of x over entries where mask = 1 (0 if there are none)."""
  return (x * mask).sum(axis) / jnp.maximum(mask.sum(axis), 1e-8)


def masked_var(x: jax.Array, mask: jax.Array, unbiased: bool = True) -> jax.Array:
  """Variance over masked entries; Bessel-corrected like verl `masked_var`."""
  mean = masked_mean(x, mask)
  var = masked_mean((x - mean) ** 2, mask)
  if unbiased:
    n = mask.sum()
    var = var * n / jnp.maximum(n - 1, 1)
  return var


def masked_whiten(x: jax.Array, mask: jax.Array, shift_mean: bool = True) -> jax.Array:
  """(x - mean) / std over masked entries (verl `masked_whiten`); mean added back if not shift_mean."""
  mean, var = masked_mean(x, mask), masked_var(x, mask)
  w = (x - mean) * jax.lax.rsqrt(var + 1e-8)
  return w if shift_mean else w + mean


def _per_row(v, b):
  return jnp.broadcast_to(jnp.asarray(v, jnp.float32), (b,))


def gae(rewards: jax.Array, values: jax.Array, mask: jax.Array, gamma, lam
        ) -> tuple[jax.Array, jax.Array]:
  """Token-level GAE that skips masked tokens (a reverse `lax.scan` over time).

  Args:
    rewards, values, mask: [B, T] float32. values[t] = V(state before token t).
    gamma, lam: scalars or per-sequence [B] arrays.
  Returns:
    (advantages, returns) [B, T] float32; returns = advantages + values. At masked positions both
    hold the carried quantities (as verl); callers multiply by the mask.
  Source: GAE (Schulman et al. 2016) eq. 16; masking as verl `core_algos.compute_gae_advantage_return`.
  """
  rewards, values, mask = (jnp.asarray(a, jnp.float32) for a in (rewards, values, mask))
  b = rewards.shape[0]
  gamma, lam = _per_row(gamma, b), _per_row(lam, b)

  def step(carry, xs):
    next_value, last_gae = carry
    r, v, m = xs
    delta = r + gamma * next_value - v
    gae_t = delta + gamma * lam * last_gae
    next_value = v * m + (1 - m) * next_value
    last_gae = gae_t * m + (1 - m) * last_gae
    return (next_value, last_gae), last_gae

  init = (jnp.zeros((b,), jnp.float32), jnp.zeros((b,), jnp.float32))
  _, adv = jax.lax.scan(step, init, (rewards.T, values.T, mask.T), reverse=True)
  adv = adv.T
  return adv, adv + values


def length_adaptive_lambda(lengths: jax.Array, alpha: float) -> jax.Array:
  """VAPO length-adaptive λ = 1 - 1/(alpha * lengths), clipped to [0, 1] (arXiv 2504.05118 eq. 7).

  lengths: [B] number of model-written tokens per sequence.
  """
  lengths = jnp.asarray(lengths, jnp.float32)
  return jnp.clip(1.0 - 1.0 / jnp.maximum(alpha * lengths, 1e-8), 0.0, 1.0)


def decoupled_gae(rewards, values, mask, gamma, lam_policy, lam_critic) -> tuple[jax.Array, jax.Array]:
  """Decoupled GAE (VC-PPO, arXiv 2503.01491): advantages with lam_policy, returns with lam_critic."""
  adv, _ = gae(rewards, values, mask, gamma, lam_policy)
  _, ret = gae(rewards, values, mask, gamma, lam_critic)
  return adv, ret


def _group_stats(scores, group_ids, num_groups):
  ones = jnp.ones_like(scores)
  cnt = jax.ops.segment_sum(ones, group_ids, num_groups)
  s = jax.ops.segment_sum(scores, group_ids, num_groups)
  mean = s / jnp.maximum(cnt, 1)
  sq = jax.ops.segment_sum((scores - mean[group_ids]) ** 2, group_ids, num_groups)
  std = jnp.sqrt(sq / jnp.maximum(cnt - 1, 1))  # unbiased, as torch.std in verl
  return cnt, s, mean, std


def grpo_advantages(scores: jax.Array, group_ids: jax.Array, eps: float = 1e-6,
                    normalize_std: bool = True) -> jax.Array:
  """GRPO outcome advantages [B]: (score - group mean) / (group std + eps).

  normalize_std=False is Dr.GRPO (arXiv 2503.20783). group_ids: [B] int32 in [0, B).
  Source: verl `compute_grpo_outcome_advantage`.
  """
  scores = jnp.asarray(scores, jnp.float32)
  _, _, mean, std = _group_stats(scores, group_ids, scores.shape[0])
  a = scores - mean[group_ids]
  return a / (std[group_ids] + eps) if normalize_std else a


def rloo_advantages(scores: jax.Array, group_ids: jax.Array) -> jax.Array:
  """RLOO advantages [B]: score minus the mean of the other members of its group (0 if alone)."""
  scores = jnp.asarray(scores, jnp.float32)
  cnt, s, _, _ = _group_stats(scores, group_ids, scores.shape[0])
  n = cnt[group_ids]
  loo = (s[group_ids] - scores) / jnp.maximum(n - 1, 1)
  return jnp.where(n > 1, scores - loo, 0.0)
