"""Continual pre-training (tars_jax/train/ct.py, the mix of data/pipeline.py, experiments/sft.py with
`sft.ct_data`): the CT mask covers exactly the text tokens, the CT loss equals a numpy next-token
cross-entropy under the full-vocabulary softmax, the SFT/CT mix draws its ratio and resumes exactly,
and the trainer runs, logs `train/ct_ce` and resumes with the same data order."""

import json
import os
import re
import shutil
import subprocess

import jax
import numpy as np
import pytest
from flax import nnx

from experiments.configs import miniwob_pipeline
from tars_jax.agent import prompts
from tars_jax.agent import tokenizer as T
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.agent.trajectory import Episode, Turn, collate
from tars_jax.data import pipeline, records
from tars_jax.train import ct, sft
from tars_jax.train import step as step_lib
from tars_jax.train import state as state_lib
from tars_jax.train.metrics import read_metrics
from _shared import assert_close_f32

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPLIES = ["Thought: the ONE button\nAction: click(start_box='(570,610)')",
           "Thought: \nAction: finished(content='Submit')"]
# a rejected trajectory's reply: not an action of the grammar (sft.prepare would refuse it)
BAD_REPLY = "Thought: drag it\nAction: drag(start_box='(1,2)', end_box='(3,4)')"


def _turn(image, obs_ids, reply_ids, text=""):
  return Turn(image=image, obs_ids=obs_ids, reply_ids=reply_ids, logprobs=np.zeros(len(reply_ids), np.float32),
              states=np.zeros(len(reply_ids), np.int32), text=text)


# -------------------------------------------------------------------------------------------- mask

def test_text_mask_covers_exactly_the_text_tokens():
  """A hand-made two-turn episode (byte tokenizer, 2 image slots per screenshot), its token view
  written out id by id: the mask picks every target but the 4 IMAGE slots, and nothing of padding."""
  tok = ByteTokenizer()
  img = np.zeros((4, 6, 3), np.uint8)
  h, i, o, a, b, c = (ord(x) for x in "hioabc")
  ep = Episode(task="t", seed=0, instruction="hi", prefix_ids=[T.BOS, h, i], turns=[
      _turn(img, [T.TURN_START, o, T.VISION_START, T.IMAGE, T.IMAGE, T.VISION_END], [a, T.EOS]),
      _turn(img, [T.TURN_END, T.TURN_START, T.VISION_START, T.IMAGE, T.IMAGE, T.VISION_END], [b, c, T.EOS])])
  # position:   0      1  2  3             4  5               6        7        8             9  10
  want_ids = [T.BOS, h, i, T.TURN_START, o, T.VISION_START, T.IMAGE, T.IMAGE, T.VISION_END, a, T.EOS,
              # 11         12            13               14       15       16            17 18 19
              T.TURN_END, T.TURN_START, T.VISION_START, T.IMAGE, T.IMAGE, T.VISION_END, b, c, T.EOS]
  bt = ct.with_text_mask(collate([ct.prepare(ep, tokenizer=tok)], pad_id=tok.pad_id, max_images=2, image_hw=(4, 6),
                                 length_multiple=16, batch_size=2).as_dict(), tok.image_id)
  assert bt["tokens"].shape == (2, 32) and bt["tokens"][0, :20].tolist() == want_ids
  # target j is token j+1: every target but tokens 6, 7, 14, 15 (IMAGE slots), none past token 19
  want = np.zeros((2, 31), np.float32)
  want[0, :19] = 1
  want[0, [5, 6, 13, 14]] = 0
  np.testing.assert_array_equal(bt["text_mask"], want)
  assert bt["text_mask"].dtype == np.float32
  # the SFT reply mask (kept as it is) lies inside it: reply tokens a, EOS, b, c, EOS
  assert np.nonzero(bt["loss_mask"][0])[0].tolist() == [8, 9, 16, 17, 18]
  assert (bt["text_mask"] >= bt["loss_mask"]).all()


def test_prepare_keeps_recorded_ids_and_encodes_text_only_turns():
  tok = ByteTokenizer()
  img = np.zeros((4, 6, 3), np.uint8)
  bad = tok.encode(BAD_REPLY)  # as sampled: no EOS (the reply hit its length limit)
  ep = Episode(task="t", seed=0, instruction="", prefix_ids=[T.BOS], turns=[
      _turn(img, [T.TURN_START], bad, text=BAD_REPLY), _turn(img, [T.TURN_START], [], text="hello")])
  ep.turns[0].loss_mask = np.zeros(len(bad), np.float32)  # stale tokens of a streaming rollout
  out = ct.prepare(ep, tokenizer=tok)
  assert out.turns[0].reply_ids == bad and out.turns[0].loss_mask is None
  assert out.turns[1].reply_ids == tok.encode("hello") + [tok.eos_id]
  assert [len(t.states) for t in out.turns] == [len(bad), 6] and ep.turns[1].reply_ids == []  # input untouched


