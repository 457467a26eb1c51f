"""Model family: M-RoPE positions by hand, MoE against a naive loop, padding invariance, KV-cache
sampling against full recomputation, constrained log-probs against a manual computation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tars_jax.agent.grammar import build_grammar
from tars_jax.agent.tokenizer import BOS, EOS, IMAGE, PAD
from tars_jax.models import ModelConfig, Policy, ValueModel, rope_positions
from tars_jax.models import sampler
from tars_jax.models.moe import MoE, load_balance_loss, route
from tars_jax.rl.losses import masked_log_softmax

CFG = ModelConfig(image_h=56, image_w=84, patch_size=14, vision_hidden=32, vision_depth=1, vision_heads=2,
                  vision_mlp=64, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=4, top_k=2,
                  moe_intermediate=32)  # merged grid 2 x 3


def test_rope_positions_by_hand():
  # text(2) + image 2x3 + text(2); then the same row left-padded by 2
  toks = jnp.array([[BOS, 65] + [IMAGE] * 6 + [66, 67], [PAD, PAD, BOS, 65] + [IMAGE] * 6])
  mask = toks != PAD
  pos = np.asarray(rope_positions(toks, mask, IMAGE, (2, 3)))
  np.testing.assert_array_equal(pos[0, 0], [0, 1, 2, 2, 2, 2, 2, 2, 5, 6])  # t
  np.testing.assert_array_equal(pos[1, 0], [0, 1, 2, 2, 2, 3, 3, 3, 5, 6])  # h = start + row
  np.testing.assert_array_equal(pos[2, 0], [0, 1, 2, 3, 4, 2, 3, 4, 5, 6])  # w = start + col
  np.testing.assert_array_equal(pos[:, 1, 2:], pos[:, 0, :8])
  np.testing.assert_array_equal(pos[:, 1, :2], 0)


def test_router_and_aux_loss_by_hand():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]))
  probs, w, idx = route(logits, 2, True)
  np.testing.assert_allclose(w, [[0.5 / 0.8, 0.3 / 0.8], [0.8 / 0.9, 0.1 / 0.9]], rtol=1e-5)
  np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
  # f[k, e]: share of tokens whose k-th choice is e; P[e]: mean prob
  f = np.array([[0.5, 0, 0.5], [0.5, 0.5, 0]])  # token0 -> (0,1), token1 -> (2, 0 or 1: tie -> lowest idx 0)
  pe = np.array([0.3, 0.2, 0.5])
  want = 3 * (f * pe[None]).sum()
  assert float(load_balance_loss(probs, idx, 3)) == pytest.approx(want, rel=1e-5)


def test_moe_equals_naive_loop():
  moe = MoE(CFG, nnx.Rngs(1))
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, CFG.hidden))
  y, _ = moe(x)
  flat = np.asarray(x).reshape(-1, CFG.hidden)
  _, w, idx = route(moe.router(jnp.asarray(flat)), CFG.top_k, True)
  wg, wu, wd = (np.asarray(p[...]) for p in (moe.w_gate, moe.w_up, moe.w_down))
  want = np.zeros_like(flat)
  for n in range(flat.shape[0]):
    for j in range(CFG.top_k):
      e = int(idx[n, j])
      h = jax.nn.silu(flat[n] @ wg[e]) * (flat[n] @ wu[e])
      want[n] += float(w[n, j]) * np.asarray(h @ wd[e])
  np.testing.assert_allclose(np.asarray(y).reshape(-1, CFG.hidden), want, atol=1e-4)


def _batch(rng, lens):
  n = CFG.n_img_tokens
  rows = [[BOS] + list(rng.integers(0, 255, l)) + [IMAGE] * n + [10] for l in lens]
  p = max(len(r) for r in rows)
  toks = np.full((len(rows), p), PAD, np.int32)
  mask = np.zeros_like(toks, bool)
  for i, r in enumerate(rows):
    toks[i, p - len(r):], mask[i, p - len(r):] = r, True
  pix = rng.random((len(rows), 1, CFG.image_h, CFG.image_w, 3)).astype(np.float32)
  return jnp.asarray(toks), jnp.asarray(mask), jnp.asarray(pix)


def test_padding_invariance_and_vision_gradient():
  pol = Policy(CFG, nnx.Rngs(0))
  toks, mask, pix = _batch(np.random.default_rng(0), [3, 9])
  pos = rope_positions(toks, mask, IMAGE, CFG.merged_grid)
  logits, _ = pol(toks, pos, mask, pix)
  r = toks[0][mask[0]][None]
  m1 = jnp.ones_like(r, bool)
  alone, _ = pol(r, rope_positions(r, m1, IMAGE, CFG.merged_grid), m1, pix[:1])
  np.testing.assert_allclose(logits[0][mask[0]], alone[0], atol=1e-4)

  def loss(model):
    lg, aux = model(toks, pos, mask, pix)
    return jnp.mean(lg[..., 65]) + aux
  grads = nnx.grad(loss)(pol)
  assert float(jnp.abs(grads.trunk.vision.patch_embed.kernel[...]).sum()) > 0
  val = ValueModel(CFG, nnx.Rngs(2))
  v, _ = val(toks, pos, mask, pix)
  assert v.shape == toks.shape


def test_kv_cache_sampling_matches_full_forward_with_grammar():
  pol = Policy(CFG, nnx.Rngs(3))
  gd, params = nnx.split(pol)
  toks, mask, pix = _batch(np.random.default_rng(1), [2, 7, 4])
  g = build_grammar(actions=("click",), max_thought_bytes=3, coord_format="fixed3")
  table = jnp.asarray(g.table)
  n = 20
  out = sampler.generate(gd, params, toks, mask, pix, None, jax.random.PRNGKey(0), max_new_tokens=n,
                         temperature=0.7, grammar_table=table,
                         start_state=jnp.full((3,), g.start, jnp.int32), eos_id=EOS, pad_id=PAD)
  # recompute every step without cache: same masked, tempered log-probs of the sampled tokens
  full = jnp.concatenate([toks, out.tokens], axis=1)
  fmask = jnp.concatenate([mask, jnp.ones_like(out.tokens, bool)], axis=1)
  logits, _ = pol(full, rope_positions(full, fmask, IMAGE, CFG.merged_grid), fmask, pix)
  p = toks.shape[1]
  lg = logits[:, p - 1:p - 1 + n]
  allowed = table[jnp.maximum(out.states, 0)] >= 0
  lp = masked_log_softmax(lg, allowed, 0.7)
  want = jnp.take_along_axis(lp, out.tokens[..., None], axis=-1)[..., 0]
  live = jnp.arange(n)[None] < out.lengths[:, None]
  np.testing.assert_allclose(np.where(live, out.logprobs, 0), np.where(live, want, 0), atol=2e-4)
  # every sampled token was allowed, and forced tokens (one option) have log-prob exactly 0
  assert bool(jnp.all(jnp.where(live, jnp.take_along_axis(allowed, out.tokens[..., None], -1)[..., 0], True)))
  forced = allowed.sum(-1) == 1
  assert bool(jnp.all(jnp.where(live & forced, out.logprobs == 0, True)))
  assert float(out.logprobs.min()) < 0


def test_tiny_grammar_forces_exact_output():
  pol = Policy(CFG, nnx.Rngs(4))
  gd, params = nnx.split(pol)
  tab = np.full((4, CFG.vocab_size), -1, np.int32)
  tab[0, ord("a")] = 1; tab[1, ord("b")] = 2; tab[2, EOS] = 3; tab[3, PAD] = 3
  toks, mask, pix = _batch(np.random.default_rng(2), [1, 2])
  out = sampler.generate(gd, params, toks, mask, pix, None, jax.random.PRNGKey(1), max_new_tokens=5,
                         grammar_table=jnp.asarray(tab), start_state=jnp.zeros((2,), jnp.int32),
                         eos_id=EOS, pad_id=PAD)
  np.testing.assert_array_equal(out.tokens, [[97, 98, EOS, PAD, PAD]] * 2)
  np.testing.assert_array_equal(out.logprobs, 0.0)
  np.testing.assert_array_equal(out.lengths, [3, 3])
  np.testing.assert_array_equal(out.states[:, :3], [[0, 1, 2]] * 2)
