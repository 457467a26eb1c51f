"""Working and episodic memory (tars_jax/agent/memory.py) and training on exactly the prompts the policy saw.

Token ids are checked against layouts written out here by hand (BOS / TURN_START / IMAGE ... ids of
`agent/tokenizer.py`), not against the builder's own helpers. The rollout tests drive
`run_episodes` with an in-process scripted sandbox (pure logic: what it shows does not matter, only
that prompts, replies and screenshots flow through); the last test does the same against the real
browser sandbox (real Chromium, MiniWoB++ pages) with working memory K = 1.
"""

import base64
import dataclasses
import io

import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from envs_bridge import protocol as P
from experiments.configs import miniwob_ppo
from tars_jax.agent import memory as M
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.agent.trajectory import Episode, Turn, collate, episode_arrays, episode_rows
from tars_jax.rl import advantages as adv_lib
from tars_jax.rollout.agent_loop import run_episodes
from tars_jax.rollout.episode import LoopConfig, turn_context
from tars_jax.train import ppo
from tars_jax.train import state as state_lib
from _shared import run

TOK = ByteTokenizer()
N_IMG = 3  # IMAGE ids per screenshot in the hand-built layouts
BOS, TS, TE, VS, VE, IMG, EOS = (TOK.bos_id, TOK.turn_start_id, TOK.turn_end_id, TOK.vision_start_id,
                                 TOK.vision_end_id, TOK.image_id, TOK.eos_id)
# |logp_train - logp_sampler| on a model token: as tests/test_on_policy.py (KV-cached decode vs one full
# forward: the same float32 math in other summation orders, ~1e-6 at |logits| ~ 10).
TOL = 1e-5


def enc(s):
  return list(s.encode("utf-8"))


# --- hand-built layout (agent/prompts.py module docstring) ---------------------------------------

def h_prefix(instruction, system="", memory=()):
  mem = ("Memory:\n" + "".join(f"- {m}\n" for m in memory)) if memory else ""
  return [BOS] + enc((f"{system}\n" if system else "") + mem + instruction + "\n")


def h_obs(text, first, n=N_IMG):  # observation with its screenshot
  return ([] if first else [TE]) + [TS] + (enc(text + "\n") if text else []) + [VS] + [IMG] * n + [VE]


def h_text(text, first):  # the same observation, text only
  return ([] if first else [TE]) + [TS] + (enc(text + "\n") if text else [])


def h_reply(s):
  return enc(s) + [EOS]


TEXTS = [None, "invalid action: x", None, "tool said hi", None, "invalid action: y"]
REPLIES = [f"Thought: t{j}\nAction: click(start_box='({10 * j},{20 * j})')" for j in range(6)]


def _image(j):
  return np.full((4, 2, 3), 10 * j + 5, np.uint8)


def _episode(n_turns, memory=(), system="sys"):
  """An episode whose turns carry the hand-built observation ids (as run_episodes writes them)."""
  ep = Episode(task="t", seed=0, instruction="do it", prefix_ids=h_prefix("do it", system, memory),
               memory=list(memory))
  for j in range(n_turns):
    rep = h_reply(REPLIES[j])
    ep.turns.append(Turn(image=_image(j), obs_ids=h_obs(TEXTS[j], j == 0), reply_ids=rep,
                         logprobs=-np.arange(1, len(rep) + 1, dtype=np.float32) / 100,
                         states=np.zeros(len(rep), np.int32), text=REPLIES[j], reward=float(j)))
  return ep


def _cfg(**mem):
  return LoopConfig(n_img_tokens=N_IMG, system="sys", memory=M.MemoryConfig(**mem))


def _upto(ep, k):
  return dataclasses.replace(ep, turns=ep.turns[:k])


# --- the context builder ---------------------------------------------------------------------------

