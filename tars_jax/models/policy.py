"""The VLM policy: vision encoder + MoE decoder + LM head (transformers `qwen3_vl_moe`).

Image features replace the embeddings of `IMAGE` placeholder tokens in order: image m of a row
fills that row's m-th block of `n_img_tokens` IMAGE tokens (Qwen2-VL `<|image_pad|>` convention).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from tars_jax.models.config import ModelConfig
from tars_jax.models.decoder import HIDDEN, Decoder, KVCache, init_cache
from tars_jax.models.moe import load_balance_loss
from tars_jax.models.vision import VisionEncoder
from tars_jax.sharding import constrain, param_axes as ax

LOGITS = ("act_batch", "act_length", "act_vocab")  # logical axes of logits [B, T, V]


class PolicyOutput(NamedTuple):
  """What `Policy.__call__` returns, whatever its keyword arguments."""
  logits: jax.Array  # [B, T, V] float32
  aux_loss: jax.Array  # float32 scalar: MoE load-balance loss (0 for a dense model)
  cache: KVCache | None  # the updated KV cache when one was passed, else None
  moe_stats: dict | None  # with moe_stats=True: {"moe_dropped", "moe_assignments"} float32 scalars


class Trunk(nnx.Module):
  """Token embeddings (+ spliced image features) -> MoE decoder (+ DeepStack) -> final RMSNorm.

  Shared by `Policy` and `ValueModel` (each has its own instance, i.e. separate parameters).
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, image_token_id: int | None = None):
    self.cfg = cfg
    self.image_token_id = cfg.image_token_id if image_token_id is None else image_token_id
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden, dtype=cfg.jdtype, rngs=rngs,
                                  embedding_metadata=ax("vocab", "embed"))
    self.visual = VisionEncoder(cfg, rngs)
    self.decoder = Decoder(cfg, rngs)

  def image_features(self, pixel_values, image_mask=None):
    """pixel_values [B, M, H, W, 3] float32 in [0, 1] -> [B, M, 1 + n_deepstack, n_img_tokens, D]: each
    screenshot's merged vision tokens (then its DeepStack features); slots with image_mask [B, M]
    False give zeros. What `visual_from_features` places on the IMAGE tokens; computed once per
    rollout batch when the RL update keeps the vision encoder frozen (`ppo.PPOHparams.freeze_vision`)."""
    b, m = pixel_values.shape[:2]
    feats = self.visual.encode(pixel_values.reshape((b * m,) + pixel_values.shape[2:]))  # [S, B*M, n, D]
    s, _, n, d = feats.shape
    feats = feats.reshape(s, b, m, n, d)
    if image_mask is not None:
      feats = feats * image_mask.astype(feats.dtype)[None, :, :, None, None]
    return feats.transpose(1, 2, 0, 3, 4)

  def visual_from_features(self, tokens, feats):
    """tokens [B, T], feats [B, M, S, n, D] (`image_features`) -> [S, B, T, D]: the k-th IMAGE token of
    a row takes merged token k of that row's images laid end to end ([M * n]); other tokens get garbage."""
    b, m, s, n, d = feats.shape
    flat = feats.transpose(2, 0, 1, 3, 4).reshape(s, b, m * n, d)
    is_img = tokens == self.image_token_id
    idx = jnp.clip(jnp.cumsum(is_img, axis=-1) - 1, 0, m * n - 1)
    return jnp.take_along_axis(flat, idx[None, ..., None], axis=2)

  def visual_per_token(self, tokens, pixel_values, image_mask=None):
    """[1 + n_deepstack, B, T, D]: for each IMAGE token, its merged vision token (then its DeepStack
    features): `visual_from_features` of `image_features`. Image slots with image_mask False give
    zeros; other tokens get garbage."""
    return self.visual_from_features(tokens, self.image_features(pixel_values, image_mask))

  def embed_inputs(self, tokens, pixel_values=None, image_mask=None, visual=None):
    """tokens [B, T] -> ([B, T, D], deepstack [n, B, T, D] or None): token embeddings with the IMAGE
    tokens' replaced by `visual[0]` (`visual_per_token`, computed from pixel_values if not given)."""
    x = self.embed_tokens(tokens)
    if visual is None and pixel_values is not None:
      visual = self.visual_per_token(tokens, pixel_values, image_mask)
    if visual is None:
      return x, None
    is_img = (tokens == self.image_token_id)[..., None]
    x = jnp.where(is_img, visual[0].astype(x.dtype), x)
    deep = jnp.where(is_img[None], visual[1:], 0) if visual.shape[0] > 1 else None
    return x, deep

  def __call__(self, tokens, positions, attn_mask, pixel_values=None, image_mask=None,
               cache: KVCache | None = None, cache_index=None, visual=None, moe_stats: bool = False,
               decode_weights=None):
    """See `Policy.__call__`. Returns (hidden [B, T, D], aux_loss float32 scalar, new cache or None),
    plus with `moe_stats` a dict {"moe_dropped": float32 assignments dropped over capacity in all MoE
    layers, "moe_assignments": float32 top-k assignments in all MoE layers (padding included)}.

    visual: None, or precomputed per-token image features [1 + n_deepstack, B, T, D] (used instead of
    pixel_values; `hf_io.HFModel` builds them for images of several sizes).
    aux_loss: switch load-balance loss pooled over all MoE layers and the `attn_mask` tokens
    (transformers `load_balancing_loss_func`), unscaled; 0 for a dense model.
    """
    attn_mask = attn_mask.astype(bool)
    x, deep = self.embed_inputs(tokens, pixel_values, image_mask, visual)
    x = constrain(x, HIDDEN)
    ci = 0 if cache_index is None else cache_index
    h, routers, cache = self.decoder(x, positions, attn_mask, cache, ci, deep, decode_weights)
    if routers is not None:
      aux = load_balance_loss(routers[0], routers[1], self.cfg.experts, attn_mask.reshape(-1))
    else:
      aux = jnp.zeros((), jnp.float32)
    if not moe_stats:
      return h, aux, cache
    no = jnp.zeros((), jnp.float32)
    dropped = no if routers is None or len(routers) < 3 else jnp.sum(routers[2])
    assigned = jnp.float32(0 if routers is None else routers[1].size)
    return h, aux, cache, {"moe_dropped": dropped, "moe_assignments": assigned}

  def init_cache(self, batch: int, length: int) -> KVCache:
    return init_cache(self.cfg, batch, length)


