"""Continuous-batching inference service (`rollout/inference_server.InferenceService`,
`models/inference/slot_decode.py`): one request alone draws exactly what today's lockstep sampler
(`BatchedPolicy` / `sampler.generate`) draws with the same key and weights; requests sharing slots with
others (joining and leaving between decode steps) draw what they draw alone; weights swap between
decode steps with versions per token; typed errors."""

import asyncio
import threading

import jax
import numpy as np
import pytest
from flax import nnx

from tars_jax.agent.grammar import build_grammar
from tars_jax.agent.tokenizer import BOS, IMAGE, VISION_END, VISION_START, ByteTokenizer
from tars_jax.models import Policy
from tars_jax.rollout.inference_server import BatchedPolicy, ContextTooLong, InferenceService, ServiceBusy

from _shared import TINY_CFG, assert_close_f32, forward_terms

CFG = TINY_CFG
TOK = ByteTokenizer()
HW = (CFG.image_h, CFG.image_w)
N_NEW = 96


@pytest.fixture(scope="module")
def split():
  return nnx.split(Policy(CFG, nnx.Rngs(7)))


def _prompt(rng, n_bytes, n_images):
  ids = [BOS] + list(rng.integers(32, 127, n_bytes))
  for _ in range(n_images):
    ids += [VISION_START] + [IMAGE] * CFG.n_img_tokens + [VISION_END]
  ims = [rng.integers(0, 256, HW + (3,), dtype=np.uint8) for _ in range(n_images)]
  return [int(x) for x in ids], ims


def _service(split, grammar, slots, **kw):
  gd, params = split
  kw = dict(dict(context_len=320, max_images=2), **kw)
  return InferenceService(gd, params, tokenizer=TOK, grammar=grammar, slots=slots, image_hw=HW,
                          max_new_tokens=N_NEW, length_multiple=32, **kw)


def _lockstep(split, grammar, jump_forward, seed):
  gd, params = split
  return BatchedPolicy(gd, params, TOK, grammar, batch_size=1, max_images=2, image_hw=HW, max_new_tokens=N_NEW,
                       length_multiple=32, seed=seed, jump_forward=jump_forward)


@pytest.mark.parametrize("jump_forward", [pytest.param(1, marks=pytest.mark.slow), 8])  # the configs' K: fast
def test_one_request_at_a_time_matches_lockstep_sampler(split, jump_forward):
  """The same tokens, states and (to float32 rounding) log-probs as `BatchedPolicy` with batch 1,
  for the keys `BatchedPolicy` draws (split of fold_in(PRNGKey(seed), iteration) per call)."""
  g = build_grammar(actions=("click", "type"), max_thought_bytes=12, max_content_bytes=6,
                    coord_format="fixed3")
  rng = np.random.default_rng(0)
  lock = _lockstep(split, g, jump_forward, seed=3)
  with _service(split, g, slots=4, jump_forward=jump_forward) as svc:
    for n_bytes, n_img in [(5, 1), (20, 2), (9, 0)]:
      ids, ims = _prompt(rng, n_bytes, n_img)
      key = jax.random.split(lock._key)[1]  # the key of BatchedPolicy's next call
      (want_ids, want_lp, want_st), = lock.act([ids], [ims])
      got = svc.submit(ids, ims, key=key).result(timeout=300)
      assert got.tokens == want_ids and want_ids[-1] == TOK.eos_id
      np.testing.assert_array_equal(got.states, want_st)
      assert_close_f32(got.logprobs, want_lp, terms=forward_terms(CFG, 256), scale=max(1.0, np.abs(want_lp).max()))
      np.testing.assert_array_equal(got.versions, np.zeros(len(want_ids)))
    assert svc.stats.requests == 3 and 0 < svc.stats.occupancy <= 0.25 + 1e-9  # one request in 4 slots


def test_requests_sharing_slots_draw_what_they_draw_alone(split):
  """7 requests through 3 slots (they join as others leave): each reply equals the reply of the same
  request and key served alone."""
  g = build_grammar(actions=("click",), max_thought_bytes=20, coord_format="fixed3")
  rng = np.random.default_rng(1)
  reqs = [_prompt(rng, int(rng.integers(1, 40)), int(rng.integers(0, 3))) for _ in range(7)]
  keys = [jax.random.PRNGKey(100 + i) for i in range(7)]
  budgets = [96, 12, 50, 96, 7, 30, 96]  # token budgets: requests leave at different steps
  with _service(split, g, slots=1, jump_forward=4) as alone:
    want = [alone.submit(ids, ims, key=k, max_new_tokens=n).result(timeout=300)
            for (ids, ims), k, n in zip(reqs, keys, budgets)]
  with _service(split, g, slots=3, jump_forward=4) as svc:
    futs = [svc.submit(ids, ims, key=k, max_new_tokens=n) for (ids, ims), k, n in zip(reqs, keys, budgets)]
    got = [f.result(timeout=300) for f in futs]
    assert svc.stats.occupancy > 1 / 3  # several slots were busy at once
  # a budget shorter than the reply cuts it there (no EOS); the others end at their EOS
  full = len(want[0].tokens)  # the reply's length without a budget: the grammar's fixed-length thought
  assert want[0].tokens[-1] == TOK.eos_id and full < 96
  for w, n in zip(want, budgets):
    assert (len(w.tokens), w.tokens[-1] == TOK.eos_id) == ((n, False) if n < full else (full, True))
  for w, r in zip(want, got):
    assert r.tokens == w.tokens
    np.testing.assert_array_equal(r.states, w.states)
    assert_close_f32(r.logprobs, w.logprobs, terms=forward_terms(CFG, 256), scale=max(1.0, np.abs(w.logprobs).max()))


