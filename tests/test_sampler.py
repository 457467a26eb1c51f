"""KV-cache sampler: greedy decoding against step-by-step full recomputation without cache,
grammar-constrained decoding against hand-made automata and a manual numpy log_softmax of the masked,
tempered logits, top-p, and the grammar of `agent/grammar.py`."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tars_jax.agent.grammar import build_grammar, free_grammar
from tars_jax.agent.tokenizer import BOS, EOS, IMAGE, PAD, VISION_END, VISION_START
from tars_jax.models import ModelConfig, Policy, rope_positions, token_logprobs
from tars_jax.models.inference import sampler
from _shared import TINY_CFG, assert_close_f32, forward_terms, left_padded_batch, fwd

CFG = TINY_CFG


def _batch(rng, lens):
  """Left-padded rows `BOS text <vs> IMAGE*6 <ve> 10` with one image each."""
  return left_padded_batch(rng, lens)


def _np_log_softmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def policy():
  # a seed whose greedy tokens below include no vision placeholder (see the precondition there)
  return Policy(CFG, nnx.Rngs(4))


def test_greedy_kv_cache_matches_full_recompute(policy):
  toks, mask, pix = _batch(np.random.default_rng(1), [2, 7, 4])
  b, p = toks.shape
  n = 8
  out = sampler.generate(policy, toks, mask, pix, jnp.ones((b, 1), bool), jax.random.PRNGKey(0),
                         max_new_tokens=n, temperature=0.0, eos_id=EOS, pad_id=PAD)
  # Reference: at each step, one full forward (no cache) over prompt + tokens so far, in a fixed
  # [B, P + N] buffer whose not-yet-generated slots are masked out.
  buf = np.concatenate([np.asarray(toks), np.full((b, n), PAD, np.int32)], 1)
  bmask = np.concatenate([np.asarray(mask), np.zeros((b, n), bool)], 1)
  done = np.zeros(b, bool)
  want_t, want_lp = np.full((b, n), PAD), np.zeros((b, n))
  for i in range(n):
    t, m = jnp.asarray(buf), jnp.asarray(bmask)
    logits = fwd(policy, t, rope_positions(t, m, IMAGE, CFG.merged_grid), m, pix).logits
    lp = _np_log_softmax(np.asarray(logits[:, p + i - 1], np.float64))
    tok = np.where(done, PAD, lp.argmax(-1))
    want_t[:, i] = tok
    want_lp[:, i] = np.where(done, 0.0, lp[np.arange(b), tok])
    buf[:, p + i], bmask[:, p + i] = tok, True
    done |= tok == EOS
  # precondition: a random-init model may emit the IMAGE / VISION_START ids, which the reference's
  # full forward would read as an image block (M-RoPE positions, vision features) while the cache
  # step embeds them as text: no common ground to compare on (the model seed is picked to avoid them)
  assert not np.isin(want_t, [IMAGE, VISION_START, VISION_END]).any(), want_t
  np.testing.assert_array_equal(out.tokens, want_t)
  assert_close_f32(out.logprobs, want_lp, terms=forward_terms(CFG, p + n), scale=2 * float(jnp.abs(logits).max()))
  assert len(set(map(tuple, want_t.tolist()))) > 1  # rows differ: the test sees per-row prompts
  np.testing.assert_array_equal(out.states, -1)
  # the graphdef/params form gives the same result
  gd, params = nnx.split(policy)
  out2 = sampler.generate(gd, params, toks, mask, pix, None, jax.random.PRNGKey(0), max_new_tokens=n,
                          temperature=0.0, eos_id=EOS, pad_id=PAD)
  np.testing.assert_array_equal(out2.tokens, out.tokens)


def test_ab_grammar_forces_exact_output_and_stops_early(policy):
  tab = np.full((4, CFG.vocab_size), -1, np.int32)
  tab[0, ord("a")] = 1; tab[1, ord("b")] = 2; tab[2, EOS] = 3; tab[3, PAD] = 3
  toks, mask, pix = _batch(np.random.default_rng(2), [1, 2])
  out = sampler.generate(policy, toks, mask, pix, None, jax.random.PRNGKey(1), max_new_tokens=6,
                         grammar_table=jnp.asarray(tab), start_state=jnp.zeros((2,), jnp.int32),
                         eos_id=EOS, pad_id=PAD)
  np.testing.assert_array_equal(out.tokens, [[97, 98, EOS, PAD, PAD, PAD]] * 2)
  np.testing.assert_array_equal(out.logprobs, 0.0)  # one allowed token: log-prob exactly 0
  np.testing.assert_array_equal(out.lengths, [3, 3])
  np.testing.assert_array_equal(out.states, [[0, 1, 2, 3, 3, 3]] * 2)


def test_constrained_logprobs_match_manual_masked_log_softmax(policy):
  # state 0: {a, b, c} -> 1; state 1: {x, y} -> 2; state 2: {EOS} -> 3 (done: PAD only)
  v = CFG.vocab_size
  tab = np.full((4, v), -1, np.int32)
  tab[0, [97, 98, 99]] = 1; tab[1, [120, 121]] = 2; tab[2, EOS] = 3; tab[3, PAD] = 3
  toks, mask, pix = _batch(np.random.default_rng(4), [3, 1, 5, 2])
  b, p = toks.shape
  n, temp = 5, 0.7
  outs = [sampler.generate(policy, toks, mask, pix, None, jax.random.PRNGKey(s), max_new_tokens=n,
                           temperature=temp, grammar_table=jnp.asarray(tab),
                           start_state=jnp.zeros((b,), jnp.int32), eos_id=EOS, pad_id=PAD) for s in range(2)]
  out = outs[0]
  assert np.isin(np.asarray(out.tokens[:, 0]), [97, 98, 99]).all()
  assert np.isin(np.asarray(out.tokens[:, 1]), [120, 121]).all()
  np.testing.assert_array_equal(out.tokens[:, 2:], [[EOS, PAD, PAD]] * b)
  np.testing.assert_array_equal(out.states, [[0, 1, 2, 3, 3]] * b)
  assert not np.array_equal(outs[0].tokens, outs[1].tokens)  # it samples (different keys differ)
  # manual: one full forward over prompt + generated reply, log_softmax(masked logits / T)
  full = jnp.concatenate([toks, out.tokens], 1)
  fmask = jnp.concatenate([mask, out.tokens != PAD], 1)
  logits = fwd(policy, full, rope_positions(full, fmask, IMAGE, CFG.merged_grid), fmask, pix).logits
  lg = np.asarray(logits[:, p - 1:p - 1 + 3], np.float64) / temp
  sets = [[97, 98, 99], [120, 121], [EOS]]
  for j, allowed in enumerate(sets):
    lp = _np_log_softmax(lg[:, j, allowed])
    tok = np.asarray(out.tokens[:, j])
    want = lp[np.arange(b), [allowed.index(int(t)) for t in tok]]
    assert_close_f32(out.logprobs[:, j], want, terms=forward_terms(CFG, full.shape[1]),
                     scale=2 * float(np.abs(lg).max()))
  assert (np.asarray(out.logprobs[:, :2]) < 0).all()
  np.testing.assert_array_equal(out.logprobs[:, 2:], 0.0)
  # the trainer's recomputation (`token_logprobs` with allowed = table[states] >= 0) agrees
  allowed = jnp.asarray(tab)[out.states] >= 0
  rec = token_logprobs(logits[:, p - 1:p - 1 + n], out.tokens, allowed, temp)
  assert_close_f32(rec[:, :3], out.logprobs[:, :3], terms=forward_terms(CFG, full.shape[1]),
                   scale=2 * float(np.abs(lg).max()))


def test_free_grammar_never_samples_special_ids_and_trainer_logprobs_agree():
  """`grammar.constrained = False` samples through `free_grammar`: bytes and EOS only. A fresh policy
  (vision placeholders are likely under a uniform-ish random model) sampled hot for 64 tokens per row
  emits none of the special ids a reply must not hold, and the trainer's recomputation of the
  log-probs (full forward, allowed = table[states] >= 0) equals the sampler's."""
  policy = Policy(CFG, nnx.Rngs(0))
  g = free_grammar()
  assert (g.table[0] >= 0).sum() == 257 and g.table[0, EOS] == g.done and g.table[g.done, PAD] == g.done
  toks, mask, pix = _batch(np.random.default_rng(5), [2, 7, 4, 3])
  b, p = toks.shape
  n, temp = 64, 2.0
  table = jnp.asarray(g.table)
  free = sampler.generate(policy, toks, mask, pix, None, jax.random.PRNGKey(3), max_new_tokens=n,
                          temperature=temp, eos_id=EOS, pad_id=PAD)
  out = sampler.generate(policy, toks, mask, pix, None, jax.random.PRNGKey(3), max_new_tokens=n,
                         temperature=temp, grammar_table=table, start_state=jnp.zeros((b,), jnp.int32),
                         eos_id=EOS, pad_id=PAD)
  special = [BOS, IMAGE, VISION_START, VISION_END, 262, 263]
  assert np.isin(np.asarray(free.tokens), special).any()  # without the table this model emits them
  body = np.asarray(out.tokens)[np.arange(n)[None] < np.asarray(out.lengths)[:, None]]
  assert not np.isin(body, special + [PAD]).any(), out.tokens
  full = jnp.concatenate([toks, out.tokens], 1)
  fmask = jnp.concatenate([mask, out.tokens != PAD], 1)
  logits = fwd(policy, full, rope_positions(full, fmask, IMAGE, CFG.merged_grid), fmask, pix).logits
  rec = token_logprobs(logits[:, p - 1:p - 1 + n], out.tokens, table[out.states] >= 0, temp)
  valid = np.arange(n)[None] < np.asarray(out.lengths)[:, None]
  assert_close_f32(np.where(valid, rec, 0), np.where(valid, out.logprobs, 0), terms=forward_terms(CFG, p + n),
                   scale=2 * float(jnp.abs(logits).max()) / temp)


