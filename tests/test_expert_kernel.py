"""The decode-loop expert kernel (`models/fast/cpu/expert_kernel.py`, XLA FFI on CPU): it builds here, its
packing puts every weight where the C++ source reads it, it equals XLA's `ragged_swiglu` (and a float64
numpy SwiGLU) for any split of the rows among experts, and bad group sizes raise instead of reading
past the buffer. The MoE layer and the sampler with the kernel: `test_decode_experts.py`; greedy decode
against transformers `generate`: `test_hf_parity.py`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tars_jax.models import moe
from tars_jax.models.fast.cpu import expert_kernel
from _shared import assert_close_f32, f32_atol


def test_the_kernel_builds_and_registers():
  # setup.sh builds it; a missing g++ would silently send every decode back to XLA's dots.
  assert expert_kernel.available(), expert_kernel.build_error()
  assert expert_kernel.library_path().exists()


def test_packing_puts_each_weight_at_its_tile_position():
  e, d, i = 2, 32, 24
  gu = jnp.arange(e * d * 2 * i, dtype=jnp.float32).reshape(e, d, 2, i)
  dn = jnp.arange(e * i * d, dtype=jnp.float32).reshape(e, i, d)
  pg, pd = np.asarray(expert_kernel.pack_gate_up(gu)), np.asarray(expert_kernel.pack_down(dn))
  assert pg.shape == (e, i // 8, d, 2, 8) and pd.shape == (e, d // 16, i, 16)
  # gate|up: tile t, input row r, gate/up p, lane j holds w[e, r, p, 8t + j]; down: lane j of tile t
  # at row r holds w[e, r, 16t + j]. Both read front to back as the C++ loops do.
  assert pg[1, 2, 5, 1, 3] == gu[1, 5, 1, 2 * 8 + 3]
  assert pd[1, 1, 7, 4] == dn[1, 7, 16 + 4]
  np.testing.assert_array_equal(pg[0, :, 0, 0].reshape(-1), gu[0, 0, 0])
  np.testing.assert_array_equal(pd[0, :, 3].reshape(-1), dn[0, 3])


def _swiglu64(xs, sizes, gu, dn):
  """float64 numpy: each expert's SwiGLU on its rows, zeros past sum(sizes)."""
  xs, gu, dn = (np.asarray(a, np.float64) for a in (xs, gu, dn))
  out, start = np.zeros_like(xs), 0
  for ex, n in enumerate(np.asarray(sizes)):
    x = xs[start:start + n]
    g, u = x @ gu[ex, :, 0], x @ gu[ex, :, 1]
    out[start:start + n] = (g / (1 + np.exp(-g)) * u) @ dn[ex]
    start += n
  return out


def _weights(e, d, i, seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 2)
  return 0.2 * jax.random.normal(k[0], (e, d, 2, i)), 0.2 * jax.random.normal(k[1], (e, i, d))


@settings(max_examples=12, deadline=None)
@given(sizes=st.lists(st.integers(0, 11), min_size=4, max_size=4), spare=st.integers(0, 3))
def test_kernel_equals_ragged_swiglu_for_any_groups(sizes, spare):
  """Group sizes with empty experts, row counts off the 4-row blocks, and rows past sum(sizes)."""
  e, d, i = 4, 32, 24
  gu, dn = _weights(e, d, i)
  g = sum(sizes) + spare
  xs = jax.random.normal(jax.random.PRNGKey(1), (max(g, 1), d))
  sz = jnp.asarray(sizes, jnp.int32)
  got = jax.jit(expert_kernel.swiglu_experts)(xs, sz, expert_kernel.pack_gate_up(gu), expert_kernel.pack_down(dn))
  want = _swiglu64(xs, sz, gu, dn)
  assert_close_f32(np.asarray(got), want, terms=d + i)
  assert_close_f32(np.asarray(got)[:sum(sizes)], np.asarray(moe.ragged_swiglu(xs, sz, gu, dn))[:sum(sizes)],
                   terms=d + i)
  assert np.abs(want).max() > 0.1 or sum(sizes) == 0  # not a comparison of zeros


def test_kernel_at_the_benchmark_shapes():
  """The 24M benchmark's layer (D 256, I 384, 8 experts) at batch 16: 32 rows, some experts crowded."""
  e, d, i = 8, 256, 384
  gu, dn = _weights(e, d, i, seed=2)
  sizes = jnp.asarray([9, 0, 5, 4, 1, 7, 2, 4], jnp.int32)
  xs = jax.random.normal(jax.random.PRNGKey(3), (32, d))
  got = expert_kernel.swiglu_experts(xs, sizes, expert_kernel.pack_gate_up(gu), expert_kernel.pack_down(dn))
  assert_close_f32(np.asarray(got), _swiglu64(xs, sizes, gu, dn), terms=d + i)


def test_bad_group_sizes_raise_instead_of_reading_past_the_rows():
  e, d, i = 4, 32, 24
  gu, dn = (f(w) for f, w in zip((expert_kernel.pack_gate_up, expert_kernel.pack_down), _weights(e, d, i)))
  xs = jnp.ones((6, d))
  with pytest.raises(Exception, match="group sizes sum past the rows"):
    jax.block_until_ready(expert_kernel.swiglu_experts(xs, jnp.asarray([3, 3, 1, 0], jnp.int32), gu, dn))
  with pytest.raises(Exception, match="negative group size"):
    jax.block_until_ready(expert_kernel.swiglu_experts(xs, jnp.asarray([3, -1, 1, 0], jnp.int32), gu, dn))
  with pytest.raises(Exception, match="TarsMoeGateUp: want"):
    jax.block_until_ready(expert_kernel.swiglu_experts(jnp.ones((6, 16)), jnp.zeros(4, jnp.int32), gu, dn))