def test_weight_swap_between_steps_and_versions(split):
  """After set_params(new, 1), replies are those of a service built with the new weights and every
  token says version 1; swaps racing running requests never split a token, and a request in flight
  across a swap keeps the version of its context (the oldest its tokens depend on) for every token."""
  gd, params = split
  params2 = jax.tree.map(lambda x: x * 1.5 if x.dtype == np.float32 else x, params)
  g = build_grammar(actions=("click",), max_thought_bytes=20, coord_format="fixed3")
  ids, ims = _prompt(np.random.default_rng(2), 10, 1)
  key = jax.random.PRNGKey(9)
  with InferenceService(gd, params2, tokenizer=TOK, grammar=g, slots=2, context_len=320, max_images=2,
                        image_hw=HW, max_new_tokens=N_NEW, length_multiple=32) as fresh:
    want = fresh.submit(ids, ims, key=key).result(timeout=300)
  with _service(split, g, slots=2) as svc:
    before = svc.submit(ids, ims, key=key).result(timeout=300)
    svc.set_params(params2, 1)
    assert svc.version == 1
    after = svc.submit(ids, ims, key=key).result(timeout=300)
    assert after.tokens == want.tokens and set(after.versions.tolist()) == {1}
    assert set(before.versions.tolist()) == {0} and before.tokens != after.tokens
    # racing swaps: one version per request, the one its prompt was prefilled with
    futs = [svc.submit(*_prompt(np.random.default_rng(10 + i), 30, 2)) for i in range(6)]
    swapper = threading.Thread(target=lambda: [svc.set_params(params if v % 2 else params2, v) for v in (2, 3, 4)])
    swapper.start()
    swapper.join()
    for f in futs:
      r = f.result(timeout=300)
      assert len(r.versions) == len(r.tokens) and len(set(r.versions.tolist())) == 1
      assert set(r.versions.tolist()) <= {1, 2, 3, 4}
    assert svc.stats.swaps >= 2


def test_typed_errors(split):
  g = build_grammar(actions=("click",), max_thought_bytes=20, coord_format="fixed3")
  with _service(split, g, slots=1) as svc:
    with pytest.raises(ContextTooLong) as e:
      svc.submit(list(range(230)), [])
    assert e.value.prompt_tokens == 256 and e.value.max_new_tokens == N_NEW and e.value.capacity == 320
    with pytest.raises(ValueError, match="3 images > max_images 2"):
      svc.submit([BOS], [np.zeros(HW + (3,), np.uint8)] * 3)
    futs = [svc.submit(*_prompt(np.random.default_rng(i), 10, 1)) for i in range(4)]
  # closed with requests queued or running: each ends (a reply or RuntimeError), none hangs
  for f in futs:
    try:
      assert f.result(timeout=60).tokens
    except RuntimeError as err:
      assert "closed" in str(err)
  with pytest.raises(RuntimeError, match="closed"):
    svc.submit([BOS], [])


def test_the_queue_is_bounded(split):
  """max_pending: submit beyond it raises ServiceBusy (typed, with the counts); asyncio callers of
  generate wait for room instead, and every one of them gets its reply."""
  g = build_grammar(actions=("click",), max_thought_bytes=20, coord_format="fixed3")
  prompts = [_prompt(np.random.default_rng(i), 10, 1) for i in range(8)]
  with _service(split, g, slots=1, max_pending=2) as svc:
    futs, busy = [], []
    for ids, ims in prompts[:5]:  # one slot decodes, two wait: the rest are refused
      try:
        futs.append(svc.submit(ids, ims))
      except ServiceBusy as e:
        busy.append(e)
    assert busy and len(futs) <= 3 and all(e.max_pending == 2 and e.pending == 2 for e in busy)
    assert all(f.result(timeout=300).tokens for f in futs)

    async def many():
      return await asyncio.gather(*[svc.generate(ids, ims) for ids, ims in prompts])

    replies = asyncio.run(many())
  assert len(replies) == 8 and all(r.tokens[-1] == TOK.eos_id for r in replies)