def test_memory_off_is_the_full_history_bit_for_bit():
  assert LoopConfig().memory == M.MemoryConfig() and not M.MemoryConfig().enabled
  ep = _episode(4)
  for k in range(5):
    image = _image(k)
    ids, images, obs_ids, ctx = turn_context(TOK, _cfg(), _upto(ep, k), image, TEXTS[k])
    want = h_prefix("do it", "sys")
    for j in range(k):
      want += h_obs(TEXTS[j], j == 0) + h_reply(REPLIES[j])
    assert ids == want + h_obs(TEXTS[k], k == 0)
    assert obs_ids == h_obs(TEXTS[k], k == 0)
    assert ids == _upto(ep, k).token_ids() + obs_ids  # the formula before memory
    assert len(images) == k + 1 and all(a is b for a, b in zip(images, [t.image for t in ep.turns[:k]] + [image]))
    assert ctx is None  # nothing recorded: the Episode is exactly what it was without memory


@pytest.mark.parametrize("k", [1, 2, 3])
def test_working_memory_keeps_the_last_k_screenshots_and_text_before(k):
  ep = _episode(5)
  n = 5
  ids, images, obs_ids, ctx = turn_context(TOK, _cfg(working_turns=k), ep, _image(n), TEXTS[n])
  want = h_prefix("do it", "sys")
  for j in range(n):
    full = j >= n - (k - 1)
    want += (h_obs(TEXTS[j], j == 0) if full else h_text(TEXTS[j], j == 0)) + h_reply(REPLIES[j])
  want += h_obs(TEXTS[n], False)
  assert ids == want
  assert ids.count(VS) == k and ids.count(IMG) == k * N_IMG
  assert [int(im[0, 0, 0]) for im in images] == [10 * j + 5 for j in range(n - k + 1, n + 1)]
  assert ctx.image_turns == tuple(range(n - k + 1, n + 1))
  assert ctx.text_turns == tuple(range(n - k + 1)) and ctx.dropped_turns == () and ctx.dropped_memory == 0
  np.testing.assert_array_equal(ctx.ids, ids)


def test_memory_on_without_a_rebuild_is_the_full_history():
  # K = 5 and 3 turns: no screenshot leaves, so the prompt is today's and the row too
  ep = _episode(3)
  ids, images, _, ctx = turn_context(TOK, _cfg(working_turns=5), _upto(ep, 2), _image(2), TEXTS[2])
  assert ids == _upto(ep, 2).token_ids() + h_obs(TEXTS[2], False) and ctx.image_turns == (0, 1, 2)


def _rebuild(ep, n, ctx, obs):
  """The prompt a Context describes, assembled by hand from its report."""
  ids = h_prefix("do it", "sys", ep.memory[ctx.dropped_memory:])
  for j in range(n):
    if j in ctx.dropped_turns:
      continue
    first = j == 0
    ids += (h_text(TEXTS[j], first) if j in ctx.text_turns else h_obs(TEXTS[j], first)) + h_reply(REPLIES[j])
  return ids + obs


