"""Helpers shared by several test modules (float32 tolerances, tiny model config, jitted forward, grid
coordinates, a scanned step's compiled temporaries, the arguments of the sampler's jitted `_generate`,
an MoE input in the bounded decode regime)."""

import asyncio
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from envs_bridge.browser import miniwob_tasks as mw
from tars_jax.models import ModelConfig

TINY_CFG = ModelConfig(image_h=56, image_w=84, patch_size=14, vision_hidden=32, vision_depth=1, vision_heads=2,
                       vision_mlp=64, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=4, top_k=2,
                       moe_intermediate=32)  # merged grid 2 x 3


F32_EPS = float(np.finfo(np.float32).eps)  # 2**-23 = 2 u, u the unit roundoff of float32


def f32_atol(scale: float, terms: int, factor: float = 4.0) -> float:
  """Absolute tolerance between two float32 computations of the same quantity (two code paths: XLA vs
  a kernel, sharded vs one device, scanned vs unrolled, ours vs torch) or one against a float64
  reference: `factor * F32_EPS * sqrt(terms) * scale`.

  The rule: each rounding along a computation of K accumulated terms errs by at most u of the running
  value (~ the result's magnitude); the errors are independent and add in quadrature, so the result
  is off by ~sqrt(K) u |result| (the probabilistic bound of Higham & Mary, "A new approach to
  probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019: lambda sqrt(K) u per
  term magnitude with high probability; the worst case K u is never approached by the blocked and
  pairwise sums of BLAS and XLA). Two paths that order, block or fuse (FMA, vector width: kernels built
  with -march=native) their sums differently each carry such an error; `factor` 4 on eps = 8 u covers
  both and the tail.

  scale: the magnitude of the result: max |expected| of the tensor compared (`assert_close_f32` takes
    that by default); for a scalar sum of many mixed-sign terms, which may cancel by chance, their root
    sum of squares (the typical size of such a sum; its rounding errors do not cancel with it).
  terms: the summation length along the computation: the sum of the contraction lengths on the way
    from the inputs to the compared value (e.g. D + I for a SwiGLU MLP's output; plus the same again
    for the backward pass and the rows summed for a weight gradient; a model forward: `forward_terms`).
  Returns a float >= 0 (0 for scale 0: equal zeros are exact). Raises ValueError for terms < 1 or
  factor <= 0."""
  if terms < 1 or factor <= 0:
    raise ValueError(f"terms must be >= 1 and factor > 0, got terms={terms}, factor={factor}")
  return factor * F32_EPS * float(np.sqrt(terms)) * float(scale)


def assert_close_f32(actual, expected, *, terms: int, scale: float | None = None, factor: float = 4.0,
                     err_msg: str = "") -> None:
  """`np.testing.assert_allclose(actual, expected, rtol=0, atol=f32_atol(scale, terms, factor))` with
  scale = max |expected| unless given (see `f32_atol` for the rule). actual, expected: arrays of the
  same shape (any float dtype; compared in float64). Raises AssertionError naming the tolerance."""
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  if scale is None:
    scale = float(np.abs(expected).max()) if expected.size else 0.0
  atol = f32_atol(scale, terms, factor)
  np.testing.assert_allclose(actual, expected, rtol=0, atol=atol,
                             err_msg=f"{err_msg} (float32 tolerance {atol:.3g}: {terms} terms, scale {scale:.3g})")


def vision_terms(cfg) -> int:
  """Summation length (`f32_atol`) of the vision tower of `cfg` (`ModelConfig`): the patch embedding
  (3 t p^2), per block the q/k/v (vision_hidden), attention (its patches), output (vision_hidden),
  MLP (vision_hidden, vision_mlp) contractions, and the 2x2 merger (4 vision_hidden, then hidden)."""
  patches = cfg.n_img_tokens * cfg.spatial_merge_size ** 2
  block = 3 * cfg.vision_hidden + patches + cfg.vision_mlp
  return (3 * cfg.temporal_patch_size * cfg.patch_size ** 2 + cfg.vision_depth * block
          + cfg.spatial_merge_size ** 2 * cfg.vision_hidden + cfg.hidden)


def forward_terms(cfg, seq: int) -> int:
  """Summation length (`f32_atol`) of one `Policy` / `ValueModel` forward of `cfg` (`ModelConfig`) on
  `seq` tokens: the vision tower (`vision_terms`), per decoder layer the q/k/v (hidden), attention
  (seq), output (heads * head_dim), gate/up (hidden; the router's too) and down (the wider of the
  dense and expert intermediates) contractions, then the LM head (hidden)."""
  inter = max(cfg.moe_intermediate, cfg.dense_intermediate or 0)
  layer = cfg.hidden + seq + cfg.heads * cfg.head_dim + cfg.hidden + inter
  return vision_terms(cfg) + cfg.layers * layer + cfg.hidden


@nnx.jit
def fwd(model, *args):
  """Jitted forward (op-by-op eager NNX is several times slower on CPU)."""
  return model(*args)


