"""Helpers shared by several test modules (tiny model config, jitted forward, grid coordinates, a
scanned step's compiled temporaries, the arguments of the sampler's jitted `_generate`, an MoE input in
the bounded decode regime)."""

import asyncio
import time

import jax
import jax.numpy as jnp
from flax import nnx

from envs_bridge.browser import miniwob_tasks as mw
from tars_jax.models import ModelConfig

TINY_CFG = ModelConfig(image_h=56, image_w=84, patch_size=14, vision_hidden=32, vision_depth=1, vision_heads=2,
                       vision_mlp=64, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=4, top_k=2,
                       moe_intermediate=32)  # merged grid 2 x 3


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
