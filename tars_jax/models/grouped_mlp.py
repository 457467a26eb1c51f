"""Exact grouped SwiGLU experts for CPU training: a `lax.while_loop` over (expert, chunk) pairs with a
dynamic trip count, and its hand-written backward (`jax.custom_vjp`).

The N*k assignments are sorted by expert (`moe.sort_by_expert`), so expert e owns rows
[start_e, start_e + g_e) of `xs`. The loop visits the sum_e ceil(g_e / R) chunks of R rows that the
groups really need (not the static bound `moe.num_blocks` that a batched matmul must compute) and indexes
the expert's weights in place (no [blocks, D, I] gather, no scatter-add of gathered-weight gradients).
Rows of a chunk past its group's end belong to the next expert: they are masked on input and not
written. A while loop with a data-dependent trip count has no reverse-mode rule in JAX, hence the
custom VJP; the forward of a differentiated call also keeps the gate / up pre-activations [G, I] (two
of the backward's eight chunk matmuls fewer, ~2 x 6 MiB per layer at 2048 assignments, width 384), and
the backward accumulates each expert's weight gradient in place. What transformers' `grouped_mm` does in torch (exact groups),
written with XLA primitives. Source: MegaBlocks (Gale et al. 2022) grouped GEMM; transformers
`integrations/moe.py` (`grouped_mm` experts).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def chunk_table(sizes: jax.Array, rows: int, max_chunks: int):
  """The chunks of R = `rows` rows covering each expert's group, in expert order.

  Args: sizes [E] int32 group sizes (sum G); max_chunks: a static bound on sum_e ceil(g_e / R)
    (`moe.num_blocks(G, E, R)`).
  Returns: (count int32 scalar = sum_e ceil(g_e / R), expert [M] int32, start [M] int32 first row in
    the sorted assignments, valid [M] int32 rows of the chunk inside its group (1..R)); entries at
    index >= count are unused.
  """
  n_chunks = -(-sizes // rows)
  end = jnp.cumsum(n_chunks)
  j = jnp.arange(max_chunks, dtype=jnp.int32)
  e = jnp.minimum(jnp.searchsorted(end, j, side="right"), sizes.shape[0] - 1).astype(jnp.int32)
  local = j - (end - n_chunks)[e]
  group_start = jnp.cumsum(sizes) - sizes
  start = group_start[e] + local * rows
  valid = jnp.clip(sizes[e] - local * rows, 0, rows)
  return end[-1].astype(jnp.int32), e, start.astype(jnp.int32), valid.astype(jnp.int32)


def _chunk(xs_pad, table, j, rows):
  """(expert, start, [R, 1] bool row mask, [R, D] rows with the foreign ones zeroed) of chunk j."""
  _, e, start, valid = table
  keep = (jnp.arange(rows) < valid[j])[:, None]
  x = jax.lax.dynamic_slice_in_dim(xs_pad, start[j], rows, axis=0)
  return e[j], start[j], keep, jnp.where(keep, x, 0)


def _swiglu_parts(x, wg, wu, e):
  g = x @ jax.lax.dynamic_index_in_dim(wg, e, keepdims=False)
  u = x @ jax.lax.dynamic_index_in_dim(wu, e, keepdims=False)
  return g, u


def _put(buf, val, start, keep):
  """buf rows start .. start + R - 1 := val where keep, unchanged elsewhere."""
  old = jax.lax.dynamic_slice_in_dim(buf, start, val.shape[0], axis=0)
  return jax.lax.dynamic_update_slice_in_dim(buf, jnp.where(keep, val.astype(buf.dtype), old), start, axis=0)


def _pad(a, rows):
  return jnp.concatenate([a, jnp.zeros((rows,) + a.shape[1:], a.dtype)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def grouped_swiglu(xs, sizes, wg, wu, wd, rows: int, max_chunks: int):
  """ys [G, D] = down(silu(x W_gate[e]) * (x W_up[e])) for each row x of expert e's group.

  Args:
    xs: [G, D] assignments sorted by expert; sizes: [E] int32 group sizes (sum G);
    wg, wu: [E, D, I]; wd: [E, I, D] (all in the compute dtype);
    rows: R, rows per chunk (static); max_chunks: static bound on the chunk count
      (`moe.num_blocks(G, E, R)`).
  Returns: ys [G, D] in xs's dtype. Differentiable (reverse mode) in xs, wg, wu, wd; exact (no
  padding enters a result, no assignment is dropped).
  """
  return _forward(xs, sizes, wg, wu, wd, rows, max_chunks, keep_parts=False)[0]


def _forward(xs, sizes, wg, wu, wd, rows, max_chunks, keep_parts: bool):
  """(ys [G, D], (gate, up) pre-activations [G + R, I] each or None)."""
  g, d = xs.shape
  table = chunk_table(sizes, rows, max_chunks)
  xs_pad = _pad(xs, rows)

  def body(c):
    j, ys, parts = c
    e, start, keep, x = _chunk(xs_pad, table, j, rows)
    a, b = _swiglu_parts(x, wg, wu, e)
    y = (jax.nn.silu(a) * b) @ jax.lax.dynamic_index_in_dim(wd, e, keepdims=False)
    if keep_parts:
      parts = (_put(parts[0], a, start, keep), _put(parts[1], b, start, keep))
    return j + 1, _put(ys, y, start, keep), parts

  parts = None
  if keep_parts:
    parts = tuple(jnp.zeros((g + rows, wg.shape[-1]), xs.dtype) for _ in range(2))
  init = (jnp.int32(0), jnp.zeros((g + rows, d), xs.dtype), parts)
  _, ys, parts = jax.lax.while_loop(lambda c: c[0] < table[0], body, init)
  return ys[:g], parts


def _fwd(xs, sizes, wg, wu, wd, rows, max_chunks):
  ys, parts = _forward(xs, sizes, wg, wu, wd, rows, max_chunks, keep_parts=True)
  return ys, (xs, sizes, wg, wu, wd, parts)


def _bwd(rows, max_chunks, res, dys):
  xs, sizes, wg, wu, wd, (a_all, b_all) = res
  g, d = xs.shape
  table = chunk_table(sizes, rows, max_chunks)
  xs_pad, dys_pad = _pad(xs, rows), _pad(dys.astype(xs.dtype), rows)

  def body(c):
    j, dxs, dwg, dwu, dwd = c
    e, start, keep, x = _chunk(xs_pad, table, j, rows)
    dy = jnp.where(keep, jax.lax.dynamic_slice_in_dim(dys_pad, start, rows, axis=0), 0)
    a = jax.lax.dynamic_slice_in_dim(a_all, start, rows, axis=0)  # rows past the group: masked below
    b = jax.lax.dynamic_slice_in_dim(b_all, start, rows, axis=0)
    sig = jax.nn.sigmoid(a)
    s = a * sig  # silu(a)
    h = s * b
    dh = dy @ jax.lax.dynamic_index_in_dim(wd, e, keepdims=False).T
    da = dh * b * sig * (1 + a * (1 - sig))  # d silu(a) / da
    db = dh * s
    w_g = jax.lax.dynamic_index_in_dim(wg, e, keepdims=False)
    w_u = jax.lax.dynamic_index_in_dim(wu, e, keepdims=False)
    dx = da @ w_g.T + db @ w_u.T
    add = lambda acc, delta: jax.lax.dynamic_update_index_in_dim(
        acc, jax.lax.dynamic_index_in_dim(acc, e, keepdims=False) + delta.astype(acc.dtype), e, axis=0)
    return (j + 1, _put(dxs, dx, start, keep), add(dwg, x.T @ da), add(dwu, x.T @ db), add(dwd, h.T @ dy))

  init = (jnp.int32(0), jnp.zeros((g + rows, d), xs.dtype), jnp.zeros_like(wg), jnp.zeros_like(wu), jnp.zeros_like(wd))
  _, dxs, dwg, dwu, dwd = jax.lax.while_loop(lambda c: c[0] < table[0], body, init)
  return dxs[:g], None, dwg, dwu, dwd


grouped_swiglu.defvjp(_fwd, _bwd)
