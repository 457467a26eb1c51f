"""Exact grouped SwiGLU experts for CPU training: loops over experts and over the chunks of rows each
expert's group really needs (dynamic trip counts), and their hand-written backward (`jax.custom_vjp`).

The N*k assignments are sorted by expert (`moe.sort_by_expert`), so expert e owns rows
[start_e, start_e + g_e) of `xs`. For each expert (outer `fori_loop`) its weights are indexed once and
its group is covered by floor(g_e / R) chunks of R rows, then at most one chunk each of R/2, R/4, ...
down to `MIN_ROWS` (`chunk_sizes`, `chunk_counts`), so fewer than MIN_ROWS padded rows are computed
per expert instead of up to R - 1 (not the static bound `moe.num_blocks` a batched matmul computes,
and no [blocks, D, I] weight gather or scatter-add of its gradient). Rows of a chunk past its group's
end belong to the next expert (see below). Gate and up run as one
matmul with the expert's [D, 2I] gate|up weights (the [E, D, 2, I] parameter reshaped: no copy). Outputs are written
whole chunks at a time: the rows a chunk computes past its group's end are overwritten by the experts
after it (only the weight gradients need the rows masked, in the backward). A while loop
with a data-dependent trip count has no reverse-mode rule in JAX, hence the custom VJP; the forward
of a differentiated call also keeps the gate|up pre-activations [G, 2I] (activation-sized, small next
to the experts' weights), and the backward accumulates each expert's weight gradients in a loop
carry written once per expert. What transformers' `grouped_mm` does in torch (exact groups), written
with XLA primitives. Source: MegaBlocks (Gale et al. 2022) grouped GEMM; transformers
`integrations/moe.py` (`grouped_mm` experts).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


# Smallest chunk of the loop: a group's last (ragged) rows are covered by chunks of rows / 2, rows / 4,
# ... down to this, so at most MIN_ROWS - 1 padded rows are computed per expert (not rows - 1).
MIN_ROWS = 16


def chunk_sizes(rows: int, min_rows: int = MIN_ROWS) -> tuple[int, ...]:
  """The static chunk sizes of the loop: rows, rows // 2, ... while >= min_rows (at least (rows,))."""
  out = [rows]
  while out[-1] // 2 >= min_rows:
    out.append(out[-1] // 2)
  return tuple(out)


def chunk_counts(size, sizes_: tuple[int, ...]) -> list:
  """How many chunks of each static size cover a group of `size` rows (an int32 scalar array, or a
  Python int): greedily whole chunks of sizes_[0], then of sizes_[1], ...; the last size also takes
  the remainder (its final chunk partly masked). Sum of count * chunk size - size < sizes_[-1]."""
  counts, rem = [], size
  for s in sizes_[:-1]:
    counts.append(rem // s)
    rem = rem - counts[-1] * s
  return counts + [-(-rem // sizes_[-1])]


def _put(buf, val, start):
  """buf rows start .. start + R - 1 := val, all of them. Rows of a chunk past its group's end belong to
  later experts (or to the padding after row G), whose own chunks run later in the loop and overwrite
  them, so no mask (and no read of the old rows) is needed."""
  return jax.lax.dynamic_update_slice_in_dim(buf, val.astype(buf.dtype), start, axis=0)


def _pad(a, rows):
  return jnp.concatenate([a, jnp.zeros((rows,) + a.shape[1:], a.dtype)])


def _for_each_chunk(sizes, sizes_, chunk_fn, expert_init, expert_done, carry):
  """Loops over experts e (outer, `lax.fori_loop`) and over the chunks covering e's group (inner: one
  dynamic-count loop per static chunk size). `expert_init(e, carry) -> (carry, local)` runs first
  (index e's weights once, not once per chunk); `chunk_fn(s, e, local, carry, start, keep) -> (carry,
  local)` for each chunk of s rows at sorted row `start` ([s, 1] bool `keep`: rows inside the group);
  `expert_done(e, local, carry) -> carry` last. `sizes_`: the static chunk sizes (`chunk_sizes`)."""
  group_start = jnp.cumsum(sizes) - sizes

  def per_expert(e, carry):
    carry, local = expert_init(e, carry)
    end = group_start[e] + sizes[e]
    pos = group_start[e]
    for s, count in zip(sizes_, chunk_counts(sizes[e], sizes_)):
      def body(_, c, s=s):
        carry, local, pos = c
        keep = (pos + jnp.arange(s) < end)[:, None]
        carry, local = chunk_fn(s, e, local, carry, pos, keep)
        return carry, local, pos + s
      carry, local, pos = jax.lax.fori_loop(0, count, body, (carry, local, pos))
    return expert_done(e, local, carry)

  return jax.lax.fori_loop(0, sizes.shape[0], per_expert, carry)


def _rows(a, start, s, keep=None):
  x = jax.lax.dynamic_slice_in_dim(a, start, s, axis=0)
  return x if keep is None else jnp.where(keep, x, 0)


def _index(w, e, dtype):
  """Expert e's slice of the stacked weights w, cast to the compute dtype (one expert at a time)."""
  return jax.lax.dynamic_index_in_dim(w, e, keepdims=False).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def grouped_swiglu(xs, sizes, wgu, wd, rows: int, min_rows: int = MIN_ROWS):
  """ys [G, D] = down(silu(x W_gate[e]) * (x W_up[e])) for each row x of expert e's group.

  Args:
    xs: [G, D] assignments sorted by expert; sizes: [E] int32 group sizes (sum G);
    wgu: [E, D, 2, I] (gate at [:, :, 0], up at [:, :, 1]: `moe.MoE.w_gate_up`); wd: [E, I, D], in
      the parameter dtype: each expert's weights are cast to xs's (compute) dtype inside the loop, so a
      bfloat16 step with float32 parameters keeps no bfloat16 copy of all E experts' weights for the
      backward (3 x E x D x I values per layer), only the parameters it already holds;
    rows: R, the largest chunk (static); a group's tail is covered by chunks of R/2, R/4, ... down to
      `min_rows` (`chunk_sizes`), so each expert computes fewer than min_rows padded rows.
  Returns: ys [G, D] in xs's dtype. Differentiable (reverse mode) in xs, wgu, wd; exact (no padding
  enters a result, no assignment is dropped). The weight gradients accumulate over chunks in float32
  and come back in the weights' dtype.
  """
  return _forward(xs, sizes, wgu, wd, rows, min_rows, keep_parts=False)[0]


def _forward(xs, sizes, wgu, wd, rows, min_rows, keep_parts: bool):
  """(ys [G, D], gate|up pre-activations [G + R, 2I] or None). Gate and up run as one matmul with the
  expert's [D, 2I] weights: one larger dot per chunk instead of two."""
  g, d = xs.shape
  e, _, _, i = wgu.shape
  xs_pad = _pad(xs, rows)
  wgu = wgu.reshape(e, d, 2 * i)  # [gate | up] columns; row-major, so no copy

  def init(e, carry):
    return carry, (_index(wgu, e, xs.dtype), _index(wd, e, xs.dtype))

  def chunk(s, e, w, carry, start, keep):
    del keep  # rows past the group give garbage that a later expert overwrites (`_put`)
    ys, parts = carry
    ab = _rows(xs_pad, start, s) @ w[0]
    y = (jax.nn.silu(ab[:, :i]) * ab[:, i:]) @ w[1]
    if keep_parts:
      parts = _put(parts, ab, start)
    return (_put(ys, y, start), parts), w

  parts = jnp.zeros((g + rows, 2 * i), xs.dtype) if keep_parts else None
  ys, parts = _for_each_chunk(sizes, chunk_sizes(rows, min_rows), chunk, init, lambda e, w, c: c,
                              (jnp.zeros((g + rows, d), xs.dtype), parts))
  return ys[:g], parts


def _fwd(xs, sizes, wgu, wd, rows, min_rows):
  ys, parts = _forward(xs, sizes, wgu, wd, rows, min_rows, keep_parts=True)
  return ys, (xs, sizes, wgu, wd, parts)


def _bwd(rows, min_rows, res, dys):
  xs, sizes, wgu4, wd, ab_all = res
  g, d = xs.shape
  e, _, _, i = wgu4.shape
  xs_pad, dys_pad = _pad(xs, rows), _pad(dys.astype(xs.dtype), rows)
  wgu = wgu4.reshape(e, d, 2 * i)  # as in the forward

  def init(e, carry):
    # e's weights, and its weight gradients accumulated over its chunks in float32 (written once, in done)
    w = (_index(wgu, e, xs.dtype), _index(wd, e, xs.dtype))
    return carry, (w, tuple(jnp.zeros(a.shape, jnp.float32) for a in w))

  def chunk(s, e, local, carry, start, keep):
    (w_gu, w_d), (dw_gu, dw_d) = local
    x = _rows(xs_pad, start, s, keep)  # masked: rows past the group must not enter e's weight gradients
    dy = _rows(dys_pad, start, s, keep)
    ab = _rows(ab_all, start, s)  # rows past the group: masked through x and dy
    a, b = ab[:, :i], ab[:, i:]
    sig = jax.nn.sigmoid(a)
    silu_a = a * sig
    h = silu_a * b
    dh = dy @ w_d.T
    dab = jnp.concatenate([dh * b * sig * (1 + a * (1 - sig)), dh * silu_a], axis=-1)  # d/da (silu'), d/db
    dx = dab @ w_gu.T
    f32 = functools.partial(jnp.matmul, preferred_element_type=jnp.float32)
    grads = (dw_gu + f32(x.T, dab), dw_d + f32(h.T, dy))
    return (_put(carry[0], dx, start),) + carry[1:], ((w_gu, w_d), grads)

  def done(e, local, carry):
    dxs, dwgu, dwd = carry
    put = lambda acc, val: jax.lax.dynamic_update_index_in_dim(acc, val.astype(acc.dtype), e, axis=0)
    return dxs, put(dwgu, local[1][0]), put(dwd, local[1][1])

  init_carry = (jnp.zeros((g + rows, d), xs.dtype), jnp.zeros_like(wgu), jnp.zeros_like(wd))
  dxs, dwgu, dwd = _for_each_chunk(sizes, chunk_sizes(rows, min_rows), chunk, init, done, init_carry)
  return dxs[:g], None, dwgu.reshape(wgu4.shape), dwd


grouped_swiglu.defvjp(_fwd, _bwd)