def grid(box) -> tuple[int, int]:
  """Centre of a MiniWoB pixel box {x, y, width, height} -> 0-1000 grid coordinates."""
  return (round((box["x"] + box["width"] / 2) / mw.WIDTH * 1000),
          round((box["y"] + box["height"] / 2) / mw.HEIGHT * 1000))


def poll(fn, timeout_s: float = 30.0, interval_s: float = 0.1):
  """Calls fn() every `interval_s` until it returns something truthy or `timeout_s` passed (no timing
  asserted: the deadline only keeps a broken test from hanging); returns its last value."""
  deadline = time.monotonic() + timeout_s
  while not (v := fn()) and time.monotonic() < deadline:
    time.sleep(interval_s)
  return v


def run(coro):
  """Runs a coroutine to completion on a fresh event loop (tests that drive the async client)."""
  loop = asyncio.new_event_loop()
  try:
    return loop.run_until_complete(coro)
  finally:
    loop.close()


def left_padded_batch(rng, lens, tail=(10,), cfg=TINY_CFG):
  """Left-padded rows `BOS <l random bytes> <vs> IMAGE*n <ve> *tail`, one image each, for every l in
  `lens` -> (tokens [B, T] int32, attn_mask [B, T] bool, pixels [B, 1, H, W, 3] float32 in [0, 1])."""
  import jax.numpy as jnp
  import numpy as np
  from tars_jax.agent.tokenizer import BOS, IMAGE, PAD, VISION_END, VISION_START
  n = cfg.n_img_tokens
  rows = [[BOS] + list(rng.integers(0, 255, l)) + [VISION_START] + [IMAGE] * n + [VISION_END, *tail] for l in lens]
  p = max(len(r) for r in rows)
  toks = np.full((len(rows), p), PAD, np.int32)
  mask = np.zeros_like(toks, bool)
  for i, r in enumerate(rows):
    toks[i, p - len(r):], mask[i, p - len(r):] = r, True
  pix = rng.random((len(rows), 1, cfg.image_h, cfg.image_w, 3)).astype(np.float32)
  return jnp.asarray(toks), jnp.asarray(mask), jnp.asarray(pix)


def scanned_step_temp_bytes(layer, params, x, *consts) -> int:
  """Temporaries (bytes, the compiled program's `memory_analysis`) of the value-and-grad of
  sum(h^2) after h <- h + layer(h, p, *consts) scanned over the leading axis of `params`.
  params (a pytree), x, consts: `jax.ShapeDtypeStruct`s; compiled only, nothing is run (buffer
  sizes are deterministic)."""
  def loss(params, x, *consts):
    def body(h, p):
      return h + layer(h, p, *consts), None
    return jnp.sum(jax.lax.scan(body, x, params)[0].astype(jnp.float32) ** 2)
  return jax.jit(jax.value_and_grad(loss)).lower(params, x, *consts).compile().memory_analysis().temp_size_in_bytes


def generate_call(policy, toks, mask, pix, max_new_tokens: int):
  """(args, kwargs) of `sampler._generate` (and its `.cpu` / `.plain` jits) for greedy decoding of
  `max_new_tokens` tokens after left-padded prompts with one image each, no grammar: what
  `sampler.generate` passes, for lowering and comparing compilations."""
  import jax.numpy as jnp
  from tars_jax.agent.tokenizer import EOS, PAD
  b = toks.shape[0]
  gd, params = nnx.split(policy)
  args = (params, jnp.asarray(toks), jnp.asarray(mask, bool), pix, jnp.ones((b, 1), bool), jax.random.PRNGKey(0),
          None, None)
  kw = dict(graphdef=gd, max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0, eos_id=EOS, pad_id=PAD,
            image_token_id=None, chunk=1)
  return args, kw


def bounded_moe_case(cfg, balanced: bool):
  """(`MoE` of `cfg` with seed 0, x [2, 8, hidden] float32) whose 16 tokens take the MoE's bounded
  decode path (`MoE._bounded`): every expert's load within its C slots (balanced), or over them (a zero
  router sends every token to experts 0..k-1: the overflow branch). Asserts the regime it promises."""
  from tars_jax.models import moe
  n, k, e = 16, cfg.top_k, cfg.experts
  c = moe.capacity(n, k, e, moe.DECODE_CAPACITY)
  assert moe.block_rows(n * k, e) == 0 and c < n  # this shape takes the bounded path
  m = moe.MoE(cfg, nnx.Rngs(0))
  if not balanced:
    m.router.kernel[...] = jnp.zeros_like(m.router.kernel[...])
  x = jax.random.normal(jax.random.PRNGKey(3), (2, 8, cfg.hidden))
  _, _, idx = moe.route(m.router(x.reshape(n, -1)), k, cfg.norm_topk_prob)
  assert (int(jnp.bincount(idx.reshape(-1), length=e).max()) <= c) == balanced
  return m, x
