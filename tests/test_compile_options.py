"""Per-executable XLA options (`tars_jax/models/fast/cpu/compile_options.py`): the sampler's decode loop compiles
without YNNPACK fusions on CPU while other jitted functions keep XLA's defaults. The decoded tokens
stay those of the model (`test_sampler.py` checks them against full recomputation, `test_hf_parity.py`
against transformers `generate`)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tars_jax.agent.tokenizer import EOS, PAD
from tars_jax.models import Policy
from tars_jax.models.fast.cpu.compile_options import DECODE_CPU_OPTIONS, jit_per_backend
from tars_jax.models.inference import sampler
from _shared import TINY_CFG, generate_call, left_padded_batch


def _few_row_dot(x, w):
  return jnp.tanh(x @ w)


def _ynn_fusions(fn, *args, **kwargs) -> int:
  """How many YNNPACK fusion instructions the optimised HLO of `fn(*args)` has."""
  text = fn.lower(*args, **kwargs).compile().as_text()
  return len(re.findall(r"%ynn_fusion(?:\.\d+)? = ", text))


def test_cpu_options_drop_ynn_fusions_only_where_asked():
  assert jax.default_backend() == "cpu"
  x, w = jnp.ones((8, 256)), jnp.ones((256, 768))
  f = jit_per_backend(_few_row_dot, cpu_options=DECODE_CPU_OPTIONS)
  # Precondition: XLA:CPU's default sends this dot to YNNPACK (else the test shows nothing).
  assert _ynn_fusions(jax.jit(_few_row_dot), x, w) >= 1
  assert _ynn_fusions(f.plain, x, w) >= 1
  assert _ynn_fusions(f.cpu, x, w) == 0
  np.testing.assert_allclose(f(x, w), jnp.tanh(x @ w), rtol=1e-6)
  # On a CPU default backend the call goes to the CPU variant.
  assert f.cpu._cache_size() == 1 and f.plain._cache_size() == 0


def test_generate_runs_the_cpu_variant_without_ynn_fusions():
  policy = Policy(TINY_CFG, nnx.Rngs(4))
  toks, mask, pix = left_padded_batch(np.random.default_rng(1), [2, 7])
  b = toks.shape[0]
  before = sampler._generate.cpu._cache_size()
  gen = sampler.generate(policy, toks, mask, pix, jnp.ones((b, 1), bool), jax.random.PRNGKey(0),
                         max_new_tokens=4, temperature=0.0, eos_id=EOS, pad_id=PAD)
  assert sampler._generate.cpu._cache_size() == before + 1
  args, kw = generate_call(policy, toks, mask, pix, 4)
  assert _ynn_fusions(sampler._generate.plain, *args, **kw) >= 1  # precondition
  assert _ynn_fusions(sampler._generate.cpu, *args, **kw) == 0
  # Both compilations decode the same greedy tokens on this model.
  plain = sampler._generate.plain(*args, **kw)
  np.testing.assert_array_equal(np.asarray(plain.tokens), np.asarray(gen.tokens))
