"""The model call and the optimiser step every update shares. PPO (train/ppo.py), SFT (train/sft.py),
CT (train/ct.py), value pretraining (train/value_pretrain.py), the ORM (train/orm.py) and the pointing
probe call these instead of each assembling the call and the step themselves.

A batch is a `trajectory.Batch` dict: tokens / attn_mask [B, T] int32, pixel_values
[B, M, H, W, 3] float32, image_mask [B, M] bool, loss_mask / states [B, T-1]. How its tokens become
the model's inputs (the IMAGE placeholder id, the screenshot's merged-patch grid) is a `ModelInputs`,
apart from the RL hyper-parameters (`ppo.PPOHparams`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from tars_jax.models import rope_positions
from tars_jax.models.inference import sampler


@dataclasses.dataclass(frozen=True)
class ModelInputs:
  """How a collated batch becomes the model's inputs (hashable: a static jit argument).

  image_token_id: the IMAGE placeholder token id (int); grid_hw: merged patches per screenshot,
  (rows, cols), where M-RoPE places the image tokens (`models.rope_positions`).
  """

  image_token_id: int
  grid_hw: tuple[int, int]


def positions(tokens: jax.Array, attn_mask: jax.Array, inputs: ModelInputs) -> jax.Array:
  """M-RoPE position ids [3, B, T] int32 of a batch (`models.rope_positions`; image tokens on the
  screenshot grid). tokens, attn_mask: [B, T]."""
  return rope_positions(tokens, attn_mask, inputs.image_token_id, inputs.grid_hw)


def allowed_tokens(table, states: jax.Array, mask: jax.Array) -> jax.Array | None:
  """[B, T, V] bool: grammar-allowed tokens where mask = 1, every token elsewhere (no -inf row), or None
  without a grammar table. table: [S, V] int32 (-1 = not allowed); states, mask: [B, T]."""
  if table is None:
    return None
  allowed = jnp.asarray(table)[states] >= 0
  return jnp.where(mask[..., None] > 0, allowed, True)


def forward(graphdef, params, batch: dict, inputs: ModelInputs, image_features=None, **kwargs):
  """The model (`nnx.merge(graphdef, params)`: a policy or a critic) on a collated batch; kwargs go to
  the model's call (e.g. `moe_stats=True`). Returns what the model returns.

  image_features: None (the screenshots `batch["pixel_values"]` go through the model's vision encoder),
  or their features [B, M, 1 + n_deepstack, n_img_tokens, D] precomputed by this model's encoder
  (`Trunk.image_features`): used as constants (no gradient reaches the encoder), the vision encoder
  is not run."""
  model = nnx.merge(graphdef, params)
  pos = positions(batch["tokens"], batch["attn_mask"], inputs)
  if image_features is None:
    return model(batch["tokens"], pos, batch["attn_mask"], batch["pixel_values"], batch["image_mask"], **kwargs)
  visual = model.trunk.visual_from_features(batch["tokens"], jax.lax.stop_gradient(image_features))
  return model(batch["tokens"], pos, batch["attn_mask"], visual=visual, **kwargs)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def image_features(graphdef, params, pixel_values: jax.Array, image_mask: jax.Array) -> jax.Array:
  """[B, M, 1 + n_deepstack, n_img_tokens, D]: the screenshots' features under the vision encoder of
  the model `nnx.merge(graphdef, params)` (`Trunk.image_features`; jitted), for `forward(image_features=)`.
  pixel_values: [B, M, H, W, 3] float32 in [0, 1]; image_mask: [B, M] bool."""
  return nnx.merge(graphdef, params).trunk.image_features(pixel_values, image_mask)


def target_logp(logits: jax.Array, tokens: jax.Array, allowed: jax.Array | None = None,
                temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """(logp [B, T-1] float32 of each next token `tokens[:, 1:]`, logp_all [B, T-1, V] float32) under
  log_softmax(logits / temperature) over the allowed tokens: the sampler's distribution
  (`sampler.constrained_log_softmax`; temperature 0 = 1). logits: [B, T, V] of the whole sequence; allowed: [B, T-1, V]."""
  logp_all = sampler.constrained_log_softmax(logits[:, :-1], allowed, temperature)
  return jnp.take_along_axis(logp_all, tokens[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0], logp_all


def apply_gradients(loss_fn: Callable, params, opt_state, opt: optax.GradientTransformation, *args,
                    extra_grads=None) -> tuple[Any, Any, jax.Array, dict, jax.Array]:
  """One optimiser step on `loss_fn(params, *args) -> (loss scalar, metrics dict)`, traced inside the
  caller's jit: (new params, new opt_state, loss, metrics, global norm of the gradient before
  clipping). Every update of the project is this step (PPO's joint policy + critic step makes two).
  extra_grads: None, or a gradient tree like `params` added before the step: the gradient of a further
  loss term at the same params, computed by its own jitted call (PPO-ptx's demonstration term: its
  batch shapes then do not multiply the compiled shapes of this step)."""
  (loss, metrics), g = jax.value_and_grad(loss_fn, has_aux=True)(params, *args)
  if extra_grads is not None:
    g = jax.tree.map(jnp.add, g, extra_grads)
  updates, opt_state = opt.update(g, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss, metrics, optax.global_norm(g)


@functools.cache
def bind(loss_fn: Callable, **static) -> Callable:
  """`loss_fn` with its static keyword arguments (graphdef, `ModelInputs`, constants: all hashable)
  bound, one object per distinct binding: `update`'s jit cache is keyed on it, so each binding
  compiles once per batch shape."""
  return functools.partial(loss_fn, **static)


@functools.partial(jax.jit, static_argnames=("loss_fn", "opt"))
def update(params, opt_state, *args, loss_fn: Callable, opt: optax.GradientTransformation):
  """One jitted update of the supervised stages (SFT, CT, the ORM): `apply_gradients` of
  `loss_fn(params, *args)` (a `bind` of a loss with its static arguments; args are arrays, e.g. the
  batch and the grammar table). Returns (params, opt_state, metrics + loss, grad_norm)."""
  params, opt_state, loss, m, gnorm = apply_gradients(loss_fn, params, opt_state, opt, *args)
  return params, opt_state, dict(m, loss=loss, grad_norm=gnorm)
