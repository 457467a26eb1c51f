"""ViT vision encoder of `qwen3_vl_moe` (transformers `Qwen3VLMoeVisionModel`) and `qwen2_5_vl`
(`Qwen2_5_VisionTransformerPretrainedModel`: see `ModelConfig` for its differences): patch embedding
(a linear map of the flattened (channel, time, dy, dx) patch = the Conv3d), learned absolute
positions bilinearly resampled to the patch grid, 2D rotary attention per image, pre-norm blocks,
2x2 patch merger into the decoder width, and DeepStack mergers on chosen blocks.

Patches are kept in transformers' merge-block order (for each 2x2 block in raster order, its 4
patches in raster order), so the merger concatenates 4 consecutive patches and the flattened
`pixel_values` of the transformers image processor feed `encode_patches` unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tars_jax.models.attention import NEG, attend
from tars_jax.models.config import ModelConfig
from tars_jax.models.decoder import remat_call, scan_stacked, stacked_module
from tars_jax.models.rope import rotate
from tars_jax.sharding import constrain, param_axes as ax


def sincos_2d(gh: int, gw: int, d: int) -> jax.Array:
  """[gh*gw, d] float32 2D sin-cos position table (half the channels per axis; MAE, He et al. 2021)."""
  q = d // 4
  omega = 1.0 / (10000.0 ** (jnp.arange(q, dtype=jnp.float32) / q))
  r, c = jnp.meshgrid(jnp.arange(gh, dtype=jnp.float32), jnp.arange(gw, dtype=jnp.float32), indexing="ij")
  parts = [f(a.reshape(-1, 1) * omega) for a in (r, c) for f in (jnp.sin, jnp.cos)]
  table = jnp.concatenate(parts, axis=-1)
  return jnp.pad(table, ((0, 0), (0, d - table.shape[1])))


@functools.lru_cache(maxsize=64)
def block_order(gh: int, gw: int, m: int) -> tuple[np.ndarray, np.ndarray]:
  """(row [L], col [L]) int32 of the patches of a gh x gw grid in merge-block order (transformers
  `get_vision_position_ids`)."""
  r, c = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
  f = lambda a: a.reshape(gh // m, m, gw // m, m).transpose(0, 2, 1, 3).reshape(-1).astype(np.int32)
  return f(r), f(c)


@functools.lru_cache(maxsize=64)
def pos_interp(gh: int, gw: int, side: int, m: int) -> np.ndarray:
  """[L, side*side] float32 matrix resampling a side x side table bilinearly (align_corners=True) to
  a gh x gw grid, rows in merge-block order: as transformers `get_vision_interpolation_indices_and_
  weights(mode='bilinear', align_corners=True)`, as a dense matrix (its gradient is a matmul, not a
  scatter, which is slow on CPU)."""
  row, col = block_order(gh, gw, m)

  def axis(i, size):
    src = i.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    fl = np.floor(src)
    taps = fl.astype(np.int64)[:, None] + np.arange(2)
    w = np.clip(1.0 - np.abs(src[:, None] - fl[:, None] - np.arange(2)), 0.0, None).astype(np.float32)
    return np.clip(taps, 0, side - 1), w

  ht, hw = axis(row, gh)
  wt, ww = axis(col, gw)
  idx = (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4)
  w = (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4)
  mat = np.zeros((gh * gw, side * side), np.float32)
  np.add.at(mat, (np.repeat(np.arange(gh * gw), 4), idx.reshape(-1)), w.reshape(-1))
  return mat


@functools.lru_cache(maxsize=64)
def rope_2d_cos_sin(gh: int, gw: int, head_dim: int, theta: float, m: int) -> tuple[np.ndarray, np.ndarray]:
  """cos, sin [gh*gw, head_dim] float32 (merge-block order) of the axial 2D rotary embedding: head_dim / 4
  frequencies per axis, laid out [rows | cols] twice (`Qwen3VLMoeVisionRotaryEmbedding`).

  NumPy, so jitted code holds them as constants: computed in the graph, XLA:CPU recomputed them inside
  every fusion that reads them (see `rope.computed_once`). Callers must not modify them (cached)."""
  quarter = head_dim // 4
  inv = (1.0 / (np.float32(theta) ** (np.arange(quarter, dtype=np.float32) / np.float32(quarter)))).astype(np.float32)
  row, col = block_order(gh, gw, m)
  ang = np.concatenate([row[:, None].astype(np.float32) * inv, col[:, None].astype(np.float32) * inv], axis=-1)
  ang = np.concatenate([ang, ang], axis=-1)
  cos, sin = np.cos(ang), np.sin(ang)
  cos.flags.writeable = sin.flags.writeable = False
  return cos, sin


@functools.lru_cache(maxsize=64)
def window_mask(gh: int, gw: int, m: int, window: int) -> np.ndarray:
  """[L, L] bool (merge-block order): patches in the same window of `window` x `window` merged
  tokens, windows tiled from the top-left (transformers `get_vision_window_index`)."""
  k = np.arange(gh * gw) // (m * m)
  bw = gw // m
  wid = (k // bw // window) * (bw // window + 1) + (k % bw) // window
  return wid[:, None] == wid[None, :]


def patchify(images: jax.Array, p: int, t: int, m: int, mean=(0.5,) * 3, std=(0.5,) * 3) -> jax.Array:
  """images [N, H, W, 3] float in [0, 1] -> patches [N, L, 3*t*p*p] in merge-block order, each
  flattened as (channel, time, dy, dx) after normalising per channel ((x - mean) / std, the image
  processor's) and repeating the still frame t times (as the processor does)."""
  n, h, w, c = images.shape
  gh, gw = h // p, w // p
  x = (images.astype(jnp.float32) - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)
  x = x.reshape(n, gh // m, m, p, gw // m, m, p, c).transpose(0, 1, 4, 2, 5, 7, 3, 6)  # n bh bw mr mc c dy dx
  x = x.reshape(n, gh * gw, c, 1, p, p)
  return jnp.broadcast_to(x, (n, gh * gw, c, t, p, p)).reshape(n, gh * gw, c * t * p * p)


PATCHES = ("act_batch", "act_length", "act_embed")  # logical axes of vision activations [N, L, d]
# Linear metadata: width-increasing (d -> i) and width-decreasing (i -> d) layers of the vision MLPs.
_up_axes = dict(kernel_metadata=ax("vision_embed", "vision_mlp"), bias_metadata=ax("vision_mlp"))
_down_axes = dict(kernel_metadata=ax("vision_mlp", "vision_embed"), bias_metadata=ax("vision_embed"))


class VisionAttention(nnx.Module):
  def __init__(self, d: int, heads: int, dtype, rngs: nnx.Rngs, impl: str = "einsum"):
    self.heads, self.impl = heads, impl
    self.qkv = nnx.Linear(d, 3 * d, dtype=dtype, rngs=rngs, kernel_metadata=ax("vision_embed", "vision_heads"),
                          bias_metadata=ax("vision_heads"))
    self.proj = nnx.Linear(d, d, dtype=dtype, rngs=rngs, kernel_metadata=ax("vision_heads", "vision_embed"),
                           bias_metadata=ax("vision_embed"))

  def __call__(self, x, cos, sin, mask=None):
    """x [N, L, d] (L patches of one image each); cos/sin [L, head_dim]; mask None (full attention)
    or [L, L] bool (window attention)."""
    n, l, d = x.shape
    hd = d // self.heads
    qkv = self.qkv(x).reshape(n, l, 3, self.heads, hd)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    q, k = rotate(q, cos[None], sin[None]).astype(x.dtype), rotate(k, cos[None], sin[None]).astype(x.dtype)
    if self.impl == "einsum":  # this layout directly: the shared core's transposes would slow this path on a CPU
      att = jnp.einsum("nqhd,nkhd->nhqk", q, k).astype(jnp.float32) / jnp.sqrt(jnp.float32(hd))
      if mask is not None:
        att = jnp.where(jnp.asarray(mask), att, NEG)
      o = jnp.einsum("nhqk,nkhd->nqhd", jax.nn.softmax(att, axis=-1).astype(v.dtype), v).reshape(n, l, d)
    else:  # every head its own key/value head (G = 1); a window always holds its query
      allowed = None if mask is None else jnp.asarray(mask)[None]
      o = attend(self.impl, q[:, :, :, None], k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), allowed)
      o = o[:, :, 0].transpose(0, 2, 1, 3).reshape(n, l, d)
    return self.proj(o)


class VisionMLP(nnx.Module):
  """linear_fc1 -> tanh-GELU (`gelu_pytorch_tanh`) -> linear_fc2."""

  def __init__(self, d: int, i: int, dtype, rngs: nnx.Rngs):
    self.linear_fc1 = nnx.Linear(d, i, dtype=dtype, rngs=rngs, **_up_axes)
    self.linear_fc2 = nnx.Linear(i, d, dtype=dtype, rngs=rngs, **_down_axes)

  def __call__(self, x):
    return self.linear_fc2(jax.nn.gelu(self.linear_fc1(x), approximate=True))


class VisionSwiGLU(nnx.Module):
  """down_proj(silu(gate_proj(x)) * up_proj(x)), all with biases (Qwen2.5-VL `Qwen2_5_VLMLP(bias=True)`)."""

  def __init__(self, d: int, i: int, dtype, rngs: nnx.Rngs):
    self.gate_proj = nnx.Linear(d, i, dtype=dtype, rngs=rngs, **_up_axes)
    self.up_proj = nnx.Linear(d, i, dtype=dtype, rngs=rngs, **_up_axes)
    self.down_proj = nnx.Linear(i, d, dtype=dtype, rngs=rngs, **_down_axes)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def _norm(cfg: ModelConfig, d: int, rngs: nnx.Rngs):
  """Vision norm: LayerNorm (qwen3_vl_moe) or RMSNorm (qwen2_5_vl), eps 1e-6."""
  if cfg.family == "qwen2_5_vl":
    return nnx.RMSNorm(d, epsilon=1e-6, dtype=cfg.jdtype, rngs=rngs, scale_metadata=ax("norm"))
  return nnx.LayerNorm(d, epsilon=1e-6, dtype=cfg.jdtype, rngs=rngs, scale_metadata=ax("norm"),
                       bias_metadata=ax("norm"))


class VisionBlock(nnx.Module):
  """Pre-norm ViT block: norm -> rotary MHA; norm -> MLP (tanh-GELU MLP, or SwiGLU for qwen2_5_vl)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, dt = cfg.vision_hidden, cfg.jdtype
    self.norm1 = _norm(cfg, d, rngs)
    self.attn = VisionAttention(d, cfg.vision_heads, dt, rngs, cfg.attention_impl)
    self.norm2 = _norm(cfg, d, rngs)
    mlp = VisionSwiGLU if cfg.family == "qwen2_5_vl" else VisionMLP
    self.mlp = mlp(d, cfg.vision_mlp, dt, rngs)

  def __call__(self, x, cos, sin, mask=None):
    x = x + self.attn(self.norm1(x), cos, sin, mask)
    return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
  """Concatenate each 2x2 block's 4 patches, MLP (exact GELU) to the decoder width. LayerNorm per
  patch before (main merger) or over the concatenation after (`postshuffle`, DeepStack mergers)."""

  def __init__(self, d: int, out: int, dtype, rngs: nnx.Rngs, m: int = 2, postshuffle: bool = False,
               rms: bool = False):
    self.m2, self.postshuffle = m * m, postshuffle
    n = d * self.m2 if postshuffle else d
    if rms:  # Qwen2.5-VL's `ln_q`
      self.norm = nnx.RMSNorm(n, epsilon=1e-6, dtype=dtype, rngs=rngs, scale_metadata=ax("norm"))
    else:
      self.norm = nnx.LayerNorm(n, epsilon=1e-6, dtype=dtype, rngs=rngs, scale_metadata=ax("norm"),
                                bias_metadata=ax("norm"))
    self.linear_fc1 = nnx.Linear(self.m2 * d, self.m2 * d, dtype=dtype, rngs=rngs, **_up_axes)
    self.linear_fc2 = nnx.Linear(self.m2 * d, out, dtype=dtype, rngs=rngs, kernel_metadata=ax("vision_mlp", "embed"),
                                 bias_metadata=ax("embed"))

  def __call__(self, x):
    """x [N, L, d] merge-block-ordered patches -> [N, L/4, out] raster-ordered merged tokens."""
    n, l, d = x.shape
    if not self.postshuffle:
      x = self.norm(x)
    x = x.reshape(n, l // self.m2, self.m2 * d)
    if self.postshuffle:
      x = self.norm(x)
    return self.linear_fc2(jax.nn.gelu(self.linear_fc1(x), approximate=False))


class PatchEmbed(nnx.Module):
  """`proj`: the Conv3d of transformers as a Linear over (channel, time, dy, dx)-flattened patches."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    n_in = 3 * cfg.temporal_patch_size * cfg.patch_size ** 2
    self.proj = nnx.Linear(n_in, cfg.vision_hidden, use_bias=cfg.family != "qwen2_5_vl", dtype=cfg.jdtype,
                           rngs=rngs, kernel_metadata=ax("patch", "vision_embed"), bias_metadata=ax("vision_embed"))

  def __call__(self, patches):
    return self.proj(patches)


class VisionEncoder(nnx.Module):
  """pixel_values [N, H, W, 3] float32 in [0, 1] -> merged tokens [N, (H/2p)*(W/2p), cfg.hidden].

  Raises ValueError (at construction) if image_h or image_w is not divisible by 2 * patch_size.
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    m = cfg.spatial_merge_size
    mh, mw = cfg.merged_grid  # validates divisibility
    self.gh, self.gw = m * mh, m * mw
    d, dt, side = cfg.vision_hidden, cfg.jdtype, cfg.pos_table_side
    self.patch_embed = PatchEmbed(cfg, rngs)
    # Learned absolute positions, initialised to a 2D sin-cos table (MAE) so that where a patch is
    # is readable from the first step: an RL policy trained from scratch must point at things.
    # (Qwen2.5-VL has none: 2D rotary only.)
    self.learned_pos = cfg.family != "qwen2_5_vl"
    if self.learned_pos:
      self.pos_embed = nnx.Param(sincos_2d(side, side, d), **ax("pos", "vision_embed"))
    if cfg.scan_layers:  # one VisionBlock of stacked [vision_depth, ...] parameters, run by lax.scan
      self.blocks = stacked_module(lambda r: VisionBlock(cfg, r), cfg.vision_depth, rngs)
    else:
      self.blocks = nnx.List([VisionBlock(cfg, rngs) for _ in range(cfg.vision_depth)])
    self.merger = PatchMerger(d, cfg.hidden, dt, rngs, m, rms=not self.learned_pos)
    self.deepstack_merger_list = nnx.List([PatchMerger(d, cfg.hidden, dt, rngs, m, postshuffle=True)
                                           for _ in cfg.deepstack_visual_indexes])

  def encode_patches(self, patches: jax.Array, gh: int, gw: int) -> jax.Array:
    """patches [N, gh*gw, 3*t*p*p] (merge-block order, `patchify` / the transformers processor's
    `pixel_values` of N images of one size) -> [1 + n_deepstack, N, gh*gw/4, hidden]: the merged
    tokens, then each DeepStack level's."""
    cfg, m = self.cfg, self.cfg.spatial_merge_size
    if gh % m or gw % m:
      raise ValueError(f"patch grid {gh}x{gw} not divisible by spatial_merge_size={m}")
    x = self.patch_embed(patches.astype(cfg.jdtype))
    if self.learned_pos:
      pos = jnp.asarray(pos_interp(gh, gw, self.cfg.pos_table_side, m)) @ self.pos_embed[...]
      x = x + pos[None].astype(x.dtype)
    cos, sin = rope_2d_cos_sin(gh, gw, cfg.vision_hidden // cfg.vision_heads, cfg.vision_rope_theta, m)
    win = None
    if cfg.family == "qwen2_5_vl":  # window attention except in the full-attention blocks
      win = window_mask(gh, gw, m, cfg.window_size // m // cfg.patch_size)
    if cfg.scan_layers:
      x, levels = self._scan(x, cos, sin, win)
    else:
      levels = {}
      for i, blk in enumerate(self.blocks):
        x = remat_call(cfg, blk, x, cos, sin, None if i in cfg.fullatt_block_indexes else win)
        x = constrain(x, PATCHES)
        if i in cfg.deepstack_visual_indexes:
          levels[i] = x
    # Levels in block order, each through the merger of its position in the index list (transformers)
    idx = cfg.deepstack_visual_indexes
    deep = [self.deepstack_merger_list[idx.index(i)](levels[i]) for i in sorted(idx)]
    return jnp.stack([self.merger(x)] + deep)

  def _scan(self, x, cos, sin, win):
    """The stacked blocks under `scan_stacked` -> (x [N, L, d], {block index: hidden state [N, L, d]}
    after each of the `deepstack_visual_indexes` blocks).

    Scanned per block: its parameters, whether it is a full-attention block (qwen2_5_vl's
    `fullatt_block_indexes`: the window mask OR-ed with True, i.e. no mask: exact) and its DeepStack
    level (-1: none). The DeepStack hidden states are a [levels, N, L, d] carry that block i writes
    into its level's slot with `jnp.where`: `levels` copies of the activations (3 in the released
    models) rather than `vision_depth` (27) had the scan emitted every block's output."""
    cfg = self.cfg
    depth, n_lv = cfg.vision_depth, len(cfg.deepstack_visual_indexes)
    level_of = np.full(depth, -1, np.int32)
    level_of[list(cfg.deepstack_visual_indexes)] = np.arange(n_lv)
    full = np.isin(np.arange(depth), cfg.fullatt_block_indexes)

    def step(blk, carry, xs):
      x, buf = carry
      level, is_full = xs
      mask = None if win is None else jnp.asarray(win) | is_full
      x = constrain(remat_call(cfg, blk, x, cos, sin, mask), PATCHES)
      if n_lv:
        buf = jnp.where((jnp.arange(n_lv) == level)[:, None, None, None], x[None], buf)
      return (x, buf), None

    buf = jnp.zeros((n_lv,) + x.shape, x.dtype) if n_lv else None
    (x, buf), _ = scan_stacked(self.blocks, step, (x, buf), (jnp.asarray(level_of), jnp.asarray(full)))
    return x, {i: buf[k] for k, i in enumerate(cfg.deepstack_visual_indexes)}

  def encode(self, pixel_values: jax.Array) -> jax.Array:
    """pixel_values [N, image_h, image_w, 3] in [0, 1] -> [1 + n_deepstack, N, n_img_tokens, hidden]."""
    cfg = self.cfg
    patches = patchify(pixel_values, cfg.patch_size, cfg.temporal_patch_size, cfg.spatial_merge_size,
                       *cfg.pixel_norm)
    return self.encode_patches(patches, self.gh, self.gw)

  def __call__(self, pixel_values: jax.Array) -> jax.Array:
    """Merged tokens only: [N, n_img_tokens, hidden]."""
    return self.encode(pixel_values)[0]