# -------------------------------------------------------------------------------------------- loss

@pytest.fixture(scope="module")
def parts():
  return state_lib.build(miniwob_pipeline.get_config("thoughts+smoke"))


def _episode(parts, replies, seed=0, hw=None):
  """A byte-tokenizer episode of the run's chat template; replies as recorded ids (bytes + EOS)."""
  rng = np.random.default_rng(seed)
  tok = parts.tokenizer
  ep = Episode(task="miniwob/click-test", seed=seed, instruction="Click button ONE.",
               prefix_ids=prompts.encode_episode_prefix(tok, "Click button ONE.", parts.loop_cfg.system))
  for k, text in enumerate(replies):
    ids = tok.encode(text) + [tok.eos_id]
    obs = prompts.encode_observation(tok, parts.loop_cfg.n_img_tokens, f"step {k}", after_reply=k > 0)
    ep.turns.append(_turn(rng.integers(0, 256, (*(hw or parts.image_hw), 3), dtype=np.uint8), obs, ids, text))
  return ep


def test_ct_loss_equals_numpy_full_vocabulary_cross_entropy(parts):
  tok = parts.tokenizer
  eps = [ct.prepare(_episode(parts, r, seed=s), tokenizer=tok) for s, r in enumerate([REPLIES, [BAD_REPLY]])]
  with pytest.raises(sft.ReplyNotInGrammar):  # CT trains on it all the same (full-vocabulary softmax)
    sft.prepare(eps[1], grammar=parts.grammar, tokenizer=tok, thoughts=True)
  b = ct.with_text_mask(collate(eps, pad_id=tok.pad_id, max_images=2, image_hw=parts.image_hw,
                                length_multiple=16, batch_size=3).as_dict(), parts.inputs.image_token_id)
  params = parts.init_state(0)["policy"]
  # jitted: the same computation, a few times faster than op-by-op on the CPU
  loss, m = jax.jit(lambda p, b: ct.loss_and_metrics(p, b, graphdef=parts.policy_gd, inputs=parts.inputs,
                                                     aux_coef=0.0))(params, b)
  out = jax.jit(lambda p, b: nnx.merge(parts.policy_gd, p)(
      b["tokens"], step_lib.positions(b["tokens"], b["attn_mask"], parts.inputs), b["attn_mask"], b["pixel_values"],
      b["image_mask"]))(params, b)
  logits = np.asarray(out.logits[:, :-1], np.float64)
  nll, hits, n = 0.0, 0, 0
  for row, ep in enumerate(eps):
    ids = ep.token_ids()
    for j in range(len(ids) - 1):  # independent of the mask: every next token that is not an image slot
      if ids[j + 1] == tok.image_id:
        continue
      z = logits[row, j]
      nll += np.log(np.exp(z - z.max()).sum()) + z.max() - z[ids[j + 1]]
      hits += int(np.argmax(z) == ids[j + 1])
      n += 1
  assert int(m["ct_tokens"]) == n
  assert_close_f32(float(loss), nll / n, terms=logits.shape[-1])
  assert_close_f32(float(m["ct_ce"]), nll / n, terms=logits.shape[-1])
  assert float(m["ct_acc"]) == pytest.approx(hits / n, abs=1e-6)


# --------------------------------------------------------------------------------------------- mix

@pytest.fixture(scope="module")
def two_sets(tmp_path_factory):
  """An 'sft' and a 'ct' record set of 12 and 9 one- to three-turn episodes (seeds 0.. / 100..)."""
  tok = ByteTokenizer()
  meta = records.DatasetMeta(image_hw=(4, 6), n_img_tokens=2, tokenizer="byte", vocab_size=tok.vocab_size)
  rng = np.random.default_rng(0)
  dirs = {}
  for name, base, n in (("sft", 0, 12), ("ct", 100, 9)):
    dirs[name] = str(tmp_path_factory.mktemp(name))
    with records.RecordWriter(dirs[name], meta) as w:
      for i in range(n):
        obs = [T.TURN_START, T.VISION_START, T.IMAGE, T.IMAGE, T.VISION_END]
        turns = [_turn(rng.integers(0, 256, (4, 6, 3), dtype=np.uint8), obs, tok.encode("x" * (5 * i)) + [T.EOS])
                 for _ in range(1 + i % 3)]
        w.write(Episode(task="t", seed=base + i, instruction="", prefix_ids=[T.BOS], turns=turns), source="rollout")
  return dirs


