"""Generative ORM (tars_jax/train/orm.py, experiments/orm.py; report sections 2.5.2, 3.3): the prompt
(last k screenshots, the history as text, the budget and what it left out) against hand-built ids,
P(yes) against a float64 softmax of the model's own logits, the classification metrics against
hand-counted ones, the PPO reward replacement, and (slow) a real training run with Orbax checkpoints
and resume, and a PPO smoke run on ORM rewards."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from experiments.configs import orm as orm_config
from tars_jax.agent import prompts
from tars_jax.agent.tokenizer import (BOS, EOS, IMAGE, TURN_END, TURN_START, VISION_END, VISION_START,
                                      ByteTokenizer)
from tars_jax.agent.trajectory import Episode, Turn
from tars_jax.data import records
from tars_jax.models import Policy
from tars_jax.rl.rewards import RewardConfig
from tars_jax.train import orm
from tars_jax.train import step as step_lib
from tars_jax.train import state as state_lib
from tars_jax.train.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = ByteTokenizer()
SYSTEM = "GUI agent."


def _b(text: str) -> list[int]:
  return list(text.encode())


def _reply(j: int) -> str:
  return f"Thought: t{j}\nAction: click(start_box='({j}0,20)')"


def _episode(n_turns: int, n_img: int = 2, hw=(4, 3), error_turn: int | None = 1, instruction="Click ONE.") -> Episode:
  """An episode of n_turns, screenshot j filled with value j, reply `_reply(j)`, turn `error_turn`'s
  observation carrying the text 'invalid action: x'."""
  ep = Episode(task="miniwob/click-test", seed=0, instruction=instruction,
               prefix_ids=prompts.encode_episode_prefix(TOK, instruction, SYSTEM))
  for j in range(n_turns):
    text = "invalid action: x" if j == error_turn else None
    ep.turns.append(Turn(image=np.full((*hw, 3), j, np.uint8),
                         obs_ids=prompts.encode_observation(TOK, n_img, text, after_reply=j > 0),
                         reply_ids=_b(_reply(j)) + [EOS], logprobs=np.zeros(0, np.float32),
                         states=np.zeros(0, np.int32), text=_reply(j)))
  return ep


# ------------------------------------------------------------------------------------------- the prompt

def test_prompt_keeps_the_last_five_screenshots_and_the_whole_history_as_text():
  ep = _episode(7)
  p = orm.build_prompt(ep, tok=TOK, system=SYSTEM, settings=orm.OrmSettings())
  img = [VISION_START, IMAGE, IMAGE, VISION_END]
  want = [BOS] + _b("GUI agent.\nClick ONE.\n")
  want += [TURN_START] + _b(_reply(0)) + [EOS]  # turn 0: text only (older than the last 5)
  want += [TURN_END, TURN_START] + _b("invalid action: x\n") + _b(_reply(1)) + [EOS]  # turn 1: text only
  for j in range(2, 7):  # turns 2-6 with their screenshot
    want += [TURN_END, TURN_START] + img + _b(_reply(j)) + [EOS]
  want += [TURN_END, TURN_START] + _b("Did the agent complete the task? Answer yes or no.\n")
  assert p.ids == want
  assert [int(im[0, 0, 0]) for im in p.images] == [2, 3, 4, 5, 6]  # the screenshots of the last 5 turns
  assert p.context.image_turns == (2, 3, 4, 5, 6) and p.context.text_turns == (0, 1)
  assert p.context.dropped_turns == () and p.dropped == {"screenshots": 2, "turns": 0, "instruction_chars": 0}
  assert p.context.ids.tolist() == want
  # a short episode keeps every screenshot (one without a turn is refused: below)
  short = orm.build_prompt(_episode(3), tok=TOK, system=SYSTEM, settings=orm.OrmSettings())
  assert short.context.image_turns == (0, 1, 2) and short.dropped["screenshots"] == 0


def test_an_episode_without_its_screenshots_or_turns_is_refused_by_name():
  ep = _episode(7)
  ep.turns[0].image = None  # older than the last 5: shown as text, so no screenshot is needed
  orm.build_prompt(ep, tok=TOK, system=SYSTEM, settings=orm.OrmSettings())
  ep.turns[4].image = ep.turns[6].image = None
  with pytest.raises(orm.MissingScreenshots, match=r"miniwob/click-test seed 0: turns \[4, 6\] of 7 have no screenshot"):
    orm.build_prompt(ep, tok=TOK, system=SYSTEM, settings=orm.OrmSettings())
  with pytest.raises(orm.MissingScreenshots, match="it has no turn"):
    orm.build_prompt(_episode(0), tok=TOK, system=SYSTEM, settings=orm.OrmSettings())


def test_thoughts_can_be_emptied_and_answers_are_their_ids_plus_eos():
  p = orm.build_prompt(_episode(1), tok=TOK, system=SYSTEM, settings=orm.OrmSettings(thoughts=False))
  assert p.ids == ([BOS] + _b("GUI agent.\nClick ONE.\n") + [TURN_START, VISION_START, IMAGE, IMAGE, VISION_END]
                   + _b("Thought: \nAction: click(start_box='(00,20)')") + [EOS] + [TURN_END, TURN_START]
                   + _b(orm.QUESTION + "\n"))
  assert orm.answer_ids(TOK, orm.OrmSettings()) == (_b("yes") + [EOS], _b("no") + [EOS])
  assert orm.answer_token_ids(TOK, orm.OrmSettings()) == (ord("y"), ord("n"))
  assert orm.answer_token_ids(TOK, orm.OrmSettings(answer_token_ids=(5, 6))) == (5, 6)
  with pytest.raises(ValueError, match="same token"):
    orm.answer_token_ids(TOK, orm.OrmSettings(answers=("yes", "yeah")))


def test_budget_leaves_out_the_oldest_text_then_the_oldest_screenshot_and_says_what():
  ep = _episode(7)
  full = len(orm.build_prompt(ep, tok=TOK, system=SYSTEM, settings=orm.OrmSettings()).ids)
  reserve = 4  # "yes" + EOS, the longest answer
  text0 = 1 + len(_reply(0)) + 1  # TURN_START reply EOS
  text1 = 2 + len("invalid action: x\n") + len(_reply(1)) + 1
  vision = 4  # VISION_START IMAGE IMAGE VISION_END: what turn 2 loses when it becomes text-only
  budget = full + reserve - text0 - text1 - vision
  p = orm.build_prompt(ep, tok=TOK, system=SYSTEM, settings=orm.OrmSettings(max_tokens=budget))
  assert len(p.ids) + reserve == budget
  assert p.context.dropped_turns == (0, 1) and p.context.text_turns == (2,) and p.context.image_turns == (3, 4, 5, 6)
  assert p.dropped == {"screenshots": 3, "turns": 2, "instruction_chars": 0}
  # one token less: the oldest text-only turn (2) goes too
  p = orm.build_prompt(ep, tok=TOK, system=SYSTEM, settings=orm.OrmSettings(max_tokens=budget - 1))
  assert p.context.dropped_turns == (0, 1, 2) and p.context.text_turns == () and p.context.image_turns == (3, 4, 5, 6)
  # a 40-turn episode in 150 tokens (80 for prefix, question and answer; 48 for a turn with its
  # screenshot): never fails, keeps the last turn with its screenshot, says what it dropped
  long = _episode(40, error_turn=None)
  p = orm.build_prompt(long, tok=TOK, system=SYSTEM, settings=orm.OrmSettings(max_tokens=150))
  assert len(p.ids) + reserve == 23 + 2 + 4 + len(_reply(39)) + 1 + 53 + reserve <= 150
  assert p.context.dropped_turns == tuple(range(39)) and p.context.image_turns == (39,)
  assert p.dropped == {"screenshots": 39, "turns": 39, "instruction_chars": 0}
  # only the instruction left to cut: its end goes, counted in characters
  fixed = len([BOS] + _b("GUI agent.\n\n")) + 2 + len(_b(orm.QUESTION + "\n")) + reserve
  p = orm.build_prompt(_episode(1, instruction="abcdefghij"), tok=TOK, system=SYSTEM,
                       settings=orm.OrmSettings(max_tokens=fixed + 3))
  assert p.images == [] and p.dropped == {"screenshots": 1, "turns": 1, "instruction_chars": 7}
  assert p.ids[:len(_b("GUI agent.\nabc\n")) + 1] == [BOS] + _b("GUI agent.\nabc\n")
  with pytest.raises(orm.OrmBudgetError, match="max_tokens=50"):  # a config that cannot hold the question
    orm.build_prompt(_episode(1), tok=TOK, system=SYSTEM, settings=orm.OrmSettings(max_tokens=50))


def test_collate_marks_the_answer_tokens_and_the_answer_position():
  ps = [orm.build_prompt(_episode(n), tok=TOK, system=SYSTEM, settings=orm.OrmSettings()) for n in (1, 6)]
  yes, no = orm.answer_ids(TOK, orm.OrmSettings())
  batch, pos = orm.collate(ps, [yes, no], pad_id=TOK.pad_id, max_images=orm.image_slots(ps, 5), image_hw=(4, 3),
                           length_multiple=16, batch_size=3)
  assert orm.image_slots(ps, 5) == 5 and orm.image_slots(ps[:1], 5) == 1
  assert batch["tokens"].shape[0] == 3 and batch["tokens"].shape[1] % 16 == 0
  for i, (p, ans) in enumerate(zip(ps, (yes, no))):
    assert pos[i] == len(p.ids) - 1
    assert batch["tokens"][i, 1:][batch["loss_mask"][i] > 0].tolist() == ans  # targets = the answer, exactly
    assert batch["attn_mask"][i].sum() == len(p.ids) + len(ans)
  assert batch["image_mask"].sum(1).tolist() == [1, 5, 0]
  np.testing.assert_array_equal(batch["pixel_values"][1, 4], np.full((4, 3, 3), 5 / 255, np.float32))
  assert batch["loss_mask"][2].sum() == 0 and pos[2] == 0  # padding row


# ------------------------------------------------------------------------------------------- the score

@pytest.fixture(scope="module")
def parts():
  """The smoke ORM config's parts (the slow tests' records and runs use its image size)."""
  return state_lib.build(orm_config.get_config("+smoke"))


@pytest.fixture(scope="module")
def tiny():
  """Parts of a still smaller model (one layer, 56 x 56 screenshots = 4 IMAGE tokens) and its
  random parameters: the fast score test compiles in seconds."""
  c = orm_config.get_config("+smoke")
  c.model.image_h = c.model.image_w = 56
  c.model.layers = 1
  p = state_lib.build(c)
  params = jax.jit(lambda k: nnx.split(Policy(p.model_cfg, rngs=nnx.Rngs(k)))[1])(jax.random.PRNGKey(0))
  return p, params


def _real_episode(parts, seed: int, n_turns: int) -> Episode:
  rng = np.random.default_rng(seed)
  ep = Episode(task="miniwob/click-test", seed=seed, instruction=f"Click button {seed}.",
               prefix_ids=prompts.encode_episode_prefix(TOK, f"Click button {seed}.", parts.loop_cfg.system))
  for j in range(n_turns):
    ep.turns.append(Turn(image=rng.integers(0, 256, (*parts.image_hw, 3), dtype=np.uint8),
                         obs_ids=prompts.encode_observation(TOK, parts.loop_cfg.n_img_tokens, None, after_reply=j > 0),
                         reply_ids=_b(_reply(j)) + [EOS], logprobs=np.zeros(0, np.float32),
                         states=np.zeros(0, np.int32), text=_reply(j)))
  return ep


def test_p_yes_is_the_softmax_of_the_models_logits_over_the_two_answers(tiny):
  parts, params = tiny
  settings = orm.OrmSettings(screenshots=2)
  scorer = orm.OrmScorer.from_parts(parts, params, settings, batch_size=2)
  eps = [_real_episode(parts, s, n) for s, n in ((0, 2), (1, 3), (2, 3))]  # 2 batches, one with a padding row
  got = scorer.p_yes(eps)
  assert got.dtype == np.float32 and got.shape == (3,)
  assert scorer.dropped == {"episodes_cut": 0, "screenshots": 2, "turns": 0, "instruction_chars": 0}
  # reference: the three prompts in one batch padded to the longest (not the scorer's buckets or
  # batches), every position's logits from the model, the answer position's picked and softmaxed here
  ps = [orm.build_prompt(ep, tok=TOK, system=parts.loop_cfg.system, settings=settings) for ep in eps]
  n = max(len(p.ids) for p in ps)
  tokens = np.full((3, n), TOK.pad_id, np.int32)
  attn = np.zeros((3, n), bool)
  pix = np.zeros((3, 2, *parts.image_hw, 3), np.float32)
  for i, p in enumerate(ps):
    tokens[i, :len(p.ids)], attn[i, :len(p.ids)] = p.ids, True
    pix[i, :len(p.images)] = np.asarray(p.images, np.float32) / 255.0
  fwd = jax.jit(lambda prm, t, a, x: nnx.merge(parts.policy_gd, prm)(
      t, step_lib.positions(t, a, parts.inputs), a, x, np.ones((3, 2), bool)).logits)
  logits = np.asarray(fwd(params, tokens, attn, pix), np.float64)
  for i, p in enumerate(ps):
    z = logits[i, len(p.ids) - 1, [ord("y"), ord("n")]]
    np.testing.assert_allclose(got[i], np.exp(z[0] - z.max()) / np.exp(z - z.max()).sum(), atol=2e-5)
  swapped = orm.OrmScorer.from_parts(parts, params, orm.OrmSettings(screenshots=2, answer_token_ids=(ord("n"), ord("y"))),
                                     batch_size=2)
  np.testing.assert_allclose(swapped.p_yes(eps), 1 - got, atol=2e-5)
  assert scorer.p_yes([]).shape == (0,)


# ------------------------------------------------------------------------------------------- metrics

def test_classification_metrics_match_hand_counts():
  p = [0.9, 0.8, 0.6, 0.4, 0.3, 0.7, 0.2, 0.5, 0.95]
  y = [1, 1, 0, 1, 0, 0, 0, 1, 1]
  m = orm.classification_metrics(p, y)
  # predicted (> 0.5): 1 1 1 0 0 1 0 0 1 -> tp 3 (0, 1, 8), fp 2 (2, 5), fn 2 (3, 7), tn 2 (4, 6)
  assert (m["tp"], m["fp"], m["fn"], m["tn"], m["n"], m["positives"]) == (3, 2, 2, 2, 9, 5)
  assert m["precision"] == pytest.approx(3 / 5) and m["recall"] == pytest.approx(3 / 5)
  assert m["f1"] == pytest.approx(3 / 5) and m["false_positive_rate"] == pytest.approx(2 / 4)
  assert m["accuracy"] == pytest.approx(5 / 9) and m["base_rate"] == pytest.approx(5 / 9)
  # AUROC: of the 5 x 4 (success, failure) pairs, the success scores higher in 4 + 4 + 2 + 2 + 4 = 16
  assert m["auroc"] == pytest.approx(16 / 20)
  # precision 0.8 recall 0.4 -> F1 = 2 * 0.32 / 1.2
  m = orm.classification_metrics([0.9, 0.9, 0.9, 0.9, 0.9, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1],
                                 [1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1], threshold=0.5)
  assert m["precision"] == pytest.approx(0.8) and m["recall"] == pytest.approx(0.4)
  assert m["f1"] == pytest.approx(2 * 0.8 * 0.4 / 1.2) and m["false_positive_rate"] == 1.0
  # nothing predicted positive, ties, one class only
  m = orm.classification_metrics([0.5, 0.5], [1, 0])
  assert (m["precision"], m["recall"], m["f1"], m["auroc"]) == (0.0, 0.0, 0.0, 0.5)
  assert orm.classification_metrics([0.7], [1])["auroc"] is None
  assert "F1" in orm.format_table({"heldout": m})


def _items():
  """A hand-built list of labelled episodes: (task, turns) strata with 3 successes / 1 failure, 2 / 5,
  4 / 0 (one class only), 2 / 2, across two tasks."""
  spec = [("a", 1, 3, 1), ("a", 6, 2, 5), ("a", 3, 4, 0), ("b", 1, 2, 2)]
  out = []
  for task, turns, n_pos, n_neg in spec:
    for label, n in ((True, n_pos), (False, n_neg)):
      for _ in range(n):
        out.append({"i": len(out), "task": task, "turns": turns, "label": label, "seed": 100 + len(out)})
  order = np.random.default_rng(7).permutation(len(out))  # strata interleaved
  return [out[j] for j in order]


def test_balance_by_length_equalises_each_task_and_length_stratum():
  items = _items()
  kept = orm.balance_by_length(items, seed=0)
  count = {}
  for x in kept:
    key = (x["task"], x["turns"])
    count.setdefault(key, [0, 0])[int(x["label"])] += 1
  # per stratum: min(successes, failures) of each; the one-class stratum dropped
  assert count == {("a", 1): [1, 1], ("a", 6): [2, 2], ("b", 1): [2, 2]}
  # nothing kept that wasn't there, nothing twice, the input's order kept
  assert all(any(x is y for y in items) for x in kept)
  assert len({x["i"] for x in kept}) == len(kept)
  pos = [next(j for j, y in enumerate(items) if y is x) for x in kept]
  assert pos == sorted(pos)
  # the smaller side of a stratum is kept whole
  assert {x["i"] for x in kept if x["task"] == "b"} == {x["i"] for x in items if x["task"] == "b"}
  # deterministic in the seed; another seed draws another subsample of the larger sides
  assert [x["i"] for x in orm.balance_by_length(items, seed=0)] == [x["i"] for x in kept]
  draws = {tuple(x["i"] for x in orm.balance_by_length(items, seed=s)) for s in range(10)}
  assert len(draws) > 1
  # after balancing, the turn count alone does not predict the label (AUROC 0.5)
  m = orm.classification_metrics([-x["turns"] for x in kept], [x["label"] for x in kept])
  assert m["auroc"] == pytest.approx(0.5)
  assert orm.classification_metrics([-x["turns"] for x in items], [x["label"] for x in items])["auroc"] != 0.5
  assert orm.balance_by_length([], seed=0) == []


def test_bootstrap_intervals_cover_the_estimate_and_resample_groups_whole():
  rng = np.random.default_rng(0)
  y = rng.random(200) < 0.4
  p = np.clip(0.5 + 0.25 * (2 * y - 1) + 0.3 * rng.standard_normal(200), 0, 1)
  point = orm.classification_metrics(p, y)
  ci = orm.bootstrap_intervals(p, y, reps=500, seed=1)
  assert set(ci) == set(orm.INTERVAL_METRICS)
  for k, (lo, hi) in ci.items():
    assert lo <= point[k] <= hi and lo < hi, k
  assert ci == orm.bootstrap_intervals(p, y, reps=500, seed=1)  # deterministic in the seed
  assert ci != orm.bootstrap_intervals(p, y, reps=500, seed=2)
  # each episode copied 4 times into one group: resampling the groups whole gives the intervals of the
  # original episodes (the metrics are ratios of counts); resampling the copies alone is too narrow
  p4, y4, g4 = np.repeat(p, 4), np.repeat(y, 4), np.repeat(np.arange(200), 4)
  grouped = orm.bootstrap_intervals(p4, y4, groups=g4, reps=500, seed=1)
  for k in orm.INTERVAL_METRICS:
    assert grouped[k] == pytest.approx(ci[k]), k
  narrow = orm.bootstrap_intervals(p4, y4, reps=500, seed=1)
  for k in orm.INTERVAL_METRICS:
    assert narrow[k][1] - narrow[k][0] < ci[k][1] - ci[k][0], k
  # stratified by the label: every replicate holds both classes in their counts (AUROC always defined)
  strat = orm.bootstrap_intervals(p, y, strata=y, reps=200, seed=1)
  assert strat["auroc"][0] <= point["auroc"] <= strat["auroc"][1]
  # a perfect classifier: degenerate intervals at the point
  perfect = orm.bootstrap_intervals(y.astype(float), y, strata=y, reps=50, seed=0)
  assert perfect["f1"] == (1.0, 1.0) and perfect["false_positive_rate"] == (0.0, 0.0) and perfect["auroc"] == (1.0, 1.0)
  rows = {"heldout": point}
  assert "F1" in orm.format_interval_table(rows, {"heldout": ci})


def test_apply_orm_rewards_replaces_only_the_outcome_term():
  class Fixed:
    dropped = {"episodes_cut": 1, "screenshots": 2, "turns": 3, "instruction_chars": 0}

    def p_yes(self, eps):
      return np.array([0.75, 0.25, 0.5], np.float32)[:len(eps)]

  def ep(env, fmt_turn0, truncated):
    e = _episode(2)
    e.turns[0].reward = fmt_turn0
    e.turns[1].env_reward, e.turns[1].done = env, True
    e.turns[1].reward = 2.0 * env + (-1.0 if truncated else 0.0)  # outcome (weight 2) + truncation
    return e

  eps = [ep(1.0, 0.0, False), ep(-1.0, -0.1, False), ep(0.0, 0.0, True)]
  m = orm.apply_orm_rewards(eps, Fixed(), RewardConfig(outcome_weight=2.0), (-1.0, 1.0))
  assert [t.reward for t in eps[0].turns] == [0.0, pytest.approx(2.0 * 0.5)]  # -1 + 0.75 * 2 = 0.5
  assert [t.reward for t in eps[1].turns] == [-0.1, pytest.approx(2.0 * -0.5)]  # format kept
  assert [t.reward for t in eps[2].turns] == [0.0, pytest.approx(-1.0 + 0.0)]  # truncation kept, ORM 0
  assert [e.env_return for e in eps] == [1.0, -1.0, 0.0]  # the verifier's outcome is untouched
  assert m["rollout/verifier_success"] == pytest.approx(1 / 3) and m["orm/p_yes"] == pytest.approx(0.5)
  assert m["orm/outcome"] == pytest.approx((1.0 - 1.0 + 0.0) / 3)
  assert m["orm/accuracy"] == pytest.approx(1.0) and m["orm/false_positive_rate"] == 0.0
  assert m["orm/turns_dropped"] == 3 and m["orm/episodes_cut"] == 1
  assert orm.orm_outcome(0.25, (0.0, 1.0)) == 0.25
  # with the success outcome the verifier's term removed is 1 / 0, not the raw reward
  e = ep(0.8, 0.0, False)
  e.turns[1].reward = 1.0
  orm.apply_orm_rewards([e], Fixed(), RewardConfig(outcome="success"), (0.0, 1.0))
  assert e.turns[1].reward == pytest.approx(0.75)


# ------------------------------------------------------------------------------- training and PPO (slow)

def _labelled_episode(parts, seed: int, success: bool, heldout: bool = False) -> Episode:
  """A recorded-looking episode: two turns; successes click near (100,100) on a white page, failures
  near (900,900) on a grey one; the verifier's reward on the last turn. `heldout`: other clicks and
  shades than the training episodes' (the ORM never saw these screens nor replies)."""
  ep = Episode(task="miniwob/click-test-2", seed=seed, instruction="Click button ONE.",
               prefix_ids=prompts.encode_episode_prefix(TOK, "Click button ONE.", parts.loop_cfg.system))
  click = {(True, False): "100,100", (False, False): "900,900", (True, True): "120,90", (False, True): "880,910"}
  shade = {(True, False): 255, (False, False): 128, (True, True): 240, (False, True): 140}
  for j in range(2):
    text = f"Thought: \nAction: click(start_box='({click[success, heldout]})')"
    ep.turns.append(Turn(image=np.full((*parts.image_hw, 3), shade[success, heldout], np.uint8),
                         obs_ids=prompts.encode_observation(TOK, parts.loop_cfg.n_img_tokens, None, after_reply=j > 0),
                         reply_ids=_b(text) + [EOS], logprobs=np.zeros(len(text) + 1, np.float32),
                         states=np.zeros(len(text) + 1, np.int32), text=text,
                         env_reward=(1.0 if success else -1.0) if j == 1 else 0.0, done=j == 1))
  return ep


