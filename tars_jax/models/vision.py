"""ViT vision encoder (Qwen2.5-VL / Qwen3-VL structure): patch embedding, learned + 2D rotary
positions, pre-norm blocks, 2x2 patch merger into the decoder width."""

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


class VisionBlock(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d = cfg.vision_hidden
    self.heads = cfg.vision_heads
    self.norm1 = nnx.LayerNorm(d, rngs=rngs)
    self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
    self.proj = nnx.Linear(d, d, rngs=rngs)
    self.norm2 = nnx.LayerNorm(d, rngs=rngs)
    self.fc1 = nnx.Linear(d, cfg.vision_mlp, rngs=rngs)
    self.fc2 = nnx.Linear(cfg.vision_mlp, d, rngs=rngs)

  def __call__(self, x, cos, sin):
    n, l, d = x.shape
    hd = d // self.heads
    q, k, v = jnp.split(self.qkv(self.norm1(x)).reshape(n, l, 3, self.heads, hd), 3, axis=2)
    q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
    q, k = rotate(q, cos[None], sin[None]), rotate(k, cos[None], sin[None])
    att = jnp.einsum("nqhd,nkhd->nhqk", q, k) / jnp.sqrt(hd).astype(x.dtype)
    o = jnp.einsum("nhqk,nkhd->nqhd", jax.nn.softmax(att, axis=-1), v).reshape(n, l, d)
    x = x + self.proj(o)
    return x + self.fc2(jax.nn.gelu(self.fc1(self.norm2(x))))


class VisionEncoder(nnx.Module):
  """pixel_values [N, H, W, 3] float32 in [0, 1] -> merged tokens [N, (H/2p)*(W/2p), hidden]."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    p, d = cfg.patch_size, cfg.vision_hidden
    self.gh, self.gw = cfg.image_h // p, cfg.image_w // p
    self.patch_embed = nnx.Linear(p * p * 3, d, rngs=rngs)
    # Learned absolute positions, initialised to a 2D sin-cos table (MAE) so that where a patch is
    # is readable from the first step: an RL policy trained from scratch must point at things.
    self.pos_embed = nnx.Param(sincos_2d(self.gh, self.gw, d))
    self.blocks = nnx.List([VisionBlock(cfg, rngs) for _ in range(cfg.vision_depth)])
    self.merge_norm = nnx.LayerNorm(d, rngs=rngs)
    self.merge_fc1 = nnx.Linear(4 * d, 4 * d, rngs=rngs)
    self.merge_fc2 = nnx.Linear(4 * d, cfg.hidden, rngs=rngs)

  def __call__(self, pixel_values: jax.Array) -> jax.Array:
    cfg, p = self.cfg, self.cfg.patch_size
    n = pixel_values.shape[0]
    x = (pixel_values - 0.5) / 0.5
    x = x.reshape(n, self.gh, p, self.gw, p, 3).transpose(0, 1, 3, 2, 4, 5).reshape(n, self.gh * self.gw, -1)
    x = self.patch_embed(x) + self.pos_embed[...][None]
    cos, sin = rope_2d_cos_sin(self.gh, self.gw, cfg.vision_hidden // cfg.vision_heads, cfg.vision_rope_theta)
    for blk in self.blocks:
      x = blk(x, cos, sin)
    x = self.merge_norm(x)
    d = x.shape[-1]
    # 2x2 merger: concatenate each 2x2 neighbourhood of patches (Qwen2-VL PatchMerger).
    x = x.reshape(n, self.gh // 2, 2, self.gw // 2, 2, d).transpose(0, 1, 3, 2, 4, 5)
    x = x.reshape(n, (self.gh // 2) * (self.gw // 2), 4 * d)
    return self.merge_fc2(jax.nn.gelu(self.merge_fc1(x)))
