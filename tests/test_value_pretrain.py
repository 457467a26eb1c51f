"""Value pretraining (critic only, lambda = 1, stop rule, critic checkpoint) and the KL-to-reference
term of the update, on the smoke model with a hand-built batch (the real end-to-end run with the
sandbox is in test_ablations.py, `-m long`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.configs import miniwob_ppo
from tars_jax.train import checkpoint as ckpt
from tars_jax.train import ppo
from tars_jax.train import state as state_lib
from tars_jax.train import value_pretrain as vpt


def _parts(**rl):
  cfg = miniwob_ppo.get_config("smoke")
  cfg.rl.update(rl)
  return state_lib.build(cfg), cfg


def _batch(parts, cfg, rewards, b=4, t=128):
  """Rows with distinct random screenshots; 10 model tokens each, `rewards[i]` on the last one."""
  rng = np.random.default_rng(0)
  h, w = parts.image_hw
  n_img = parts.model_cfg.n_img_tokens
  tok = np.full((b, t), 65, np.int32)
  tok[:, 0] = parts.tokenizer.bos_id
  tok[:, 8:8 + n_img] = parts.tokenizer.image_id
  loss = np.zeros((b, t - 1), np.float32)
  loss[:, 80:90] = 1.0
  rew = np.zeros((b, t - 1), np.float32)
  rew[:, 89] = rewards
  return dict(tokens=tok, attn_mask=np.ones((b, t), bool), loss_mask=loss, rewards=rew,
              old_logp=np.zeros((b, t - 1), np.float32) - 5.0, states=np.zeros((b, t - 1), np.int32),
              pixel_values=rng.random((b, cfg.env.max_turns, h, w, 3), np.float32),
              image_mask=np.ones((b, cfg.env.max_turns), bool))


def test_stop_rule_streak_and_hparams():
  rule = vpt.StopRule(max_value_loss=0.1, min_explained_variance=0.5, patience=2)
  s = 0
  for loss, ev, want in ((0.05, 0.6, 1), (0.2, 0.9, 0), (0.1, 0.5, 1), (0.01, 0.99, 2)):
    s = rule.streak(s, loss, ev)
    assert s == want
  with pytest.raises(ValueError):
    vpt.StopRule(0.1, 0.5, patience=0)
  cfg = miniwob_ppo.get_config("smoke")
  cfg.rl.update(algo="grpo", group_size=2, lam_critic=0.9, value_clip=0.2)
  hp = vpt.pretrain_hparams(state_lib.hparams(cfg))
  assert (hp.algo, hp.lam_critic, hp.value_clip) == ("ppo", 1.0, None)


@pytest.mark.long  # ~30 s
def test_value_update_trains_only_the_critic_on_monte_carlo_returns(tmp_path):
  parts, cfg = _parts()
  full = parts.init_state(0)
  state = vpt.init_critic_state(full["critic"], parts.copt)
  batch = _batch(parts, cfg, [1.0, 1.0, 0.0, 0.0])
  hp = vpt.pretrain_hparams(parts.hparams)
  kw = dict(critic_gd=parts.critic_gd, copt=parts.copt, hp=hp, inputs=parts.inputs, epochs=2, minibatch_size=4,
            rng=np.random.default_rng(0), n_real=4)
  state, m = vpt.value_update(state, batch, **kw)
  # zero-initialised value head: V = 0, returns (gamma = lambda = 1) are 1 on the 20 model tokens of
  # rows 0-1 and 0 on rows 2-3 -> 0.5 * mean(R^2) = 0.5 * 20 / 40
  assert m["fresh_value_loss"] == pytest.approx(0.25, abs=1e-6)
  assert m["return_mean"] == pytest.approx(0.5, abs=1e-6)
  assert int(state["step"]) == 2 and set(state) == {"step", "critic", "critic_opt"}
  for _ in range(3):
    state, m2 = vpt.value_update(state, batch, **kw)
  assert m2["fresh_value_loss"] < 0.25  # the critic learned the returns of these rows
  assert np.isfinite(m2["explained_variance"]) and m2["critic_grad_norm"] > 0

  # checkpoint round trip into a fresh train state (what --config.critic.init does)
  path = ckpt.save_tree(str(tmp_path / "critic"), state["critic"])
  other = parts.init_state(1)
  loaded = state_lib.load_critic(other, path, parts.copt)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               loaded["critic"], state["critic"])
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               loaded["policy"], other["policy"])  # the policy is untouched
  with pytest.raises(FileNotFoundError):
    state_lib.load_critic(other, str(tmp_path / "missing"), parts.copt)


@pytest.mark.long  # ~30 s
def test_kl_to_initial_policy_is_zero_first_then_positive():
  parts, cfg = _parts(kl_coef=0.5, kl_kind="k3")
  assert parts.hparams.kl_coef == 0.5
  state = parts.init_state(0)
  ref = jax.tree.map(jnp.copy, state["policy"])
  batch = _batch(parts, cfg, [1.0, 0.0, 1.0, 0.0])
  kw = dict(policy_gd=parts.policy_gd, critic_gd=parts.critic_gd, popt=parts.popt, copt=parts.copt,
            hp=parts.hparams, inputs=parts.inputs, epochs=1, minibatch_size=4, n_real=4)
  with pytest.raises(ValueError, match="ref_params"):
    ppo.ppo_update(state, batch, None, rng=np.random.default_rng(0), **kw)
  state, m = ppo.ppo_update(state, batch, None, rng=np.random.default_rng(0), ref_params=ref, **kw)
  assert m["kl_ref"] == 0.0  # policy == reference before the first step: k3(0) = 0 exactly
  assert m["policy_grad_norm"] > 0 and "clipfrac_low" in m and "clipfrac_high" in m
  state, m = ppo.ppo_update(state, batch, None, rng=np.random.default_rng(0), ref_params=ref, **kw)
  assert m["kl_ref"] > 0.0


def _vpt(workdir, iterations: int):
  """experiments/value_pretrain.py on the smoke config (real sandbox), `iterations` at most; the stop
  thresholds are out of reach so the iteration count alone ends it."""
  import subprocess
  import sys
  out = subprocess.run(
      [sys.executable, "-m", "experiments.value_pretrain", "--config", "experiments/configs/value_pretrain.py:smoke",
       "--workdir", str(workdir), f"--config.vpt.max_iterations={iterations}", "--config.vpt.ckpt_every=1",
       "--config.vpt.stop_value_loss=0.0", "--config.vpt.stop_explained_variance=2.0"],
      capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return out.stdout


@pytest.mark.long  # ~3 min: three value-pretraining processes with the browser sandbox
def test_a_resumed_value_pretraining_makes_the_updates_of_an_uninterrupted_one(tmp_path):
  """Two iterations, then a re-run asked for three: it resumes at iteration 2 and its critic equals, to
  float tolerance, the critic of one process that ran the three iterations (same rollout seeds, sampling
  keys and minibatch order per iteration)."""
  straight = _vpt(tmp_path / "straight", 3)
  assert "stopped by max_iterations after 3 iterations" in straight
  _vpt(tmp_path / "resumed", 2)
  resumed = _vpt(tmp_path / "resumed", 3)
  assert "resumed from" in resumed and "(iteration 2)" in resumed and "[vpt] it 3:" in resumed and "[vpt] it 2:" not in resumed
  assert "stopped by max_iterations after 3 iterations" in resumed
  from experiments.configs import value_pretrain
  cfg = value_pretrain.get_config("smoke")
  target = state_lib.build(cfg).init_state(cfg.seed)["critic"]
  a = ckpt.restore_tree(str(tmp_path / "straight" / "critic"), target)
  b = ckpt.restore_tree(str(tmp_path / "resumed" / "critic"), target)
  init = jax.tree.leaves(target)
  assert any(not np.allclose(x, y) for x, y in zip(jax.tree.leaves(a), init))  # it trained
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