@pytest.mark.parametrize("jump_forward", [1, 40])
def test_action_grammar_sampling_matches_full_forward(policy, jump_forward):
  toks, mask, pix = _batch(np.random.default_rng(1), [2, 7, 4])
  g = build_grammar(actions=("click",), max_thought_bytes=3, coord_format="fixed3")
  table = jnp.asarray(g.table)
  n = 24
  out = sampler.generate(policy, toks, mask, pix, None, jax.random.PRNGKey(0), max_new_tokens=n,
                         temperature=1.3, grammar_table=table, start_state=jnp.full((3,), g.start, jnp.int32),
                         eos_id=EOS, pad_id=PAD, jump_forward=jump_forward)
  full = jnp.concatenate([toks, out.tokens], axis=1)
  fmask = jnp.concatenate([mask, jnp.ones_like(out.tokens, bool)], axis=1)
  logits = fwd(policy, full, rope_positions(full, fmask, IMAGE, CFG.merged_grid), fmask, pix).logits
  p = toks.shape[1]
  allowed = np.asarray(table[out.states] >= 0)
  live = np.arange(n)[None] < np.asarray(out.lengths)[:, None]
  lg = np.where(allowed, np.asarray(logits[:, p - 1:p - 1 + n], np.float64) / 1.3, -np.inf)
  want = np.take_along_axis(_np_log_softmax(lg), np.asarray(out.tokens)[..., None], -1)[..., 0]
  assert_close_f32(np.where(live, out.logprobs, 0), np.where(live, want, 0), terms=forward_terms(CFG, p + n),
                   scale=2 * float(jnp.abs(logits).max()) / 1.3)
  assert np.take_along_axis(allowed, np.asarray(out.tokens)[..., None], -1)[live].all()
  forced = allowed.sum(-1) == 1
  assert (np.asarray(out.logprobs)[live & forced] == 0).all() and (np.asarray(out.logprobs)[live] < 0).any()
  # the state sequence follows the table
  st, tk = np.asarray(out.states), np.asarray(out.tokens)
  np.testing.assert_array_equal(st[:, 0], g.start)
  np.testing.assert_array_equal(st[:, 1:], np.asarray(g.table)[st[:, :-1], tk[:, :-1]])


