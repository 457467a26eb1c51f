"""MoE decoder (Qwen3-VL-MoE text model structure): RMSNorm, GQA attention with qk-norm and
interleaved M-RoPE, MoE (or dense) SwiGLU MLPs, final norm; with an explicit KV-cache pytree for
prefill/decode (transformers `Qwen3VLMoeTextModel`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tars_jax.models.attention import attend, attend_causal_blocks
from tars_jax.models.config import ModelConfig
from tars_jax.models.moe import DenseMLP, MoE, MoeStrategy, build_strategy
from tars_jax.models.rope import mrope_cos_sin, rotate
from tars_jax.sharding import constrain, param_axes as ax

HIDDEN = ("act_batch", "act_length", "act_embed")  # logical axes of the residual stream [B, L, D]


class KVCache(NamedTuple):
  """Explicit KV cache (a pytree, static shapes).

  k, v: one [B, KV, S, head_dim] array per layer (activation dtype; head-major, the layout the
  attention matmuls read without a transpose), or with `cfg.scan_layers` one stacked
  [layers, B, KV, S, head_dim] array each; mask: [B, S] bool, True on slots holding a real
  (non-padding) token that later queries may attend to.
  """
  k: tuple
  v: tuple
  mask: jax.Array


def init_cache(cfg: ModelConfig, batch: int, length: int) -> KVCache:
  """Empty cache of `length` slots: zeros, mask all False (stacked k / v under `cfg.scan_layers`)."""
  shape = (batch, cfg.kv_heads, length, cfg.head_dim)
  if cfg.scan_layers:
    z = jnp.zeros((cfg.layers,) + shape, cfg.jdtype)
    return KVCache(z, z, jnp.zeros((batch, length), bool))
  z = tuple(jnp.zeros(shape, cfg.jdtype) for _ in range(cfg.layers))
  return KVCache(z, z, jnp.zeros((batch, length), bool))


def write_slots(buf: jax.Array, new: jax.Array, index, axis: int = 1) -> jax.Array:
  """Writes new [B, ..., L, ...] into buf [B, ..., S, ...] at slots index .. index + L - 1 along `axis`
  (>= 1; the mask [B, S] uses 1, the head-major cache [B, KV, S, hd] uses 2).

  `index`: int32 scalar (all rows) or [B] (per row). Like `lax.dynamic_update_slice`, a start that
  would overrun S is clamped, so callers size buffers to fit.
  """
  new = new.astype(buf.dtype)
  start = lambda i: tuple(i if a == axis else 0 for a in range(buf.ndim))
  if jnp.ndim(index) == 0:
    return jax.lax.dynamic_update_slice(buf, new, start(index))
  return jax.vmap(lambda b_, n_, i: jax.lax.dynamic_update_slice(b_, n_, start(i)[1:]))(buf, new, index)


class Attention(nnx.Module):
  """GQA self-attention with RMS qk-norm (per head, before rotary), as `Qwen3VLMoeTextAttention`;
  for qwen2_5_vl with q/k/v biases and no qk-norm (`Qwen2_5_VLAttention`)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, h, kv, hd, dt = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.jdtype
    self.h, self.kv, self.hd, self.impl, self.block = h, kv, hd, cfg.attention_impl, cfg.attention_block
    qwen2 = cfg.family == "qwen2_5_vl"  # Qwen2 attention: q/k/v biases, no qk-norm
    self.q_proj = nnx.Linear(d, h * hd, use_bias=qwen2, dtype=dt, rngs=rngs,
                             kernel_metadata=ax("embed", "heads"), bias_metadata=ax("heads"))
    self.k_proj = nnx.Linear(d, kv * hd, use_bias=qwen2, dtype=dt, rngs=rngs,
                             kernel_metadata=ax("embed", "kv_heads"), bias_metadata=ax("kv_heads"))
    self.v_proj = nnx.Linear(d, kv * hd, use_bias=qwen2, dtype=dt, rngs=rngs,
                             kernel_metadata=ax("embed", "kv_heads"), bias_metadata=ax("kv_heads"))
    self.o_proj = nnx.Linear(h * hd, d, use_bias=False, dtype=dt, rngs=rngs, kernel_metadata=ax("heads", "embed"))
    self.qk_norm = not qwen2
    if self.qk_norm:
      self.q_norm = nnx.RMSNorm(hd, epsilon=cfg.rms_eps, dtype=dt, rngs=rngs, scale_metadata=ax("norm"))
      self.k_norm = nnx.RMSNorm(hd, epsilon=cfg.rms_eps, dtype=dt, rngs=rngs, scale_metadata=ax("norm"))

  def __call__(self, x, cos, sin, key_mask, kv=None, write_index=0):
    """x [B, L, D]; cos/sin [B, L, hd]; key_mask [B, S] bool over key slots.

    Without `kv` the keys are these L tokens (S = L, query j at slot j). With `kv = (k, v)`
    ([B, KV, S, hd]) the new keys/values are written at slots write_index .. write_index + L - 1
    and query j (slot write_index + j) attends to slots <= its own. `write_index` is an int32
    scalar, or [B] for a per-row cursor (jump-forward decoding writes chunks of different valid
    lengths per row). Returns (y [B, L, D], (k, v) | None).
    """
    b, l, _ = x.shape
    q = self.q_proj(x).reshape(b, l, self.h, self.hd)
    k = self.k_proj(x).reshape(b, l, self.kv, self.hd)
    if self.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    v = self.v_proj(x).reshape(b, l, self.kv, self.hd)
    q, k = rotate(q, cos, sin).astype(x.dtype), rotate(k, cos, sin).astype(x.dtype)
    # Keys / values head-major [B, KV, S, hd]: a [B, S, KV, hd] cache made XLA copy the whole cache
    # into this layout twice per layer and decode step.
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    if kv is not None:
      ck, cv = kv
      k, v = write_slots(ck, k, write_index, axis=2), write_slots(cv, v, write_index, axis=2)
      kv = (k, v)
    s = k.shape[2]
    q_slot = jnp.reshape(write_index, (-1, 1)) + jnp.arange(l)  # [1 or B, L]
    allowed = (jnp.arange(s)[None, None, :] <= q_slot[:, :, None]) & key_mask[:, None, :]  # [B, L, S]
    g = self.h // self.kv  # query heads per KV head (head i uses KV head i // g, as repeat_kv)
    qg = q.reshape(b, l, self.kv, g, self.hd)
    # Query l at key slot l without a cache, and in a prefill written from slot 0 (a static 0: the
    # sampler's; slots >= L are then causally masked for every query): causal blocks apply.
    if self.block and (kv is None or (isinstance(write_index, int) and write_index == 0)):
      o = attend_causal_blocks(self.impl, qg, k, v, allowed, self.block)
    else:
      o = attend(self.impl, qg, k, v, allowed)
    o = o.transpose(0, 3, 1, 2, 4).reshape(b, l, self.h * self.hd)
    return self.o_proj(o), kv