def _orm(workdir, data, *extra):
  cmd = [sys.executable, "-m", "experiments.orm", "--config", "experiments/configs/orm.py:+smoke",
         f"--workdir={workdir}", f"--config.orm.data=('{data}',)", *extra]
  p = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                     timeout=900)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  return p.stdout


@pytest.fixture(scope="module")
def orm_run(parts, tmp_path_factory):
  """A smoke ORM trained for 30 steps on 24 hand-made labelled episodes (12 successes), then resumed
  to 36 steps; returns (run dir, records dir, first run's stdout, second's)."""
  tmp = tmp_path_factory.mktemp("orm")
  meta = records.DatasetMeta.for_model(parts.image_hw, parts.loop_cfg.n_img_tokens, TOK)
  with records.RecordWriter(str(tmp / "data"), meta, prefix="iter_000001") as w:
    for s in range(24):
      w.write(_labelled_episode(parts, s, success=s % 2 == 0), source="rollout")
  run = tmp / "orm"
  first = _orm(run, tmp / "data", "--config.orm.steps=30", "--config.orm.ckpt_every=10", "--config.orm.eval_every=15")
  second = _orm(run, tmp / "data", "--config.orm.steps=36", "--config.orm.ckpt_every=10", "--config.orm.eval_every=15")
  return run, tmp / "data", first, second


