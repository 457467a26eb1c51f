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
from tars_jax.models.decoder import Decoder, KVCache, init_cache
from tars_jax.models.moe import load_balance_loss
from tars_jax.models.vision import VisionEncoder


class Trunk(nnx.Module):
  """Token embeddings (+ spliced image features) -> MoE decoder -> final RMSNorm.

  Shared by `Policy` and `ValueModel` (each has its own instance, i.e. separate parameters).
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, image_token_id: int = IMAGE):
    self.cfg, self.image_token_id = cfg, image_token_id
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden, dtype=cfg.jdtype, rngs=rngs)
    self.visual = VisionEncoder(cfg, rngs)
    self.decoder = Decoder(cfg, rngs)

  def embed_inputs(self, tokens, pixel_values=None, image_mask=None):
    """tokens [B, T] -> [B, T, D]; the k-th IMAGE token of a row takes merged vision token k of that
    row's images laid end to end ([M * n_img_tokens]). Image slots with image_mask False give zeros."""
    x = self.embed_tokens(tokens)
    if pixel_values is None:
      return x
    b, m = pixel_values.shape[:2]
    feats = self.visual(pixel_values.reshape((b * m,) + pixel_values.shape[2:]))  # [B*M, n, D]
    n = feats.shape[1]
    feats = feats.reshape(b, m, n, -1)
    if image_mask is not None:
      feats = feats * image_mask.astype(feats.dtype)[:, :, None, None]
    feats = feats.reshape(b, m * n, -1).astype(x.dtype)
    is_img = tokens == self.image_token_id
    idx = jnp.clip(jnp.cumsum(is_img, axis=-1) - 1, 0, m * n - 1)
    gathered = jnp.take_along_axis(feats, idx[..., None], axis=1)
    return jnp.where(is_img[..., None], gathered, x)

  def __call__(self, tokens, positions, attn_mask, pixel_values=None, image_mask=None,
               cache: KVCache | None = None, cache_index=None):
    """See `Policy.__call__`. Returns (hidden [B, T, D], aux_loss float32 scalar, new cache or None).

    aux_loss: switch load-balance loss pooled over all MoE layers and the `attn_mask` tokens
    (transformers `load_balancing_loss_func`), unscaled; 0 for a dense model.
    """
    attn_mask = attn_mask.astype(bool)
    x = self.embed_inputs(tokens, pixel_values, image_mask)
    ci = 0 if cache_index is None else cache_index
    h, routers, cache = self.decoder(x, positions, attn_mask, cache, ci)
    if routers:
      probs = jnp.stack([r[0] for r in routers])
      idx = jnp.stack([r[1] for r in routers])
      aux = load_balance_loss(probs, idx, self.cfg.experts, attn_mask.reshape(-1))
    else:
      aux = jnp.zeros((), jnp.float32)
    return h, aux, cache

  def init_cache(self, batch: int, length: int) -> KVCache:
    return init_cache(self.cfg, batch, length)


class Policy(nnx.Module):
  """Vision-language policy: `Trunk` + untied LM head."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.trunk = Trunk(cfg, rngs)
    self.lm_head = nnx.Linear(cfg.hidden, cfg.vocab_size, use_bias=False, dtype=cfg.jdtype, rngs=rngs)

  def __call__(self, tokens, positions, attn_mask, pixel_values=None, image_mask=None,
               cache: KVCache | None = None, cache_index=None):
    """Next-token logits.

    Args:
      tokens: [B, T] int32; positions: [3, B, T] int32 (`rope_positions`); attn_mask: [B, T] bool
        (False = padding: never attended to). Attention is causal.
      pixel_values: [B, M, H, W, 3] float32 in [0, 1] or None; image_mask: [B, M] bool or None.
      cache: None, or a `KVCache` (`init_cache`) to write these T tokens into at slots
        `cache_index` .. `cache_index + T - 1` (int32 scalar; prefill: 0) — they then attend to every
        earlier valid slot of the cache too.
    Returns:
      (logits [B, T, V] float32, aux_loss float32 scalar) without cache;
      (logits, aux_loss, new KVCache) with cache.
    """
    h, aux, new_cache = self.trunk(tokens, positions, attn_mask, pixel_values, image_mask, cache, cache_index)
    logits = self.lm_head(h).astype(jnp.float32)
    if cache is None:
      return logits, aux
    return logits, aux, new_cache

  def features(self, tokens, positions, attn_mask, pixel_values=None, image_mask=None):
    """Final hidden states (after the final norm): (hidden [B, T, D], aux_loss)."""
    h, aux, _ = self.trunk(tokens, positions, attn_mask, pixel_values, image_mask)
    return h, aux

  def init_cache(self, batch: int, length: int) -> KVCache:
    """Empty KV cache of `length` slots for a batch of `batch` rows."""
    return self.trunk.init_cache(batch, length)
