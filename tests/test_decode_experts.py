"""The CPU decode loop's expert weights split (XLA's per-expert dots) or packed for the FFI kernel
(`expert_kernel.py`) once per `generate` (`moe.prepare_decode_weights`): the same tokens and
log-probs as without either, the same values as the dense reference, and no copy of an expert's weight
slice left inside the compiled loop (with the kernel: its two custom calls per layer instead)."""

import dataclasses
import re

import jax
import numpy as np
import pytest
from flax import nnx

from tars_jax.models import Policy, moe

from tars_jax.models.fast.cpu import expert_kernel
from tars_jax.models.fast.cpu.compile_options import DECODE_CPU_OPTIONS
from tars_jax.models.inference import sampler
from _shared import TINY_CFG, assert_close_f32, bounded_moe_case, forward_terms, generate_call, left_padded_batch

# 8 experts top-2: at batch 8 the bounded [E, C, D] decode path runs (C = 4 < 8 rows per expert); expert
# width 48 so that no other weight of the model has an expert slice's shape.
CFG = dataclasses.replace(TINY_CFG, experts=8, moe_intermediate=48, moe_impl="grouped")
N = 6  # new tokens
KERNEL = {"ffi": True, "xla": False}  # ModelConfig.moe_decode_kernel


# XLA's per-expert path (kernel off) in the slow suite: the kernel is the default decode path.
@pytest.fixture(scope="module", params=["ffi", pytest.param("xla", marks=pytest.mark.slow)])
def policy(request):
  """The same weights (seed 3) with the decode loop's experts on the FFI kernel or on XLA's dots."""
  assert expert_kernel.supports(CFG.hidden, CFG.moe_intermediate, CFG.jdtype)
  return Policy(dataclasses.replace(CFG, moe_decode_kernel=KERNEL[request.param]), nnx.Rngs(3))


def _args(policy):
  toks, mask, pix = left_padded_batch(np.random.default_rng(2), [1, 3, 5, 2, 4, 6, 3, 1], cfg=CFG)
  return generate_call(policy, toks, mask, pix, N)


def _unsplit_generate(monkeypatch):
  """`sampler._generate_fn` compiled (CPU options) with the split turned off: a fresh function object,
  so jax traces it anew instead of reusing the split trace."""
  monkeypatch.setattr(moe, "prepare_decode_weights", lambda model: None)
  fn = sampler._generate_fn
  clone = type(fn)(fn.__code__, fn.__globals__, "unsplit_generate", fn.__defaults__, fn.__closure__)
  return jax.jit(clone, static_argnames=sampler.GENERATE_STATIC, compiler_options=DECODE_CPU_OPTIONS)


def _computations(text: str) -> dict[str, list[str]]:
  """HLO text -> {computation name: its instruction lines}."""
  bodies, name = {}, None
  for line in text.splitlines():
    m = re.match(r"^(?:ENTRY )?%(\S+) ", line)
    if m:
      name = m.group(1)
      bodies[name] = []
    elif name:
      bodies[name].append(line)
  return bodies


def _reachable(bodies: dict[str, list[str]], root: str) -> set[str]:
  """Names of the HLO computations `root` calls, transitively (fusions, conds, nested loops)."""
  seen, todo = set(), [root]
  while todo:
    c = todo.pop()
    if c in seen or c not in bodies:
      continue
    seen.add(c)
    for line in bodies[c]:
      todo += re.findall(r"(?:calls|body|condition|to_apply|branch_computations)=\{?%([\w.\-]+)", line)
      for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
        todo += re.findall(r"%([\w.\-]+)", group)
  return seen


def _loop_lines(text: str) -> list[str]:
  """The instruction lines of the decode `while` loop's body and of every computation it calls."""
  loop = re.search(r"= .* while\(.*body=%([\w.\-]+)", text).group(1)
  bodies = _computations(text)
  return [line for c in _reachable(bodies, loop) for line in bodies[c]]


def _expert_weight_copies_in_loop(text: str) -> int:
  """Instructions inside the decode `while` loop that produce one expert's gate|up [D, 2I] or down
  [I, D] weights (the per-step copies out of the stacked parameters), or all experts' gate|up in the
  dense path's [D, E*2I] layout (its einsum's copy of the stacked parameter)."""
  d, i, e = CFG.hidden, CFG.moe_intermediate, CFG.experts
  shapes = (f"f32[{d},{2 * i}]", f"f32[{d},2,{i}]", f"f32[{i},{d}]", f"f32[{d},{e * 2 * i}]")
  makes_slice = re.compile(r"= (" + "|".join(re.escape(s) for s in shapes) + r")\{.*\b(fusion|slice|copy|dynamic-slice)\(")
  return sum(bool(makes_slice.search(line)) for line in _loop_lines(text))


