"""Model configuration of the policy/critic family (structure of transformers' `qwen3_vl_moe`).

Field <-> transformers `Qwen3VLMoeConfig` names (`hf_io.config_from_hf` / `config_to_hf` convert):
  vision: patch_size, vision_hidden = hidden_size, vision_depth = depth, vision_heads = num_heads,
          vision_mlp = intermediate_size, temporal_patch_size, spatial_merge_size,
          num_position_embeddings, deepstack_visual_indexes;
  text:   vocab_size, hidden = hidden_size, layers = num_hidden_layers, heads = num_attention_heads,
          kv_heads = num_key_value_heads, head_dim, experts = num_experts, top_k = num_experts_per_tok,
          moe_intermediate = moe_intermediate_size, dense_intermediate = intermediate_size,
          decoder_sparse_step, mlp_only_layers, norm_topk_prob, mrope_section (rope_parameters),
          rope_theta, rms_eps; top level: image_token_id, tie_word_embeddings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

FAMILIES = ("qwen3_vl_moe", "qwen2_5_vl")  # transformers model_type values this code implements
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP normalisation (Qwen2.5-VL processor)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Rematerialisation of each decoder layer / vision block in the backward pass (`jax.checkpoint`):
# "none" keeps all activations; "full" recomputes the block; "dots" saves matmul outputs only.
REMAT_POLICIES = ("none", "full", "dots")
# MoE computation: "dense" (every expert on every token, weighted: exact reference), "ragged"
# (tokens sorted by expert, `jax.lax.ragged_dot`; with a capacity factor an [E, C, D] buffer) or
# "blocked" (tokens sorted by expert into fixed-size blocks, one expert per block, batched matmuls
# over gathered expert weights: dropless; its decode paths are the fast CPU ones) or "grouped"
# (blocked's decode paths; for many rows a while loop over exact per-expert chunks: the fastest CPU
# train step, and with its faster prefill the fastest CPU decode).
MOE_IMPLS = ("dense", "ragged", "blocked", "grouped")
# Attention core (`attention.py`): "einsum" (autodiff saves every layer's [B, H, L, S] scores and
# probabilities) or "recompute" (custom VJP: saves the output and two row statistics, recomputes the
# probabilities in the backward).
ATTENTION_IMPLS = ("einsum", "recompute")
# How routed tokens meet expert-sharded weights on a mesh with an `expert` axis: "gspmd" (the compiler
# partitions the ragged computation) or "all_to_all" (explicit dispatch / return `all_to_all` in a
# `shard_map`, `expert_parallel.py`).
MOE_DISPATCHES = ("gspmd", "all_to_all")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Fields of the vision encoder and the MoE decoder.

  Images are `image_h` x `image_w` pixels (height x width; the defaults 224 x 168 are portrait, like
  MiniWoB's 160 x 210 screen) cut into `patch_size` patches; a 2x2 merger makes
  `merged_grid = (image_h / 2p, image_w / 2p)` decoder tokens per image (8 x 6 = 48 by default).
  `decoder_sparse_step`: layer i (0-based) is MoE iff (i + 1) % step == 0 (1 = all, as transformers);
  other layers use a dense SwiGLU MLP of width `dense_intermediate`. `experts = 0` = dense model.
  `mrope_section` splits the head_dim / 2 rotary frequencies over (t, h, w), interleaved as
  Qwen3-VL; None = an even split. `dtype` is the activation/compute dtype ("float32" or "bfloat16");
  parameters are always float32 and logits are returned in float32.
  `family` picks the architecture (`FAMILIES`). Vision: each image is cut into `patch_size` patches
  (`temporal_patch_size` copies of the frame, as transformers' image processor does for stills);
  the learned position table has `num_position_embeddings` = side^2 entries, bilinearly resampled
  to the image's patch grid (None = (max patch-grid side)^2 of `image_h` x `image_w`: no resampling
  for square grids); `deepstack_visual_indexes` lists vision blocks whose merged outputs are added to
  the image-token hidden states after decoder layers 0, 1, ... (DeepStack; () = none).
  `mlp_only_layers`: decoder layers forced dense. `image_token_id`: the placeholder id (our byte
  tokenizer's IMAGE = 259). `tie_word_embeddings`: LM head = embedding matrix.
  `family = "qwen2_5_vl"` (transformers `Qwen2_5_VLForConditionalGeneration`): RMSNorm + SwiGLU
  (with biases) vision blocks, no learned positions, window attention (windows of `window_size`
  pixels) except in `fullatt_block_indexes`, RMSNorm merger; a dense Qwen2 decoder (q/k/v biases,
  no qk-norm, `experts = 0`, head_dim = hidden / heads) with contiguous (not interleaved) M-RoPE
  sections. `image_mean` / `image_std` normalise [0, 1] pixels (None: the family's processor
  default, 0.5 / 0.5 for qwen3_vl_moe, CLIP's for qwen2_5_vl).
  Memory knobs: `dtype = "bfloat16"` (activations), `remat` in `REMAT_POLICIES` (per decoder layer
  and vision block: "none", "full" recompute, or "dots" = keep matmul outputs, recompute the rest);
  `attention_impl` in `ATTENTION_IMPLS` (decoder and ViT): "einsum" (autodiff keeps each layer's
  [B, heads, L, S] scores and probabilities) or "recompute" (custom VJP keeping the output and two
  [B, heads, L] row statistics: fewer temporaries per layer for a recomputed QK^T and exp in the
  backward, a memory knob rather than a speed one, see attention.py);
  `attention_block`: without a KV cache (training, scoring) and in a prefill written from a static
  cache slot 0 (the sampler's) the decoder's causal attention runs in
  blocks of this many queries, block j against key slots [0, (j + 1) * block) only (0 = one full
  L x L square; `attention.attend_causal_blocks`): skipping the masked upper triangle makes long rows
  faster, short rows (one block or so) unchanged (benchmarks/RESULTS.md, "Causal query blocks for
  attention without a cache");
  `scan_layers = True`: the decoder layers, and the vision blocks, are each one stacked module (every
  parameter gets a leading [layers] / [vision_depth] axis, logical name "layers") run by
  `jax.lax.scan`, so the step compiles one layer body and one block body instead of unrolled copies
  (compile time and HLO size independent of depth, as maxtext's `scan_layers`); same outputs and gradients, the KV cache is stacked [layers, B, KV, S, hd]. Every
  layer must then have the same structure: a mix of dense and MoE layers (`decoder_sparse_step > 1`,
  `mlp_only_layers`) raises ValueError here rather than scanning over periods.
  MoE compute: `moe_impl` in `MOE_IMPLS` ("dense": exact reference, all experts on all tokens;
  "ragged": dropless grouped matmuls over tokens sorted by expert, same outputs and gradients;
  "blocked": the same grouping padded to blocks of rows with one expert each, as batched matmuls:
  at decode (N * k <= E) each token's k expert matrices only, for few rows per expert a bounded
  [E, C, D] buffer with the dense path as exact fallback; "grouped": blocked's paths for few rows,
  else a `lax.while_loop` over the chunks each expert's group really needs, with a hand-written
  backward (`grouped_mlp.py`): no padding to a static bound, no weight gathers; the fastest train
  step and (by its prefill) the fastest decode on CPU; a single-device / data-parallel path: under
  expert parallelism every chunk's dynamic weight index gathers the expert, use "ragged" there).
  On a GPU the ranking inverts: "blocked" / "dense" (large batched matmuls) are the fast train steps,
  "grouped" and "ragged" slower, and `remat = "full"` cuts the step's temporaries by a large factor
  for a small share of its time (benchmarks/RESULTS.md, "Train-step MFU on an H200");
  `moe_capacity_factor` (ragged only; None = dropless): at most ceil(factor * tokens * top_k /
  experts) assignments per expert, the rest dropped and counted (`Policy(..., moe_stats=True)`;
  the trainer logs `train/moe_dropped_frac`).
  `moe_dispatch` in `MOE_DISPATCHES` (needs moe_impl "ragged"; matters only under a mesh whose
  `expert` axis has size > 1): "gspmd" leaves the expert parallelism to the compiler; "all_to_all"
  sends each assignment to the shard owning its expert and back with explicit `all_to_all`s
  (`expert_parallel.moe_all_to_all`: dropless with send buffers of N_l * k rows per destination, or
  with the capacity factor counted per expert and source shard).
  `moe_decode_kernel` ("blocked" / "grouped" on XLA:CPU without a mesh): the sampler's decode loop
  runs each MoE layer's experts with the FFI kernel of `expert_kernel.py` (tile-packed float32
  weights streamed once per step on all cores, exactly the routed rows, so decode is bound by memory
  bandwidth rather than per-expert dispatch; benchmarks/RESULTS.md, "Decode experts as an FFI
  kernel") when it builds and the layer is float32 with hidden
  a multiple of 16 and moe_intermediate of 8; False, or where it does not apply, keeps XLA's
  per-expert dots. Same tokens either way; values differ by float32 rounding (sums in another order).
  `moe_grouped_blas` ("grouped" on XLA:CPU without a mesh, float32): the experts of the grouped path
  (train step, prefill) run as one OpenBLAS-backed custom call forward and one backward
  (`expert_kernel.grouped_swiglu`) instead of XLA's while loop over chunks; same math, float32
  rounding aside. False, or where it does not apply (bf16, a mesh, an accelerator), keeps the loop.
  The defaults are the `tiny()` preset (1.48M parameters: 0.42M vision, 1.05M text) for RL on CPU.
  """

  vocab_size: int = 264
  image_h: int = 224
  image_w: int = 168
  patch_size: int = 14
  vision_hidden: int = 96
  vision_depth: int = 2
  vision_heads: int = 4
  vision_mlp: int = 192
  hidden: int = 128
  layers: int = 4
  heads: int = 4
  kv_heads: int = 2
  head_dim: int = 32
  experts: int = 4
  top_k: int = 2
  moe_intermediate: int = 128
  dense_intermediate: int = 256
  norm_topk_prob: bool = True
  decoder_sparse_step: int = 1
  rope_theta: float = 10000.0
  vision_rope_theta: float = 10000.0
  rms_eps: float = 1e-6
  mrope_section: tuple[int, int, int] | None = None
  dtype: str = "float32"
  family: str = "qwen3_vl_moe"
  temporal_patch_size: int = 1
  spatial_merge_size: int = 2
  num_position_embeddings: int | None = None
  deepstack_visual_indexes: tuple[int, ...] = ()
  mlp_only_layers: tuple[int, ...] = ()
  image_token_id: int = 259
  tie_word_embeddings: bool = False
  window_size: int = 112
  fullatt_block_indexes: tuple[int, ...] = ()
  image_mean: tuple[float, float, float] | None = None
  image_std: tuple[float, float, float] | None = None
  remat: str = "none"
  attention_impl: str = "einsum"
  attention_block: int = 64
  moe_impl: str = "dense"
  moe_capacity_factor: float | None = None
  moe_dispatch: str = "gspmd"
  moe_decode_kernel: bool = True
  moe_grouped_blas: bool = True
  scan_layers: bool = False

  def __post_init__(self):
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat={self.remat!r}; known: {list(REMAT_POLICIES)}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"attention_impl={self.attention_impl!r}; known: {list(ATTENTION_IMPLS)}")
    if self.attention_block < 0:
      raise ValueError(f"attention_block={self.attention_block} must be >= 0 (0 = one full square)")
    if self.moe_impl not in MOE_IMPLS:
      raise ValueError(f"moe_impl={self.moe_impl!r}; known: {list(MOE_IMPLS)}")
    if self.moe_dispatch not in MOE_DISPATCHES:
      raise ValueError(f"moe_dispatch={self.moe_dispatch!r}; known: {list(MOE_DISPATCHES)}")
    if self.moe_dispatch == "all_to_all" and self.moe_impl != "ragged":
      raise ValueError("moe_dispatch='all_to_all' needs moe_impl='ragged' (its experts run as ragged_dot)")
    if self.moe_capacity_factor is not None:
      if self.moe_impl != "ragged":
        raise ValueError("moe_capacity_factor needs moe_impl='ragged' (the dense path computes every expert)")
      if not self.moe_capacity_factor > 0:
        raise ValueError(f"moe_capacity_factor={self.moe_capacity_factor} must be > 0 (None = dropless)")
    if self.family not in FAMILIES:
      raise ValueError(f"unknown model family {self.family!r}; known: {list(FAMILIES)}")
    for name in ("deepstack_visual_indexes", "mlp_only_layers", "fullatt_block_indexes"):
      object.__setattr__(self, name, tuple(int(i) for i in getattr(self, name)))
    for name in ("image_mean", "image_std"):
      if getattr(self, name) is not None:
        object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))
    if self.family == "qwen2_5_vl":
      if self.experts or self.deepstack_visual_indexes:
        raise ValueError("qwen2_5_vl is a dense model without DeepStack: set experts=0, deepstack_visual_indexes=()")
      if self.head_dim * self.heads != self.hidden:
        raise ValueError(f"qwen2_5_vl needs head_dim * heads == hidden ({self.head_dim} * {self.heads} != {self.hidden})")
    if any(not 0 <= i < self.vision_depth for i in self.deepstack_visual_indexes):
      raise ValueError(f"deepstack_visual_indexes {self.deepstack_visual_indexes} outside [0, {self.vision_depth})")
    if len(set(self.deepstack_visual_indexes)) != len(self.deepstack_visual_indexes):
      # one DeepStack level per block: a repeated block would get one merger's output, not two levels
      raise ValueError(f"deepstack_visual_indexes {self.deepstack_visual_indexes} repeats a block")
    if len(self.deepstack_visual_indexes) > self.layers:
      raise ValueError(f"{len(self.deepstack_visual_indexes)} deepstack levels > {self.layers} decoder layers")
    if self.heads % self.kv_heads:
      raise ValueError(f"heads={self.heads} not a multiple of kv_heads={self.kv_heads}")
    if self.vision_hidden % self.vision_heads or (self.vision_hidden // self.vision_heads) % 4:
      raise ValueError("vision head dim (vision_hidden / vision_heads) must be a multiple of 4 (2D rope)")
    if self.experts and not 0 < self.top_k <= self.experts:
      raise ValueError(f"top_k={self.top_k} must be in [1, experts={self.experts}]")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even")
    if self.mrope_section is not None and sum(self.mrope_section) != self.head_dim // 2:
      raise ValueError(f"mrope_section {self.mrope_section} must sum to head_dim / 2 = {self.head_dim // 2}")
    jnp.dtype(self.dtype)  # raises TypeError for an unknown dtype name
    if self.scan_layers:
      kinds = {self.is_sparse(i) for i in range(self.layers)}
      if len(kinds) > 1:  # one scanned body = one layer structure; mixed dense/MoE stacks cannot scan
        dense = [i for i in range(self.layers) if not self.is_sparse(i)]
        raise ValueError(f"scan_layers=True needs every decoder layer to have the same structure, but layers "
                         f"{dense} are dense and the others MoE (decoder_sparse_step={self.decoder_sparse_step}, "
                         f"mlp_only_layers={self.mlp_only_layers}); set scan_layers=False")

  @classmethod
  def tiny(cls, **overrides) -> "ModelConfig":
    """The CPU-RL preset (the defaults): ViT 2 x 96 on 224x168 (H x W) images, 48 image tokens;
    4-layer MoE decoder, hidden 128, 4 heads / 2 KV heads, 4 experts top-2."""
    return cls(**overrides)

  @classmethod
  def from_dict(cls, d: Any) -> "ModelConfig":
    """From a dict or an `ml_collections.ConfigDict`; unknown keys raise ValueError naming them."""
    if hasattr(d, "to_dict"):
      d = d.to_dict()
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
      raise ValueError(f"unknown model config fields {sorted(unknown)}")
    d = dict(d)
    for name in ("deepstack_visual_indexes", "mlp_only_layers", "fullatt_block_indexes"):
      if d.get(name) is not None:
        d[name] = tuple(int(x) for x in d[name])
    for name in ("image_mean", "image_std"):  # CLIP-style normalisation: fractions, never integers
      if d.get(name) is not None:
        d[name] = tuple(float(x) for x in d[name])
    if d.get("mrope_section") is not None:
      d["mrope_section"] = tuple(int(x) for x in d["mrope_section"])
    return cls(**d)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @property
  def jdtype(self):
    return jnp.dtype(self.dtype)

  @property
  def merged_grid(self) -> tuple[int, int]:
    """(rows, cols) of merged vision tokens per image. Raises ValueError if not divisible."""
    p2 = self.spatial_merge_size * self.patch_size
    if self.image_h % p2 or self.image_w % p2:
      raise ValueError(f"image {self.image_h}x{self.image_w} not divisible by merge*patch_size={p2}")
    return self.image_h // p2, self.image_w // p2

  @property
  def interleaved_mrope(self) -> bool:
    """Qwen3-VL interleaves the (t, h, w) frequencies; Qwen2.5-VL gives each a contiguous chunk."""
    return self.family != "qwen2_5_vl"

  @property
  def pixel_norm(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std) per channel applied to [0, 1] pixels."""
    if self.family == "qwen2_5_vl":
      default = (CLIP_MEAN, CLIP_STD)
    else:
      default = ((0.5,) * 3, (0.5,) * 3)
    return (self.image_mean or default[0], self.image_std or default[1])

  @property
  def pos_table_side(self) -> int:
    """Side of the square learned vision position table (`num_position_embeddings` = side^2)."""
    if self.num_position_embeddings is None:
      return max(self.image_h, self.image_w) // self.patch_size
    side = int(round(self.num_position_embeddings ** 0.5))
    if side * side != self.num_position_embeddings:
      raise ValueError(f"num_position_embeddings={self.num_position_embeddings} is not a square")
    return side

  @property
  def n_img_tokens(self) -> int:
    h, w = self.merged_grid
    return h * w

  @property
  def sections(self) -> tuple[int, int, int]:
    """(t, h, w) counts of rotary frequencies; sums to head_dim / 2."""
    if self.mrope_section is not None:
      return tuple(self.mrope_section)
    half = self.head_dim // 2
    h = w = half // 3
    return (half - h - w, h, w)

  def is_sparse(self, layer_idx: int) -> bool:
    """transformers' rule: MoE iff not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    return (layer_idx not in self.mlp_only_layers and self.experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0)