def test_budget_is_never_exceeded_and_what_was_dropped_is_reported():
  summaries = ["first try: clicked the wrong box", "second try: it worked"]
  ep = _episode(5, memory=summaries)
  n, obs = 5, h_obs(TEXTS[5], False)
  unbounded = turn_context(TOK, _cfg(working_turns=3), ep, _image(n), TEXTS[n])
  top = len(unbounded[0])
  floor = len(h_prefix("do it", "sys")) + len(obs)  # what is never left out
  reserve = 7
  prev_len, prev_dropped = None, -1
  seen = set()
  for budget in range(top + reserve + 2, floor + reserve - 1, -1):
    cfg = _cfg(working_turns=3, max_context_tokens=budget, reserve_tokens=reserve)
    ids, images, _, ctx = turn_context(TOK, cfg, ep, _image(n), TEXTS[n])
    assert len(ids) <= budget - reserve
    assert ids == _rebuild(ep, n, ctx, obs)  # the report says exactly what is in and out
    assert len(images) == ids.count(VS) == len(ctx.image_turns) and ctx.image_turns[-1] == n
    # order: oldest turns first, screenshots before whole turns of the recent ones, summaries last
    d = len(ctx.dropped_turns)
    assert ctx.dropped_turns == tuple(range(d))
    assert ctx.text_turns == tuple(range(d, d + len(ctx.text_turns)))
    assert ctx.image_turns[:-1] == tuple(range(d + len(ctx.text_turns), n))
    if ctx.dropped_memory:
      assert d == n
    assert prev_len is None or len(ids) <= prev_len
    assert d >= prev_dropped or ctx.dropped_memory
    prev_len, prev_dropped = len(ids), d
    seen.add((d, len(ctx.text_turns), ctx.dropped_memory))
  assert (0, 3, 0) in seen and any(m == 2 for _, _, m in seen) and any(t == 0 and d == 5 for d, t, _ in seen)
  with pytest.raises(M.ContextBudgetError) as e:
    turn_context(TOK, _cfg(max_context_tokens=floor + reserve - 1, reserve_tokens=reserve), ep, _image(n), TEXTS[n])
  assert (e.value.needed, e.value.budget) == (floor, floor - 1)


def test_memory_config_rejects_bad_values():
  with pytest.raises(ValueError, match="episodic"):
    M.MemoryConfig(episodic="sometimes")
  with pytest.raises(ValueError, match="working_turns"):
    M.MemoryConfig(working_turns=-1)
  with pytest.raises(ValueError, match="reserve_tokens"):
    M.MemoryConfig(max_context_tokens=10, reserve_tokens=10)


def test_config_builds_the_loop_memory():
  c = miniwob_ppo.get_config("smoke")
  assert state_lib.memory_config(c.memory) == M.MemoryConfig()  # the config's defaults: off
  c.memory.working_turns, c.memory.episodic = 5, "template"
  assert state_lib.memory_config(c.memory).working_turns == 5
  del c.memory["summary_max_tokens"]
  with pytest.raises(AttributeError, match="summary_max_tokens"):
    state_lib.memory_config(c.memory)


# --- episodic memory -------------------------------------------------------------------------------

def test_template_summary_and_the_per_task_store():
  ep = _episode(2)
  ep.turns[1].error = "invalid action: x"
  ep.turns[1].done, ep.turns[1].env_reward = True, 1.0
  s = M.template_summary(ep, 200, TOK)
  assert s == "do it | click(start_box='(0,0)'); invalid | success, return 1.00"
  assert M.template_summary(ep, 10, TOK) == "do it | cl"
  assert M.clip_tokens("é" * 3, 3, TOK) == "é"  # never half a character
  cfg = M.MemoryConfig(episodic="template", episodic_episodes=2, episodic_max_tokens=2 * len("- s0\n"),
                       summary_max_tokens=4)
  store = M.EpisodicMemory(cfg, TOK)
  for k in range(3):
    store.add("a", f"s{k}")
  store.add("b", "other task, cut to 4")
  assert store.summaries("a") == ["s1", "s2"] and store.summaries("b") == ["othe"] and store.summaries("c") == []
  tight = M.EpisodicMemory(dataclasses.replace(cfg, episodic_max_tokens=len("- s0\n")), TOK)
  for k in range(3):
    tight.add("a", f"s{k}")
  assert tight.summaries("a") == ["s2"]  # the latest that fit the token bound


def test_episodic_summaries_open_the_prefix():
  ids, _, _, ctx = turn_context(TOK, _cfg(working_turns=2), _episode(0, memory=["m1", "m2"]), _image(0), None)
  assert ids == [BOS] + enc("sys\nMemory:\n- m1\n- m2\ndo it\n") + h_obs(None, True)
  assert ctx.dropped_memory == 0


# --- rows for training, chained GAE ---------------------------------------------------------------

