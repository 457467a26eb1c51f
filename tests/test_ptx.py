"""PPO-ptx (Ouyang et al. 2022, eq. 2; config rl.ptx_coef): a policy step adds exactly ptx_coef x the SFT
gradient of a demonstration batch, draws one batch per minibatch step, and the trainer resumes the
demonstration stream where it stopped (real demonstrations of the MiniWoB++ experts, real Chromium)."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

from experiments.configs import miniwob_ppo
from tars_jax.train import ppo
from tars_jax.train import sft
from tars_jax.train import state as state_lib
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIG = os.path.join(ROOT, "experiments/configs/replication.py")


def _batch(parts, cfg, b, t, seed, loss_span):
  """A collated batch of b rows of t tokens: random byte tokens, a screenshot per turn slot, the loss on
  `loss_span` (a slice of target positions)."""
  rng = np.random.default_rng(seed)
  h, w = parts.image_hw
  tok = rng.integers(32, 120, (b, t)).astype(np.int32)
  tok[:, 0] = parts.tokenizer.bos_id
  tok[:, 8:8 + parts.model_cfg.n_img_tokens] = parts.tokenizer.image_id
  loss = np.zeros((b, t - 1), np.float32)
  loss[:, loss_span] = 1.0
  return dict(tokens=tok, attn_mask=np.ones((b, t), bool), loss_mask=loss,
              rewards=np.zeros((b, t - 1), np.float32), old_logp=np.zeros((b, t - 1), np.float32) - 5.0,
              states=np.zeros((b, t - 1), np.int32),
              pixel_values=rng.random((b, cfg.env.max_turns, h, w, 3), np.float32),
              image_mask=np.ones((b, cfg.env.max_turns), bool))


@pytest.mark.long  # ~40 s: a tiny policy, two compiled update programs and the reference gradient
def test_a_ptx_step_adds_the_demonstrations_sft_gradient_and_draws_one_batch_per_step():
  cfg = miniwob_ppo.get_config("smoke")
  cfg.rl.algo, cfg.rl.group_size = "grpo", 2
  parts = state_lib.build(cfg)
  batch = _batch(parts, cfg, 4, 128, 0, slice(80, 90))
  demo = {k: v for k, v in _batch(parts, cfg, 2, 128, 1, slice(70, 100)).items() if k not in ("rewards", "old_logp")}
  lr, coef = 0.1, 0.5
  sgd = optax.sgd(lr)  # plain SGD: the step is -lr x the gradient, so the ptx term shows up additively

  def update(ptx_coef, ptx_batches, epochs=1):
    state = parts.init_state(0)
    state = dict(state, policy_opt=sgd.init(state["policy"]))
    hp = dataclasses.replace(parts.hparams, ptx_coef=ptx_coef)
    # one informative group of two rows, minibatches of two: one policy step per epoch
    return ppo.ppo_update(state, batch, None, policy_gd=parts.policy_gd, critic_gd=parts.critic_gd, popt=sgd,
                          copt=parts.copt, hp=hp, inputs=parts.inputs, epochs=epochs, minibatch_size=2,
                          rng=np.random.default_rng(0), n_real=4, group_ids=np.array([0, 0, 1, 1]),
                          scores=np.array([1.0, 0.0, 0.5, 0.5], np.float32), ptx_batches=ptx_batches)

  plain, _ = update(0.0, None)
  with_ptx, out = update(coef, iter([demo]))
  # the reference: the SFT loss's own gradient at the initial policy (train/sft.py), scaled by coef
  # (jitted: one compile instead of op-by-op dispatch of the model's forward and backward)
  params0 = parts.init_state(0)["policy"]
  ce, g = jax.jit(jax.value_and_grad(lambda p: sft.loss_and_metrics(
      p, demo, None, graphdef=parts.policy_gd, inputs=parts.inputs, aux_coef=0.0)[0]))(params0)
  want = jax.tree.map(lambda x: -lr * coef * np.asarray(x), g)
  got = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), with_ptx["policy"], plain["policy"])
  scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(want))
  assert scale > 0
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-3 * scale), got, want)
  assert out["ptx_ce"] == pytest.approx(float(ce), rel=1e-4)

  drawn = []

  def demos():
    while True:
      drawn.append(1)
      yield demo
  update(coef, demos(), epochs=3)
  assert len(drawn) == 3  # one minibatch per epoch, one demonstration batch per minibatch step


def test_ptx_without_demonstrations_or_with_a_negative_coefficient_is_refused():
  hp = state_lib.hparams(miniwob_ppo.get_config("smoke"))
  with pytest.raises(ValueError, match="rl.ptx_coef must be >= 0"):
    dataclasses.replace(hp, ptx_coef=-0.1)
  batch = {"rewards": np.zeros((1, 2), np.float32), "old_logp": np.zeros((1, 2), np.float32)}
  with pytest.raises(ValueError, match="needs ptx_batches"):
    ppo.ppo_update({}, batch, None, policy_gd=None, critic_gd=None, popt=None, copt=None,
                   hp=dataclasses.replace(hp, ptx_coef=1.0), inputs=None, epochs=1, minibatch_size=1,
                   rng=np.random.default_rng(0), n_real=1)


def _run(*args, check=True):
  p = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                     capture_output=True, text=True, timeout=900)
  if check:
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  return p


def _train(workdir, demos, iterations, check=True):
  return _run("experiments.train", "--config", f"{CONFIG}:ppo_kl_ptx+smoke", "--workdir", str(workdir),
              "--config.vpt.enabled=False", f"--config.iterations={iterations}", "--config.ckpt_every=1",
              *([f"--config.rl.ptx_data=('{demos}',)"] if demos else []), check=check)


def _ptx_rows(workdir):
  with open(workdir / "metrics.jsonl") as f:
    return [{k: v for k, v in json.loads(line).items() if k.startswith("train/ptx")} for line in f]


@pytest.mark.long  # ~3 min: the experts' demonstrations, then two smoke trainer runs against real Chromium
@pytest.mark.browser
def test_trainer_trains_on_demonstrations_and_resumes_their_stream(tmp_path):
  from test_resume import _params
  demos = tmp_path / "demos"
  _run("experiments.demos", "--config", f"{CONFIG}:sft+smoke", "--out", str(demos))
  straight = tmp_path / "straight"
  out = _train(straight, demos, 2).stdout
  assert "[train] PPO-ptx: coefficient 1.0" in out
  rows = _ptx_rows(straight)
  assert len(rows) == 2 and all(r["train/ptx_ce"] > 0 for r in rows)
  # the same run stopped after its first checkpoint: resuming must draw the second iteration's demonstrations
  resumed = tmp_path / "resumed"
  shutil.copytree(straight, resumed)
  shutil.rmtree(resumed / "checkpoints" / "2")
  os.remove(resumed / "done.json")
  _train(resumed, demos, 2)
  assert _ptx_rows(resumed) == rows
  a, b = _params(straight), _params(resumed)
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# ~5 s (a fast test): the trainer refuses before it builds the model
def test_trainer_refuses_ptx_without_demonstrations(tmp_path):
  bad = _train(tmp_path / "none", None, 1, check=False)
  assert bad.returncode != 0 and "needs demonstrations" in bad.stderr