def test_multi_turn_session_extends_its_slot_like_a_full_prefill(split):
  """Episodes of 3 turns (prompt = previous prompt + reply + TURN_END + new screenshot): with a
  session, turns 2 and 3 run only their new tokens into the slot (`slot_decode.extend`, M-RoPE
  positions continued) and draw the same tokens, to float32 rounding the same log-probs, as full
  prefills of the whole history; a weight swap and `release` drop the idle contexts."""
  from tars_jax.agent.tokenizer import TURN_END
  g = build_grammar(actions=("click",), max_thought_bytes=6, coord_format="fixed3")
  rng = np.random.default_rng(3)
  starts = [_prompt(rng, n, 1) for n in (7, 30)]
  shots = [[rng.integers(0, 256, HW + (3,), dtype=np.uint8) for _ in range(3)] for _ in starts]
  obs = [VISION_START] + [IMAGE] * CFG.n_img_tokens + [VISION_END]

  def play(svc, session):
    ctx = [(list(ids), list(ims)) for ids, ims in starts]
    out = []
    for t in range(3):
      futs = [svc.submit(ids, ims, key=jax.random.PRNGKey(10 * t + e), session=(e if session else None))
              for e, (ids, ims) in enumerate(ctx)]
      replies = [f.result(timeout=300) for f in futs]
      out.append(replies)
      ctx = [(ids + r.tokens + [TURN_END] + obs, ims + [shots[e][t]]) for e, ((ids, ims), r) in
             enumerate(zip(ctx, replies))]
    return out, ctx

  kw = dict(slots=2, jump_forward=4, context_len=512, max_images=4)
  with _service(split, g, **kw) as full:
    want, _ = play(full, session=False)
    assert full.stats.extends == full.stats.reused == 0
  with _service(split, g, **kw) as svc:
    got, ctx = play(svc, session=True)
    assert svc.stats.reused == 4  # turns 2 and 3 of both episodes ran only their new tokens
    for tw, tg in zip(want, got):
      for w, r in zip(tw, tg):
        assert r.tokens == w.tokens
        assert_close_f32(r.logprobs, w.logprobs, terms=forward_terms(CFG, 320), scale=max(1.0, np.abs(w.logprobs).max()))
    # a swap drops the idle contexts: the next turn is a full prefill again
    svc.set_params(split[1], 1)
    p0 = svc.stats.prefills
    svc.submit(*ctx[0], key=jax.random.PRNGKey(99), session=0).result(timeout=300)
    assert svc.stats.prefills == p0 + 1 and svc.stats.reused == 4
    # release frees the slot: a third episode takes it without evicting session 0's context
    svc.release(1)
    svc.submit(*_prompt(rng, 4, 1), session=2).result(timeout=300)
    svc.submit(*ctx[0], key=jax.random.PRNGKey(7), session=0).result(timeout=300)
    # session 0 sent the same prompt again (not an extension of prompt + reply): prefilled anew
    assert svc.stats.prefills == p0 + 3 and svc.stats.reused == 4


def test_an_idle_session_longer_than_the_replies_decoding_beside_it_keeps_its_context(split):
  """Decode steps attend over the first 256 * 2**k cache positions that hold every context a slot keeps
  (`InferenceService._span`), not the whole cache: episode 0's idle context (~300 positions) survives the
  steps of a short request that alone would fit 256, and its next turn draws the tokens (log-probs to
  float32 rounding) that a full prefill of its history draws in a service without sessions."""
  from tars_jax.agent.tokenizer import TURN_END
  g = build_grammar(actions=("click",), max_thought_bytes=6, coord_format="fixed3")
  rng = np.random.default_rng(5)
  ids, ims = _prompt(rng, 260, 1)
  shot = rng.integers(0, 256, HW + (3,), dtype=np.uint8)
  short = _prompt(rng, 4, 0)
  kw = dict(slots=2, jump_forward=4, context_len=1024, max_images=2)
  with _service(split, g, **kw) as svc:
    first = svc.submit(ids, ims, key=jax.random.PRNGKey(1), session=0).result(timeout=300)
    nxt = ids + first.tokens + [TURN_END, VISION_START] + [IMAGE] * CFG.n_img_tokens + [VISION_END]
    assert 256 < len(ids) + len(first.tokens) < 512 and svc._span() == 512  # the idle context sets the span
    svc.submit(*short, key=jax.random.PRNGKey(2), max_new_tokens=N_NEW).result(timeout=300)  # beside it
    got = svc.submit(nxt, ims + [shot], key=jax.random.PRNGKey(3), session=0).result(timeout=300)
    assert svc.stats.reused == 1
  with _service(split, g, **kw) as full:
    want = full.submit(nxt, ims + [shot], key=jax.random.PRNGKey(3)).result(timeout=300)
  assert got.tokens == want.tokens
  assert_close_f32(got.logprobs, want.logprobs, terms=forward_terms(CFG, 512), scale=max(1.0, np.abs(want.logprobs).max()))