def _with_contexts(ep, cfg):
  """`ep` with each turn's Context as the builder gives it from the turns before (run_episodes' order)."""
  out = dataclasses.replace(ep, turns=[])
  for k, t in enumerate(ep.turns):
    _, _, obs_ids, ctx = turn_context(TOK, cfg, out, t.image, TEXTS[k])
    assert obs_ids == t.obs_ids
    out.turns.append(dataclasses.replace(t, context=ctx))
  return out


def test_rows_are_the_prompts_with_their_replies():
  ep = _with_contexts(_episode(3), _cfg(working_turns=1))
  rows = episode_rows(ep)
  assert [r["turns"] for r in rows] == [[0], [1], [2]]  # K = 1: every prompt after the first is rebuilt
  for k, r in enumerate(rows):
    ctx = list(ep.turns[k].context.ids)
    assert r["tokens"].tolist() == ctx + h_reply(REPLIES[k])
    assert r["loss"].tolist() == [0.0] * len(ctx) + [1.0] * len(h_reply(REPLIES[k]))
    assert r["reward"][-1] == float(k) and r["reward"][:-1].sum() == 0
    assert r["image_turns"] == [k]
  b = collate([ep, _episode(2)], pad_id=TOK.pad_id, max_images=3, image_hw=(4, 2), length_multiple=8,
              batch_size=2)
  # 3 rows of the first episode + 1 of the second (no contexts: its full history), grown to 4 rows
  assert b.tokens.shape[0] == 4
  np.testing.assert_array_equal(b.row_episode, [0, 0, 0, 1])
  np.testing.assert_array_equal(b.next_row, [1, 2, -1, -1])
  np.testing.assert_array_equal(b.image_mask.sum(1), [1, 1, 1, 2])
  assert b.pixel_values[2, 0, 0, 0, 0] == pytest.approx(25 / 255)
  # an episode without a rebuild (K = 5) is one row equal to the memory-off one
  ep5 = _with_contexts(_episode(3), _cfg(working_turns=5))
  (r5,) = episode_rows(ep5)
  a = episode_arrays(_episode(3))
  for key in ("tokens", "loss", "reward", "logp", "state"):
    np.testing.assert_array_equal(r5[key], a[key])


def test_collate_without_contexts_has_no_chain_fields():
  b = collate([_episode(2)], pad_id=TOK.pad_id, max_images=2, image_hw=(4, 2), length_multiple=8)
  assert b.row_episode is None and "row_episode" not in b.as_dict() and "next_row" not in b.as_dict()


def test_chained_gae_equals_gae_over_one_row():
  rng = np.random.default_rng(0)
  # one episode of 3 turns as one row, and as 3 rows with other observation tokens and padding
  turns = [(4, 3), (2, 5), (3, 2)]  # (observation tokens, model tokens) per turn
  gamma, lam = 0.97, 0.9
  one_r, one_v, one_m = [], [], []
  rows = []
  for obs, mod in turns:
    r = np.r_[np.zeros(obs), rng.normal(size=mod)]
    v = rng.normal(size=obs + mod)
    m = np.r_[np.zeros(obs), np.ones(mod)]
    one_r += [r]
    one_v += [v]
    one_m += [m]
    extra = rng.integers(1, 5)  # the rebuilt prompt is longer: more observation tokens before
    rows.append((np.r_[np.zeros(extra), r], np.r_[rng.normal(size=extra), v], np.r_[np.zeros(extra), m]))
  T = 16
  pad = lambda x: np.r_[x, np.zeros(T - len(x))]  # noqa: E731
  R = np.stack([pad(x[0]) for x in rows] + [np.zeros(T)])
  V = np.stack([pad(x[1]) for x in rows] + [np.zeros(T)])
  Mk = np.stack([pad(x[2]) for x in rows] + [np.zeros(T)])
  nxt = np.array([1, 2, -1, -1])
  adv, ret = adv_lib.gae(R, V, Mk, gamma, lam, next_row=nxt)
  a1, r1 = adv_lib.gae(np.concatenate(one_r)[None], np.concatenate(one_v)[None], np.concatenate(one_m)[None],
                       gamma, lam)
  model = Mk > 0
  np.testing.assert_allclose(np.asarray(adv)[model], np.asarray(a1)[0][np.concatenate(one_m) > 0], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(ret)[model], np.asarray(r1)[0][np.concatenate(one_m) > 0], rtol=1e-6, atol=1e-6)
  # unchained, the rows would be three episodes: the first row's last advantage would differ
  a_cut, _ = adv_lib.gae(R, V, Mk, gamma, lam)
  assert not np.allclose(np.asarray(a_cut)[model], np.asarray(adv)[model])