class Policy(nnx.Module):
  """Vision-language policy: `Trunk` + untied LM head."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.trunk = Trunk(cfg, rngs)
    if not cfg.tie_word_embeddings:
      self.lm_head = nnx.Linear(cfg.hidden, cfg.vocab_size, use_bias=False, dtype=cfg.jdtype, rngs=rngs,
                                kernel_metadata=ax("embed", "vocab"))

  def logits(self, h):
    """Final hidden states [..., D] -> float32 logits [..., V] (tied: embedding matrix transposed)."""
    if self.cfg.tie_word_embeddings:
      out = self.trunk.embed_tokens.attend(h).astype(jnp.float32)
    else:
      out = self.lm_head(h).astype(jnp.float32)
    return constrain(out, LOGITS) if out.ndim == 3 else out

  def __call__(self, tokens, positions, attn_mask, pixel_values=None, image_mask=None,
               cache: KVCache | None = None, cache_index=None, visual=None, moe_stats: bool = False,
               decode_weights=None) -> PolicyOutput:
    """Next-token logits.

    Args:
      tokens: [B, T] int32; positions: [3, B, T] int32 (`rope_positions`); attn_mask: [B, T] bool
        (False = padding: never attended to). Attention is causal.
      pixel_values: [B, M, H, W, 3] float32 in [0, 1] or None; image_mask: [B, M] bool or None.
      cache: None, or a `KVCache` (`init_cache`) to write these T tokens into at slots
        `cache_index` .. `cache_index + T - 1` (int32 scalar; prefill: 0) — they then attend to every
        earlier valid slot of the cache too.
      moe_stats: also compute the MoE routing statistics (`Trunk.__call__`).
      decode_weights: None, or the MoE experts' weights in the decode layout of the model's
        `MoeStrategy` (`moe.prepare_decode_weights(policy)`: what the sampler's decode loop passes).
    Returns:
      `PolicyOutput`: logits [B, T, V] float32, aux_loss float32 scalar, the new `KVCache` (None
      without cache), the stats dict (None without `moe_stats`).
    """
    out = self.trunk(tokens, positions, attn_mask, pixel_values, image_mask, cache, cache_index, visual,
                     moe_stats=moe_stats, decode_weights=decode_weights)
    return PolicyOutput(self.logits(out[0]), out[1], out[2] if cache is not None else None,
                        out[3] if moe_stats else None)

  def moe_strategy_summary(self) -> str:
    """How the MoE layers compute their experts (`moe.MoeStrategy.summary`), for a run's banner."""
    strategy = self.trunk.decoder.moe_strategy
    return "no MoE layers" if strategy is None else strategy.summary()

  def features(self, tokens, positions, attn_mask, pixel_values=None, image_mask=None):
    """Final hidden states (after the final norm): (hidden [B, T, D], aux_loss)."""
    h, aux, _ = self.trunk(tokens, positions, attn_mask, pixel_values, image_mask)
    return h, aux

  def init_cache(self, batch: int, length: int) -> KVCache:
    """Empty KV cache of `length` slots for a batch of `batch` rows."""
    return self.trunk.init_cache(batch, length)