def _mixed(dirs, ratio):
  seeds = lambda eps: [e.seed for e in eps]  # noqa: E731
  streams = {k: pipeline.batches(records.episodes(d), seed=int(k == "ct"), batch_size=2, length_multiple=16,
                                 collate_fn=seeds) for k, d in dirs.items()}
  return pipeline.mix(streams, {"sft": 1 - ratio, "ct": ratio})


def test_mix_draws_the_ratio_and_resumes_exactly(two_sets):
  it = iter(_mixed(two_sets, 0.3))
  drawn = [next(it) for _ in range(200)]
  n_ct = sum(name == "ct" for name, _ in drawn)
  assert abs(n_ct - 60) <= 3 * np.sqrt(200 * 0.3 * 0.7)  # a binomial 3-sigma bound ...
  assert abs(n_ct - 60) <= 2  # ... and the interleaving is fixed, so it is met to about one batch
  for name, seeds in drawn:  # batches are all of one set
    assert all((s >= 100) == (name == "ct") for s in seeds)
  # each set is its own stream: every epoch of the CT set comes whole (9 episodes over its batches)
  ct_seeds = [s for name, seeds in drawn if name == "ct" for s in seeds]
  assert sorted(ct_seeds[:9]) == list(range(100, 109))

  it = iter(_mixed(two_sets, 0.3))
  for _ in range(37):
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # JSON-able: it goes into the checkpoint metadata
  want = [next(it) for _ in range(30)]
  fresh = iter(_mixed(two_sets, 0.3))
  fresh.set_state(state)
  assert [next(fresh) for _ in range(30)] == want == drawn[37:67]
  with pytest.raises(ValueError, match="another mix"):
    iter(_mixed(two_sets, 0.5)).set_state(state)
  with pytest.raises(ValueError, match="unmixed"):
    iter(_mixed(two_sets, 0.3)).set_state(state["mix"]["parents"]["sft"])


def test_mix_of_one_source_is_that_stream_tagged(two_sets):
  """ct_ratio 0 (or 1): the plain stream, its state as before mixing existed (old checkpoints resume)."""
  plain = iter(pipeline.batches(records.episodes(two_sets["sft"]), seed=0, batch_size=2, length_multiple=16,
                                collate_fn=lambda eps: [e.seed for e in eps]))
  it = iter(_mixed(two_sets, 0.0))
  assert [next(it) for _ in range(10)] == [("sft", next(plain)) for _ in range(10)]
  assert it.get_state() == plain.get_state()
  assert {name for name, _ in (next(iter(_mixed(two_sets, 1.0))),)} == {"ct"}
  with pytest.raises(ValueError, match="not all 0"):
    pipeline.mix({"a": None}, {"a": 0.0})


# ----------------------------------------------------------------------------------------- trainer

def _write(directory, parts, episodes, image_hw=None):
  meta = records.DatasetMeta(image_hw=image_hw or parts.image_hw, n_img_tokens=parts.loop_cfg.n_img_tokens,
                             tokenizer="byte", vocab_size=parts.tokenizer.vocab_size)
  with records.RecordWriter(str(directory), meta) as w:
    for ep in episodes:
      w.write(ep, source="rollout")


def _run(workdir, *overrides, check=True):
  cmd = [os.path.join(ROOT, ".venv", "bin", "python"), "-m", "experiments.sft", "--config",
         "experiments/configs/miniwob_pipeline.py:thoughts+smoke", f"--workdir={workdir}",
         "--config.sft.eval_every=0", *overrides]
  p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
  if check:
    assert p.returncode == 0, p.stderr[-3000:]
  return p


@pytest.mark.parametrize("sets, msg", [
    (dict(ct_data=("ct",)), "ct_data is set but config.sft.ct_ratio is 0"),
    (dict(ct_ratio=0.5), r"ct_ratio=0.5 but config.sft.ct_data is empty"),
    (dict(ct_data=("ct",), ct_ratio=1.0), "would never be read"),
    (dict(ct_ratio=1.5, ct_data=("ct",)), r"ct_ratio=1.5: .* in \[0, 1\]"),
    (dict(data=()), "config.sft.data is empty")])