def test_per_expert_swiglu_equals_the_stacked_einsums():
  e, c, d, i = 8, 4, 64, 32
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  buf = jax.random.normal(k[0], (e, c, d))
  wgu, wd = jax.random.normal(k[1], (e, d, 2, i)), jax.random.normal(k[2], (e, i, d))
  want = moe.capacity_swiglu(buf, wgu, wd)
  got = moe.per_expert_swiglu(buf, tuple(wgu), tuple(wd))
  assert_close_f32(got, want, terms=d + i)


def test_split_decodes_the_same_tokens_and_log_probs(policy, monkeypatch):
  args, kw = _args(policy)
  split = sampler._generate(*args, **kw)
  plain = _unsplit_generate(monkeypatch)(*args, **kw)
  np.testing.assert_array_equal(np.asarray(split.tokens), np.asarray(plain.tokens))
  assert_close_f32(np.asarray(split.logprobs), np.asarray(plain.logprobs),
                   terms=forward_terms(CFG, args[1].shape[1] + split.tokens.shape[1]))


def _kernel_calls_in_loop(text: str) -> int:
  """Custom calls to the FFI kernel's gate|up target inside the decode `while` loop."""
  return sum("custom_call_target=\"tars_moe_gate_up\"" in line for line in _loop_lines(text))


def test_no_expert_weight_copies_inside_the_decode_loop(policy, monkeypatch):
  args, kw = _args(policy)
  split_text = sampler._generate.cpu.lower(*args, **kw).compile().as_text()
  plain_text = _unsplit_generate(monkeypatch).lower(*args, **kw).compile().as_text()
  # Precondition: without the split the loop copies both weights of every expert of every layer.
  assert _expert_weight_copies_in_loop(plain_text) >= 2 * CFG.experts * CFG.layers
  assert _expert_weight_copies_in_loop(split_text) == 0
  assert _kernel_calls_in_loop(plain_text) == 0
  assert _kernel_calls_in_loop(split_text) == (CFG.layers if policy.cfg.moe_decode_kernel else 0)


@pytest.mark.parametrize("kernel", list(KERNEL))
@pytest.mark.parametrize("balanced", [True, False])
def test_split_moe_equals_the_dense_reference_in_both_branches(balanced, kernel):
  """The bounded decode path with split weights: the [E, C, D] branch when every expert's load fits C,
  the same per-expert path with C = N when one overflows (a zero router sends every token to experts
  0..k-1; without the split that branch is the dense path); with the FFI kernel, each expert on its
  routed rows whatever the load. All equal the dense reference."""
  m, x = bounded_moe_case(dataclasses.replace(CFG, moe_decode_kernel=KERNEL[kernel]), balanced)
  dense = nnx.merge(nnx.split(moe.MoE(dataclasses.replace(CFG, moe_impl="dense"), nnx.Rngs(0)))[0], nnx.state(m))
  want = dense(x)[0]

  gd, state = nnx.split(m)

  @jax.jit
  def split_forward(state, x):  # as in the sampler: the layout is made inside the jit and passed in
    mod = nnx.merge(gd, state)
    decode_weights = moe.decode_layout(mod)
    assert decode_weights is not None
    return mod(x, decode_weights)[0]

  assert_close_f32(split_forward(state, x), want, terms=2 * CFG.hidden + CFG.moe_intermediate)  # router, experts


def _layers_split(cfg) -> int:
  """Layers with a decode layout in `prepare_decode_weights` of a freshly built model of `cfg`, traced
  abstractly (no weights made)."""
  out = []
  jax.eval_shape(lambda: out.append(moe.prepare_decode_weights(Policy(cfg, nnx.Rngs(3)))))
  return 0 if out[0] is None else sum(w is not None for w in out[0])


def test_split_skips_scanned_layers_and_counts_the_rest():
  assert _layers_split(CFG) == CFG.layers
  assert _layers_split(dataclasses.replace(CFG, scan_layers=True)) == 0
  assert _layers_split(dataclasses.replace(CFG, moe_impl="blocked")) == CFG.layers
  assert _layers_split(dataclasses.replace(CFG, moe_impl="dense")) == 0  # no bounded path: no copy made
