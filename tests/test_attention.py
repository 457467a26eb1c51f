"""The two attention cores (`tars_jax/models/attention.py`, `ModelConfig.attention_impl`).

"recompute" is "einsum" with a hand-written backward (FlashAttention-2's, untiled). Checked here:
the same forward values; gradients equal to JAX autodiff of the einsum core (float32, grouped-query
heads, causal + left-padding masks with a fully masked row; bfloat16 within bfloat16 rounding); and
what it is for: the compiled train step of a 4-layer scanned model keeps fewer temporary bytes, 1.5
float32 [B, H, L, S] arrays per layer fewer or more. The independent reference for the gradients, torch
autograd on transformers' model with the same weights, is `tests/test_hf_parity.py::
test_gradients_match_torch_autograd` (both cores, both families).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tars_jax.models import ModelConfig, Policy
from tars_jax.models.attention import attend, attend_causal_blocks, attend_decode, attend_einsum, attend_recompute
from tars_jax.models.rope import rope_positions
from _shared import assert_close_f32, f32_atol, forward_terms


def _terms(q, k, grad: bool = False) -> int:
  """float32 summation length (`_shared.f32_atol`) of attention over q [B, L, KV, G, hd], k [B, KV, S, hd]:
  scores over hd, softmax and weighted values over S; gradients: that forward and backward again plus
  the L queries summed into dk / dv."""
  fwd_terms = q.shape[-1] + k.shape[2]
  return 2 * fwd_terms + q.shape[1] if grad else fwd_terms


def _inputs(dtype, b=3, l=7, s=9, kv=2, g=3, hd=8, seed=0):
  """q [B, L, KV, G, hd], k / v [B, KV, S, hd], allowed [B, L, S]: causal over the last L of S slots,
  left padding of 0 / 2 / S slots (row 2 fully masked: its output is the uniform average of v)."""
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, l, kv, g, hd), dtype)
  k = jax.random.normal(ks[1], (b, kv, s, hd), dtype)
  v = jax.random.normal(ks[2], (b, kv, s, hd), dtype)
  slot = np.arange(s)
  causal = slot[None, :] <= (s - l + np.arange(l))[:, None]
  pad = np.array([0, 2, s])[:, None] <= slot[None, :]
  allowed = jnp.asarray(causal[None] & pad[:, None, :])
  return q, k, v, allowed, jax.random.normal(ks[3], (b, kv, g, l, hd), jnp.float32)


def test_forward_is_the_einsum_core():
  q, k, v, allowed, _ = _inputs(jnp.float32)
  want = attend_einsum(q, k, v, allowed)
  np.testing.assert_array_equal(np.asarray(attend_recompute(q, k, v, allowed)), np.asarray(want))
  # the fully masked row averages v uniformly (finite mask value), as transformers' eager attention
  mean_v = np.broadcast_to(np.asarray(jnp.mean(v[2], axis=1))[:, None], want.shape[1:3] + want.shape[-1:])
  assert_close_f32(np.asarray(want[2, :, :, 0]), mean_v, terms=_terms(q, k))


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, None), (jnp.bfloat16, 2e-2)])  # None: float32 rule
def test_gradients_equal_autodiff_of_einsum(dtype, tol):
  q, k, v, allowed, w = _inputs(dtype)

  def loss(core):
    return lambda q, k, v: jnp.sum(core(q, k, v, allowed).astype(jnp.float32) * w)

  want = jax.grad(loss(attend_einsum), argnums=(0, 1, 2))(q, k, v)
  got = jax.grad(loss(attend_recompute), argnums=(0, 1, 2))(q, k, v)
  for name, g_, w_ in zip("qkv", got, want):
    assert g_.dtype == w_.dtype == dtype
    g_, w_ = np.asarray(g_, np.float32), np.asarray(w_, np.float32)
    assert np.abs(w_).max() > 0.1, name  # not vacuous
    bound = f32_atol(np.abs(w_).max(), _terms(q, k, grad=True)) if tol is None else tol * np.abs(w_).max()
    assert np.abs(g_ - w_).max() <= bound, (name, np.abs(g_ - w_).max(), bound)


def test_no_mask_and_unknown_impl():
  q, k, v, _, w = _inputs(jnp.float32)
  f = lambda core: jax.grad(lambda q: jnp.sum(core(q, k, v, None) * w))(q)
  assert_close_f32(np.asarray(f(attend_recompute)), np.asarray(f(attend_einsum)), terms=_terms(q, k, grad=True))
  with pytest.raises(ValueError, match="known: \\['einsum', 'recompute'\\]"):
    attend("flash", q, k, v, None)
  with pytest.raises(ValueError, match="attention_impl='flash'"):
    ModelConfig(attention_impl="flash")


def _np_attention(q, k, v, allowed):
  """float64 NumPy softmax(q k^T / sqrt(hd), masked by -1e9) v in `attend`'s layouts: the reference."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  s = np.einsum("blkgd,bksd->bkgls", q, k) / np.sqrt(q.shape[-1])
  s = np.where(np.asarray(allowed)[:, None, None], s, -1e9)
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("bkgls,bksd->bkgld", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, None), (jnp.bfloat16, 2e-2)])  # None: float32 rule
def test_decode_form_is_attention_for_one_query(dtype, tol):
  q, k, v, allowed, _ = _inputs(dtype, l=1)  # row 2 fully masked: the uniform average of v
  want = _np_attention(q, k, v, allowed)
  got = attend_decode(q, k, v, allowed)
  assert got.dtype == dtype and got.shape == want.shape
  if tol is None:  # relative: the float32 rule at scale 1 (outputs and gradients, below)
    tol = f32_atol(1.0, _terms(q, k, grad=True))
  np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol)
  np.testing.assert_allclose(np.asarray(attend_decode(q, k, v, None), np.float32),
                             _np_attention(q, k, v, np.ones_like(allowed)), rtol=tol, atol=tol)
  # `attend` takes it for one query on CPU, for either impl; the einsum core agrees
  for impl in ("einsum", "recompute"):
    np.testing.assert_array_equal(np.asarray(attend(impl, q, k, v, allowed)), np.asarray(got))
  np.testing.assert_allclose(np.asarray(attend_einsum(q, k, v, allowed), np.float32), np.asarray(got, np.float32),
                             rtol=tol, atol=tol)
  # a 1-query tail block of `attend_causal_blocks` in training differentiates through it
  w = jax.random.normal(jax.random.key(5), got.shape, jnp.float32)
  grads = lambda core: jax.grad(lambda q, k, v: jnp.sum(core(q, k, v, allowed).astype(jnp.float32) * w),
                                argnums=(0, 1, 2))(q, k, v)
  for g_, w_ in zip(grads(attend_decode), grads(attend_einsum)):
    g_, w_ = np.asarray(g_, np.float32), np.asarray(w_, np.float32)
    assert np.abs(g_ - w_).max() <= tol * np.abs(w_).max()