class DecoderLayer(nnx.Module):
  """Pre-norm block: x + attn(norm(x)); x + mlp(norm(x)). MLP is MoE iff `cfg.is_sparse(idx)`."""

  def __init__(self, cfg: ModelConfig, layer_idx: int, rngs: nnx.Rngs, moe_strategy: MoeStrategy | None = None):
    dt = cfg.jdtype
    self.input_layernorm = nnx.RMSNorm(cfg.hidden, epsilon=cfg.rms_eps, dtype=dt, rngs=rngs,
                                       scale_metadata=ax("norm"))
    self.self_attn = Attention(cfg, rngs)
    self.post_attention_layernorm = nnx.RMSNorm(cfg.hidden, epsilon=cfg.rms_eps, dtype=dt, rngs=rngs,
                                                scale_metadata=ax("norm"))
    self.mlp = (MoE(cfg, rngs, moe_strategy) if cfg.is_sparse(layer_idx)
                else DenseMLP(cfg.hidden, cfg.dense_intermediate, rngs, dtype=dt))

  def __call__(self, x, cos, sin, key_mask, kv=None, write_index=0, decode_weights=None):
    """Returns (x [B, L, D], router (probs, idx) or None, new (k, v) or None). decode_weights: this
    layer's entry of `moe.prepare_decode_weights` (None: the parameters as they are)."""
    a, kv = self.self_attn(self.input_layernorm(x), cos, sin, key_mask, kv, write_index)
    x = x + a
    h = self.post_attention_layernorm(x)
    m, router = self.mlp(h) if decode_weights is None else self.mlp(h, decode_weights)
    return x + m, router, kv


def remat_call(cfg: ModelConfig, block, *args):
  """block(*args), under `nnx.remat` with the policy `cfg.remat` names (identity for "none")."""
  if cfg.remat == "none":
    return block(*args)
  policy = None if cfg.remat == "full" else jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  return nnx.remat(lambda b, *a: b(*a), policy=policy)(block, *args)


