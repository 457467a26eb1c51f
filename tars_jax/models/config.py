"""Model configuration of the policy/critic family (structure of transformers' `qwen3_vl_moe`)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Fields of the vision encoder and the MoE decoder.

  Images are [image_h, image_w] pixels cut into `patch_size` patches; a 2x2 merger makes
  `merged_grid = (image_h / 2p, image_w / 2p)` decoder tokens per image.
  `decoder_sparse_step`: every k-th layer is MoE (1 = all); other layers use a dense SwiGLU MLP of
  width `dense_intermediate`. `mrope_section` splits head_dim / 2 rotary frequencies over (t, h, w),
  interleaved as Qwen3-VL; None = an even split.
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

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
    """From a (ConfigDict-derived) dict; unknown keys raise ValueError naming them."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
      raise ValueError(f"unknown model config fields {sorted(unknown)}")
    d = dict(d)
    if d.get("mrope_section") is not None:
      d["mrope_section"] = tuple(d["mrope_section"])
    return cls(**d)

  @property
  def merged_grid(self) -> tuple[int, int]:
    p2 = 2 * self.patch_size
    if self.image_h % p2 or self.image_w % p2:
      raise ValueError(f"image {self.image_h}x{self.image_w} not divisible by 2*patch_size={p2}")
    return self.image_h // p2, self.image_w // p2

  @property
  def n_img_tokens(self) -> int:
    h, w = self.merged_grid
    return h * w

  @property
  def sections(self) -> tuple[int, int, int]:
    if self.mrope_section is not None:
      return self.mrope_section
    half = self.head_dim // 2
    h = w = half // 3
    return (half - h - w, h, w)