# --- rollouts: prompts given to the act function == rows trained ------------------------------------

class _Sandbox:
  """In-process scripted sandbox with the client API run_episodes uses (open / step / close /
  serves): screenshots differ per seed and step, every other step answers with an error text, an
  episode never ends before the step budget."""

  serves = None

  def __init__(self):
    self.steps: dict[str, int] = {}
    self.actions: dict[str, list[str]] = {}

  def _obs(self, seed, k, error=None):
    img = np.zeros((30, 40, 3), np.uint8)
    img[..., 0], img[: 5 + 5 * k, :, 1], img[:, : 3 + 7 * seed, 2] = 40 * k, 200, 120
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    info = {"instruction": f"click the box {seed}"}
    if error:
      info["error"] = error
    return P.Observation(screenshot_png_b64=base64.b64encode(buf.getvalue()).decode(), info=info)

  async def open(self, task, seed, data_mode="train"):
    sid = f"{task}/{seed}/{len(self.steps)}"
    self.steps[sid], self.actions[sid] = 0, []
    return sid, self._obs(seed, 0)

  async def step(self, sid, action):
    self.steps[sid] += 1
    self.actions[sid].append(action)
    k = self.steps[sid]
    return self._obs(int(sid.split("/")[-2]), k, "invalid action: try again" if k % 2 else None)

  async def close(self, sid):
    pass


def _scripted_act(calls, text="Thought: I clicked the box\nAction: click(start_box='(100,200)')"):
  def act(prompts, images):
    r = TOK.encode(text) + [EOS]
    calls.extend((list(p), list(im)) for p, im in zip(prompts, images))
    return [(r, np.zeros(len(r), np.float32), np.zeros(len(r), np.int32)) for _ in prompts]
  return act


def test_memory_off_rollout_prompts_are_todays():
  calls = []
  cfg = LoopConfig(max_turns=3, image_hw=(8, 6), n_img_tokens=N_IMG, system="sys")
  eps = run(run_episodes(_scripted_act(calls), [_Sandbox()], [("t", 1), ("t", 2)], cfg, TOK))
  reply = h_reply("Thought: I clicked the box\nAction: click(start_box='(100,200)')")
  texts = [None, "invalid action: try again", None]
  want = []
  for seed in (1, 2):  # hand-built full history of each turn
    hist = h_prefix(f"click the box {seed}", "sys")
    for k in range(3):
      want.append((seed, k, hist + h_obs(texts[k], k == 0)))
      hist = hist + h_obs(texts[k], k == 0) + reply
  got = sorted(calls, key=lambda c: (c[0][: len(h_prefix("click the box 1", "sys"))], len(c[0])))
  assert [c[0] for c in got] == [w[2] for w in sorted(want, key=lambda w: (w[0], w[1]))]
  assert [len(c[1]) for c in got] == [1, 2, 3, 1, 2, 3]
  assert all(t.context is None for e in eps for t in e.turns) and all(e.memory == [] for e in eps)


