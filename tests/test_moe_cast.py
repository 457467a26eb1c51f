"""`moe.cast_apply` / `cast_einsum`: the experts' float32 weights cast to the compute dtype inside a
`jax.checkpoint`, so the backward redoes the cast instead of keeping a bf16 copy of every layer's
experts. Values and gradients against the plain cast-outside einsum, and the compiled step's
temporaries (deterministic buffer sizes, nothing timed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tars_jax.models import moe
from _shared import scanned_step_temp_bytes

BF = jnp.bfloat16


def _plain(spec, x, w, *rest, dtype, index=None):
  return jnp.einsum(spec, x, (w if index is None else w[index]).astype(dtype), *rest)


@pytest.mark.parametrize("indexed", [False, True])
def test_same_values_and_gradients_as_casting_outside(indexed):
  kx, kw, kr = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(kx, (3, 5, 8)).astype(BF)
  w = jax.random.normal(kw, (4, 8, 6))  # float32 parameters of 4 experts
  r = jax.random.normal(kr, (3, 5)).astype(BF)
  index = jnp.asarray([2, 0, 2], jnp.int32) if indexed else None
  spec = "brd,bdi,br->bri"  # block b through expert index[b] (or expert b)
  w_in = w if indexed else w[:3]

  def loss(f, x, w, r):
    return jnp.sum(jnp.sin(f(spec, x, w, r, dtype=BF, index=index).astype(jnp.float32)))

  got = jax.jit(jax.value_and_grad(lambda *a: loss(moe.cast_einsum, *a), argnums=(0, 1, 2)))(x, w_in, r)
  want = jax.jit(jax.value_and_grad(lambda *a: loss(_plain, *a), argnums=(0, 1, 2)))(x, w_in, r)
  assert float(got[0]) == float(want[0])
  for a, b in zip(got[1], want[1]):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  if indexed:  # expert 1 and 3 got no block: zero gradient; expert 2 got two
    assert float(jnp.abs(got[1][1][1]).max()) == 0.0 and float(jnp.abs(got[1][1][2]).max()) > 0


def _temp_bytes(f, layers, e, d, i, n) -> int:
  def layer(h, p):
    wgu, wd = p
    return f("nei,eid->nd", jax.nn.silu(f("nd,edi->nei", h, wgu, dtype=BF)), wd, dtype=BF)
  params = (jax.ShapeDtypeStruct((layers, e, d, i), jnp.float32), jax.ShapeDtypeStruct((layers, e, i, d), jnp.float32))
  return scanned_step_temp_bytes(layer, params, jax.ShapeDtypeStruct((n, d), BF))


def test_a_scanned_bf16_step_keeps_no_bf16_copy_of_the_experts():
  """4 scanned layers of 16 experts (256 x 128) over 64 rows: casting inside keeps at least one bf16
  copy of every layer's expert weights fewer than casting outside."""
  layers, e, d, i, n = 4, 16, 256, 128, 64
  saved = _temp_bytes(_plain, layers, e, d, i, n) - _temp_bytes(moe.cast_einsum, layers, e, d, i, n)
  assert saved >= layers * e * 2 * d * i * 2, saved
