"""SFT (tars_jax/train/sft.py): the loss covers exactly the reply tokens, equals a numpy cross-entropy
of the grammar-constrained distribution, memorises a batch, and its optimiser matches the PPO state."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from experiments.configs import miniwob_pipeline
from tars_jax.agent import prompts
from tars_jax.agent.trajectory import Episode, Turn, collate
from tars_jax.data import records
from tars_jax.train import checkpoint as ckpt
from tars_jax.train import ppo, sft
from tars_jax.train import step as step_lib
from tars_jax.train.metrics import read_metrics
from tars_jax.train import state as state_lib
from _shared import assert_close_f32

REPLIES = ["Thought: the ONE button\nAction: click(start_box='(570,610)')",
           "Thought: the field\nAction: type(content='hello')",
           "Thought: \nAction: finished(content='Submit')"]


@pytest.fixture(scope="module")
def parts():
  return state_lib.build(miniwob_pipeline.get_config("thoughts+smoke"))


def _episode(parts, replies, seed=0):
  rng = np.random.default_rng(seed)
  tok = parts.tokenizer
  ep = Episode(task="miniwob/click-test", seed=seed, instruction="Click button ONE.",
               prefix_ids=prompts.encode_episode_prefix(tok, "Click button ONE.", parts.loop_cfg.system))
  for k, text in enumerate(replies):
    img = rng.integers(0, 256, (*parts.image_hw, 3), dtype=np.uint8)
    ep.turns.append(Turn(image=img, obs_ids=prompts.encode_observation(tok, parts.loop_cfg.n_img_tokens, None,
                                                                      after_reply=k > 0),
                         reply_ids=[], logprobs=np.zeros(0, np.float32), states=np.zeros(0, np.int32), text=text))
  return ep


def _batch(parts, eps, thoughts=True):
  eps = [sft.prepare(e, grammar=parts.grammar, tokenizer=parts.tokenizer, thoughts=thoughts) for e in eps]
  return eps, collate(eps, pad_id=parts.tokenizer.pad_id, max_images=4, image_hw=parts.image_hw,
                      length_multiple=16).as_dict()


def test_reply_text_keeps_or_empties_the_thought():
  assert sft.reply_text(REPLIES[0], True) == REPLIES[0]
  assert sft.reply_text(REPLIES[0], False) == "Thought: \nAction: click(start_box='(570,610)')"
  with pytest.raises(ValueError, match="is not 'Thought"):
    sft.reply_text("click(start_box='(1,2)')", False)


def test_prepare_rejects_replies_outside_the_grammar(parts):
  ep = _episode(parts, ["Thought: \nAction: drag(start_box='(100,100)', end_box='(200,200)')"])
  with pytest.raises(sft.ReplyNotInGrammar, match="drag.*not accepted"):
    sft.prepare(ep, grammar=parts.grammar, tokenizer=parts.tokenizer, thoughts=True)


def test_loss_mask_covers_exactly_the_reply_tokens(parts):
  tok = parts.tokenizer
  (ep,), b = _batch(parts, [_episode(parts, REPLIES)])
  targets = b["tokens"][0, 1:]
  picked = targets[b["loss_mask"][0] > 0].tolist()
  assert picked == [i for t in ep.turns for i in tok.encode(t.text) + [tok.eos_id]]
  # never a prompt, observation or image token: everything before each reply is masked out
  specials = {tok.image_id, tok.vision_start_id, tok.vision_end_id, tok.turn_start_id, tok.turn_end_id, tok.bos_id}
  assert not specials & set(picked[:-1]) and picked.count(tok.eos_id) == len(REPLIES)
  n_prompt = len(ep.prefix_ids) + len(ep.turns[0].obs_ids)
  assert b["loss_mask"][0, : n_prompt - 1].sum() == 0 and b["loss_mask"][0, n_prompt - 1] == 1


def test_loss_equals_numpy_constrained_cross_entropy(parts):
  eps, b = _batch(parts, [_episode(parts, REPLIES, seed=s) for s in range(2)])
  params = parts.init_state(0)["policy"]
  loss, m = sft.loss_and_metrics(params, b, parts.table, graphdef=parts.policy_gd, inputs=parts.inputs, aux_coef=0.0)
  out = nnx.merge(parts.policy_gd, params)(b["tokens"], step_lib.positions(b["tokens"], b["attn_mask"], parts.inputs),
                                           b["attn_mask"], b["pixel_values"], b["image_mask"])
  logits = np.asarray(out.logits[:, :-1], np.float64)
  table = np.asarray(parts.grammar.table)
  ce, free_ce, n, nf = 0.0, 0.0, 0, 0
  for i, j in zip(*np.nonzero(b["loss_mask"])):
    allowed = table[b["states"][i, j]] >= 0
    z = logits[i, j][allowed]
    nll = np.log(np.exp(z - z.max()).sum()) + z.max() - logits[i, j, b["tokens"][i, j + 1]]
    ce, n = ce + nll, n + 1
    if allowed.sum() > 1:
      free_ce, nf = free_ce + nll, nf + 1
    else:
      assert abs(nll) < 1e-6  # a grammar-forced token costs nothing
  assert int(m["tokens"]) == n and int(m["free"]) == nf and 0 < nf < n
  assert_close_f32(float(loss), ce / n, terms=logits.shape[-1])
  assert_close_f32(float(m["ce_free"]), free_ce / nf, terms=logits.shape[-1])


def test_train_step_memorises_a_batch(parts):
  _, b = _batch(parts, [_episode(parts, REPLIES, seed=s) for s in range(2)])
  opt = sft.make_optimizer(3e-3, 2, 40, 0.1, 1.0, 0.0)
  params = parts.init_state(0)["policy"]
  ost = opt.init(params)
  first = None
  for _ in range(25):
    params, ost, m = sft.train_step(params, ost, b, parts.table, graphdef=parts.policy_gd, opt=opt,
                                    inputs=parts.inputs, aux_coef=0.01)
    first = first if first is not None else float(m["ce"])
  assert float(m["ce"]) < 0.3 * first


def test_optimizer_schedule_and_state_tree_match_ppo():
  opt = sft.make_optimizer(1e-3, 10, 110, 0.1, 1.0, 0.0)
  p = {"w": jnp.zeros(3)}
  assert jax.tree.structure(opt.init(p)) == jax.tree.structure(ppo.make_optimizer(1e-3, 10, 1.0, 0.0).init(p))
  # a gradient of ones through Adam gives |update| = lr(step) at every step (m/sqrt(v) = 1)
  st, lrs = opt.init(p), []
  for _ in range(110):
    u, st = opt.update({"w": jnp.ones(3)}, st, p)
    lrs.append(-float(u["w"][0]))
  # (global-norm clipping scales the gradient; Adam's m / sqrt(v) normalises the scale away)
  np.testing.assert_allclose(lrs[0], 1e-3 * 1 / 10, rtol=1e-3)  # warm-up: the first step already moves
  np.testing.assert_allclose(lrs[9], 1e-3, rtol=1e-3)
  mid = 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + np.cos(np.pi * 50 / 100))  # cosine half way: (lr + end) / 2
  np.testing.assert_allclose(lrs[59], mid, rtol=1e-3)
  np.testing.assert_allclose(lrs[-1], 1e-4, rtol=1e-2)
  assert optax.global_norm(u) > 0


def _write(directory, parts, image_hw, n_img_tokens, episodes):
  meta = records.DatasetMeta(image_hw=image_hw, n_img_tokens=n_img_tokens, tokenizer="byte",
                             vocab_size=parts.tokenizer.vocab_size)
  with records.RecordWriter(str(directory), meta) as w:
    for ep in episodes:
      w.write(ep, source="expert")


def test_check_data_names_the_mismatch_before_training(parts, tmp_path):
  ep = sft.prepare(_episode(parts, REPLIES[:1]), grammar=parts.grammar, tokenizer=parts.tokenizer, thoughts=True)
  n = parts.loop_cfg.n_img_tokens
  kw = dict(image_hw=parts.image_hw, n_img_tokens=n, tokenizer=parts.tokenizer)
  _write(tmp_path / "ok", parts, parts.image_hw, n, [ep])
  assert sft.check_data([str(tmp_path / "ok")], **kw).image_hw == tuple(parts.image_hw)
  _write(tmp_path / "empty", parts, parts.image_hw, n, [])
  with pytest.raises(records.EmptyDataset, match="no records"):
    sft.check_data([str(tmp_path / "empty")], **kw)
  with pytest.raises(records.DatasetMismatch, match="n_img_tokens"):
    sft.check_data([str(tmp_path / "ok")], **dict(kw, n_img_tokens=n + 4))
  with pytest.raises(records.DatasetMismatch, match="image_hw"):
    sft.check_data([str(tmp_path / "ok")], **dict(kw, image_hw=(112, 84)))
  with pytest.raises(FileNotFoundError, match="dataset.json"):
    sft.check_data([str(tmp_path / "nothing")], **kw)
  with pytest.raises(ValueError, match="empty"):
    sft.check_data([], **kw)


@pytest.mark.long
def test_killed_run_resumes_with_the_same_data_order(parts, tmp_path):
  """experiments/sft.py resumed from its step-2 checkpoint repeats steps 3-4 exactly as the
  uninterrupted run did: the same batches (grain iterator state in the checkpoint), the same losses."""
  import os
  import shutil
  import subprocess
  eps = [sft.prepare(_episode(parts, REPLIES[: 1 + s % 3], seed=s), grammar=parts.grammar,
                     tokenizer=parts.tokenizer, thoughts=True) for s in range(12)]
  _write(tmp_path / "data", parts, parts.image_hw, parts.loop_cfg.n_img_tokens, eps)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

  def run(workdir):
    cmd = [os.path.join(root, ".venv", "bin", "python"), "-m", "experiments.sft", "--config",
           "experiments/configs/miniwob_pipeline.py:thoughts+smoke", f"--workdir={workdir}",
           f"--config.sft.data=('{tmp_path / 'data'}',)", "--config.sft.eval_every=0", "--config.sft.steps=4",
           "--config.sft.ckpt_every=2"]
    p = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout

  run(tmp_path / "a")
  full = read_metrics(str(tmp_path / "a"))
  shutil.copytree(tmp_path / "a", tmp_path / "b")
  shutil.rmtree(tmp_path / "b" / "checkpoints" / "4")  # as if killed after the step-2 checkpoint
  assert "resumed from" in run(tmp_path / "b")
  resumed = read_metrics(str(tmp_path / "b"))
  assert [r["step"] for r in resumed] == [1, 2, 3, 4]
  for a, b in zip(full, resumed):
    assert a["train/ce"] == b["train/ce"] and a["train/tokens"] == b["train/tokens"]


def _long_run(parts, tmp_path, *flags):
  """(repo root, command) of experiments/sft.py for 3 000 steps on 8 one-turn episodes written under
  `tmp_path / 'data'`, into `tmp_path / 'run'`, with `flags` appended: runs stopped before their count."""
  import os
  eps = [sft.prepare(_episode(parts, REPLIES[:1], seed=s), grammar=parts.grammar, tokenizer=parts.tokenizer,
                     thoughts=True) for s in range(8)]
  _write(tmp_path / "data", parts, parts.image_hw, parts.loop_cfg.n_img_tokens, eps)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return root, [os.path.join(root, ".venv", "bin", "python"), "-m", "experiments.sft", "--config",
                "experiments/configs/miniwob_pipeline.py:thoughts+smoke", f"--workdir={tmp_path / 'run'}",
                f"--config.sft.data=('{tmp_path / 'data'}',)", "--config.sft.steps=3000", *flags]


@pytest.mark.long  # ~1.5 min: compiles twice
def test_sigterm_checkpoints_at_the_next_step_and_the_same_command_continues_there(parts, tmp_path):
  """SIGTERM (pkill, pre-emption, a session's end) stops experiments/sft.py at its next step with a
  checkpoint there, not at its last periodic one (every 1 000 steps here), and exit status 128 + SIGTERM
  naming the step; the same command resumes from that step."""
  import os
  import signal
  import subprocess
  import time
  root, cmd = _long_run(parts, tmp_path, "--config.sft.eval_every=0", "--config.sft.ckpt_every=1000",
                        "--config.sft.log_every=1")
  p = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 600  # only so a broken test cannot hang
    while not (os.path.exists(tmp_path / "run" / "metrics.jsonl") and len(read_metrics(str(tmp_path / "run"))) >= 3):
      assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:] if p.poll() is not None else ""
      time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
  finally:
    if p.poll() is None:
      p.kill()
  assert p.returncode == 128 + signal.SIGTERM, out[-2000:] + err[-2000:]
  m = re.search(r"Terminated: \[sft\] SIGTERM received: stopped at step (\d+) of 3000", err)
  assert m, err[-3000:]
  ended = int(m.group(1))
  assert 3 <= ended < 1000 and ckpt.manager(str(tmp_path / "run")).latest_step() == ended
  again = subprocess.run(cmd[:-4] + [f"--config.sft.steps={ended + 2}", "--config.sft.eval_every=0"], cwd=root,
                         capture_output=True, text=True, timeout=900)
  assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
  assert f"resumed from {tmp_path / 'run' / 'checkpoints'}/{ended}" in again.stdout, again.stdout[-2000:]
  assert ckpt.manager(str(tmp_path / "run")).latest_step() == ended + 2


@pytest.mark.long  # ~2 min: compiles, two sandbox evaluations
@pytest.mark.browser
def test_wall_clock_guard_excludes_evaluations_stops_loudly_and_the_same_command_continues(parts, tmp_path):
  """`sft.max_minutes` guards a process's training time after a sandbox evaluation too (the evaluation's
  own time is left out): a 0.4-minute guard stops a 3 000-step run with exit status `EXIT_TRIPPED`, naming the
  stage and the step reached, after checkpointing it; the same command again resumes there and makes more."""
  import subprocess
  from tars_jax.train.guard import EXIT_TRIPPED
  root, cmd = _long_run(parts, tmp_path, "--config.sft.max_minutes=0.4", "--config.sft.eval_every=3000",
                        "--config.sft.eval_episodes=2", "--config.sft.ckpt_every=1000")
  p = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=900)
  assert p.returncode == EXIT_TRIPPED, p.stdout[-2000:] + p.stderr[-2000:]
  m = re.search(r"\[sft\] wall-clock guard of 0.4 min tripped at step (\d+) of 3000", p.stderr)
  assert m, p.stderr[-3000:]
  ended = int(m.group(1))
  rows = read_metrics(str(tmp_path / "run"))
  assert "eval/miniwob/click-test/success" in rows[0]  # the step-0 evaluation ran before training
  assert 0 < ended < 3000 and ckpt.manager(str(tmp_path / "run")).latest_step() == ended
  again = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=900)
  assert f"resumed from {tmp_path / 'run' / 'checkpoints'}/{ended}" in again.stdout, again.stdout[-2000:]
  later = int(re.search(r"tripped at step (\d+) of 3000", again.stderr).group(1))
  assert later > ended and ckpt.manager(str(tmp_path / "run")).latest_step() == later
