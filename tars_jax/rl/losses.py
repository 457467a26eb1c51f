"""PPO losses as pure JAX functions over `[B, T]` token arrays (mask = 1 on model-written tokens).

Semantics follow verl `verl/trainer/ppo/core_algos.py` (`compute_policy_loss`, `compute_value_loss`,
`agg_loss`, `kl_penalty`); clip-higher from DAPO (arXiv 2503.14476), dual-clip from Ye et al. 2020.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tars_jax.rl.advantages import masked_mean

_MASKED = -1e9
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate(loss: jax.Array, mask: jax.Array, mode: str = "token-mean") -> jax.Array:
  """Reduces a [B, T] per-token loss to a scalar.

  token-mean: sum / number of masked tokens; seq-mean-token-sum: mean over sequences of per-sequence
  sums; seq-mean-token-mean: mean over sequences of per-sequence means; seq-mean-token-sum-norm:
  sum / (B * T) with T the padded length (Dr.GRPO's constant normaliser).
  Sequences without masked tokens do not count in the seq-mean modes.
  Raises: ValueError for an unknown mode.
  """
  mask = mask.astype(jnp.float32)
  if mode == "token-mean":
    return masked_mean(loss, mask)
  seq_has = (mask.sum(-1) > 0).astype(jnp.float32)
  if mode == "seq-mean-token-sum":
    per_seq = (loss * mask).sum(-1)
  elif mode == "seq-mean-token-mean":
    per_seq = (loss * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1e-8)
  elif mode == "seq-mean-token-sum-norm":
    return (loss * mask).sum() / (loss.shape[0] * loss.shape[-1])
  else:
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGG_MODES}")
  return (per_seq * seq_has).sum() / jnp.maximum(seq_has.sum(), 1.0)


def ppo_policy_loss(logp, old_logp, advantages, mask, clip_low: float = 0.2, clip_high: float = 0.2,
                    clip_c: float | None = None, agg: str = "token-mean"):
  """Clipped PPO surrogate with clip-higher and optional dual-clip.

  Args: logp, old_logp, advantages, mask: [B, T] float32 (log-probs in nats).
    clip_low / clip_high: ratio clipped to [1 - clip_low, 1 + clip_high] (DAPO clip-higher).
    clip_c: dual-clip constant (> 1); bounds the loss of negative-advantage tokens by -c * A.
  Returns: (loss scalar, metrics) with clipfrac, clipfrac_low, clipfrac_high, dual_clipfrac,
    approx_kl (= mean(old_logp - logp), verl `ppo_kl`), ratio_mean.
  """
  mask = mask.astype(jnp.float32)
  log_ratio = jnp.clip(logp - old_logp, -20.0, 20.0)
  ratio = jnp.exp(log_ratio)
  loss1 = -advantages * ratio
  loss2 = -advantages * jnp.clip(ratio, 1 - clip_low, 1 + clip_high)
  clipped = jnp.maximum(loss1, loss2)
  pg = clipped
  dual = jnp.zeros_like(pg)
  if clip_c is not None:
    loss3 = -advantages * clip_c
    dual = ((advantages < 0) & (loss3 < clipped)).astype(jnp.float32)
    pg = jnp.where(advantages < 0, jnp.minimum(loss3, clipped), clipped)
  metrics = {
      "clipfrac": masked_mean((loss2 > loss1).astype(jnp.float32), mask),
      "clipfrac_low": masked_mean(((ratio < 1 - clip_low) & (advantages < 0)).astype(jnp.float32), mask),
      "clipfrac_high": masked_mean(((ratio > 1 + clip_high) & (advantages > 0)).astype(jnp.float32), mask),
      "dual_clipfrac": masked_mean(dual, mask),
      "approx_kl": masked_mean(-log_ratio, mask),
      "ratio_mean": masked_mean(ratio, mask),
  }
  return aggregate(pg, mask, agg), metrics


def value_loss(values, old_values, returns, mask, clip: float | None = None, agg: str = "token-mean"):
  """0.5 * max((V - R)^2, (clip(V, V_old ± clip) - R)^2) (verl `compute_value_loss`).

  Returns (loss scalar, {"vf_clipfrac"}). clip=None disables clipping.
  """
  mask = mask.astype(jnp.float32)
  l1 = (values - returns) ** 2
  if clip is None:
    return 0.5 * aggregate(l1, mask, agg), {"vf_clipfrac": jnp.zeros(())}
  v_clip = old_values + jnp.clip(values - old_values, -clip, clip)
  l2 = (v_clip - returns) ** 2
  return 0.5 * aggregate(jnp.maximum(l1, l2), mask, agg), {
      "vf_clipfrac": masked_mean((l2 > l1).astype(jnp.float32), mask)}


def masked_log_softmax(logits: jax.Array, allowed: jax.Array | None = None, temperature: float = 1.0):
  """log_softmax(logits / temperature) over allowed tokens only ([..., V]).

  Disallowed tokens get a large finite negative logit (probability exactly 0 in float32) rather
  than -inf, so gradients through p * log p stay finite.
  """
  z = logits.astype(jnp.float32) / temperature
  if allowed is not None:
    z = jnp.where(allowed, z, _MASKED)
  return jax.nn.log_softmax(z, axis=-1)


def entropy(logits: jax.Array, mask: jax.Array, allowed: jax.Array | None = None,
            temperature: float = 1.0) -> jax.Array:
  """Per-token entropy [B, T] (nats) of softmax(logits / T) restricted to `allowed` [B, T, V].

  Zero where mask = 0 and where a single token is allowed.
  """
  logp = masked_log_softmax(logits, allowed, temperature)
  p = jnp.exp(logp)
  ent = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)
  return ent * mask


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, kind: str = "k3") -> jax.Array:
  """Per-token KL(π || π_ref) estimate from sampled-token log-probs (Schulman's k1/k2/k3).

  k1 = logp - ref; k2 = 0.5 (logp - ref)^2; k3 = exp(ref - logp) - (ref - logp) - 1 (low variance,
  clamped to [-10, 10] as verl); abs = |logp - ref|.
  Raises: ValueError for an unknown kind.
  """
  d = logp - ref_logp
  if kind == "k1":
    return d
  if kind == "k2":
    return 0.5 * d ** 2
  if kind == "k3":
    kl = jnp.exp(-jnp.clip(d, -20, 20)) + d - 1
    return jnp.clip(kl, -10.0, 10.0)
  if kind == "abs":
    return jnp.abs(d)
  raise ValueError(f"unknown KL kind {kind!r}; expected k1, k2, k3 or abs")