LAYERS_AXIS = {nnx.PARTITION_NAME: "layers"}  # logical name of the stacked layer axis (rule: replicated)
STACKED_NAMES = ("layers", "blocks")  # attribute names of stackable lists: decoder layers, vision blocks


def stacked_module(make, n: int, rngs: nnx.Rngs):
  """`n` instances of `make(rngs)` as one module whose parameters are stacked on a leading [n] axis
  (logical axis "layers" prepended to each `out_sharding`), built by `nnx.vmap` over `n` split keys
  (flax "scan over layers" recipe). Every instance must have the same structure."""

  @nnx.split_rngs(splits=n)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=LAYERS_AXIS)
  def build(r):
    return make(r)

  return build(rngs)


def stacked_layers(cfg: ModelConfig, rngs: nnx.Rngs, moe_strategy: MoeStrategy | None = None) -> DecoderLayer:
  """`cfg.layers` decoder layers as one stacked `DecoderLayer` (`stacked_module`); every layer has
  layer 0's structure (`ModelConfig` rejects mixed dense/MoE stacks when `scan_layers` is set)."""
  return stacked_module(lambda r: DecoderLayer(cfg, 0, r, moe_strategy), cfg.layers, rngs)


def scan_stacked(stacked: nnx.Module, step, carry, xs):
  """`jax.lax.scan` of `step(block, carry, x_i) -> (carry, y_i)` over the blocks of a `stacked_module`
  (block i: the split state's slice i merged back into one module) and the per-block inputs `xs`
  (a pytree with leading [n] axes, or None). Returns (carry, stacked ys).

  A plain `lax.scan` over `nnx.split` state rather than `nnx.scan`: the sampler calls the model
  inside a `lax.while_loop` body that closes over it, and `nnx.scan` refuses modules whose
  variables belong to an outer trace."""
  graphdef, state = nnx.split(stacked)

  def body(c, inp):
    st, x = inp
    return step(nnx.merge(graphdef, st), c, x)

  return jax.lax.scan(body, carry, (state, xs))


