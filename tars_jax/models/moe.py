"""Mixture-of-Experts MLP (Qwen3-MoE structure): softmax top-k router, SwiGLU experts,
switch-style load-balance loss (transformers `load_balancing_loss_func`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tars_jax.models.config import ModelConfig


def route(router_logits: jax.Array, top_k: int, norm_topk_prob: bool):
  """Softmax router. Returns (probs [N, E], topk weights [N, k], topk indices [N, k])."""
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  w, idx = jax.lax.top_k(probs, top_k)
  if norm_topk_prob:
    w = w / jnp.sum(w, axis=-1, keepdims=True)
  return probs, w, idx


def load_balance_loss(probs: jax.Array, idx: jax.Array, num_experts: int, mask: jax.Array | None = None):
  """E * sum_e f_e * P_e over (masked) tokens: f_e = share of top-k assignments routed to expert e
  (per top-k slot, as transformers), P_e = mean router probability. probs [N, E], idx [N, k], mask [N]."""
  onehot = jax.nn.one_hot(idx, num_experts)  # [N, k, E]
  m = jnp.ones(probs.shape[:1]) if mask is None else mask.astype(jnp.float32)
  denom = jnp.maximum(m.sum(), 1.0)
  tokens_per_expert = jnp.einsum("nke,n->ke", onehot, m) / denom
  prob_per_expert = jnp.einsum("ne,n->e", probs, m) / denom
  return num_experts * jnp.sum(tokens_per_expert * prob_per_expert[None])


class MoE(nnx.Module):
  """x [B, T, D] -> (y [B, T, D], aux loss). Dense compute over all experts weighted by the
  (sparse) routing weights: exact, jittable, fine at small scale (dropless grouped matmul is the
  scaling issue's job)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, i, e = cfg.hidden, cfg.moe_intermediate, cfg.experts
    self.cfg = cfg
    init = nnx.initializers.lecun_normal()
    self.router = nnx.Linear(d, e, use_bias=False, rngs=rngs)
    self.w_gate = nnx.Param(init(rngs.params(), (e, d, i)))
    self.w_up = nnx.Param(init(rngs.params(), (e, d, i)))
    self.w_down = nnx.Param(init(rngs.params(), (e, i, d)))

  def __call__(self, x: jax.Array, mask: jax.Array | None = None):
    b, t, d = x.shape
    cfg = self.cfg
    flat = x.reshape(b * t, d)
    probs, w, idx = route(self.router(flat), cfg.top_k, cfg.norm_topk_prob)
    dense_w = jnp.zeros((b * t, cfg.experts), flat.dtype).at[jnp.arange(b * t)[:, None], idx].add(w.astype(flat.dtype))
    h = jax.nn.silu(jnp.einsum("nd,edi->nei", flat, self.w_gate[...])) * jnp.einsum("nd,edi->nei", flat, self.w_up[...])
    y = jnp.einsum("nei,eid,ne->nd", h, self.w_down[...], dense_w)
    aux = load_balance_loss(probs, idx, cfg.experts, None if mask is None else mask.reshape(-1))
    return y.reshape(b, t, d), aux


class DenseMLP(nnx.Module):
  def __init__(self, d: int, i: int, rngs: nnx.Rngs):
    self.gate = nnx.Linear(d, i, use_bias=False, rngs=rngs)
    self.up = nnx.Linear(d, i, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(i, d, use_bias=False, rngs=rngs)

  def __call__(self, x, mask=None):
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x)), jnp.zeros((), jnp.float32)