@pytest.mark.long  # ~40 s of compiles
def test_train_step_keeps_fewer_bytes_and_the_same_gradients():
  """A 4-layer scanned policy (text only, 256 tokens): loss and gradients equal between the cores, and
  the compiled value-and-grad step's temporaries shrink by 1.5 float32 [B, heads, L, L] arrays per
  layer or more (einsum autodiff keeps the masked scores and the probabilities of every layer; 1.9
  measured). With unrolled layers XLA:CPU's schedule keeps most of them anyway (not asserted)."""
  b, t, layers, heads = 2, 256, 4, 4
  base = ModelConfig(layers=layers, heads=heads, kv_heads=2, hidden=64, head_dim=16, experts=4, top_k=2,
                     moe_intermediate=32, vision_depth=1, scan_layers=True, attention_block=0)
  toks = jax.random.randint(jax.random.key(1), (b, t), 0, 256)
  mask = jnp.ones((b, t), bool).at[1, :17].set(False)
  pos = rope_positions(toks, mask, base.image_token_id, base.merged_grid)
  params = jax.jit(lambda: nnx.split(Policy(base, nnx.Rngs(0)))[1])()
  out = {}
  for impl in ("einsum", "recompute"):
    gd, _ = nnx.split(nnx.eval_shape(lambda: Policy(dataclasses.replace(base, attention_impl=impl), nnx.Rngs(0))))

    def loss(p):
      logits = nnx.merge(gd, p)(toks, pos, mask).logits
      lp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), toks[:, 1:, None], -1)
      return -jnp.mean(lp)

    step = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
    out[impl] = (step(params), step.memory_analysis().temp_size_in_bytes)
  (l0, g0), temp0 = out["einsum"]
  (l1, g1), temp1 = out["recompute"]
  assert_close_f32(float(l1), float(l0), terms=forward_terms(base, t))  # a mean of -log p > 0: no cancellation
  for a, c in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    assert_close_f32(np.asarray(a), np.asarray(c), terms=2 * forward_terms(base, t) + b * t)
  probs_bytes = b * heads * t * t * 4
  assert temp0 - temp1 >= 1.5 * layers * probs_bytes, (temp0, temp1, probs_bytes)


