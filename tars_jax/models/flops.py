"""Model FLOPs of a forward / train step, for MFU (model FLOPs utilisation, PaLM appendix B).

Counts the matrix-multiply FLOPs (2 per multiply-add) a `Policy` of `ModelConfig` needs for one batch,
from the config alone — what the model must compute, not what an implementation happens to execute:

  * decoder, per token: q/k/v/o projections, the router, `top_k` experts of a MoE layer (gate, up,
    down: 3 * hidden * moe_intermediate each) or the dense SwiGLU MLP, the LM head;
  * causal self-attention, per row of T tokens: QK^T and PV over the T (T + 1) / 2 (query, key)
    pairs a causal mask keeps (half of the square; padding counted as tokens);
  * vision encoder, per image: patch embedding, qkv / proj / MLP of every block, full attention over
    the image's patches (qwen2_5_vl: window attention over `window_size`-pixel windows outside
    `fullatt_block_indexes`), the 2x2 merger and each DeepStack merger.

Elementwise work (norms, softmax, rotary, SiLU) is left out, as in the usual 6 N D count. A train step
(forward + backward with respect to parameters and activations) is 3 x the forward FLOPs. The executed
FLOPs of an implementation can be larger: the "dense" MoE runs all `experts` on every token
(`experts / top_k` x the expert FLOPs), our window attention masks a full product; XLA's
`compiled.cost_analysis()["flops"]` reports those (benchmarks/train_step_gpu.py prints both).

Reference: Chowdhery et al. 2022 (PaLM), appendix B (model FLOPs = 6 N per token + attention);
Korthikanti et al. 2022, section 6 (the per-layer matmul count with attention).
"""

from __future__ import annotations

import dataclasses

from tars_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Flops:
  """Forward FLOPs of one batch by part (float, FLOPs = 2 x multiply-adds)."""
  decoder_dense: float      # projections, router, expert / MLP matmuls: per-token terms of the decoder
  decoder_attention: float  # QK^T and PV under the causal mask
  lm_head: float
  vision: float             # the whole encoder incl. its attention, merger and DeepStack mergers

  @property
  def forward(self) -> float:
    return self.decoder_dense + self.decoder_attention + self.lm_head + self.vision

  @property
  def train_step(self) -> float:
    """Forward + backward: the backward pass costs twice the forward's matmuls (grads w.r.t. inputs
    and w.r.t. weights)."""
    return 3.0 * self.forward


def active_decoder_params_per_token(cfg: ModelConfig) -> float:
  """Decoder weight entries one token multiplies by (attention projections, router, `top_k` experts
  or the dense MLP, over all layers; embeddings and LM head excluded)."""
  d, h, kv, hd = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim
  attn = d * h * hd * 2 + d * kv * hd * 2
  total = 0.0
  for i in range(cfg.layers):
    if cfg.is_sparse(i):
      total += attn + d * cfg.experts + cfg.top_k * 3 * d * cfg.moe_intermediate
    else:
      total += attn + 3 * d * cfg.dense_intermediate
  return total


def vision_forward_flops(cfg: ModelConfig, grid_h: int, grid_w: int) -> float:
  """Forward FLOPs of the vision encoder on one image of `grid_h` x `grid_w` patches (each a multiple
  of `spatial_merge_size`)."""
  n = grid_h * grid_w
  d, m2 = cfg.vision_hidden, cfg.spatial_merge_size ** 2
  f = 2.0 * n * (3 * cfg.temporal_patch_size * cfg.patch_size ** 2) * d  # patch embedding
  mlp_mats = 3 if cfg.family == "qwen2_5_vl" else 2
  per_block_tokens = 2.0 * n * (3 * d * d + d * d + mlp_mats * d * cfg.vision_mlp)
  win = max(1, cfg.window_size // cfg.patch_size) ** 2  # patches per window (qwen2_5_vl)
  for b in range(cfg.vision_depth):
    keys = n if (cfg.family != "qwen2_5_vl" or b in cfg.fullatt_block_indexes) else min(n, win)
    f += per_block_tokens + 2 * 2.0 * n * keys * d  # QK^T and PV, all heads (heads * head_dim = d)
  merged = n // m2
  merger = 2.0 * merged * (m2 * d * m2 * d + m2 * d * cfg.hidden)
  return f + merger * (1 + len(cfg.deepstack_visual_indexes))


def forward_flops(cfg: ModelConfig, batch: int, seq: int, images_per_row: int = 0,
                  image_hw: tuple[int, int] | None = None) -> Flops:
  """Model FLOPs of one forward pass over `batch` rows of `seq` tokens, each row with
  `images_per_row` images of `image_hw` = (height, width) pixels (default: the config's
  image_h x image_w).

  Raises ValueError if the image size is not a multiple of `patch_size * spatial_merge_size`.
  """
  tokens = float(batch * seq)
  per_tok = active_decoder_params_per_token(cfg)
  attn = cfg.layers * batch * 2 * 2.0 * cfg.heads * cfg.head_dim * seq * (seq + 1) / 2
  vision = 0.0
  if images_per_row:
    ih, iw = image_hw or (cfg.image_h, cfg.image_w)
    unit = cfg.patch_size * cfg.spatial_merge_size
    if ih % unit or iw % unit:
      raise ValueError(f"image {ih}x{iw} px is not a multiple of patch_size * spatial_merge_size = {unit}")
    vision = batch * images_per_row * vision_forward_flops(cfg, ih // cfg.patch_size, iw // cfg.patch_size)
  return Flops(decoder_dense=2.0 * tokens * per_tok, decoder_attention=attn,
               lm_head=2.0 * tokens * cfg.hidden * cfg.vocab_size, vision=vision)