def test_episodic_memory_through_run_episodes():
  cfg = LoopConfig(max_turns=2, image_hw=(8, 6), n_img_tokens=N_IMG, system="sys",
                   memory=M.MemoryConfig(episodic="template", summary_max_tokens=120))
  with pytest.raises(ValueError, match="EpisodicMemory"):
    run(run_episodes(_scripted_act([]), [_Sandbox()], [("t", 1)], cfg, TOK))
  store = M.EpisodicMemory(cfg.memory, TOK)
  first = run(run_episodes(_scripted_act([]), [_Sandbox()], [("t", 1)], cfg, TOK, episodic=store))
  assert first[0].memory == []
  # the scripted sandbox answers the first step with an error: that action shows as invalid
  s = "click the box 1 | invalid; click(start_box='(100,200)') | truncated, return 0.00"
  assert store.summaries("t") == [s]
  calls = []
  second = run(run_episodes(_scripted_act(calls), [_Sandbox()], [("t", 3)], cfg, TOK, episodic=store))
  assert second[0].memory == [s]
  assert calls[0][0] == h_prefix("click the box 3", "sys", [s]) + h_obs(None, True)
  # written by the policy: its reply to the summary prompt (the thought), through the same act
  pcfg = dataclasses.replace(cfg, memory=M.MemoryConfig(episodic="policy"))
  pstore, pcalls = M.EpisodicMemory(pcfg.memory, TOK), []
  run(run_episodes(_scripted_act(pcalls), [_Sandbox()], [("t", 1)], pcfg, TOK, episodic=pstore))
  assert pstore.summaries("t") == ["I clicked the box"]
  prompt, images = pcalls[-1]
  assert images == [] and prompt[-len(enc(M.SUMMARY_PROMPT + "\n")) - 2:] == [TE, TS] + enc(M.SUMMARY_PROMPT + "\n")
  assert VS not in prompt


def _tiny_parts(max_turns):
  cfg = miniwob_ppo.get_config("smoke")
  cfg.model.image_h, cfg.model.image_w = 56, 84  # 2 x 3 image tokens per screenshot
  cfg.env.max_turns = max_turns
  return state_lib.build(cfg), cfg


def _trained_turns(batch, n_rows):
  """(prompt ids, reply ids, screenshots [m, H, W, 3]) of every reply in the batch's first `n_rows`
  rows, read off the arrays the trainer uses: a reply = a run of loss-mask 1, its prompt = the row's
  tokens before it, its screenshots = the row's first m images, m = the prompt's VISION_START ids."""
  out = []
  for r in range(n_rows):
    toks, lm = batch["tokens"][r], batch["loss_mask"][r]
    j = 0
    while j < len(lm):
      if lm[j] == 0:
        j += 1
        continue
      e = j
      while e < len(lm) and lm[e] == 1:
        e += 1
      prompt = toks[: j + 1].tolist()
      m = prompt.count(VS)
      assert batch["image_mask"][r, :m].all()
      out.append((prompt, toks[j + 1: e + 1].tolist(), batch["pixel_values"][r, :m]))
      j = e
    assert set(np.unique(lm)) <= {0.0, 1.0}
  return out


def _check_trains_what_the_policy_saw(parts, params, calls, episodes, batch):
  """Every act call's (prompt, screenshots, reply) is exactly one trained reply of the batch, and the
  trainer's log-probs of those replies equal the sampler's."""
  real = int((batch["row_episode"] >= 0).sum())
  trained = _trained_turns(batch, real)
  assert len(trained) == len(calls) == sum(len(e.turns) for e in episodes)
  trained = sorted(trained, key=lambda x: (x[0], x[1]))  # (prompt, reply, screenshots)
  calls = sorted(calls, key=lambda x: (x[0], x[2]))  # (prompt, screenshots, reply)
  for (p, r, pix), (cp, cimgs, cr) in zip(trained, calls):
    assert (p, r) == (cp, cr)
    assert len(pix) == len(cimgs)
    for a, b in zip(pix, cimgs):
      np.testing.assert_array_equal(a, b.astype(np.float32) / 255.0)
  mask = batch["loss_mask"] > 0
  logp = np.asarray(ppo.reference_logp(params, {k: jnp.asarray(v) for k, v in batch.items()}, parts.table,
                                       policy_gd=parts.policy_gd, hp=parts.hparams, inputs=parts.inputs))
  d = logp[mask] - batch["old_logp"][mask]
  assert np.abs(d).max() <= TOL, f"max |logp - old_logp| = {np.abs(d).max():.3g}"
  assert (batch["old_logp"][mask] < -1e-3).sum() >= len(episodes)  # real sampled decisions were compared