@pytest.mark.parametrize("grammar_kw", [pytest.param(dict(max_thought_bytes=3, coord_format="fixed3"),
                                                     marks=pytest.mark.slow),
                                        dict(max_thought_bytes=0, coord_format="tens3")])
def test_jump_forward_greedy_equals_token_by_token(policy, grammar_kw):
  # Jump-forward only batches the grammar's forced tokens: greedy outputs, log-probs, states and
  # lengths equal those of one token per step, including rows that stop at max_new_tokens.
  toks, mask, pix = _batch(np.random.default_rng(5), [2, 7, 4, 1])
  g = build_grammar(actions=("click",), **grammar_kw)
  kw = dict(temperature=0.0, grammar_table=jnp.asarray(g.table), start_state=jnp.full((4,), g.start, jnp.int32),
            eos_id=EOS, pad_id=PAD)
  for n in (60, 30):
    ref = sampler.generate(policy, toks, mask, pix, None, jax.random.PRNGKey(0), max_new_tokens=n, **kw)
    for k in (40,):
      out = sampler.generate(policy, toks, mask, pix, None, jax.random.PRNGKey(0), max_new_tokens=n,
                             jump_forward=k, **kw)
      np.testing.assert_array_equal(out.tokens, ref.tokens)
      np.testing.assert_array_equal(out.states, ref.states)
      np.testing.assert_array_equal(out.lengths, ref.lengths)
      assert_close_f32(out.logprobs, ref.logprobs, terms=forward_terms(CFG, toks.shape[1] + n))
    finished = (np.asarray(ref.tokens) == EOS).any(axis=1)
    assert finished.all() if n == 60 else not finished.any()  # n = 30 cuts every reply short
  with pytest.raises(ValueError, match="jump_forward"):
    sampler.generate(policy, toks, mask, pix, None, jax.random.PRNGKey(0), max_new_tokens=4,
                     jump_forward=0, **kw)


