"""Mixture-of-Experts MLP (Qwen3-MoE structure): softmax top-k router, SwiGLU experts,
switch-style load-balance loss (transformers `load_balancing_loss_func`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tars_jax.models.config import ModelConfig


def route(router_logits: jax.Array, top_k: int, norm_topk_prob: bool):
  """Softmax top-k router (transformers `Qwen3VLMoeTextTopKRouter`).

  Args: router_logits [N, E]. Returns (probs [N, E] float32, weights [N, k] float32, indices [N, k]
  int32); with `norm_topk_prob` the k weights are renormalised to sum to 1. Ties pick the lower index.
  """
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  w, idx = jax.lax.top_k(probs, top_k)
  if norm_topk_prob:
    w = w / jnp.sum(w, axis=-1, keepdims=True)
  return probs, w, idx


def load_balance_loss(probs: jax.Array, idx: jax.Array, num_experts: int,
                      mask: jax.Array | None = None) -> jax.Array:
  """Switch-Transformer load-balance loss, E * sum_e f_e * P_e, as transformers
  `load_balancing_loss_func` (Fedus et al. 2021, eqs. 4-6).

  Args:
    probs: [L, N, E] or [N, E] router probabilities of L MoE layers (pooled over layers as
      transformers concatenates them, not averaged per layer).
    idx: [L, N, k] or [N, k] selected experts.
    mask: None or [N] (1 = real token), the same for every layer.
  f_e = (top-k assignments to e) / (tokens), P_e = mean router probability of e, both over masked
  tokens of all layers; sum_e f_e = k. Returns a float32 scalar (1 * k for a perfectly uniform router).
  """
  if probs.ndim == 2:
    probs, idx = probs[None], idx[None]
  m = jnp.ones(probs.shape[1], jnp.float32) if mask is None else mask.astype(jnp.float32)
  rows = jnp.maximum(m.sum() * probs.shape[0], 1.0)
  counts = jnp.einsum("lnke,n->e", jax.nn.one_hot(idx, num_experts, dtype=jnp.float32), m)
  prob_sum = jnp.einsum("lne,n->e", probs.astype(jnp.float32), m)
  return num_experts * jnp.sum((counts / rows) * (prob_sum / rows))


class MoE(nnx.Module):
  """x [B, T, D] -> (y [B, T, D], (probs [B*T, E], indices [B*T, k])) for the aux loss.

  Dense compute over all experts weighted by the (sparse, top-k) routing weights: exact, jittable,
  fine at small scale (dropless `ragged_dot` is the scaling issue's job). Expert weights are stored
  as [E, D, I] / [E, I, D] (transformers' `gate_up_proj` split in two and transposed).
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, i, e = cfg.hidden, cfg.moe_intermediate, cfg.experts
    self.top_k, self.norm_topk_prob, self.experts = cfg.top_k, cfg.norm_topk_prob, e
    self.dtype = cfg.jdtype
    # fan-in = D for gate/up, I for down (the default lecun_normal would take the expert axis).
    init_in = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1,
                                                   batch_axis=(0,))
    self.router = nnx.Linear(d, e, use_bias=False, dtype=jnp.float32, rngs=rngs)
    self.w_gate = nnx.Param(init_in(rngs.params(), (e, d, i)))
    self.w_up = nnx.Param(init_in(rngs.params(), (e, d, i)))
    self.w_down = nnx.Param(init_in(rngs.params(), (e, i, d)))

  def __call__(self, x: jax.Array):
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    probs, w, idx = route(self.router(flat), self.top_k, self.norm_topk_prob)
    dense_w = jnp.sum(jax.nn.one_hot(idx, self.experts, dtype=jnp.float32) * w[..., None], axis=1)  # [N, E]
    dt = self.dtype
    h = (jax.nn.silu(jnp.einsum("nd,edi->nei", flat, self.w_gate[...].astype(dt)))
         * jnp.einsum("nd,edi->nei", flat, self.w_up[...].astype(dt)))
    y = jnp.einsum("nei,eid,ne->nd", h, self.w_down[...].astype(dt), dense_w.astype(dt))
    return y.reshape(b, t, d), (probs, idx)


class DenseMLP(nnx.Module):
  """SwiGLU MLP (transformers `Qwen3VLMoeTextMLP`): x [B, T, D] -> ([B, T, D], None)."""

  def __init__(self, d: int, i: int, rngs: nnx.Rngs, dtype=jnp.float32):
    self.gate_proj = nnx.Linear(d, i, use_bias=False, dtype=dtype, rngs=rngs)
    self.up_proj = nnx.Linear(d, i, use_bias=False, dtype=dtype, rngs=rngs)
    self.down_proj = nnx.Linear(i, d, use_bias=False, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)), None