def _recording(policy, calls):
  def act(prompts, images):
    out = policy.act(prompts, images)
    calls.extend((list(p), [im.copy() for im in imgs], list(o[0])) for p, imgs, o in zip(prompts, images, out))
    return out
  return act


def _rollout_and_check(clients, jobs, parts, cfg, loop_cfg):
  state = parts.init_state(cfg.seed)
  policy = parts.batched_policy(state["policy"], batch_size=len(jobs), seed=cfg.seed)
  calls = []
  episodes = run(run_episodes(_recording(policy, calls), clients, jobs, loop_cfg, parts.tokenizer))
  assert not any(e.lost for e in episodes)
  batch = collate(episodes, pad_id=parts.tokenizer.pad_id, max_images=cfg.env.max_turns, image_hw=parts.image_hw,
                  length_multiple=cfg.length_multiple, batch_size=len(jobs)).as_dict()
  _check_trains_what_the_policy_saw(parts, state["policy"], calls, episodes, batch)
  return episodes, batch, state


def _chained_advantages_are_one_rows(parts, state, batch, n_episodes):
  """The trainer's advantages on the chained rows (`ppo.prepare`: critic on the policy's prompts, GAE
  chained across rows) equal plain GAE over each episode's model tokens laid end to end."""
  jb = {k: jnp.asarray(v) for k, v in batch.items()}
  values, _, ret, _ = ppo.prepare(state["critic"], jb, parts.table, critic_gd=parts.critic_gd, hp=parts.hparams, inputs=parts.inputs)
  free = ppo.free_decisions(parts.table, jb["states"], jb["loss_mask"])
  raw, _ = ppo.raw_advantages(values, jb, parts.hparams, free)
  hp, mask = parts.hparams, batch["loss_mask"] > 0
  for e in range(n_episodes):
    rows = np.nonzero(batch["row_episode"] == e)[0]
    r = np.concatenate([batch["rewards"][i][mask[i]] for i in rows])[None]
    v = np.concatenate([np.asarray(values)[i][mask[i]] for i in rows])[None]
    lam = float(ppo.policy_lambda(free, hp, jb["row_episode"])[rows[0]])
    want, want_ret = adv_lib.decoupled_gae(r, v, np.ones_like(r), hp.gamma, lam, hp.lam_critic)
    got = np.concatenate([np.asarray(raw)[i][mask[i]] for i in rows])
    got_ret = np.concatenate([np.asarray(ret)[i][mask[i]] for i in rows])
    np.testing.assert_allclose(got, np.asarray(want)[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_ret, np.asarray(want_ret)[0], rtol=1e-5, atol=1e-6)


def test_ppo_trains_on_exactly_the_context_the_policy_saw():
  parts, cfg = _tiny_parts(max_turns=3)
  loop_cfg = dataclasses.replace(parts.loop_cfg, memory=M.MemoryConfig(working_turns=1))
  episodes, batch, state = _rollout_and_check([_Sandbox()], [("t", 1), ("t", 2)], parts, cfg, loop_cfg)
  assert all(len(e.turns) == 3 for e in episodes)
  # K = 1: one screenshot per prompt, so each turn is its own row, chained within its episode
  assert int((batch["row_episode"] >= 0).sum()) == 6
  np.testing.assert_array_equal(batch["next_row"][:6], [1, 2, -1, 4, 5, -1])
  assert all(t.context.image_turns == (k,) and t.context.text_turns == tuple(range(k))
             for e in episodes for k, t in enumerate(e.turns))
  _chained_advantages_are_one_rows(parts, state, batch, len(episodes))


@pytest.mark.long  # ~4 min on the loaded 2-core machine: Chromium, two rollouts, sampler + PPO compiles
@pytest.mark.browser
def test_working_memory_against_the_real_browser(server):
  """End to end on real MiniWoB++ pages with working memory K = 1 and template episodic memory: two
  rollouts (the second sees the first's summaries), each trained on exactly its prompts."""
  from envs_bridge.client import SandboxClient
  parts, cfg = _tiny_parts(max_turns=3)
  loop_cfg = dataclasses.replace(parts.loop_cfg, memory=M.MemoryConfig(working_turns=1, episodic="template"))
  store = M.EpisodicMemory(loop_cfg.memory, parts.tokenizer)
  jobs = [("miniwob/click-test-2", 0), ("miniwob/click-test-2", 1), ("miniwob/click-test", 2)]

  params = parts.init_state(cfg.seed)["policy"]
  pol = parts.batched_policy(params, batch_size=len(jobs), seed=cfg.seed)

  async def go(calls, jobs):
    async with SandboxClient(server.url) as c:
      return await run_episodes(_recording(pol, calls), [c], jobs, loop_cfg, parts.tokenizer, episodic=store)

  for round_ in range(2):
    pol.start_iteration(round_)
    calls = []
    episodes = run(go(calls, jobs))
    assert not any(e.lost for e in episodes)
    if round_:  # the first round's summaries (real instructions, actions, outcomes) open the prefixes
      assert all(e.memory and e.prefix_ids[: len(enc(parts.loop_cfg.system)) + 1] ==
                 [BOS] + enc(parts.loop_cfg.system) for e in episodes)
      assert all(enc("Memory:\n- ") == e.prefix_ids[len(enc(parts.loop_cfg.system)) + 2:][:len(enc("Memory:\n- "))]
                 for e in episodes)
    assert sum(len(e.turns) for e in episodes) > len(episodes)  # some multi-turn episodes: text turns used
    batch = collate(episodes, pad_id=parts.tokenizer.pad_id, max_images=cfg.env.max_turns,
                    image_hw=parts.image_hw, length_multiple=cfg.length_multiple, batch_size=len(jobs)).as_dict()
    _check_trains_what_the_policy_saw(parts, params, calls, episodes, batch)
    assert all(t.context.image_turns == (k,) for e in episodes for k, t in enumerate(e.turns))
  # the trainer's update on the last rollout's chained rows: on-policy before it (ratio 1, no clipping)
  state = parts.init_state(cfg.seed)
  rows = int((batch["row_episode"] >= 0).sum())
  _, m = ppo.ppo_update(state, batch, parts.table, policy_gd=parts.policy_gd, critic_gd=parts.critic_gd,
                        popt=parts.popt, copt=parts.copt, hp=parts.hparams, inputs=parts.inputs, epochs=1, minibatch_size=rows,
                        rng=np.random.default_rng(0), n_real=len(episodes))
  assert abs(m["ratio_mean"] - 1.0) <= TOL and m["clipfrac"] == 0.0 and np.isfinite(m["value_loss"])
  kept = store.to_json()["miniwob/click-test-2"]
  assert len(kept) == 3  # capped at episodic_episodes (4 written)
  fit = [x for k, x in enumerate(kept) if sum(len(f"- {y}\n".encode()) for y in kept[k:]) <= 128]
  assert store.summaries("miniwob/click-test-2") == fit and fit  # the latest that fit episodic_max_tokens
