"""The critic: the policy's trunk class (separate parameters) with a scalar value head
(report section 2.5.4: a value model of the same architecture as the policy)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from tars_jax.models.config import ModelConfig
from tars_jax.models.policy import Trunk
from tars_jax.sharding import param_axes as ax


class ValueModel(nnx.Module):
  """__call__(tokens, positions, attn_mask, pixel_values, image_mask, visual=None) -> (values [B, T]
  float32, aux).

  values[:, j] estimates the return from the state after token j. The head starts at zero so
  initial values are 0 (no spurious advantages before value pretraining).
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.trunk = Trunk(cfg, rngs)
    self.value_head = nnx.Linear(cfg.hidden, 1, kernel_init=nnx.initializers.zeros_init(), rngs=rngs,
                                 kernel_metadata=ax("embed", None), bias_metadata=ax(None))

  def features(self, tokens, positions, attn_mask, pixel_values=None, image_mask=None, visual=None):
    """Final hidden states: (hidden [B, T, D], aux_loss). visual: as `Trunk.__call__`'s."""
    h, aux, _ = self.trunk(tokens, positions, attn_mask, pixel_values, image_mask, visual=visual)
    return h, aux

  def __call__(self, tokens, positions, attn_mask, pixel_values=None, image_mask=None, visual=None):
    h, aux = self.features(tokens, positions, attn_mask, pixel_values, image_mask, visual)
    return self.value_head(h.astype(jnp.float32))[..., 0], aux
