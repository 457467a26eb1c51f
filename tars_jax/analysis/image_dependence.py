"""How much a policy's decisions depend on its screenshot, layer by layer.

A GUI policy that ignores its screenshot can still look fine on a location prior (click where targets
usually are). This module measures the dependence directly: run the batch once with each row's own
screenshots and once with the screenshots of another row (a fixed permutation of the batch), and
compare, at the positions where the policy makes a free decision (model-written tokens at which the
grammar allows more than one token):

- `layer<i>` / `embed` / `final`: relative change of the residual stream,
  mean_q ||h(own) - h(other)|| / ||h(own)|| (0 = blind to the image at that depth);
- `tv`: total-variation distance between the two next-token distributions the sampler would draw
  from (grammar-constrained, temperature-scaled), mean over decisions; 1 = the decisions are
  entirely different, 0 = the same;
- `max_dlogit`: mean over decisions of the largest |change| of an allowed token's logit.

The text of the two runs is the same, so every difference is caused by the screenshot. Rows should
show different screens (e.g. different seeds): a row paired with an identical screenshot contributes
0. Only the decoder's unscanned layers are walked (`cfg.scan_layers=False`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tars_jax.models.rope import mrope_cos_sin, rope_positions
from tars_jax.rl.losses import masked_log_softmax


def decision_mask(batch: dict, table: jax.Array | None) -> np.ndarray:
  """[B, T-1] bool: target positions that are free decisions of the policy.

  `batch` is a `collate(...).as_dict()` batch (`loss_mask` [B, T-1] float32, `states` [B, T-1] int32
  grammar states); `table` the grammar table [S, V] int32 (None: free text, every model token counts).
  A position is a decision when its loss mask is 1 and the grammar allows at least two tokens there
  (grammar-forced tokens have probability 1 and cannot depend on anything).
  """
  mask = np.asarray(batch["loss_mask"]) > 0
  if table is None:
    return mask
  n_allowed = (np.asarray(table)[np.maximum(np.asarray(batch["states"]), 0)] >= 0).sum(-1)
  return mask & (n_allowed > 1)


def layer_states(policy, tokens, positions, attn_mask, pixel_values, image_mask):
  """[(name, [B, T, D] float32)] residual stream after the embedding (`embed`, image features spliced
  in), after each decoder layer (`layer<i>`, DeepStack added as in `Decoder.__call__`) and after the
  final norm (`final`), plus ("logits", [B, T, V] float32). Raises ValueError for scanned layers."""
  trunk = policy.trunk
  dec, cfg = trunk.decoder, trunk.decoder.cfg
  if cfg.scan_layers:
    raise ValueError("image_dependence walks unscanned decoder layers; build the model with scan_layers=False")
  x, deep = trunk.embed_inputs(tokens, pixel_values, image_mask)
  out = [("embed", x)]
  cos, sin = mrope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, cfg.sections, cfg.interleaved_mrope)
  key_mask = attn_mask.astype(bool)
  for i, layer in enumerate(dec.layers):
    x = layer(x, cos, sin, key_mask)[0]
    if deep is not None and i < deep.shape[0]:
      x = x + deep[i].astype(x.dtype)
    out.append((f"layer{i}", x))
  h = dec.norm(x)
  out.append(("final", h))
  out.append(("logits", policy.logits(h)))
  return [(k, v.astype(jnp.float32)) for k, v in out]


@functools.partial(jax.jit, static_argnums=0)
def _states(graphdef, params, tokens, positions, attn_mask, pixel_values, image_mask):
  """`layer_states` jitted, as a dict (names are not JAX values)."""
  return dict(layer_states(nnx.merge(graphdef, params), tokens, positions, attn_mask, pixel_values, image_mask))


def image_dependence(graphdef, params, batch: dict, table, *, temperature: float = 1.0,
                     image_token_id: int, grid_hw: tuple[int, int], shift: int = 1) -> dict[str, float]:
  """Image dependence of a policy's decisions on one batch (see the module docstring).

  Args:
    graphdef, params: the `nnx.split` of a `Policy`.
    batch: `collate(...).as_dict()` ([B, T] tokens / attn_mask, [B, M, H, W, 3] pixel_values, ...),
      B >= 2; the screenshots of row b are replaced by those of row (b + shift) % B.
    table: grammar table [S, V] int32 or None (free text).
    temperature: the sampler's temperature (for `tv`).
    image_token_id, grid_hw: the placeholder id and merged grid, for M-RoPE positions.
  Returns:
    {"embed", "layer0", ..., "final": relative change (float), "tv": float in [0, 1],
     "max_dlogit": float, "decisions": number of decision positions}.
  Raises:
    ValueError: fewer than 2 rows, no decision position, or scanned layers.
  """
  tokens = jnp.asarray(batch["tokens"])
  if tokens.shape[0] < 2:
    raise ValueError("image_dependence needs at least 2 rows (screenshots are swapped between rows)")
  q = decision_mask(batch, table)
  if not q.any():
    raise ValueError("no decision positions in the batch (loss_mask empty or every token forced)")
  attn = jnp.asarray(batch["attn_mask"])
  pos = rope_positions(tokens, attn, image_token_id, grid_hw)
  pix, imask = jnp.asarray(batch["pixel_values"]), jnp.asarray(batch["image_mask"])
  own = _states(graphdef, params, tokens, pos, attn, pix, imask)
  other = _states(graphdef, params, tokens, pos, attn, jnp.roll(pix, -shift, axis=0), jnp.roll(imask, -shift, axis=0))
  qj = jnp.asarray(q)
  n = float(q.sum())
  res: dict[str, float] = {}
  depth = len(own) - 3  # embed, layer0 .. layer{depth-1}, final, logits
  for name in ["embed"] + [f"layer{i}" for i in range(depth)] + ["final", "logits"]:
    a, b = own[name], other[name]
    a, b = a[:, :-1], b[:, :-1]  # position t predicts target t + 1: the decision positions' inputs
    if name == "logits":
      allowed = None if table is None else jnp.asarray(table)[jnp.maximum(jnp.asarray(batch["states"]), 0)] >= 0
      pa = jnp.exp(masked_log_softmax(a, allowed, temperature))
      pb = jnp.exp(masked_log_softmax(b, allowed, temperature))
      tv = 0.5 * jnp.abs(pa - pb).sum(-1)
      dl = jnp.abs(a - b) if allowed is None else jnp.where(allowed, jnp.abs(a - b), 0.0)
      res["tv"] = float(jnp.where(qj, tv, 0.0).sum() / n)
      res["max_dlogit"] = float(jnp.where(qj, dl.max(-1), 0.0).sum() / n)
      continue
    rel = jnp.linalg.norm(a - b, axis=-1) / jnp.maximum(jnp.linalg.norm(a, axis=-1), 1e-12)
    res[name] = float(jnp.where(qj, rel, 0.0).sum() / n)
  res["decisions"] = n
  return res


def format_row(res: dict[str, float]) -> str:
  """One line: 'embed 0.000 layer0 0.031 ... final 0.12 | tv 0.041 max_dlogit 0.35'."""
  layers = [k for k in res if k not in ("tv", "max_dlogit", "decisions")]
  return " ".join(f"{k} {res[k]:.3g}" for k in layers) + f" | tv {res['tv']:.3g} max_dlogit {res['max_dlogit']:.3g}"
