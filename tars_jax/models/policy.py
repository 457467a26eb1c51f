"""The VLM policy: vision encoder + MoE decoder + LM head (structure of `qwen3_vl_moe`).

Image features replace the embeddings of `IMAGE` placeholder tokens in order: image m of a row
fills that row's m-th block of `n_img_tokens` IMAGE tokens (Qwen2-VL `<|image_pad|>` convention).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tars_jax.agent.tokenizer import IMAGE
from tars_jax.models.config import ModelConfig
from tars_jax.models.decoder import DecoderLayer
from tars_jax.models.rope import mrope_cos_sin
from tars_jax.models.vision import VisionEncoder


class Trunk(nnx.Module):
  """Embeddings (text + spliced image features) -> decoder layers -> final RMSNorm."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, image_token_id: int = IMAGE):
    self.cfg, self.image_token_id = cfg, image_token_id
    self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden, rngs=rngs)
    self.vision = VisionEncoder(cfg, rngs)
    self.layers = nnx.List([DecoderLayer(cfg, i, rngs) for i in range(cfg.layers)])
    self.norm = nnx.RMSNorm(cfg.hidden, epsilon=cfg.rms_eps, rngs=rngs)

  def embed_inputs(self, tokens, pixel_values=None):
    x = self.embed(tokens)
    if pixel_values is None:
      return x
    b, m = pixel_values.shape[:2]
    feats = self.vision(pixel_values.reshape((b * m,) + pixel_values.shape[2:]))
    feats = feats.reshape(b, m * feats.shape[1], -1).astype(x.dtype)
    is_img = tokens == self.image_token_id
    idx = jnp.clip(jnp.cumsum(is_img, axis=-1) - 1, 0, feats.shape[1] - 1)
    gathered = jnp.take_along_axis(feats, idx[..., None], axis=1)
    return jnp.where(is_img[..., None], gathered, x)

  def __call__(self, tokens, positions, attn_mask, pixel_values=None, image_mask=None, cache=None,
               write_index=0, key_mask=None):
    """tokens [B, L] int32, positions [3, B, L], attn_mask [B, L] bool (real tokens).

    Without cache: causal self-attention over the L tokens restricted to attn_mask.
    With cache (list of {"k","v"} per layer, [B, S, KV, hd]): tokens are written at slots
    write_index.., attending over `key_mask` [B, S].
    Returns (hidden [B, L, D], mean MoE aux loss, new cache or None). `image_mask` [B, M] is
    accepted for interface symmetry; unused image slots are never referenced by IMAGE tokens.
    """
    del image_mask
    cfg = self.cfg
    x = self.embed_inputs(tokens, pixel_values)
    cos, sin = mrope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, cfg.sections)
    attn_mask = attn_mask.astype(bool)
    km = attn_mask if cache is None else key_mask
    aux, new_cache = [], [] if cache is not None else None
    for i, layer in enumerate(self.layers):
      x, a, c = layer(x, cos, sin, km, attn_mask, None if cache is None else cache[i], write_index)
      aux.append(a)
      if cache is not None:
        new_cache.append(c)
    return self.norm(x), jnp.mean(jnp.stack(aux)), new_cache

  def init_cache(self, batch: int, length: int, dtype=jnp.float32) -> list[dict]:
    cfg = self.cfg
    shape = (batch, length, cfg.kv_heads, cfg.head_dim)
    return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(cfg.layers)]


class Policy(nnx.Module):
  """__call__(tokens, positions, attn_mask, pixel_values, image_mask) -> (logits [B,T,V] f32, aux)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.trunk = Trunk(cfg, rngs)
    self.lm_head = nnx.Linear(cfg.hidden, cfg.vocab_size, use_bias=False, rngs=rngs)

  def __call__(self, tokens, positions, attn_mask, pixel_values=None, image_mask=None):
    h, aux, _ = self.trunk(tokens, positions, attn_mask, pixel_values, image_mask)
    return self.lm_head(h).astype(jnp.float32), aux

  def step(self, tokens, positions, attn_mask, cache, write_index, key_mask, pixel_values=None):
    """Cached forward (prefill or decode): (logits [B, L, V] f32, new cache)."""
    h, _, cache = self.trunk(tokens, positions, attn_mask, pixel_values, None, cache, write_index, key_mask)
    return self.lm_head(h).astype(jnp.float32), cache
