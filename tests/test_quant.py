"""Quantised serving weights (`tars_jax/models/inference/quant.py`; report section 3, W4A8): quantise ->
dequantise error bounds against a numpy reference, the int8 x int8 matmul against exact integer
arithmetic, a tiny policy's logits against float32 within a bound derived from the quantisation
steps, greedy decode through `InferenceService` / `BatchedPolicy`, typed errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tars_jax.agent.grammar import build_grammar
from tars_jax.agent.tokenizer import BOS, IMAGE, VISION_END, VISION_START, ByteTokenizer
from tars_jax.models import Policy, rope_positions
from tars_jax.models.inference import quant
from tars_jax.rollout.inference_server import BatchedPolicy, InferenceService

from _shared import TINY_CFG, assert_close_f32, forward_terms, left_padded_batch

CFG = TINY_CFG
TOK = ByteTokenizer()
HW = (CFG.image_h, CFG.image_w)
IS_Q = lambda x: isinstance(x, quant.QTensor)


def _np_quantize(w, bits, axis, group, scale_override=None):
  """Independent numpy reference: (q int64, scale float32 [groups along axis], deq float64);
  `scale_override` (the returned scale's shape) replaces the computed scales."""
  w = np.asarray(w, np.float32)
  wm = np.moveaxis(w, axis, -1)  # contraction axis last
  k = wm.shape[-1]
  g = k if group is None else group
  wg = wm.reshape(wm.shape[:-1] + (k // g, g))
  m = 2 ** (bits - 1) - 1
  amax = np.abs(wg).max(-1, keepdims=True)
  scale = np.where(amax > 0, amax / np.float32(m), np.float32(1)).astype(np.float32)
  if scale_override is not None:
    scale = np.moveaxis(np.asarray(scale_override, np.float32), axis, -1)[..., None]
  q = np.clip(np.round(wg / scale), -m, m)
  deq = (q * scale.astype(np.float64)).reshape(wm.shape)
  return (np.moveaxis(q.reshape(wm.shape), -1, axis).astype(np.int64), np.moveaxis(scale[..., 0], -1, axis),
          np.moveaxis(deq, -1, axis))


def _weights(rng, shape):
  w = rng.standard_normal(shape).astype(np.float32)
  w[..., 0] = 0.0  # an all-zero output channel (scale falls back to 1, q = 0)
  w.reshape(-1)[5] = 40.0  # an outlier: its group's scale is large, the others' unaffected
  return w


@pytest.mark.parametrize("bits,group,shape,axis", [
    (8, None, (64, 48), -2),  # nnx.Linear kernel [K, N], per-channel
    (4, 32, (96, 8), -2),  # per group of 32 input channels
    (8, None, (3, 64, 2, 16), -3),  # MoE w_gate_up [E, D, 2, I]
    (4, 32, (3, 64, 2, 16), -3),
    (4, 16, (3, 32, 64), -2),  # MoE w_down [E, I, D]
])
def test_quantize_dequantize_matches_numpy_and_bound(bits, group, shape, axis):
  """q and scale equal the numpy reference; every element |w - deq(q(w))| <= scale / 2 of its group
  (plus the float32 rounding of q * scale); |q| <= qmax and each group's largest |w| maps to +-qmax."""
  w = _weights(np.random.default_rng(bits + len(shape)), shape)
  qt = quant.quantize_array(jnp.asarray(w), bits, axis, group)
  q_ref, s_ref, deq_ref = _np_quantize(w, bits, axis, group)
  assert qt.q.dtype == (jnp.int8 if bits == 8 else jnp.int4) and qt.q.shape == w.shape
  # XLA divides by the constant qmax as a multiply by its rounded reciprocal: scales within 1 ulp
  np.testing.assert_allclose(np.asarray(qt.scale), s_ref, rtol=np.finfo(np.float32).eps, atol=0)
  s_got = np.asarray(qt.scale)
  q_ref, _, deq_ref = _np_quantize(w, bits, axis, group, scale_override=s_got)  # q of exactly these scales
  np.testing.assert_array_equal(np.asarray(qt.q.astype(jnp.int8), np.int64), q_ref)
  m = 2 ** (bits - 1) - 1
  assert np.abs(q_ref).max() <= m
  # the scale of each element's group, broadcast to the weight's shape
  k = w.shape[axis]
  g = k if group is None else group
  s_full = np.repeat(s_ref, g, axis=axis).astype(np.float64)
  deq = np.asarray(qt.dequantize(), np.float64)
  np.testing.assert_allclose(deq, deq_ref, rtol=np.finfo(np.float32).eps, atol=0)
  err = np.abs(w.astype(np.float64) - deq)
  assert np.all(err <= s_full / 2 * (1 + 1e-6) + np.finfo(np.float32).eps * np.abs(w)), err.max()
  # the group maximum is represented exactly by +-qmax (up to the scale's own rounding)
  wm = np.moveaxis(np.abs(w), axis, -1).reshape(-1, g)
  qm = np.moveaxis(np.abs(q_ref), axis, -1).reshape(-1, g)
  nonzero = wm.max(-1) > 0
  assert np.all(qm.max(-1)[nonzero] == m)
  # reading the QTensor through `[...]` (what nnx.Param does) gives the dequantised weight
  np.testing.assert_array_equal(np.asarray(qt[...]), np.asarray(qt.dequantize()))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_int_matmul_is_exact_integer_arithmetic_and_within_bound(mode):
  """W8A8 / W4A8 x @ w: equals (sum_g s_x * s_w[g] * sum_k qx qw, integer sums in int64) to float32
  rounding, and differs from the float product by at most sum_i |x_i| dw + |w_i| dx + dx dw with
  dw = s_w / 2, dx = s_x / 2 (both roundings at their worst)."""
  m = quant.MODES[mode]
  rng = np.random.default_rng(3)
  k, n = 128, 24
  x = rng.standard_normal((2, 5, k)).astype(np.float32)
  x[0, 0, 3] = 25.0  # an activation outlier in one row
  w = _weights(rng, (k, n))
  qt = quant.quantize_array(jnp.asarray(w), m.weight_bits, -2, m.group)
  y = np.asarray(quant.int_matmul(jnp.asarray(x), qt), np.float64)
  # numpy: per-row activation quantisation, int64 sums per weight group
  amax = np.abs(x).max(-1, keepdims=True)
  sx = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
  xq = np.clip(np.round(x / sx), -127, 127).astype(np.int64)
  q_ref, s_ref, deq_ref = _np_quantize(w, m.weight_bits, -2, m.group)
  g = s_ref.shape[0]
  acc = np.einsum("bsgk,gkn->bsgn", xq.reshape(2, 5, g, k // g), q_ref.reshape(g, k // g, n))
  want = np.einsum("bsgn,gn->bsn", acc.astype(np.float64), s_ref.astype(np.float64)) * sx
  assert_close_f32(y, want, terms=k)
  # against the float product: a rigorous bound from the two rounding steps
  gs = k // g
  dw = np.repeat(s_ref, gs, axis=0).astype(np.float64) / 2  # [K, N]
  dx = sx.astype(np.float64) / 2  # [2, 5, 1]
  bound = np.abs(x) @ dw + dx * np.abs(w).sum(0) + dx * dw.sum(0)
  exact = x.astype(np.float64) @ w.astype(np.float64)
  assert np.all(np.abs(y - exact) <= bound * (1 + 1e-5)), (np.abs(y - exact) / bound).max()


# ---- whole model ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def split():
  return nnx.split(Policy(CFG, nnx.Rngs(11)))


def _dequantized(qparams):
  """The float params whose weights are the dequantised ones (the float model's structure)."""
  return jax.tree.map(lambda x: x.dequantize() if IS_Q(x) else x, qparams, is_leaf=IS_Q)


def _last_logits(gd, params, toks, mask, pix):
  model = nnx.merge(gd, params)
  pos = rope_positions(toks, mask, CFG.image_token_id, CFG.merged_grid)
  return model(toks, pos, mask, pix, jnp.ones(pix.shape[:2], bool)).logits[:, -1]


def _half_steps(qparams, params):
  """Half the quantisation step of every weight (s / 2 of its group), zeros for float leaves: a tree
  shaped like `params`."""
  return jax.tree.map(lambda q, w: (jnp.repeat(q.scale, q.shape[q.axis] // q.groups, axis=q.axis) / 2
                                    if IS_Q(q) else jnp.zeros_like(w)), qparams, params, is_leaf=IS_Q)


def _first_order_sigmas(gd, params, halves, batch):
  """[len(halves), B, V]: for each tree of half steps h = s / 2, the standard deviation of the
  first-order logit change sum_w (d logit / d w) dw when each rounding error dw is an independent
  uniform on [-h, h] (variance h^2 / 3): sqrt(sum_w (d logit / d w)^2 h^2 / 3) at the float weights,
  one VJP per logit. The model of rounding errors as independent, the one `_shared.f32_atol` uses
  for float rounding (Higham & Mary 2019); the worst case (all errors aligned) is about
  sqrt(#weights) times larger and would catch only gross mistakes."""
  out, vjp = jax.vjp(lambda p: _last_logits(gd, p, *batch), params)
  b, v = out.shape

  def one(i):
    (g,) = vjp(jax.nn.one_hot(i // v, b)[:, None] * jax.nn.one_hot(i % v, v)[None, :])
    grads = jax.tree.leaves(g)
    return jnp.stack([jnp.sqrt(sum(jnp.sum(a * a * h * h) for a, h in zip(grads, jax.tree.leaves(half))) / 3)
                      for half in halves])

  res = jax.lax.map(one, jnp.arange(b * v), batch_size=64)  # [B*V, n]
  return np.asarray(res, np.float64).T.reshape(len(halves), b, v)


# Tolerance in standard deviations of the first-order change: a normal deviate exceeds 6 with
# probability 2e-9, over the 2 x 264 logits compared 1e-6.
N_SIGMA = 6.0


@pytest.fixture(scope="module")
def bounds(split):
  """Logits of the float model and of each mode on a fixed batch, and each weight width's first-order
  standard deviation (`_first_order_sigmas`)."""
  gd, params = split
  batch = left_padded_batch(np.random.default_rng(0), (3, 9))
  out = {"float": np.asarray(_last_logits(gd, params, *batch), np.float64)}
  halves = []
  for mode in quant.MODES:
    qgd, qparams = quant.Quantizer(gd, mode).quantize(params)
    out[mode] = np.asarray(_last_logits(qgd, qparams, *batch), np.float64)
    if mode.endswith("weight_only"):
      halves.append(("sigma_" + mode[:4], _half_steps(qparams, params)))
      out["deq_" + mode] = np.asarray(_last_logits(gd, _dequantized(qparams), *batch), np.float64)
  for (name, _), sig in zip(halves, _first_order_sigmas(gd, params, [h for _, h in halves], batch)):
    out[name] = sig
  return out


@pytest.mark.long  # the `bounds` fixture: 528 VJPs of the tiny model (~80 s)
@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_weight_only_logits_equal_dequantized_model_and_within_bound(bounds, bits):
  """Weight-only: logits equal the float model with the dequantised weights (same arithmetic, to
  float32 rounding), and differ from the float32 model by at most N_SIGMA standard deviations of the
  first-order change the weights' rounding errors cause (`_first_order_sigmas`).
  The linearisation assumes no MoE top-k choice flips (a discontinuity): this fixed batch has none; on
  large batches some tokens near a routing tie do flip, under bfloat16 as under int8
  (benchmarks/RESULTS.md, "Quantised inference")."""
  got, deq = bounds[bits + "_weight_only"], bounds["deq_" + bits + "_weight_only"]
  assert_close_f32(got, deq, terms=forward_terms(CFG, 32))
  diff = np.abs(got - bounds["float"])
  assert diff.max() > 0  # really quantised
  tol = N_SIGMA * bounds["sigma_" + bits]
  assert np.all(diff <= tol), (diff / tol).max()


@pytest.mark.long  # the `bounds` fixture: 528 VJPs of the tiny model (~80 s)
@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_activation_quantized_logits_within_bound(bounds, bits):
  """W8A8 / W4A8 logits vs float32: within N_SIGMA x sqrt(weight term^2 + activation term^2) of the
  first-order standard deviations. The activation term is taken as int8's weight term: per-row int8
  activations have the same relative step (row max / 127) as per-channel int8 weights (column max /
  127) and enter the same matmuls (an estimate, not a derivation: the activations' own sensitivities
  are not computed). A wrong scale axis, a dropped scale or an int overflow exceeds it by far."""
  diff = np.abs(bounds[bits] - bounds["float"])
  tol = N_SIGMA * np.sqrt(bounds["sigma_" + bits] ** 2 + bounds["sigma_int8"] ** 2)
  assert diff.max() > 0
  assert np.all(diff <= tol), (diff / tol).max()
  assert np.abs(bounds[bits] - bounds[bits + "_weight_only"]).max() > 0  # activations really rounded


# ---- serving ---------------------------------------------------------------------------------------

def _prompts(n):
  rng = np.random.default_rng(5)
  out = []
  for i in range(n):
    ids = [BOS] + [int(x) for x in rng.integers(32, 127, 6 + 7 * i)]
    ims = []
    if i % 2 == 0:
      ids += [VISION_START] + [IMAGE] * CFG.n_img_tokens + [VISION_END]
      ims.append(rng.integers(0, 256, HW + (3,), dtype=np.uint8))
    out.append((ids, ims))
  return out


def _service(gd, params, grammar, **kw):
  return InferenceService(gd, params, tokenizer=TOK, grammar=grammar, slots=2, context_len=320, max_images=1,
                          image_hw=HW, max_new_tokens=96, length_multiple=32, temperature=0.0, jump_forward=4, **kw)


def _greedy(svc, prompts):
  return [svc.submit(ids, ims).result(timeout=300) for ids, ims in prompts]


GRAMMAR = build_grammar(actions=("click", "type"), max_thought_bytes=10, max_content_bytes=6, coord_format="fixed3")


@pytest.mark.parametrize("mode", ["int8_weight_only", "int4_weight_only"])
def test_weight_only_service_decodes_as_dequantized_float_model(split, mode):
  """Greedy decode of the quantised service = greedy decode of a float service whose weights are the
  dequantised ones (tokens, grammar states; log-probs to float32 rounding)."""
  gd, params = split
  _, qparams = quant.Quantizer(gd, mode).quantize(params)
  prompts = _prompts(3)
  with _service(gd, params, GRAMMAR, quantize=mode) as svc:
    got = _greedy(svc, prompts)
  with _service(gd, _dequantized(qparams), GRAMMAR) as ref:
    want = _greedy(ref, prompts)
  for g, w in zip(got, want):
    assert g.tokens == w.tokens and g.tokens[-1] == TOK.eos_id
    np.testing.assert_array_equal(g.states, w.states)
    assert_close_f32(g.logprobs, w.logprobs, terms=forward_terms(CFG, 256), scale=max(1.0, np.abs(w.logprobs).max()))


# int4 in the slow step: the same service path as int8, ~21 s of the fast suite (RESULTS "Fast suite")
@pytest.mark.parametrize("mode", ["int8", pytest.param("int4", marks=pytest.mark.slow)])
def test_activation_quantized_service_matches_lockstep_sampler(split, mode):
  """W8A8 / W4A8 have no float model to compare tokens with (activations are rounded inside each
  matmul); what is compared: the continuous-batching service and the lockstep `BatchedPolicy`, both
  with `quantize=mode`, give the same greedy tokens and states (log-probs to float32 rounding), and
  a weight swap (`set_params`) is quantised too (its replies = a service built with those weights)."""
  gd, params = split
  prompts = _prompts(3)
  lock = BatchedPolicy(gd, params, TOK, GRAMMAR, batch_size=1, max_images=1, image_hw=HW, max_new_tokens=96,
                       length_multiple=32, temperature=0.0, jump_forward=4, quantize=mode)
  want = [lock.act([ids], [ims])[0] for ids, ims in prompts]
  params2 = jax.tree.map(lambda a: a * 1.5 if a.ndim >= 2 else a, params)
  with _service(gd, params, GRAMMAR, quantize=mode) as svc:
    got = _greedy(svc, prompts)
    svc.set_params(params2, 1)
    swapped = _greedy(svc, prompts[:1])
  for g, (ids, lp, st) in zip(got, want):
    assert g.tokens == ids and ids[-1] == TOK.eos_id
    np.testing.assert_array_equal(g.states, st)
    assert_close_f32(g.logprobs, lp, terms=forward_terms(CFG, 256), scale=max(1.0, np.abs(lp).max()))
  with _service(gd, params2, GRAMMAR, quantize=mode) as ref:
    (want2,) = _greedy(ref, prompts[:1])
  assert swapped[0].tokens == want2.tokens and set(swapped[0].versions) == {1}
  # the lockstep policy requantises when the trainer assigns new params
  lock.params = params2
  assert lock.act([prompts[0][0]], [prompts[0][1]])[0][0] == want2.tokens


def test_quantized_params_layout(split):
  """Which leaves are quantised: decoder projections and experts (int8 / int4 QTensors), never the
  embeddings, norms, router, LM head or vision encoder; the float params are left unchanged."""
  gd, params = split
  before = jax.tree.map(np.asarray, params)
  _, qparams = quant.Quantizer(gd, "int4").quantize(params)
  paths = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(qparams, is_leaf=IS_Q) if IS_Q(x)]
  assert paths and all("decoder" in p and "layers" in p for p in paths)
  assert not any(s in p for p in paths for s in ("router", "embed", "norm", "lm_head", "visual"))
  assert sum("w_gate_up" in p for p in paths) == CFG.layers and sum("q_proj" in p for p in paths) == CFG.layers
  assert all(q.q.dtype == jnp.int4 for q in jax.tree.leaves(qparams, is_leaf=IS_Q) if IS_Q(q))
  jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, params))
  assert quant.serving_bytes(qparams) < quant.serving_bytes(params)


def test_unknown_mode_and_bad_group_are_typed_errors(split):
  gd, params = split
  with pytest.raises(quant.QuantizationError, match="unknown quantisation mode 'fp8'"):
    quant.check_mode("fp8")
  with pytest.raises(quant.QuantizationError):
    BatchedPolicy(gd, params, TOK, GRAMMAR, batch_size=1, max_images=1, image_hw=HW, max_new_tokens=8,
                  quantize="int3")
  with pytest.raises(quant.QuantizationError):
    _service(gd, params, GRAMMAR, quantize="w4a16")
  with pytest.raises(quant.QuantizationError, match="does not divide"):
    quant.quantize_array(jnp.ones((40, 8)), 4, -2, 32)
  assert issubclass(quant.QuantizationError, ValueError)