@pytest.mark.parametrize("impl", [pytest.param("einsum", marks=pytest.mark.long), "recompute"])
def test_causal_blocks_equal_the_full_square_on_real_rows(impl):
  """Causal self-attention by query blocks (`attend_causal_blocks`, blocks of 4 over L = S = 11, left
  padding of 0 / 3 / 6 slots): outputs and gradients of q, k, v equal the full L x L square's on every
  real query row (padding rows, masked out of the loss, average v over their block's keys instead)."""
  b, l, kv, g, hd = 3, 11, 2, 2, 8
  ks = jax.random.split(jax.random.key(2), 4)
  q = jax.random.normal(ks[0], (b, l, kv, g, hd))
  k, v = (jax.random.normal(kk, (b, kv, l, hd)) for kk in ks[1:3])
  slot = np.arange(l)
  real = np.array([0, 3, 6])[:, None] <= slot[None, :]  # [B, L]
  allowed = jnp.asarray((slot[None, :] <= slot[:, None])[None] & real[:, None, :])
  w = jax.random.normal(ks[3], (b, kv, g, l, hd)) * jnp.asarray(real)[:, None, None, :, None]

  def loss(f):
    return lambda q, k, v: jnp.sum(f(q, k, v) * w)

  full = lambda q, k, v: attend(impl, q, k, v, allowed)
  blocked = lambda q, k, v: attend_causal_blocks(impl, q, k, v, allowed, 4)
  sel = np.broadcast_to(real[:, None, None, :, None], (b, kv, g, l, hd))
  assert_close_f32(np.asarray(blocked(q, k, v))[sel], np.asarray(full(q, k, v))[sel], terms=_terms(q, k))
  want = jax.grad(loss(full), argnums=(0, 1, 2))(q, k, v)
  got = jax.grad(loss(blocked), argnums=(0, 1, 2))(q, k, v)
  for a, c in zip(got, want):
    assert np.abs(np.asarray(c)).max() > 0.1
    assert_close_f32(np.asarray(a), np.asarray(c), terms=_terms(q, k, grad=True))
  with pytest.raises(ValueError, match="attention_block=-1"):
    ModelConfig(attention_block=-1)


@pytest.mark.long  # ~40 s of compiles
def test_prefill_by_causal_blocks_samples_what_one_square_does():
  """The sampler's prefill (a KV cache written from slot 0) also runs by causal blocks: greedy tokens
  and their log-probs from a left-padded batch of ~60-token prompts with one image equal those of the
  same weights with `attention_block=0` (one full square, prefill and decode)."""
  from _shared import TINY_CFG, left_padded_batch
  from tars_jax.agent.tokenizer import PAD
  from tars_jax.models.inference import sampler
  toks, mask, pix = left_padded_batch(np.random.default_rng(1), [2, 7, 4])
  assert toks.shape[1] > 16
  _, params = nnx.split(Policy(dataclasses.replace(TINY_CFG, attention_block=0), nnx.Rngs(4)))
  out = {}
  for block in (0, 16):
    gd, _ = nnx.split(nnx.eval_shape(lambda: Policy(dataclasses.replace(TINY_CFG, attention_block=block),
                                                    nnx.Rngs(4))))
    out[block] = sampler.generate(gd, params, toks, mask, pix, None, jax.random.PRNGKey(0), max_new_tokens=8,
                                  temperature=0.0, eos_id=-1, pad_id=PAD)
  np.testing.assert_array_equal(np.asarray(out[16].tokens), np.asarray(out[0].tokens))
  assert_close_f32(np.asarray(out[16].logprobs), np.asarray(out[0].logprobs),
                   terms=forward_terms(TINY_CFG, toks.shape[1] + 8))
  assert np.asarray(out[0].logprobs).min() < -0.1  # not vacuous: a random policy is not certain