@pytest.mark.long  # 1.5-3.5 min on the 2-core machine (load): the fixture's two trainer processes (compiles, 36 steps)
def test_orm_training_lowers_the_loss_separates_the_classes_and_resumes(orm_run, parts):
  run, data, first, second = orm_run
  rows = read_metrics(str(run))
  assert [r["step"] for r in rows if "train/ce" in r] == list(range(1, 37))
  ce = [r["train/ce"] for r in rows if "train/ce" in r]
  assert np.mean(ce[-5:]) < 0.5 * np.mean(ce[:3])
  assert "resumed from" in second and "/30" in second
  assert sorted(os.listdir(run / "checkpoints"))[-1] == "36"
  summary = json.load(open(run / "orm.json"))
  assert summary["steps"] == 36 and summary["data"]["train"]["successes"] > 0
  assert {"heldout", "train (sample)"} <= set(summary["metrics"])
  for k in ("f1", "precision", "recall", "false_positive_rate", "auroc"):
    assert k in summary["metrics"]["heldout"]
  assert "F1" in second and "heldout" in second
  # the scorer of the run judges episodes it was not trained on: new seeds, other clicks and shades
  scorer = orm.OrmScorer.from_run(str(run))
  trained = {e.seed for e, _ in records.read_episodes(str(data))}
  heldout = [_labelled_episode(parts, 1000 + s, success=s % 2 == 0, heldout=True) for s in range(12)]
  assert not trained & {e.seed for e in heldout}
  p = scorer.p_yes(heldout)
  y = np.array([e.success for e in heldout])
  assert y.sum() == 6 and p[y].mean() > p[~y].mean() + 0.2
  assert orm.classification_metrics(p, y)["auroc"] >= 0.9


