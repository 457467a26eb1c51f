"""Group-relative algorithms in the trainer: jobs/groups, episode advantages by hand, and the update
skipping groups without signal."""

import dataclasses

import jax
import numpy as np
import pytest

from experiments.configs import miniwob_ppo
from tars_jax.rl import advantages as adv_lib
from tars_jax.rollout.jobs import group_ids, rollout_jobs
from tars_jax.train import ppo
from tars_jax.train import state as state_lib


def test_rollout_jobs_groups_and_fresh_seeds():
  jobs = rollout_jobs(("a", "b"), 8, 4, it=3, seed_offset=100)
  assert jobs == [("a", 106)] * 4 + [("b", 107)] * 4
  ppo_jobs = rollout_jobs(("a", "b"), 4, 1, it=0, seed_offset=0)
  assert ppo_jobs == [("a", 0), ("b", 1), ("a", 2), ("b", 3)]
  # one group per iteration, four tasks: iterations 0..4 visit c0 c1 c2 c3 c0 (not c0 every time)
  firsts = [rollout_jobs(("c0", "c1", "c2", "c3"), 4, 4, it, 0)[0] for it in range(5)]
  assert firsts == [("c0", 0), ("c1", 1), ("c2", 2), ("c3", 3), ("c0", 4)]
  seen = {s for it in range(5) for _, s in rollout_jobs(("a",), 8, 2, it, 0)}
  assert len(seen) == 5 * 4  # four groups per iteration, never a reused seed
  with pytest.raises(ValueError, match="must divide"):
    rollout_jobs(("a",), 6, 4, 0, 0)


def test_group_ids_by_task_and_seed():
  E = dataclasses.make_dataclass("E", ["task", "seed"])
  eps = [E("a", 1), E("a", 1), E("b", 1), E("a", 2), E("b", 1)]
  np.testing.assert_array_equal(group_ids(eps), [0, 0, 1, 2, 1])


def test_outcome_advantages_by_hand():
  scores = np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], np.float32)
  gid = np.array([0, 0, 0, 0, 1, 1, 1, 1])
  # group 0: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5; group 1: no signal
  np.testing.assert_allclose(ppo.outcome_advantages(scores, gid, "grpo"),
                             [1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0], atol=1e-5)
  np.testing.assert_allclose(ppo.outcome_advantages(scores, gid, "drgrpo"),
                             [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0], atol=1e-6)
  np.testing.assert_allclose(ppo.outcome_advantages(scores, gid, "rloo"),
                             [1.0, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0], atol=1e-6)
  with pytest.raises(ValueError, match="no outcome advantages"):
    ppo.outcome_advantages(scores, gid, "ppo")


def _tiny_parts(algo):
  cfg = miniwob_ppo.get_config("smoke")
  cfg.rl.algo, cfg.rl.group_size = algo, 2
  return state_lib.build(cfg), cfg


def _fake_batch(parts, cfg, b=4, t=128):
  rng = np.random.default_rng(0)
  h, w = parts.image_hw
  n_img = parts.model_cfg.n_img_tokens
  tok = np.full((b, t), 65, np.int32)
  tok[:, 0] = parts.tokenizer.bos_id
  tok[:, 8:8 + n_img] = parts.tokenizer.image_id
  loss = np.zeros((b, t - 1), np.float32)
  loss[:, 80:90] = 1.0
  return dict(tokens=tok, attn_mask=np.ones((b, t), bool), loss_mask=loss,
              rewards=np.zeros((b, t - 1), np.float32), old_logp=np.zeros((b, t - 1), np.float32) - 5.0,
              states=np.zeros((b, t - 1), np.int32),
              pixel_values=rng.random((b, cfg.env.max_turns, h, w, 3), np.float32),
              image_mask=np.ones((b, cfg.env.max_turns), bool))


@pytest.mark.slow  # ~25 s
def test_group_update_skips_groups_without_signal_and_learns_otherwise():
  parts, cfg = _tiny_parts("grpo")
  batch = _fake_batch(parts, cfg)
  gid = np.array([0, 0, 1, 1])
  common = dict(policy_gd=parts.policy_gd, critic_gd=parts.critic_gd, popt=parts.popt, copt=parts.copt,
                hp=parts.hparams, inputs=parts.inputs, epochs=1, minibatch_size=2, n_real=4, group_ids=gid)
  state = parts.init_state(0)
  before = jax.tree.map(np.asarray, state["policy"])
  # every group scores the same: no row carries signal, nothing is updated
  state, out = ppo.ppo_update(state, batch, None, rng=np.random.default_rng(0),
                              scores=np.array([1.0, 1.0, 0.0, 0.0], np.float32), **common)
  assert out["informative_fraction"] == 0.0 and int(state["step"]) == 0
  jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, state["policy"]))
  # one informative group: exactly one minibatch step, and the policy moves
  state, out = ppo.ppo_update(state, batch, None, rng=np.random.default_rng(0),
                              scores=np.array([1.0, 0.0, 0.5, 0.5], np.float32), **common)
  assert out["informative_fraction"] == 0.5 and int(state["step"]) == 1
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), state["policy"], before)
  assert max(jax.tree.leaves(moved)) > 0
  with pytest.raises(ValueError, match="needs episode scores"):
    ppo.ppo_update(state, batch, None, rng=np.random.default_rng(0),
                   **{**common, "group_ids": None}, scores=None)


