"""Scaled dot-product attention cores shared by the decoder (GQA) and the vision encoder.

Two implementations of the same function (`ModelConfig.attention_impl`):

- "einsum": scores, softmax and the weighted sum as plain ops; reverse-mode autodiff saves the
  [B, H, L, S] scores and probabilities of every layer for the backward pass.
- "recompute": the same forward, under a `jax.custom_vjp` whose residuals are q, k, v, the output
  and the per-row max and log-normaliser of the scores only ([B, H, L] float32 each); the backward
  recomputes the probabilities from q, k and those two and applies the softmax backward through
  D = rowsum(dO * O) (FlashAttention-2's backward, Dao 2023, arXiv 2307.08691, Algorithm 2, here
  untiled). One extra Q K^T product per layer in the backward; no [B, H, L, S] array outlives its
  layer's forward.

Either core can run by causal query blocks when there is no KV cache (`attend_causal_blocks`,
`ModelConfig.attention_block`), skipping the key blocks the causal mask removes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tars_jax.models.config import ATTENTION_IMPLS

NEG = -1e9  # finite mask value: fully masked (padding) query rows stay NaN-free; exp() is exactly 0


def _scores(q, k, allowed):
  """float32 [B, KV, G, L, S] scaled, masked scores of q [B, L, KV, G, hd] against k [B, KV, S, hd]."""
  s = jnp.einsum("blkgd,bksd->bkgls", q, k).astype(jnp.float32) / jnp.sqrt(jnp.float32(q.shape[-1]))
  return s if allowed is None else jnp.where(allowed[:, None, None], s, NEG)


def _weighted(p, v):
  # Batch-major product, the small output transposed by the caller: writing "->blkgd" directly lowers
  # to a much slower CPU dot (benchmarks/RESULTS.md, "Decode step layout").
  return jnp.einsum("bkgls,bksd->bkgld", p.astype(v.dtype), v)


def attend_einsum(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array | None) -> jax.Array:
  """softmax(q k^T / sqrt(hd), masked) v for grouped-query heads.

  Args:
    q: [B, L, KV, G, hd] queries (G query heads share each of the KV key/value heads; query head
      kv * G + g uses KV head kv, transformers' `repeat_kv` order).
    k, v: [B, KV, S, hd] keys / values (same dtype as q).
    allowed: [B or 1, L, S] bool (True = query l may attend to key slot s) or None (all allowed).
  Returns:
    [B, KV, G, L, hd] in v's dtype; scores and softmax in float32. A row with no allowed key gets
    the uniform average of v (finite mask value `NEG`).
  """
  return _weighted(jax.nn.softmax(_scores(q, k, allowed), axis=-1), v)


def attend_decode(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array | None) -> jax.Array:
  """`attend_einsum` for one query per row (a decode step), as multiplies and reductions: q
  [B, 1, KV, G, hd], k, v [B, KV, S, hd], allowed [B or 1, 1, S] bool or None -> [B, KV, G, 1, hd] in
  v's dtype (products, scores and softmax in float32). The same function; on XLA:CPU its two
  multiply-reduce fusions stream the cache once each, where the einsum form lowers to batched dots of
  a [G, hd] block per (row, KV head) that run on one core, far below memory bandwidth
  (`benchmarks/RESULTS.md`, "Decode attention as multiply-and-reduce on CPU")."""
  f32 = jnp.float32
  qt = jnp.moveaxis(q, 1, 3).astype(f32)  # [B, KV, G, 1, hd]
  s = jnp.sum(qt[:, :, :, :, None, :] * k[:, :, None, None].astype(f32), axis=-1) / jnp.sqrt(f32(q.shape[-1]))
  if allowed is not None:
    s = jnp.where(allowed[:, None, None], s, NEG)
  p = jax.nn.softmax(s, axis=-1)  # [B, KV, G, 1, S]
  return jnp.sum(p[..., None] * v[:, :, None, None].astype(f32), axis=-2).astype(v.dtype)


@jax.custom_vjp
def _attend_recompute(q, k, v, allowed):
  return attend_einsum(q, k, v, allowed)


def _fwd(q, k, v, allowed):
  s = _scores(q, k, allowed)
  m = jnp.max(s, axis=-1, keepdims=True)
  e = jnp.exp(s - m)
  z = jnp.sum(e, axis=-1, keepdims=True)
  o = _weighted(e / z, v)
  # the row max and log-normaliser apart, not their sum: on a fully masked row both scores and max are
  # NEG = -1e9, where float32 cannot hold NEG + log(S) (its spacing there is 64)
  return o, (q, k, v, allowed, o, m[..., 0], jnp.log(z)[..., 0])


def _bwd(res, do):
  q, k, v, allowed, o, m, log_z = res
  p = jnp.exp(_scores(q, k, allowed) - m[..., None] - log_z[..., None])  # float32 [B, KV, G, L, S]
  dv = jnp.einsum("bkgls,bkgld->bksd", p.astype(v.dtype), do)
  dp = jnp.einsum("bkgld,bksd->bkgls", do, v).astype(jnp.float32)
  d = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
  ds = p * (dp - d) / jnp.sqrt(jnp.float32(q.shape[-1]))
  if allowed is not None:
    # the mask's `where` passes no gradient to masked scores (p there is 0, except on a fully masked
    # row, where it is uniform)
    ds = jnp.where(allowed[:, None, None], ds, 0.0)
  ds = ds.astype(q.dtype)
  dq = jnp.einsum("bkgls,bksd->blkgd", ds, k)
  dk = jnp.einsum("bkgls,blkgd->bksd", ds, q)
  return dq, dk, dv, None


_attend_recompute.defvjp(_fwd, _bwd)


def attend_recompute(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array | None) -> jax.Array:
  """`attend_einsum` with a memory-lean backward: its residuals are q, k, v, the mask, the output and
  two float32 [B, KV, G, L] row statistics (max, log-normaliser), not the [B, KV, G, L, S] scores and
  probabilities. Same arguments, same forward values; gradients equal to autodiff's up to float
  rounding (tests/test_attention.py). Source: FlashAttention-2's backward (Dao 2023, arXiv
  2307.08691, Algorithm 2) without tiling.

  What it saves: the per-layer scores and probabilities among the step's temporaries, which matter
  with scanned layers and long rows (with unrolled layers XLA:CPU's scheduler can keep most of them
  anyway). Cost: one more Q K^T and exp per layer in the backward, small with `attend_causal_blocks`,
  larger with one full causal square; a memory knob, not a speed one (`benchmarks/train_step_memory.py`;
  `benchmarks/RESULTS.md`, "Attention memory: `attention_impl="recompute"`")."""
  return _attend_recompute(q, k, v, allowed)


def attend_causal_blocks(impl: str, q, k, v, allowed, block: int):
  """`attend` for causal self-attention without a cache (query l at key slot l, S = L), by blocks of
  `block` queries: block j attends to key slots [0, (j + 1) * block) only, skipping the keys the
  causal mask removes anyway (L^2 / 2 + L * block / 2 scores instead of L^2). Real rows equal
  `attend`'s (the skipped keys' exp() is exactly 0); a fully masked (padding) query row averages
  v over its block's key range instead of all S. Returns [B, KV, G, L, hd]."""
  l = q.shape[1]
  if l <= block:
    return attend(impl, q, k, v, allowed)
  outs = []
  for start in range(0, l, block):
    end = min(l, start + block)
    outs.append(attend(impl, q[:, start:end], k[:, :, :end], v[:, :, :end], allowed[:, start:end, :end]))
  return jnp.concatenate(outs, axis=3)


def attend(impl: str, q, k, v, allowed):
  """`attend_einsum` or `attend_recompute` by `ModelConfig.attention_impl`; ValueError for others.
  One query per row on XLA:CPU (a decode step; also a 1-query tail block of `attend_causal_blocks`,
  differentiated by plain autodiff then): `attend_decode`, whichever the impl."""
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"attention_impl={impl!r}; known: {list(ATTENTION_IMPLS)}")
  if q.shape[1] == 1 and jax.default_backend() == "cpu":
    return attend_decode(q, k, v, allowed)
  if impl == "einsum":
    return attend_einsum(q, k, v, allowed)
  return attend_recompute(q, k, v, allowed)
