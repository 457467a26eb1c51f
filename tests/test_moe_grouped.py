"""The "grouped" MoE path (`tars_jax/models/fast/grouped_mlp.py`): the loops over experts and their chunks
and the hand-written backward against a per-row reference written independently (each row through its
own expert's weights, differentiated by JAX); the chunk counts, and the blocked path's block table
(`moe.chunk_table`), against a direct count."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tars_jax.models import moe
from tars_jax.models.config import ModelConfig
from tars_jax.models.fast.grouped_mlp import chunk_counts, chunk_sizes, grouped_swiglu
from _shared import assert_close_f32, f32_atol, scanned_step_temp_bytes


def _reference(xs, expert, wg, wu, wd):
  """ys[r] = down_e(silu(x W_gate[e]) * x W_up[e]) with e = expert[r]: per-row gathers, no grouping."""
  g = jnp.einsum("rd,rdi->ri", xs, wg[expert])
  u = jnp.einsum("rd,rdi->ri", xs, wu[expert])
  return jnp.einsum("ri,rid->rd", jax.nn.silu(g) * u, wd[expert])


def _weights(key, e, d, i):
  k1, k2, k3 = jax.random.split(key, 3)
  return (jax.random.normal(k1, (e, d, i)) / np.sqrt(d), jax.random.normal(k2, (e, d, i)) / np.sqrt(d),
          jax.random.normal(k3, (e, i, d)) / np.sqrt(i))


# group sizes: an empty expert, sizes not multiples of the chunk, one expert with everything; chunk
# sizes (rows, min_rows): one size only, or a group's tail split over chunks of 8, 4, 2 rows (31 = 16 + 8
# + 4 + 2 + a masked 2-row chunk)
@pytest.mark.parametrize("sizes,rows,min_rows", [((5, 0, 9, 3), 4, 4), ((0, 0, 17, 0), 4, 4), ((8, 8, 8, 8), 8, 8),
                                                 ((1, 2, 3, 30), 16, 16), ((1, 2, 31, 7), 16, 2),
                                                 ((33, 0, 15, 9), 16, 4)])
def test_values_and_gradients_equal_per_row_reference(sizes, rows, min_rows):
  e, d, i = len(sizes), 6, 5
  g = sum(sizes)
  xs = jax.random.normal(jax.random.PRNGKey(g), (g, d))
  wg, wu, wd = _weights(jax.random.PRNGKey(1), e, d, i)
  expert = jnp.repeat(jnp.arange(e), jnp.asarray(sizes), total_repeat_length=g)
  sz = jnp.asarray(sizes, jnp.int32)
  probe = jax.random.normal(jax.random.PRNGKey(2), (g, d))  # a non-uniform cotangent

  def ours(xs, wg, wu, wd):  # the [E, D, 2, I] parameter layout (`moe.MoE.w_gate_up`)
    return jnp.sum(probe * grouped_swiglu(xs, sz, jnp.stack([wg, wu], axis=2), wd, rows, min_rows))

  def ref(xs, wg, wu, wd):
    return jnp.sum(probe * _reference(xs, expert, wg, wu, wd))

  y = jax.jit(lambda xs, wg, wu, wd: grouped_swiglu(xs, sz, jnp.stack([wg, wu], axis=2), wd, rows,
                                                    min_rows))(xs, wg, wu, wd)
  assert_close_f32(y, _reference(xs, expert, wg, wu, wd), terms=d + i)
  got = jax.jit(jax.grad(ours, argnums=(0, 1, 2, 3)))(xs, wg, wu, wd)
  want = jax.grad(ref, argnums=(0, 1, 2, 3))(xs, wg, wu, wd)
  for a, b, name in zip(got, want, ("xs", "w_gate", "w_up", "w_down")):
    assert_close_f32(a, b, terms=2 * (d + i) + g, err_msg=name)  # forward, backward, rows of a weight gradient
  # an expert without rows gets exactly zero gradient
  for k, s in enumerate(sizes):
    if s == 0:
      assert float(jnp.max(jnp.abs(got[1][k]))) == 0.0 and float(jnp.max(jnp.abs(got[3][k]))) == 0.0


def test_float32_weights_with_bfloat16_rows():
  """Parameters stay float32 while the rows run in bfloat16 (cast per expert inside the loop): values
  and gradients against the float32 per-row reference on the same bf16-rounded inputs, the weight
  gradients in float32, the row gradient in bfloat16."""
  sizes, e, d, i = (40, 0, 25, 7), 4, 16, 12
  g = sum(sizes)
  bf = jnp.bfloat16
  rnd = lambda a: a.astype(bf).astype(jnp.float32)
  xs = jax.random.normal(jax.random.PRNGKey(3), (g, d)).astype(bf)
  wg, wu, wd = _weights(jax.random.PRNGKey(4), e, d, i)
  expert = jnp.repeat(jnp.arange(e), jnp.asarray(sizes), total_repeat_length=g)
  sz = jnp.asarray(sizes, jnp.int32)
  probe = jax.random.normal(jax.random.PRNGKey(5), (g, d))

  def ours(xs, wg, wu, wd):
    return jnp.sum(probe * grouped_swiglu(xs, sz, jnp.stack([wg, wu], axis=2), wd, 16, 4).astype(jnp.float32))

  def ref(xs, wg, wu, wd):  # float32 throughout, on the inputs the bf16 path sees
    return jnp.sum(probe * _reference(xs.astype(jnp.float32), expert, rnd(wg), rnd(wu), rnd(wd)))

  got = jax.jit(jax.grad(ours, argnums=(0, 1, 2, 3)))(xs, wg, wu, wd)
  want = jax.grad(ref, argnums=(0, 1, 2, 3))(xs, wg, wu, wd)
  assert got[0].dtype == bf and all(a.dtype == jnp.float32 for a in got[1:])
  for a, b, name in zip(got, want, ("xs", "w_gate", "w_up", "w_down")):
    a = np.asarray(a, np.float32)
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2, name
  assert float(jnp.max(jnp.abs(got[1][1]))) == 0.0  # the empty expert


def test_no_bfloat16_copy_of_the_expert_weights_is_kept():
  """A scanned bf16 value-and-grad step with float32 parameters: passing the float32 weights (cast per
  expert inside) keeps at least one whole bf16 copy of every layer's expert weights fewer in the
  compiled temporaries than casting them first (what autodiff of a cast outside must keep for the
  backward). Compiled buffer sizes: deterministic, nothing is timed."""
  layers, e, d, i, g = 4, 16, 256, 128, 512
  bf = jnp.bfloat16

  def temp_bytes(cast_outside: bool) -> int:
    def layer(h, p, sizes):
      wgu, wd = (w.astype(bf) for w in p) if cast_outside else p
      return grouped_swiglu(h, sizes, wgu, wd, 64)
    params = (jax.ShapeDtypeStruct((layers, e, d, 2, i), jnp.float32),
              jax.ShapeDtypeStruct((layers, e, i, d), jnp.float32))
    return scanned_step_temp_bytes(layer, params, jax.ShapeDtypeStruct((g, d), bf),
                                   jax.ShapeDtypeStruct((e,), jnp.int32))

  bf16_copy = layers * e * 3 * d * i * 2
  assert temp_bytes(True) - temp_bytes(False) >= bf16_copy


def check_chunk_table(sizes: list[int], rows: int) -> None:
  """The blocked path's block table of any routing covers every row exactly once, one expert per chunk, and the grouped
  loop's chunk counts cover each group with fewer padded rows than its smallest chunk (run by the
  hypothesis test of the block bound, `test_sharding.test_block_bound_holds_for_any_routing`)."""
  g = sum(sizes)
  count, expert, start, valid = (np.asarray(a) for a in moe.chunk_table(jnp.asarray(sizes, jnp.int32), rows,
                                                                      moe.num_blocks(g, len(sizes), rows)))
  assert int(count) == sum(-(-s // rows) for s in sizes)
  covered = np.concatenate([np.arange(start[j], start[j] + valid[j]) for j in range(int(count))])
  np.testing.assert_array_equal(np.sort(covered), np.arange(g))  # every row exactly once
  owner = np.repeat(np.arange(len(sizes)), sizes)
  for j in range(int(count)):
    assert 1 <= valid[j] <= rows
    assert (owner[start[j]:start[j] + valid[j]] == expert[j]).all()  # a chunk never mixes experts
  # the grouped loop's chunks of rows, rows / 2, ...: cover each group with < the smallest size padded
  for min_rows in (1, 2, 16):
    sizes_ = chunk_sizes(rows, min_rows)
    assert sizes_[0] == rows and all(a // 2 == b for a, b in zip(sizes_, sizes_[1:])) and sizes_[-1] >= min(min_rows, rows)
    for size in sizes:
      counts = chunk_counts(size, sizes_)  # the same arithmetic the loop traces, on Python ints
      covered = sum(c * n for c, n in zip(counts, sizes_))
      assert size <= covered < size + sizes_[-1], (size, sizes_, counts)


def test_grouped_in_bfloat16_stays_close_to_float32():
  cfg = ModelConfig(hidden=32, experts=4, top_k=2, moe_intermediate=24, moe_impl="grouped")
  m = moe.MoE(cfg, nnx.Rngs(0))
  m16 = nnx.merge(nnx.split(moe.MoE(dataclasses.replace(cfg, dtype="bfloat16"), nnx.Rngs(0)))[0], nnx.state(m))
  x = jax.random.normal(jax.random.PRNGKey(6), (1, 200, 32))
  y32, y16 = m(x)[0], m16(x)[0]
  assert y16.dtype == jnp.bfloat16
  rel = float(jnp.linalg.norm(y16.astype(jnp.float32) - y32) / jnp.linalg.norm(y32))
  assert 0 < rel < 2e-2


@pytest.mark.parametrize("groups", [1, 2, 8])
def test_capacity_swiglu_groups_equal_numpy_reference(groups):
  """The [E, C, D] expert products (the bounded decode path) equal a float64 numpy SwiGLU per expert,
  whether computed as one batched einsum or split into independent per-group einsums (XLA:CPU runs
  those on separate cores); gradients of the split form equal the unsplit one's."""
  e, c, d, i = 8, 3, 16, 12
  k = jax.random.split(jax.random.PRNGKey(5), 3)
  buf = jax.random.normal(k[0], (e, c, d))
  wgu, wd = jax.random.normal(k[1], (e, d, 2, i)) * 0.3, jax.random.normal(k[2], (e, i, d)) * 0.3
  b64, g64, d64 = (np.asarray(a, np.float64) for a in (buf, wgu, wd))
  want = np.empty((e, c, d))
  for x in range(e):
    gate, up = b64[x] @ g64[x, :, 0], b64[x] @ g64[x, :, 1]
    want[x] = (gate / (1 + np.exp(-gate)) * up) @ d64[x]
  got = moe.capacity_swiglu(buf, wgu, wd, groups)
  assert_close_f32(np.asarray(got), want, terms=d + i)
  loss = lambda g: lambda *a: jnp.sum(jnp.sin(moe.capacity_swiglu(*a, groups=g)))
  grads = [jax.grad(loss(g), argnums=(0, 1, 2))(buf, wgu, wd) for g in (1, groups)]
  for a, b in zip(*grads):
    assert_close_f32(np.asarray(a), np.asarray(b), terms=2 * (d + i) + c)
  with pytest.raises(ValueError, match="does not divide"):
    moe.capacity_swiglu(buf, wgu, wd, groups=3)


