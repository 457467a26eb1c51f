"""MoE decoder (Qwen3-MoE structure): RMSNorm, GQA attention with qk-norm and interleaved M-RoPE,
MoE (or dense) SwiGLU MLPs, with an explicit KV cache pytree for prefill/decode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tars_jax.models.config import ModelConfig
from tars_jax.models.moe import DenseMLP, MoE
from tars_jax.models.rope import rotate

_NEG = -1e9  # finite mask value: fully masked (padding) query rows stay NaN-free


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, h, kv, hd = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim
    self.h, self.kv, self.hd = h, kv, hd
    self.q_proj = nnx.Linear(d, h * hd, use_bias=False, rngs=rngs)
    self.k_proj = nnx.Linear(d, kv * hd, use_bias=False, rngs=rngs)
    self.v_proj = nnx.Linear(d, kv * hd, use_bias=False, rngs=rngs)
    self.o_proj = nnx.Linear(h * hd, d, use_bias=False, rngs=rngs)
    self.q_norm = nnx.RMSNorm(hd, epsilon=cfg.rms_eps, rngs=rngs)
    self.k_norm = nnx.RMSNorm(hd, epsilon=cfg.rms_eps, rngs=rngs)

  def __call__(self, x, cos, sin, key_mask, cache=None, write_index=0):
    """x [B, L, D]; cos/sin [B, L, hd]; key_mask [B, S] bool over key slots (S = L without cache).

    With `cache = {"k", "v"}` ([B, S, KV, hd]) the new keys/values are written at slots
    write_index .. write_index + L - 1 and the queries attend causally over all cache slots.
    Returns (y [B, L, D], new cache or None).
    """
    b, l, _ = x.shape
    q = self.q_norm(self.q_proj(x).reshape(b, l, self.h, self.hd))
    k = self.k_norm(self.k_proj(x).reshape(b, l, self.kv, self.hd))
    v = self.v_proj(x).reshape(b, l, self.kv, self.hd)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    if cache is not None:
      k = jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), (0, write_index, 0, 0))
      v = jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), (0, write_index, 0, 0))
      cache = {"k": k, "v": v}
    s = k.shape[1]
    q_slot = write_index + jnp.arange(l)
    allowed = (jnp.arange(s)[None, :] <= q_slot[:, None])[None] & key_mask[:, None, :]  # [B, L, S]
    g = self.h // self.kv
    qg = q.reshape(b, l, self.kv, g, self.hd)
    att = jnp.einsum("blkgd,bskd->bkgls", qg, k) / jnp.sqrt(jnp.float32(self.hd))
    att = jnp.where(allowed[:, None, None], att.astype(jnp.float32), _NEG)
    p = jax.nn.softmax(att, axis=-1).astype(v.dtype)
    o = jnp.einsum("bkgls,bskd->blkgd", p, v).reshape(b, l, self.h * self.hd)
    return self.o_proj(o), cache


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: ModelConfig, layer_idx: int, rngs: nnx.Rngs):
    self.attn_norm = nnx.RMSNorm(cfg.hidden, epsilon=cfg.rms_eps, rngs=rngs)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = nnx.RMSNorm(cfg.hidden, epsilon=cfg.rms_eps, rngs=rngs)
    sparse = cfg.experts > 0 and (layer_idx + 1) % cfg.decoder_sparse_step == 0
    self.mlp = MoE(cfg, rngs) if sparse else DenseMLP(cfg.hidden, cfg.dense_intermediate, rngs)

  def __call__(self, x, cos, sin, key_mask, token_mask, cache=None, write_index=0):
    a, cache = self.attn(self.attn_norm(x), cos, sin, key_mask, cache, write_index)
    x = x + a
    m, aux = self.mlp(self.mlp_norm(x), token_mask)
    return x + m, aux, cache