def test_top_p():
  logp = jnp.log(jnp.array([0.15, 0.5, 0.05, 0.3]))
  kept = lambda q: np.asarray(sampler.top_p_filter(logp, q) > -1e8)
  np.testing.assert_array_equal(kept(0.8), [False, True, False, True])
  np.testing.assert_array_equal(kept(0.81), [True, True, False, True])
  np.testing.assert_array_equal(kept(0.5), [False, True, False, False])
  np.testing.assert_array_equal(kept(1.0), [True, True, True, True])


def test_tiny_top_p_is_greedy_and_top_p_one_is_plain_sampling(policy):
  toks, mask, pix = _batch(np.random.default_rng(5), [2, 6])
  kw = dict(max_new_tokens=6, eos_id=EOS, pad_id=PAD)
  key = jax.random.PRNGKey(7)
  greedy = sampler.generate(policy, toks, mask, pix, None, key, temperature=0.0, **kw)
  nucleus = sampler.generate(policy, toks, mask, pix, None, key, temperature=1.0, top_p=1e-6, **kw)
  np.testing.assert_array_equal(nucleus.tokens, greedy.tokens)
  # log-probs are those of the un-truncated T=1 distribution, as greedy reports
  np.testing.assert_allclose(nucleus.logprobs, greedy.logprobs, atol=1e-5)
  plain = sampler.generate(policy, toks, mask, pix, None, key, temperature=1.0, top_p=1.0, **kw)
  assert not np.array_equal(plain.tokens, greedy.tokens)


def test_no_grammar_pads_after_eos():
  # LM head = bias only, with p(EOS) = 1/2 and the other 263 tokens uniform: rows end at random steps
  pol = Policy(CFG, nnx.Rngs(0))
  v = CFG.vocab_size
  pol.lm_head = nnx.Linear(CFG.hidden, v, kernel_init=nnx.initializers.zeros_init(), rngs=nnx.Rngs(0))
  pol.lm_head.bias[...] = jnp.zeros(v).at[EOS].set(np.log(v - 1))
  toks, mask, pix = _batch(np.random.default_rng(6), [1, 3, 2, 4, 5, 0])
  n = 10
  out = sampler.generate(pol, toks, mask, pix, None, jax.random.PRNGKey(0), max_new_tokens=n,
                         temperature=1.0, eos_id=EOS, pad_id=PAD)
  t, lp, lens = np.asarray(out.tokens), np.asarray(out.logprobs), np.asarray(out.lengths)
  assert (lens > 1).any() and (lens < n).any()  # some row ended, some after a non-EOS token
  for r in range(6):
    row = t[r].tolist()
    e = row.index(EOS) if EOS in row else n - 1
    assert lens[r] == e + 1
    assert EOS not in row[:e] and PAD not in row[:e]
    np.testing.assert_allclose(lp[r, :e], np.log(0.5 / (v - 1)), rtol=1e-5)
    if EOS in row:
      np.testing.assert_allclose(lp[r, e], np.log(0.5), rtol=1e-5)
      assert (t[r, e + 1:] == PAD).all() and (lp[r, e + 1:] == 0).all()


@pytest.mark.slow
def test_report_tiny_param_count_and_generation_time():
  cfg = ModelConfig.tiny()
  pol = Policy(cfg, nnx.Rngs(0))
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(pol, nnx.Param)))
  b, n = 16, 48
  rng = np.random.default_rng(0)
  row = [BOS] + list(rng.integers(0, 255, 60)) + [VISION_START] + [IMAGE] * cfg.n_img_tokens + [VISION_END]
  toks = jnp.asarray(np.tile(np.array(row, np.int32), (b, 1)))
  mask = jnp.ones_like(toks, bool)
  pix = jnp.asarray(rng.random((b, 1, cfg.image_h, cfg.image_w, 3)).astype(np.float32))
  g = build_grammar(actions=("click",), max_thought_bytes=16, coord_format="fixed3")
  gd, params = nnx.split(pol)
  kw = dict(max_new_tokens=n, temperature=1.0, grammar_table=jnp.asarray(g.table),
            start_state=jnp.full((b,), g.start, jnp.int32), eos_id=EOS, pad_id=PAD)
  t0 = time.perf_counter()
  jax.block_until_ready(sampler.generate(gd, params, toks, mask, pix, None, jax.random.PRNGKey(0), **kw))
  t1 = time.perf_counter()
  out = jax.block_until_ready(sampler.generate(gd, params, toks, mask, pix, None, jax.random.PRNGKey(1), **kw))
  t2 = time.perf_counter()
  print(f"\ntiny policy: {n_params:,} params; B={b} P={toks.shape[1]} N={n}: compile+run {t1 - t0:.2f}s, "
        f"run {t2 - t1:.3f}s ({int(out.lengths.sum())} tokens)")
  assert n_params > 0
