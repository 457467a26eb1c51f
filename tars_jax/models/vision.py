"""ViT vision encoder (Qwen3-VL structure, transformers `Qwen3VLMoeVisionModel`): patch embedding,
learned absolute + 2D rotary positions, pre-norm blocks, 2x2 patch merger into the decoder width.

Differences kept on purpose (small-scale, fixed-size images): temporal patch size 1, one fixed
image size (so the learned position table is not interpolated), patches in raster order (the merger
regroups 2x2 neighbourhoods by reshaping; transformers pre-orders patches by merge window — the same
math), no deepstack features.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tars_jax.models.config import ModelConfig
from tars_jax.models.rope import rope_2d_cos_sin, rotate


def sincos_2d(gh: int, gw: int, d: int) -> jax.Array:
  """[gh*gw, d] float32 2D sin-cos position table (half the channels per axis; MAE, He et al. 2021)."""
  q = d // 4
  omega = 1.0 / (10000.0 ** (jnp.arange(q, dtype=jnp.float32) / q))
  r, c = jnp.meshgrid(jnp.arange(gh, dtype=jnp.float32), jnp.arange(gw, dtype=jnp.float32), indexing="ij")
  parts = [f(a.reshape(-1, 1) * omega) for a in (r, c) for f in (jnp.sin, jnp.cos)]
  table = jnp.concatenate(parts, axis=-1)
  return jnp.pad(table, ((0, 0), (0, d - table.shape[1])))


class VisionAttention(nnx.Module):
  def __init__(self, d: int, heads: int, dtype, rngs: nnx.Rngs):
    self.heads = heads
    self.qkv = nnx.Linear(d, 3 * d, dtype=dtype, rngs=rngs)
    self.proj = nnx.Linear(d, d, dtype=dtype, rngs=rngs)

  def __call__(self, x, cos, sin):
    """x [N, L, d] (L patches of one image each); cos/sin [L, head_dim]. Full (non-causal) attention."""
    n, l, d = x.shape
    hd = d // self.heads
    qkv = self.qkv(x).reshape(n, l, 3, self.heads, hd)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    q, k = rotate(q, cos[None], sin[None]).astype(x.dtype), rotate(k, cos[None], sin[None]).astype(x.dtype)
    att = jnp.einsum("nqhd,nkhd->nhqk", q, k).astype(jnp.float32) / jnp.sqrt(jnp.float32(hd))
    o = jnp.einsum("nhqk,nkhd->nqhd", jax.nn.softmax(att, axis=-1).astype(v.dtype), v).reshape(n, l, d)
    return self.proj(o)


class VisionBlock(nnx.Module):
  """Pre-norm ViT block: LayerNorm -> rotary MHA; LayerNorm -> MLP (tanh-GELU, `gelu_pytorch_tanh`)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, dt = cfg.vision_hidden, cfg.jdtype
    self.norm1 = nnx.LayerNorm(d, epsilon=1e-6, dtype=dt, rngs=rngs)
    self.attn = VisionAttention(d, cfg.vision_heads, dt, rngs)
    self.norm2 = nnx.LayerNorm(d, epsilon=1e-6, dtype=dt, rngs=rngs)
    self.linear_fc1 = nnx.Linear(d, cfg.vision_mlp, dtype=dt, rngs=rngs)
    self.linear_fc2 = nnx.Linear(cfg.vision_mlp, d, dtype=dt, rngs=rngs)

  def __call__(self, x, cos, sin):
    x = x + self.attn(self.norm1(x), cos, sin)
    return x + self.linear_fc2(jax.nn.gelu(self.linear_fc1(self.norm2(x)), approximate=True))


class PatchMerger(nnx.Module):
  """LayerNorm per patch, concatenate each 2x2 neighbourhood, MLP (exact GELU) to the decoder width."""

  def __init__(self, d: int, out: int, dtype, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(d, epsilon=1e-6, dtype=dtype, rngs=rngs)
    self.linear_fc1 = nnx.Linear(4 * d, 4 * d, dtype=dtype, rngs=rngs)
    self.linear_fc2 = nnx.Linear(4 * d, out, dtype=dtype, rngs=rngs)

  def __call__(self, x, gh: int, gw: int):
    """x [N, gh*gw, d] raster-ordered patches -> [N, (gh/2)*(gw/2), out] raster-ordered merged tokens."""
    n, _, d = x.shape
    x = self.norm(x)
    x = x.reshape(n, gh // 2, 2, gw // 2, 2, d).transpose(0, 1, 3, 2, 4, 5)
    x = x.reshape(n, (gh // 2) * (gw // 2), 4 * d)  # channel order: (dr, dc, d) as the HF merge window
    return self.linear_fc2(jax.nn.gelu(self.linear_fc1(x), approximate=False))


class VisionEncoder(nnx.Module):
  """pixel_values [N, H, W, 3] float32 in [0, 1] -> merged tokens [N, (H/2p)*(W/2p), cfg.hidden].

  Raises ValueError (at construction) if H or W is not divisible by 2 * patch_size.
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    p, d, dt = cfg.patch_size, cfg.vision_hidden, cfg.jdtype
    mh, mw = cfg.merged_grid  # validates divisibility
    self.gh, self.gw = 2 * mh, 2 * mw
    self.patch_embed = nnx.Linear(p * p * 3, d, dtype=dt, rngs=rngs)
    # Learned absolute positions, initialised to a 2D sin-cos table (MAE) so that where a patch is
    # is readable from the first step: an RL policy trained from scratch must point at things.
    self.pos_embed = nnx.Param(sincos_2d(self.gh, self.gw, d))
    self.blocks = nnx.List([VisionBlock(cfg, rngs) for _ in range(cfg.vision_depth)])
    self.merger = PatchMerger(d, cfg.hidden, dt, rngs)

  def __call__(self, pixel_values: jax.Array) -> jax.Array:
    cfg, p = self.cfg, self.cfg.patch_size
    n = pixel_values.shape[0]
    x = ((pixel_values.astype(jnp.float32) - 0.5) / 0.5).astype(cfg.jdtype)  # [0,1] -> [-1,1]
    # patch (r, c) flattened as (dy, dx, channel)
    x = x.reshape(n, self.gh, p, self.gw, p, 3).transpose(0, 1, 3, 2, 4, 5).reshape(n, self.gh * self.gw, -1)
    x = self.patch_embed(x) + self.pos_embed[...][None].astype(cfg.jdtype)
    cos, sin = rope_2d_cos_sin(self.gh, self.gw, cfg.vision_hidden // cfg.vision_heads, cfg.vision_rope_theta)
    for blk in self.blocks:
      x = blk(x, cos, sin)
    return self.merger(x, self.gh, self.gw)
