"""Rotary position embeddings: 3-axis M-RoPE positions and their application.

`rope_positions` follows Qwen2-VL `get_rope_index`: text tokens have t = h = w = consecutive
integers; an image block of (gh x gw) merged tokens starting at position s has t = s, h = s + row,
w = s + col; the next text token starts at s + max(gh, gw). Padding gets position 0.
`apply_mrope` rotates with per-frequency axes interleaved as Qwen3-VL (`apply_interleaved_mrope`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _increments(tokens, attn_mask, image_token_id, grid_hw):
  gh, gw = grid_hw
  n = gh * gw
  valid = attn_mask.astype(bool)
  is_img = (tokens == image_token_id) & valid
  k = (jnp.cumsum(is_img, axis=-1) - 1) % n  # index inside the current image block
  last_of_block = is_img & (k == n - 1)
  incr = jnp.where(valid & ~is_img, 1, 0) + jnp.where(last_of_block, max(gh, gw), 0)
  return incr.astype(jnp.int32), is_img, k


def rope_positions(tokens: jax.Array, attn_mask: jax.Array, image_token_id: int,
                   grid_hw: tuple[int, int]) -> jax.Array:
  """M-RoPE positions [3, B, T] int32 (t, h, w), Qwen2-VL `get_rope_index` semantics.

  Args:
    tokens: [B, T] int32; attn_mask: [B, T] bool (padding anywhere, e.g. left: positions start at 0
      at a row's first real token; padding gets 0 and does not advance positions).
    image_token_id: the placeholder id; each image must appear as exactly gh*gw consecutive
      placeholder tokens (raster order); grid_hw: (gh, gw) merged grid of every image.
  Text token: t = h = w = running position. Image block starting at s: t = s, h = s + row,
  w = s + col; the next token starts at s + max(gh, gw). Pure jnp, jittable.
  """
  gh, gw = grid_hw
  incr, is_img, k = _increments(tokens, attn_mask, image_token_id, grid_hw)
  start = jnp.cumsum(incr, axis=-1) - incr  # exclusive cumsum: position where each token starts
  row, col = k // gw, k % gw
  t = start
  h = jnp.where(is_img, start + row, start)
  w = jnp.where(is_img, start + col, start)
  pos = jnp.stack([t, h, w]) * attn_mask.astype(jnp.int32)[None]
  return pos.astype(jnp.int32)


def next_position(tokens, attn_mask, image_token_id, grid_hw) -> jax.Array:
  """[B] int32: position of the token that would follow each row's real tokens (decode start)."""
  incr, _, _ = _increments(tokens, attn_mask, image_token_id, grid_hw)
  return incr.sum(-1).astype(jnp.int32)


def mrope_cos_sin(positions: jax.Array, head_dim: int, theta: float, sections: tuple[int, int, int],
                  interleaved: bool = True):
  """cos, sin [B, T, head_dim] for positions [3, B, T].

  interleaved (Qwen3-VL): frequency j uses h if j % 3 == 1 and j < 3 * s_h, w if j % 3 == 2 and
  j < 3 * s_w, else t. Contiguous (Qwen2/2.5-VL): the first s_t frequencies use t, the next s_h h,
  the last s_w w.
  """
  half = head_dim // 2
  inv = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
  ang = positions.astype(jnp.float32)[..., None] * inv  # [3, B, T, half]
  idx = jnp.arange(half)
  s_t, s_h, s_w = sections
  if interleaved:
    use_h = (idx % 3 == 1) & (idx < 3 * s_h)
    use_w = (idx % 3 == 2) & (idx < 3 * s_w)
  else:
    use_h = (idx >= s_t) & (idx < s_t + s_h)
    use_w = idx >= s_t + s_h
  a = jnp.where(use_h, ang[1], jnp.where(use_w, ang[2], ang[0]))
  a = jnp.concatenate([a, a], axis=-1)
  return computed_once(lambda a: (jnp.cos(a), jnp.sin(a)), a)


def computed_once(fn, x: jax.Array):
  """fn(x), written to buffers that its users read, on XLA:CPU; plain fn(x) on other backends.

  XLA:CPU fuses elementwise producers into every consumer fusion, so the cos / sin of the rotary
  angles were recomputed inside each rotate and transpose fusion that reads them (forward and backward
  of q and k in every layer), once per head (benchmarks/RESULTS.md, "Rotary cos / sin computed once
  per CPU train step").
  A conditional's result is a buffer no fusion reaches into. Both branches are `fn`, so the predicate
  (data-dependent, hence not folded by XLA) cannot change the result. Not on GPU / TPU, where a
  conditional can cost a host round trip and their fusion heuristics do not duplicate transcendentals.
  """
  if jax.default_backend() != "cpu":
    return fn(x)
  return jax.lax.cond(jnp.isnan(x.reshape(-1)[0]), fn, fn, x)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [B, T, H, D] rotated by cos/sin [B, T, D] (rotate-half convention of transformers)."""
  d = x.shape[-1] // 2
  rot = jnp.concatenate([-x[..., d:], x[..., :d]], axis=-1)
  return x * cos[:, :, None] + rot * sin[:, :, None]
