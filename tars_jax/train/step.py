"""The model call every update shares: a collated batch through the policy (or critic) and the
log-probs of its target tokens. PPO (train/ppo.py), SFT (train/sft.py), CT (train/ct.py), the ORM
(train/orm.py) and the pointing probe call these instead of each assembling the call themselves.

A batch is a `trajectory.Batch` dict: tokens / attn_mask [B, T] int32, pixel_values
[B, M, H, W, 3] float32, image_mask [B, M] bool, loss_mask / states [B, T-1].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tars_jax.models import rope_positions

from tars_jax.models.inference import sampler


def positions(tokens: jax.Array, attn_mask: jax.Array, hp) -> jax.Array:
  """M-RoPE position ids of a batch (`models.rope_positions`; image tokens on the screenshot grid).
  hp: anything with `image_token_id` and `grid_hw` (e.g. `ppo.PPOHparams`)."""
  return rope_positions(tokens, attn_mask, hp.image_token_id, hp.grid_hw)


def allowed_tokens(table, states: jax.Array, mask: jax.Array) -> jax.Array | None:
  """[B, T, V] bool: grammar-allowed tokens where mask = 1, every token elsewhere (no -inf row), or None
  without a grammar table. table: [S, V] int32 (-1 = not allowed); states, mask: [B, T]."""
  if table is None:
    return None
  allowed = jnp.asarray(table)[states] >= 0
  return jnp.where(mask[..., None] > 0, allowed, True)


def forward(graphdef, params, batch: dict, hp, **kwargs):
  """The model (`nnx.merge(graphdef, params)`: a policy or a critic) on a collated batch; kwargs go to
  the model's call (e.g. `moe_stats=True`). Returns what the model returns."""
  return nnx.merge(graphdef, params)(batch["tokens"], positions(batch["tokens"], batch["attn_mask"], hp),
                                     batch["attn_mask"], batch["pixel_values"], batch["image_mask"], **kwargs)


def target_logp(logits: jax.Array, tokens: jax.Array, allowed: jax.Array | None = None,
                temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """(logp [B, T-1] float32 of each next token `tokens[:, 1:]`, logp_all [B, T-1, V] float32) under
  log_softmax(logits / temperature) over the allowed tokens: the sampler's distribution
  (`sampler.constrained_log_softmax`; temperature 0 = 1). logits: [B, T, V] of the whole sequence; allowed: [B, T-1, V]."""
  logp_all = sampler.constrained_log_softmax(logits[:, :-1], allowed, temperature)
  return jnp.take_along_axis(logp_all, tokens[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0], logp_all
