"""PPO losses as pure JAX functions over `[B, T]` token arrays (mask = 1 on model-written tokens).

Semantics follow verl `verl/trainer/ppo/core_algos.py` (`compute_policy_loss`, `compute_value_loss`,
`agg_loss`, `kl_penalty`); clip-higher from DAPO (arXiv 2503.14476), dual-clip from Ye et al. 2020
(arXiv 1912.09729). All functions are jittable and vmappable; `mode` / `kind` / `agg` strings and
clip constants are static Python values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tars_jax.rl.advantages import masked_mean

# Logit given to disallowed tokens: exp() underflows to exactly 0 in float32, yet stays finite so
# p * log p and its gradient never meet 0 * inf.
_MASKED = -1e9
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3", "abs")
_KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}  # verl's other names


def decision_mask(mask: jax.Array, num_allowed: jax.Array | None) -> jax.Array:
  """[B, T] float32: `mask` on sampled decisions, 0 on grammar-forced tokens.

  A token is forced when the grammar allowed exactly one token at its position: the sampler had no
  choice, its log-prob is exactly 0 under the constrained distribution, its entropy 0 and its
  policy gradient 0. Counting it would dilute per-token means (entropy, token-mean losses) and the
  length of VAPO's length-adaptive lambda by the share of forced tokens, which depends on the
  reply's grammar, not on the policy.
  Args:
    mask: [B, T] {0, 1} (bool or float), 1 on model-written tokens.
    num_allowed: [B, T] int, the number of tokens the grammar allowed at each position
      (`(table >= 0).sum(-1)[states]`), or None (unconstrained sampling: every token is a decision).
  """
  mask = jnp.asarray(mask, jnp.float32)
  if num_allowed is None:
    return mask
  return mask * (jnp.asarray(num_allowed) > 1).astype(jnp.float32)


def aggregate(loss: jax.Array, mask: jax.Array, mode: str = "token-mean") -> jax.Array:
  """Reduces a per-token loss [B, T] to a scalar float32, as verl `agg_loss`.

  token-mean:              sum(loss * mask) / sum(mask)                       (0 if no token)
  seq-mean-token-sum:      mean over the B sequences of sum_t(loss * mask)
  seq-mean-token-mean:     mean over the B sequences of sum_t(loss * mask) / sum_t(mask)
  seq-mean-token-sum-norm: sum(loss * mask) / T, with T = loss.shape[-1] the padded (max) length
                           as verl's constant normaliser (Dr.GRPO, arXiv 2503.20783; keep T fixed
                           across steps to keep the scale fixed). Note: not divided by B.
  Sequences with no masked token count as sequences of loss 0 in the seq-mean modes (verl divides
  by B too; where verl's seq-mean-token-mean gives NaN for them, this gives 0, as tunix).
  Pass `decision_mask(...)` as the mask under a grammar: the number of tokens that normalises
  (token-mean, seq-mean-token-mean) then counts only sampled decisions, not forced tokens.
  Raises: ValueError for an unknown mode.
  """
  loss = jnp.asarray(loss, jnp.float32)
  mask = jnp.broadcast_to(jnp.asarray(mask, jnp.float32), loss.shape)
  if mode == "token-mean":
    return masked_mean(loss, mask)
  if mode not in AGG_MODES:
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGG_MODES}")
  seq_sum = (loss * mask).sum(-1)
  if mode == "seq-mean-token-sum":
    return seq_sum.mean()
  if mode == "seq-mean-token-mean":
    return (seq_sum / jnp.maximum(mask.sum(-1), 1.0)).mean()
  return seq_sum.sum() / loss.shape[-1]  # seq-mean-token-sum-norm


def ppo_policy_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array,
                    clip_low: float = 0.2, clip_high: float = 0.2, clip_c: float | None = None,
                    agg: str = "token-mean") -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped PPO surrogate with clip-higher and optional dual-clip.

  Per token, with r = exp(clip(logp - old_logp, -20, 20)):
    loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))          (clip-higher, DAPO)
    and, if clip_c is given, for A < 0 only: loss = min(loss, -A clip_c)  (dual-clip)
  then `aggregate(loss, mask, agg)`.

  Args:
    logp, old_logp: [B, T] float32 log-probs (nats) of the sampled tokens under the current policy
      and the policy that sampled them. advantages, mask: [B, T].
    clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
    clip_c: dual-clip constant, > 1 (verl default 3.0); None disables dual-clip.
      The three clip constants may be Python floats or traced scalars (e.g. swept under vmap).
    agg: an `aggregate` mode.
  Returns:
    (loss scalar float32, metrics dict of scalar float32 over masked tokens):
      clipfrac: fraction of tokens where the clipped term is the max (= clipfrac_low + clipfrac_high);
      clipfrac_low: A < 0 and r < 1 - clip_low; clipfrac_high: A > 0 and r > 1 + clip_high;
      dual_clipfrac: A < 0 and the dual-clip bound is active (verl `pg_clipfrac_lower`);
      approx_kl: k1 estimate mean(old_logp - logp) of KL(old || new) (= verl `ppo_kl`);
      approx_kl_k3: k3 estimate mean((r - 1) - log r) of the same KL (>= 0 per token, low variance);
      ratio_mean: mean r.
  Raises: ValueError if clip_c is a Python number <= 1.
  Source: verl `core_algos.compute_policy_loss`.
  """
  if isinstance(clip_c, (int, float)) and clip_c <= 1.0:  # traced constants are not checked
    raise ValueError(f"dual-clip constant clip_c must be > 1, got {clip_c}")
  logp, old_logp, advantages = (jnp.asarray(a, jnp.float32) for a in (logp, old_logp, advantages))
  mask = jnp.asarray(mask, jnp.float32)
  log_ratio = jnp.clip(logp - old_logp, -20.0, 20.0)
  ratio = jnp.exp(log_ratio)
  loss1 = -advantages * ratio
  loss2 = -advantages * jnp.clip(ratio, 1 - clip_low, 1 + clip_high)
  clipped = jnp.maximum(loss1, loss2)
  pg, dual = clipped, jnp.zeros_like(clipped)
  if clip_c is not None:
    loss3 = -advantages * clip_c
    neg = advantages < 0
    dual = (neg & (clipped > loss3)).astype(jnp.float32)
    pg = jnp.where(neg, jnp.minimum(loss3, clipped), clipped)
  f32 = lambda b: b.astype(jnp.float32)
  metrics = {
      "clipfrac": masked_mean(f32(loss2 > loss1), mask),
      "clipfrac_low": masked_mean(f32((ratio < 1 - clip_low) & (advantages < 0)), mask),
      "clipfrac_high": masked_mean(f32((ratio > 1 + clip_high) & (advantages > 0)), mask),
      "dual_clipfrac": masked_mean(dual, mask),
      "approx_kl": masked_mean(-log_ratio, mask),
      "approx_kl_k3": masked_mean(ratio - 1 - log_ratio, mask),
      "ratio_mean": masked_mean(ratio, mask),
  }
  return aggregate(pg, mask, agg), metrics


def decoupled_ppo_policy_loss(logp: jax.Array, prox_logp: jax.Array, behav_logp: jax.Array,
                              advantages: jax.Array, mask: jax.Array, clip_low: float = 0.2,
                              clip_high: float = 0.2, clip_c: float | None = None, agg: str = "token-mean",
                              max_weight: float | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Decoupled PPO objective for stale (off-policy) tokens: the trust region is centred on the
  proximal policy (the policy before this update), and the behaviour policy that sampled the token
  enters only through the importance weight w = pi_prox / pi_behav (no gradient):

    loss = max(-A w r, -A w clip(r, 1 - clip_low, 1 + clip_high)),  r = pi_theta / pi_prox

  i.e. `ppo_policy_loss(logp, prox_logp, w * A, ...)` (w > 0). With pi_prox = pi_behav (on-policy
  tokens) this is the standard clipped objective. `max_weight`: tokens whose w exceeds it (sampled by
  a behaviour policy far from the proximal one) are left out of the loss, as AReaL's
  `behav_imp_weight_cap` filters them; None keeps every token.

  Args:
    logp, prox_logp, behav_logp: [B, T] float32 log-probs (nats) of the sampled tokens under the
      current, proximal and behaviour policies; advantages, mask: [B, T]; the rest as `ppo_policy_loss`.
  Returns: (loss, metrics of `ppo_policy_loss` over the kept tokens, plus behaviour_weight_mean over
    `mask` and behaviour_weight_filtered, the fraction of `mask`'s tokens left out by max_weight).
  Source: Hilton, Cobbe & Schulman 2022, "Batch size-invariance for policy optimization" (arXiv
  2110.00641), eq. 2; AReaL (Fu et al. 2025, arXiv 2505.24298) eq. 5 for asynchronous rollouts, and
  its `behav_imp_weight_cap` (inclusionAI/AReaL, `areal/utils/functional.py`).
  """
  w = jax.lax.stop_gradient(jnp.exp(jnp.clip(jnp.asarray(prox_logp, jnp.float32)
                                             - jnp.asarray(behav_logp, jnp.float32), -20.0, 20.0)))
  mask = jnp.asarray(mask, jnp.float32)
  kept = mask if max_weight is None else mask * (w <= max_weight)
  loss, m = ppo_policy_loss(logp, prox_logp, w * jnp.asarray(advantages, jnp.float32), kept, clip_low,
                            clip_high, clip_c, agg)
  filtered = jnp.sum(mask - kept) / jnp.maximum(jnp.sum(mask), 1.0)
  return loss, dict(m, behaviour_weight_mean=masked_mean(w, mask), behaviour_weight_filtered=filtered)


def value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array, mask: jax.Array,
               clip: float | None = None, agg: str = "token-mean"
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped value loss 0.5 * aggregate(max((V - R)^2, (V_clip - R)^2)).

  Args:
    values: [B, T] float32 current critic predictions V; old_values: [B, T] the critic's values at
      rollout time; returns: [B, T] targets R; mask: [B, T].
    clip: V_clip = old_values + clip(V - old_values, -clip, clip); None disables clipping.
    agg: an `aggregate` mode.
  Returns:
    (loss scalar float32, {"vf_clipfrac": fraction of masked tokens where the clipped error is larger
    (0 without clipping)}).
  Source: verl `core_algos.compute_value_loss`.
  """
  values, old_values, returns = (jnp.asarray(a, jnp.float32) for a in (values, old_values, returns))
  mask = jnp.asarray(mask, jnp.float32)
  l1 = (values - returns) ** 2
  if clip is None:
    return 0.5 * aggregate(l1, mask, agg), {"vf_clipfrac": jnp.zeros((), jnp.float32)}
  v_clip = old_values + jnp.clip(values - old_values, -clip, clip)
  l2 = (v_clip - returns) ** 2
  return 0.5 * aggregate(jnp.maximum(l1, l2), mask, agg), {
      "vf_clipfrac": masked_mean((l2 > l1).astype(jnp.float32), mask)}


def masked_log_softmax(logits: jax.Array, allowed: jax.Array | None = None,
                       temperature: float = 1.0) -> jax.Array:
  """log_softmax(logits / temperature) over the allowed tokens only; [..., V] float32.

  Args:
    logits: [..., V]; may already hold -inf for excluded tokens.
    allowed: None or [..., V] bool (e.g. grammar table row >= 0).
  Disallowed and -inf tokens get the finite logit -1e9 (probability exactly 0 in float32, log-prob
  about -1e9) so gradients stay finite. A row with no allowed token becomes uniform over V (callers
  mask such rows out).
  """
  z = jnp.asarray(logits, jnp.float32) / temperature
  keep = z > _MASKED  # False for -inf (and NaN)
  if allowed is not None:
    keep = keep & allowed
  return jax.nn.log_softmax(jnp.where(keep, z, _MASKED), axis=-1)


def entropy(logits: jax.Array, mask: jax.Array, allowed_mask: jax.Array | None = None,
            temperature: float = 1.0) -> jax.Array:
  """Per-token entropy (nats) of softmax(logits / temperature) restricted to allowed tokens.

  Args:
    logits: [B, T, V]; mask: [B, T]; allowed_mask: None or [B, T, V] bool, the grammar-constrained
      support (the distribution the sampler drew from).
  Returns:
    [B, T] float32, zeroed where mask = 0; exactly 0 where a single token is allowed; finite
    (with finite gradients) with -inf logits. Mean over tokens: `aggregate(entropy(...), mask, mode)`.
  Source: verl `verl/utils/torch_functional.py:entropy_from_logits`, plus the allowed-token mask.
  """
  logp = masked_log_softmax(logits, allowed_mask, temperature)
  p = jnp.exp(logp)
  ent = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)
  return ent * jnp.asarray(mask, jnp.float32)


def top_entropy_mask(ent: jax.Array, mask: jax.Array, frac: float) -> jax.Array:
  """[B, T] float32: `mask` kept only on the tokens whose entropy is at or above the (1 - frac)
  quantile (linear interpolation) of `ent` over the tokens of `mask`, i.e. the highest-entropy `frac`
  of them ("forking" tokens); frac >= 1 returns `mask`. An empty mask gives an empty result.

  ent: [B, T] float32 per-token entropy (nats; `entropy`), treated as a constant; mask: [B, T] 0/1.
  Source: Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective
  Reinforcement Learning for LLM Reasoning" (arXiv 2506.01939): the policy gradient on the top 20 %.
  """
  mask = jnp.asarray(mask, jnp.float32)
  if frac >= 1.0:
    return mask
  ent = jax.lax.stop_gradient(jnp.asarray(ent, jnp.float32))
  thr = jnp.nanquantile(jnp.where(mask > 0, ent, jnp.nan), 1.0 - frac)  # NaN when the mask is empty
  return mask * (ent >= thr)


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, kind: str = "k3") -> jax.Array:
  """Per-token estimate of KL(π || π_ref) from the sampled tokens' log-probs (same shape, float32).

  With d = logp - ref_logp:  k1 = d;  k2 = 0.5 d^2;  abs = |d|;
  k3 (low-variance, unbiased, >= 0) = exp(-d') + d' - 1 with d' = clip(d, -20, 20), clamped to
  [-10, 10], as verl. verl's names `kl`, `mse`, `low_var_kl` are accepted for k1, k2, k3.
  Raises: ValueError for an unknown kind.
  Source: J. Schulman, "Approximating KL divergence" (2020); verl `core_algos.kl_penalty`.
  """
  kind = _KL_ALIASES.get(kind, kind)
  d = jnp.asarray(logp, jnp.float32) - jnp.asarray(ref_logp, jnp.float32)
  if kind == "k1":
    return d
  if kind == "k2":
    return 0.5 * d ** 2
  if kind == "k3":
    d = jnp.clip(d, -20.0, 20.0)
    return jnp.clip(jnp.exp(-d) + d - 1.0, -10.0, 10.0)
  if kind == "abs":
    return jnp.abs(d)
  raise ValueError(f"unknown KL kind {kind!r}; expected one of {KL_KINDS}")