def test_supports_only_float32_and_whole_tiles():
  assert expert_kernel.supports(256, 384, jnp.float32)
  assert not expert_kernel.supports(256, 384, jnp.bfloat16)
  assert not expert_kernel.supports(72, 384, jnp.float32)  # D not a multiple of 16
  assert not expert_kernel.supports(256, 36, jnp.float32)  # I not a multiple of 8


def test_a_failed_build_names_the_compiler_command(monkeypatch, tmp_path):
  """No g++: `build` raises KernelBuildError with the command (the MoE then keeps XLA's path)."""
  monkeypatch.setenv("TARS_JAX_KERNEL_DIR", str(tmp_path))
  monkeypatch.setenv("PATH", str(tmp_path))  # no compiler on the PATH
  with pytest.raises(expert_kernel.KernelBuildError, match="g\\+\\+ .*decode_experts.cc"):
    expert_kernel.build()
  assert not list(tmp_path.glob("*.so"))


def _grouped_loss64(xs, sizes, gu, dn, r):
  """float64 numpy: (sum(SwiGLU experts(xs) * r), its gradients in xs, gu, dn) by hand (the chain rule
  through silu(a) * b), independent of both JAX implementations."""
  xs, gu, dn, r = (np.asarray(a, np.float64) for a in (xs, gu, dn, r))
  loss, dx, dgu, ddn, s = 0.0, np.zeros_like(xs), np.zeros_like(gu), np.zeros_like(dn), 0
  for ex, n in enumerate(np.asarray(sizes)):
    x, dy = xs[s:s + n], r[s:s + n]
    a, b = x @ gu[ex, :, 0], x @ gu[ex, :, 1]
    sig = 1 / (1 + np.exp(-a))
    h = a * sig * b
    loss += float(np.sum((h @ dn[ex]) * dy))
    dh = dy @ dn[ex].T
    da, db = dh * b * sig * (1 + a * (1 - sig)), dh * a * sig
    dx[s:s + n] = da @ gu[ex, :, 0].T + db @ gu[ex, :, 1].T
    dgu[ex, :, 0], dgu[ex, :, 1], ddn[ex] = x.T @ da, x.T @ db, h.T @ dy
    s += n
  return loss, (dx, dgu, ddn)


@settings(max_examples=10, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=4, max_size=4), spare=st.integers(0, 3))
def test_grouped_blas_value_and_gradients_equal_float64_and_the_xla_loop(sizes, spare):
  """The train-step kernel (`expert_kernel.grouped_swiglu`, OpenBLAS): loss and all three gradients
  against a float64 chain rule by hand and against `grouped_mlp.grouped_swiglu` (XLA's loop), for
  empty experts, uneven groups and rows past sum(sizes)."""
  _check_grouped_blas(sizes, spare)


def test_grouped_blas_groups_split_into_row_chunks():
  """Groups over the kernel's 128-row task size (split into 3, 2 and 1 near-equal chunks)."""
  _check_grouped_blas([300, 0, 129, 7], 5)


def _check_grouped_blas(sizes, spare):
  from tars_jax.models.fast import grouped_mlp
  e, d, i = 4, 32, 24
  gu, dn = _weights(e, d, i, seed=5)
  g = max(sum(sizes) + spare, 1)
  xs = jax.random.normal(jax.random.PRNGKey(6), (g, d))
  r = jax.random.normal(jax.random.PRNGKey(7), (g, d))
  sz = jnp.asarray(sizes, jnp.int32)

  def loss(fn):
    return jax.jit(jax.value_and_grad(lambda xs, gu, dn: jnp.sum(fn(xs, sz, gu, dn) * r), argnums=(0, 1, 2)))

  got, got_g = loss(expert_kernel.grouped_swiglu)(xs, gu, dn)
  want, want_g = _grouped_loss64(xs, sz, gu, dn, r)
  xla, xla_g = loss(lambda *a: grouped_mlp.grouped_swiglu(*a, 16))(xs, gu, dn)
  # the loss: a tree-reduced sum of G * D mixed-sign products (scale: their root sum of squares) of rows
  # through the D + I chain; gradients: forward and backward chains plus the rows of a weight gradient
  prods = _swiglu64(xs, sz, gu, dn) * np.asarray(r, np.float64)
  assert abs(float(got) - want) <= f32_atol(float(np.sqrt(np.sum(prods ** 2))), d + i + int(np.log2(prods.size)) + 1)
  for a, b, c in zip(got_g, want_g, xla_g):
    assert_close_f32(np.asarray(a), b, terms=2 * (d + i) + g)
    assert_close_f32(np.asarray(a), np.asarray(c), terms=2 * (d + i) + g)
  assert sum(sizes) == 0 or np.abs(want_g[1]).max() > 0.1  # gradients far from 0: not vacuous
  np.testing.assert_array_equal(np.asarray(got_g[0])[sum(sizes):], 0)  # rows in no group get no gradient


def test_grouped_blas_bad_group_sizes_raise():
  e, d, i = 4, 32, 24
  gu, dn = _weights(e, d, i)
  with pytest.raises(Exception, match="group sizes sum past the rows"):
    jax.block_until_ready(expert_kernel.grouped_swiglu(jnp.ones((6, d)), jnp.asarray([3, 3, 1, 0], jnp.int32), gu, dn))
  with pytest.raises(Exception, match="TarsGroupedSwigluFwd: want"):
    jax.block_until_ready(expert_kernel.grouped_swiglu(jnp.ones((6, 16)), jnp.zeros(4, jnp.int32), gu, dn))