def test_unknown_algo_rejected():
  with pytest.raises(ValueError, match="unknown rl.algo"):
    _tiny_parts("a2c")


@pytest.mark.parametrize("algo", ["grpo", "drgrpo", "rloo"])
def test_group_algo_refuses_groups_of_one(algo):
  cfg = miniwob_ppo.get_config("smoke")
  cfg.rl.algo, cfg.rl.group_size = algo, 1  # would be REINFORCE on raw returns
  with pytest.raises(ValueError, match="rl.group_size must be >= 2"):
    state_lib.build(cfg)
  cfg.rl.algo = "ppo"  # the critic is the baseline: one episode per seed is right
  assert state_lib.build(cfg).hparams.algo == "ppo"


def test_group_sizes_by_hand():
  np.testing.assert_array_equal(adv_lib.group_sizes(np.array([7, 7, 3, 9, 7, 3])), [3, 3, 2, 1, 3, 2])


@pytest.mark.parametrize("epochs", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_group_update_drops_and_counts_singleton_groups(epochs):
  # Three real episodes: group 0 = (1, 0), group 1 = one episode whose partner was lost (score 1).
  parts, cfg = _tiny_parts("grpo")
  batch = _fake_batch(parts, cfg)  # 4 rows: the last is padding (n_real = 3)
  state, out = ppo.ppo_update(parts.init_state(0), batch, None, policy_gd=parts.policy_gd,
                              critic_gd=parts.critic_gd, popt=parts.popt, copt=parts.copt, hp=parts.hparams, inputs=parts.inputs,
                              epochs=epochs, minibatch_size=2, rng=np.random.default_rng(0), n_real=3,
                              scores=np.array([1.0, 0.0, 1.0, 0.0], np.float32),
                              group_ids=np.array([0, 0, 1, 0], np.int32))
  assert out["groups_dropped_singleton"] == 1
  # group 0: mean 0.5, unbiased std sqrt(0.5): advantages +-0.5 / sqrt(0.5) = +-sqrt(0.5); the
  # singleton gets 0 (not its raw score 1), so |adv| averages 2 sqrt(0.5) / 3 over the 3 episodes
  assert out["advantage_abs_mean"] == pytest.approx(2 * np.sqrt(0.5) / 3, rel=1e-4)
  assert out["informative_fraction"] == pytest.approx(2 / 3)
  # only group 0's two rows are trained: one minibatch of 2 per epoch (three rows would make two)
  assert int(state["step"]) == epochs


@pytest.mark.slow  # ~40 s: two tiny policies, a few compiled update steps each
@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_an_update_raises_the_rewarded_reply_and_lowers_the_other(algo):
  # Two episodes of one group on the same screen; episode 0 wrote bytes "B" and scored 1, episode 1
  # wrote "C" and scored 0. After an on-policy update the rewarded reply is more likely and the
  # other less (the direction of the policy gradient, whatever the advantage estimator).
  parts, cfg = _tiny_parts(algo)
  batch = _fake_batch(parts, cfg, b=2)
  batch["pixel_values"][1] = batch["pixel_values"][0]
  batch["tokens"][0, 81:91], batch["tokens"][1, 81:91] = ord("B"), ord("C")
  batch["rewards"][0, 89], batch["rewards"][1, 89] = 1.0, 0.0
  state = parts.init_state(0)
  logp0 = np.asarray(ppo.reference_logp(state["policy"], batch, None, policy_gd=parts.policy_gd, hp=parts.hparams, inputs=parts.inputs))
  batch["old_logp"] = logp0 * batch["loss_mask"]  # on-policy
  state, _ = ppo.ppo_update(state, batch, None, policy_gd=parts.policy_gd, critic_gd=parts.critic_gd,
                            popt=parts.popt, copt=parts.copt, hp=parts.hparams, inputs=parts.inputs, epochs=4, minibatch_size=2,
                            rng=np.random.default_rng(0), n_real=2, scores=np.array([1.0, 0.0], np.float32),
                            group_ids=np.array([0, 0]))
  logp1 = np.asarray(ppo.reference_logp(state["policy"], batch, None, policy_gd=parts.policy_gd, hp=parts.hparams, inputs=parts.inputs))
  m = batch["loss_mask"] > 0
  gain = [(logp1[i][m[i]] - logp0[i][m[i]]).sum() for i in range(2)]
  assert gain[0] > 0 > gain[1], gain