def test_bad_ct_settings_are_refused_naming_the_fields(sets, msg):
  from absl import app
  from experiments import sft as sft_script
  s = miniwob_pipeline.get_config("thoughts+smoke").sft
  s.data = ("demos",)
  s.update(sets)
  with pytest.raises(app.UsageError, match=msg):
    sft_script.check_data_settings(s)


def test_trainer_refuses_a_ct_set_of_another_screenshot_size_before_training(parts, tmp_path):
  """The trainer itself: a CT set written for another screenshot size stops at `sft.check_data` naming
  image_hw, before any step (the settings' refusals above run first in `experiments/sft.py`'s main)."""
  _write(tmp_path / "sft", parts, [_episode(parts, REPLIES[:1])])
  _write(tmp_path / "ct_bad", parts, [_episode(parts, [BAD_REPLY], hw=(28, 42))], image_hw=(28, 42))
  p = _run(tmp_path / "run", f"--config.sft.data=('{tmp_path / 'sft'}',)",
           f"--config.sft.ct_data=('{tmp_path / 'ct_bad'}',)", "--config.sft.ct_ratio=0.5", check=False)
  assert p.returncode != 0 and re.search("DatasetMismatch.*image_hw", p.stderr), p.stderr[-2000:]
  assert not os.path.exists(tmp_path / "run" / "checkpoints")


@pytest.mark.long  # ~5 min on 2 busy cores: three trainer processes, each compiling the SFT and CT updates
def test_trainer_mixes_ct_batches_logs_ct_ce_and_resumes(parts, tmp_path):
  """experiments/sft.py with ct_ratio 0.5 alternates SFT and CT batches (log rows of train/ce or
  train/ct_ce), and resumed from its step-2 checkpoint repeats steps 3-4 exactly (the mix position and
  both streams' states are in the checkpoint). A CT-only run (ct_ratio 1, no SFT data) trains too."""
  tok = parts.tokenizer
  sft_eps = [sft.prepare(_episode(parts, REPLIES[: 1 + s % 2], seed=s), grammar=parts.grammar, tokenizer=tok,
                         thoughts=True) for s in range(8)]
  ct_eps = [_episode(parts, [BAD_REPLY, REPLIES[0]][: 1 + s % 2], seed=50 + s) for s in range(8)]
  _write(tmp_path / "sft", parts, sft_eps)
  _write(tmp_path / "ct", parts, ct_eps)
  args = (f"--config.sft.data=('{tmp_path / 'sft'}',)", f"--config.sft.ct_data=('{tmp_path / 'ct'}',)",
          "--config.sft.ct_ratio=0.5", "--config.sft.steps=4", "--config.sft.ckpt_every=2")
  assert "CT (50% of batches)" in _run(tmp_path / "a", *args).stdout
  full = read_metrics(str(tmp_path / "a"))
  assert [r["step"] for r in full] == [1, 2, 3, 4]
  kinds = ["ct" if "train/ct_ce" in r else "sft" for r in full]
  assert sorted(kinds) == ["ct", "ct", "sft", "sft"]
  for r, kind in zip(full, kinds):  # one kind per batch; CT counts its text tokens, far more than replies
    assert ("train/ce" in r) == (kind == "sft") and np.isfinite(r.get("train/ct_ce", r.get("train/ce")))
    if kind == "ct":
      assert r["train/ct_tokens"] > 100
  shutil.copytree(tmp_path / "a", tmp_path / "b")
  shutil.rmtree(tmp_path / "b" / "checkpoints" / "4")  # as if killed after the step-2 checkpoint
  assert "resumed from" in _run(tmp_path / "b", *args).stdout
  resumed = read_metrics(str(tmp_path / "b"))
  assert [r["step"] for r in resumed] == [1, 2, 3, 4]
  for a, b in zip(full, resumed):
    for k in ("train/ce", "train/tokens", "train/ct_ce", "train/ct_tokens"):
      assert a.get(k) == b.get(k), k
  # a CT-only run: no SFT data at all
  _run(tmp_path / "c", f"--config.sft.ct_data=('{tmp_path / 'ct'}',)", "--config.sft.ct_ratio=1.0",
       "--config.sft.steps=2", "--config.sft.ckpt_every=2")
  rows = read_metrics(str(tmp_path / "c"))
  assert len(rows) == 2 and all("train/ct_ce" in r and "train/ce" not in r for r in rows)
  assert json.load(open(tmp_path / "c" / "sft.json"))["steps"] == 2