@pytest.mark.long  # 1-2 min after the ORM fixture: 2 PPO iterations against real Chromium
@pytest.mark.browser
def test_ppo_smoke_run_on_orm_rewards(orm_run, tmp_path):
  run = tmp_path / "ppo"
  cmd = [sys.executable, "-m", "experiments.train", "--config", "experiments/configs/orm.py:ppo_orm+smoke",
         f"--workdir={run}", f"--config.rl.orm_run={orm_run[0]}"]
  p = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                     timeout=900)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  assert "outcome rewards from the ORM" in p.stdout
  rows = read_metrics(str(run))
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:
    assert 0.0 <= r["orm/p_yes"] <= 1.0 and -1.0 <= r["orm/outcome"] <= 1.0
    assert r["rollout/verifier_success"] == r["success_rate"] and "orm/false_positive_rate" in r
  # the recorded rollouts: the last turn's reward is the ORM's outcome (+ format / truncation terms),
  # the verifier's reward is kept in env_reward
  cfg = orm_config.get_config("ppo_orm+smoke")
  scorer = orm.OrmScorer.from_run(str(orm_run[0]))
  eps = [e for e, _ in records.read_episodes(str(run / "rollouts"))]
  probs = scorer.p_yes(eps)
  for e, pr in zip(eps, probs):
    t = e.turns[-1]
    rest = (cfg.rl.format_penalty if t.error else 0.0) + (cfg.rl.truncation_reward if e.truncated else 0.0)
    assert t.reward == pytest.approx(rest + cfg.rl.outcome_weight * orm.orm_outcome(pr, (-1.0, 1.0)), abs=1e-4)
