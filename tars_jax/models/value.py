"""The critic: the policy's trunk architecture (separate parameters) with a scalar value head."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from tars_jax.models.config import ModelConfig
from tars_jax.models.policy import Trunk


class ValueModel(nnx.Module):
  """__call__(tokens, positions, attn_mask, pixel_values, image_mask) -> (values [B, T] f32, aux).

  values[:, j] estimates the return from the state after token j (report section 2.5.4: value model
  of the same architecture as the policy).
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.trunk = Trunk(cfg, rngs)
    self.value_head = nnx.Linear(cfg.hidden, 1, kernel_init=nnx.initializers.zeros_init(), rngs=rngs)

  def __call__(self, tokens, positions, attn_mask, pixel_values=None, image_mask=None):
    h, aux, _ = self.trunk(tokens, positions, attn_mask, pixel_values, image_mask)
    return self.value_head(h)[..., 0].astype(jnp.float32), aux