class Decoder(nnx.Module):
  """Embedded inputs -> decoder layers -> final RMSNorm (no embedding, no head).

  `layers`: an `nnx.List` of `DecoderLayer`s, or with `cfg.scan_layers` one `DecoderLayer` of
  stacked parameters (`stacked_layers`) applied by `jax.lax.scan` (one compiled layer body)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    # Chosen once, here, for every MoE layer: the backend and mesh are not consulted while tracing.
    self.moe_strategy = build_strategy(cfg) if cfg.experts else None
    if cfg.scan_layers:
      self.layers = stacked_layers(cfg, rngs, self.moe_strategy)
    else:
      self.layers = nnx.List([DecoderLayer(cfg, i, rngs, self.moe_strategy) for i in range(cfg.layers)])
    self.norm = nnx.RMSNorm(cfg.hidden, epsilon=cfg.rms_eps, dtype=cfg.jdtype, rngs=rngs, scale_metadata=ax("norm"))

  def __call__(self, x, positions, attn_mask, cache: KVCache | None = None, cache_index=0, deepstack=None,
               decode_weights=None):
    """x [B, L, D]; positions [3, B, L] int32; attn_mask [B, L] bool (real tokens).

    deepstack: None or [n, B, L, D] added to the hidden states after layers 0 .. n-1 (zero away from
    image tokens; transformers `_deepstack_process`).
    decode_weights: None, or `moe.prepare_decode_weights` (one entry per layer; unscanned layers only).
    Without cache: causal attention over the L tokens restricted to `attn_mask` keys.
    With cache: the L tokens go to slots cache_index.. (their `attn_mask` is recorded in
    `cache.mask`) and attend causally over all valid cache slots; cache_index is an int32 scalar
    or a [B] per-row cursor.
    Returns (hidden [B, L, D], routers, new cache or None); routers: None for a dense model, else
    the router outputs of the n MoE layers stacked: (probs [n, B*L, E], idx [n, B*L, k]) plus, with
    a capacity factor, dropped [n] float32.
    """
    cfg = self.cfg
    cos, sin = mrope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, cfg.sections, cfg.interleaved_mrope)
    attn_mask = attn_mask.astype(bool)
    if cache is not None:
      key_mask = write_slots(cache.mask, attn_mask, cache_index)
    else:
      key_mask = attn_mask
    if cfg.scan_layers:
      if decode_weights is not None:
        raise ValueError("decode_weights are per unscanned layer; scanned layers slice their stacked weights")
      x, routers, kv = self._scan(x, cos, sin, key_mask, cache, cache_index, deepstack)
      new_cache = None if cache is None else KVCache(kv[0], kv[1], key_mask)
      return self.norm(x), routers, new_cache
    routers, ks, vs = [], [], []
    for i, layer in enumerate(self.layers):
      kv = None if cache is None else (cache.k[i], cache.v[i])
      dw = None if decode_weights is None else decode_weights[i]
      x, r, kv = remat_call(cfg, layer, x, cos, sin, key_mask, kv, cache_index, dw)
      if deepstack is not None and i < deepstack.shape[0]:
        x = x + deepstack[i].astype(x.dtype)
      x = constrain(x, HIDDEN)
      if r is not None:
        routers.append(r)
      if cache is not None:
        ks.append(kv[0])
        vs.append(kv[1])
    new_cache = None if cache is None else KVCache(tuple(ks), tuple(vs), key_mask)
    routers = tuple(jnp.stack(a) for a in zip(*routers)) if routers else None
    return self.norm(x), routers, new_cache

  def _scan(self, x, cos, sin, key_mask, cache, cache_index, deepstack):
    """The stacked layers under `scan_stacked`: x is the carry; the layer parameters, the cache's
    k / v ([layers, B, KV, S, hd]) and the layer index are scanned; DeepStack [n, B, L, D] is closed
    over and level i added after layer i < n (`jnp.where` with 0 elsewhere: exact). Remat, if any,
    wraps the body (inside the scan, as maxtext). Returns (x, stacked routers or None, (k, v) or None)."""
    cfg = self.cfg
    n_deep = 0 if deepstack is None else deepstack.shape[0]
    kv = None if cache is None else (cache.k, cache.v)

    def step(layer, x, xs):
      kv, i = xs
      x, r, kv = remat_call(cfg, layer, x, cos, sin, key_mask, kv, cache_index)
      if n_deep:
        x = x + jnp.where(i < n_deep, deepstack[jnp.minimum(i, n_deep - 1)], 0).astype(x.dtype)
      return constrain(x, HIDDEN), (r, kv)

    x, (routers, kv) = scan_stacked(self.layers, step, x, (kv, jnp.arange(cfg.layers)))
    return x, routers, kv


def split_layer_path(path: tuple):
  """(prefix up to and including the list name, index, rest) of an unscanned per-layer path
  (... "layers", i, ... of the decoder or ... "blocks", i, ... of the vision encoder), else None."""
  for j in range(len(path) - 1):
    if path[j] in STACKED_NAMES and isinstance(path[j + 1], int):
      return path[:j + 1], path[j + 1], path[j + 2:]
  return None


def stack_layer_arrays(flat) -> dict:
  """Unscanned flat parameters {path: array} (paths `... "layers" | "blocks", i, ...` from
  `nnx.to_flat_state`) -> the scanned layout {path without i: [n, ...] stacked array}; other entries
  unchanged. Arrays may be numpy or jax. Raises ValueError if a layer's entry is missing."""
  out, groups = {}, {}
  for path, a in flat.items():
    sp = split_layer_path(tuple(path))
    if sp is None:
      out[tuple(path)] = a
    else:
      groups.setdefault(sp[0] + sp[2], {})[sp[1]] = a
  for path, by_layer in groups.items():
    if sorted(by_layer) != list(range(len(by_layer))):
      raise ValueError(f"{path}: layers {sorted(by_layer)} are not 0 .. {len(by_layer) - 1}")
    parts = [by_layer[i] for i in range(len(by_layer))]
    out[path] = (np.stack if isinstance(parts[0], np.ndarray) else jnp.stack)(parts)
  return out


def unstack_layer_arrays(flat, layer_paths) -> dict:
  """Inverse of `stack_layer_arrays`: `layer_paths` are the stacked paths (those under the
  decoder's "layers" or the vision encoder's "blocks"); each [n, ...] array becomes entries
  (... name, i, ...)."""
  out = {}
  for path, a in flat.items():
    path = tuple(path)
    if path not in layer_paths:
      out[path] = a
      continue
    j = min(path.index(n) for n in STACKED_NAMES if n in path)
    for i in range(a.shape[0]):
      out[path[:j + 1] + (i,) + path[j + 1:]] = a[i]
  return out
