"""`HFModel`: our `Policy` behind the transformers `Qwen3VLMoeForConditionalGeneration.forward`
calling convention (input_ids, attention_mask, flattened pixel_values, image_grid_thw), so a
checkpoint loaded by `hf_io.load_pretrained` is fed exactly the arrays transformers' processor makes.

The per-image grid sizes must be concrete (numpy or host arrays): each distinct image size is its
own compiled vision call, as transformers splits its packed sequence per image (`cu_seqlens`).
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tars_jax.models.config import ModelConfig
from tars_jax.models.policy import Policy


def hf_rope_index(input_ids: np.ndarray, attention_mask: np.ndarray | None, image_token_id: int,
                  grids: list[tuple[int, int]]) -> np.ndarray:
  """M-RoPE positions [3, B, T] int32 as transformers `Qwen3VLMoeModel.get_rope_index` for images.

  Args:
    input_ids: [B, T] ints; attention_mask: [B, T] (0 = padding, gets position 0) or None.
    grids: (rows, cols) of merged tokens of each image, in order over the batch (row-major).
  Each maximal run of image tokens is one image (transformers groups by token type): t = start,
  h = start + row, w = start + col; the next text token starts at start + max(rows, cols).
  Raises ValueError if a run's length is not its grid's size or the number of runs differs.
  """
  ids = np.asarray(input_ids)
  mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
  pos = np.zeros((3,) + ids.shape, np.int32)
  it = iter(grids)
  for b in range(ids.shape[0]):
    types = ids[b][mask[b]] == image_token_id
    cur, parts = 0, []
    for is_img, grp in itertools.groupby(types):
      n = len(list(grp))
      if not is_img:
        parts.append(np.broadcast_to(np.arange(n) + cur, (3, n)))
        cur += n
        continue
      try:
        gh, gw = next(it)
      except StopIteration:
        raise ValueError(f"more image-token runs than images ({len(grids)})") from None
      if n != gh * gw:
        raise ValueError(f"row {b}: an image-token run of {n} tokens for an image of {gh}x{gw} merged tokens")
      r, c = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
      parts.append(np.stack([np.full(n, cur), cur + r.reshape(-1), cur + c.reshape(-1)]))
      cur += max(gh, gw)
    if parts:
      pos[:, b, mask[b]] = np.concatenate(parts, axis=1)
  if next(it, None) is not None:
    raise ValueError(f"fewer image-token runs than images ({len(grids)})")
  return pos


@nnx.jit(static_argnums=(2, 3))
def _encode(visual, patches, gh, gw):
  return visual.encode_patches(patches, gh, gw)


@nnx.jit
def _forward(policy, tokens, positions, mask, visual):
  out = policy(tokens, positions, mask, visual=visual)
  return out.logits, out.aux_loss


class HFModel(nnx.Module):
  """transformers-style causal VLM around `policy` (a `Policy`; its `cfg` is `self.cfg`)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.policy = Policy(cfg, rngs)

  def image_features(self, pixel_values, image_grid_thw) -> tuple[jax.Array, list[tuple[int, int]]]:
    """transformers' flattened patches [sum t*h*w, 3*t_p*p*p] + grid [N, 3] (t, h, w in patches) ->
    ([1 + n_deepstack, K, D] merged (and DeepStack) tokens of all images end to end, merged grids)."""
    grid = np.asarray(image_grid_thw).astype(int).reshape(-1, 3)
    m = self.cfg.spatial_merge_size
    want = 3 * self.cfg.temporal_patch_size * self.cfg.patch_size ** 2
    if pixel_values.ndim != 2 or pixel_values.shape[1] != want:
      raise ValueError(f"pixel_values shape {tuple(pixel_values.shape)}; expected [patches, {want}]")
    counts = grid.prod(-1)
    if counts.sum() != pixel_values.shape[0]:
      raise ValueError(f"image_grid_thw covers {counts.sum()} patches, pixel_values has {pixel_values.shape[0]}")
    feats, grids, start = [], [], 0
    for (t, h, w), n in zip(grid, counts):
      if t != 1:
        raise NotImplementedError(f"video inputs (grid t={t}) are not supported")
      feats.append(_encode(self.policy.trunk.visual, jnp.asarray(pixel_values[start:start + n])[None], int(h), int(w))[:, 0])
      grids.append((int(h) // m, int(w) // m))
      start += n
    return jnp.concatenate(feats, axis=1), grids

  def forward(self, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None):
    """Same arrays as transformers' forward -> (logits [B, T, V] float32, aux_loss float32 scalar).

    Positions: with images, `hf_rope_index` (padding-aware); without, 0 .. T-1 for every row as
    transformers' forward does when it gets no image_grid_thw (its `generate` differs: it counts
    only real tokens, as our sampler does). Raises ValueError when image tokens and image features
    do not match in number.
    """
    ids = np.asarray(input_ids)
    b, t = ids.shape
    mask = np.ones((b, t), bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    visual = None
    if pixel_values is not None:
      feats, grids = self.image_features(jnp.asarray(pixel_values), image_grid_thw)
      is_img = ids == self.cfg.image_token_id
      if is_img.sum() != feats.shape[1]:
        raise ValueError(f"{is_img.sum()} image tokens but {feats.shape[1]} image features")
      gidx = np.clip(np.cumsum(is_img.reshape(-1)) - 1, 0, None).reshape(b, t)
      visual = feats[:, jnp.asarray(gidx)]  # [S, B, T, D]
      positions = hf_rope_index(ids, mask, self.cfg.image_token_id, grids)
    else:
      positions = np.broadcast_to(np.arange(t, dtype=np.int32), (3, b, t))
    return _forward(self.policy, jnp.asarray(ids, jnp.int32), jnp.asarray(positions), jnp.asarray(mask), visual)

  def with_compute_dtype(self, dtype) -> "HFModel":
    """A model over this one's parameter arrays (shared at the time of the call: no copy) computing in
    `dtype`: mixed precision,
    e.g. float32 parameters from `hf_io.load_pretrained(path)` with bfloat16 activations, matmuls
    and KV cache (`ModelConfig.dtype`; logits, softmax and losses stay float32).
    (`load_pretrained(path, dtype=jnp.bfloat16)` instead casts the parameters too.)"""
    cfg = dataclasses.replace(self.cfg, dtype=jnp.dtype(dtype).name)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: HFModel(cfg, nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.state(self))

  def __call__(self, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None):
    """Logits [B, T, vocab] float32 (see `forward`)."""
    return self.forward(input_ids, attention_mask, pixel_values, image_grid_thw)[0]
