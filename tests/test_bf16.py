"""The bfloat16 compute knob (`ModelConfig.dtype = "bfloat16"`): parameters stay float32, activations
and the KV cache are bfloat16, logits float32, and the loss, gradients and sampling track the float32
model with the same parameters to bfloat16 precision (the reference is the float32 model, computed
independently); the knob must really change the arithmetic (results not bit-equal to float32)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tars_jax.agent.tokenizer import BOS, IMAGE, PAD
from tars_jax.models import Policy, rope_positions
from tars_jax.models.inference import sampler
from _shared import TINY_CFG, left_padded_batch

CFG = TINY_CFG
BF16 = dataclasses.replace(TINY_CFG, dtype="bfloat16")


def _batch(rng):
  """Two left-padded rows `BOS text <vs> IMAGE*6 <ve> text`, one image each."""
  return left_padded_batch(rng, (3, 8), tail=(10, 11))


@pytest.fixture(scope="module")
def models():
  """(float32 policy, bfloat16-compute policy) with identical float32 parameters (same seed)."""
  return Policy(CFG, nnx.Rngs(0)), Policy(BF16, nnx.Rngs(0))


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_parameters_stay_float32_and_equal(models):
  f32, bf16 = models
  p32, p16 = jax.tree.leaves(nnx.state(f32, nnx.Param)), jax.tree.leaves(nnx.state(bf16, nnx.Param))
  assert len(p32) == len(p16)
  for a, b in zip(p32, p16):
    assert b.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_activations_bf16_logits_float32_close_to_float32(models):
  f32, bf16 = models
  toks, mask, pix = _batch(np.random.default_rng(0))
  pos = rope_positions(toks, mask, IMAGE, CFG.merged_grid)
  h16, _ = nnx.jit(lambda m, *a: m.features(*a))(bf16, toks, pos, mask, pix)
  assert h16.dtype == jnp.bfloat16
  l32, aux32, _, _ = nnx.jit(lambda m, *a: m(*a))(f32, toks, pos, mask, pix)
  l16, aux16, _, _ = nnx.jit(lambda m, *a: m(*a))(bf16, toks, pos, mask, pix)
  assert l16.dtype == jnp.float32 and aux16.dtype == jnp.float32
  real = np.asarray(mask)
  err = _rel(np.asarray(l16)[real], np.asarray(l32)[real])
  assert 1e-5 < err < 3e-2, err  # bf16 has 8 mantissa bits (~4e-3 relative per rounding)
  np.testing.assert_allclose(float(aux16), float(aux32), rtol=5e-2)
  # The argmax agrees wherever float32's top-2 gap is clearly above bf16 noise.
  top2 = np.sort(np.asarray(l32), -1)[..., -2:]
  clear = real & (top2[..., 1] - top2[..., 0] > 0.1)
  assert clear.sum() >= 4
  np.testing.assert_array_equal(np.asarray(l16).argmax(-1)[clear], np.asarray(l32).argmax(-1)[clear])


@pytest.mark.slow  # ~30 s
def test_loss_and_gradients_track_float32(models):
  f32, bf16 = models
  toks, mask, pix = _batch(np.random.default_rng(1))
  pos = rope_positions(toks, mask, IMAGE, CFG.merged_grid)

  def loss(m):
    lg, aux, _, _ = m(toks, pos, mask, pix)
    logp = jax.nn.log_softmax(lg[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, toks[:, 1:, None], axis=-1)[..., 0]
    w = mask[:, 1:].astype(jnp.float32)
    return jnp.sum(nll * w) / jnp.sum(w) + 0.01 * aux

  step = nnx.jit(nnx.value_and_grad(loss))
  l32, g32 = step(f32)
  l16, g16 = step(bf16)
  assert abs(float(l16) - float(l32)) < 2e-2 * abs(float(l32))
  flat32 = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(g32)])
  leaves16 = jax.tree.leaves(g16)
  assert all(x.dtype == jnp.float32 for x in leaves16)  # gradients of float32 parameters
  flat16 = np.concatenate([np.asarray(x, np.float64).ravel() for x in leaves16])
  assert np.isfinite(flat16).all()
  cos = flat16 @ flat32 / (np.linalg.norm(flat16) * np.linalg.norm(flat32))
  assert cos > 0.999, cos
  assert 1e-5 < _rel(flat16, flat32) < 5e-2


def test_sampler_bf16_cache_and_first_token(models):
  _, bf16 = models
  toks, mask, pix = _batch(np.random.default_rng(2))
  cache = bf16.init_cache(2, 4)
  assert all(k.dtype == jnp.bfloat16 for k in cache.k + cache.v)
  gen = sampler.generate(bf16, toks, mask, pix, None, jax.random.PRNGKey(0), max_new_tokens=6, temperature=0.0,
                         eos_id=-1, pad_id=PAD)
  assert np.isfinite(np.asarray(gen.logprobs)).all()
  # The first greedy token is the argmax of the same (bf16) model's full forward at the last prompt slot.
  pos = rope_positions(toks, mask, IMAGE, CFG.merged_grid)
  logits = nnx.jit(lambda m, *a: m(*a).logits)(bf16, toks, pos, mask, pix)
  np.testing.assert_array_equal(np.asarray(gen.tokens[:, 0]), np.asarray(logits[:, -1]).argmax(-1))


def test_hf_model_with_compute_dtype_shares_float32_params():
  from tars_jax.models.interop.hf_model import HFModel
  m32 = HFModel(CFG, nnx.Rngs(1))
  m16 = m32.with_compute_dtype(jnp.bfloat16)
  assert m16.cfg.dtype == "bfloat16" and m32.cfg.dtype == "float32"
  p32, p16 = jax.tree.leaves(nnx.state(m32, nnx.Param)), jax.tree.leaves(nnx.state(m16, nnx.Param))
  assert len(p32) == len(p16) and all(a is b for a, b in zip(p32, p16))  # the same buffers
  toks, mask, pix = _batch(np.random.default_rng(3))
  pos = rope_positions(toks, mask, IMAGE, CFG.merged_grid)
  h16, _ = nnx.jit(lambda m, *a: m.features(*a))(m16.policy, toks, pos, mask, pix)
  h32, _ = nnx.jit(lambda m, *a: m.features(*a))(m32.policy, toks, pos, mask, pix)
  assert h16.dtype == jnp.bfloat16 and h32.dtype == jnp.float32
  real = np.asarray(mask)
  assert 1e-5 < _rel(np.asarray(h16, np.float32)[real], np.asarray(h32)[real]) < 3e-2