def test_decode_expert_groups_only_split_without_a_mesh():
  """One einsum per expert on XLA:CPU without a mesh; one batched einsum under a mesh (GSPMD shards
  the buffer's expert axis): the strategy a model built in each setting takes."""
  from tars_jax import sharding
  assert jax.default_backend() == "cpu"
  cfg = ModelConfig(hidden=32, experts=8, top_k=2, moe_intermediate=24, moe_impl="blocked")
  assert moe.MoE(cfg, nnx.Rngs(0)).strategy.per_expert_dots
  with sharding.activate(sharding.make_mesh((1, 1, 1, 1)), sharding.make_rules()):
    assert not moe.MoE(cfg, nnx.Rngs(0)).strategy.per_expert_dots


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_layer_on_openblas_equals_the_xla_loop(dtype):
  """An MoE layer of the "grouped" path with `moe_grouped_blas` (the experts as OpenBLAS custom calls,
  `expert_kernel.grouped_swiglu`) against the same layer in XLA's loop: equal outputs and parameter
  gradients in float32, and the compiled step really calls the kernels (forward and backward); in
  bfloat16 the kernel does not apply and the step has no such call."""
  cfg = ModelConfig(hidden=64, experts=4, top_k=2, moe_intermediate=48, moe_impl="grouped", dtype=dtype)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 128, 64))
  assert moe.block_rows(2 * 128 * 2, 4) > 1  # this shape takes the grouped loop
  base = moe.MoE(cfg, nnx.Rngs(0))
  state = nnx.state(base)

  def step(blas: bool):
    gd = nnx.graphdef(moe.MoE(dataclasses.replace(cfg, moe_grouped_blas=blas), nnx.Rngs(0)))
    probe = jax.random.normal(jax.random.PRNGKey(1), x.shape)
    return jax.jit(jax.value_and_grad(lambda s, x: jnp.sum(nnx.merge(gd, s)(x)[0].astype(jnp.float32) * probe)))

  hlo = {blas: step(blas).lower(state, x).compile().as_text() for blas in (True, False)}
  calls = lambda text: [t for t in ("tars_grouped_swiglu_fwd", "tars_grouped_swiglu_bwd") if f'"{t}"' in text]
  assert calls(hlo[False]) == []
  if dtype == "bfloat16":
    assert calls(hlo[True]) == []
    return
  assert calls(hlo[True]) == ["tars_grouped_swiglu_fwd", "tars_grouped_swiglu_bwd"]
  (v1, g1), (v0, g0) = step(True)(state, x), step(False)(state, x)
  # float32 tolerances: the loss is one tree-reduced sum (log2 N deep) of N = B * T * hidden products
  # y * probe of mixed sign, y through the experts' D + I chain (scale: the products' root sum of
  # squares); gradients: the forward and backward chains through the experts plus the rows summed
  d, i, rows = cfg.hidden, cfg.moe_intermediate, x.shape[0] * x.shape[1] * cfg.top_k
  prods = base(x)[0] * jax.random.normal(jax.random.PRNGKey(1), x.shape)  # step()'s probe
  atol = f32_atol(float(jnp.sqrt(jnp.sum(prods ** 2))), d + i + int(np.log2(x.size)))
  assert abs(float(v1) - float(v0)) <= atol, (float(v1), float(v0), atol)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    assert_close_f32(np.asarray(a), np.asarray(b), terms=2 * (d + i) + rows)
