"""Issue #4 public RL API: GAE against rlax's published numbers, bad input (NaN/inf positions, empty
rows, unknown names), reward shaping by hand (DAPO overlong ramp, step budget)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tars_jax.rl import advantages as A
from tars_jax.rl import losses as L
from tars_jax.rl.checks import NonFiniteError, check_finite
from tars_jax.rl.metrics import explained_variance
from tars_jax.rl.rewards import RewardConfig, overlong_penalty, thought_of, turn_reward_terms
from experiments.configs import miniwob_ppo
from tars_jax.train import ppo
from tars_jax.train import state as state_lib


def _hp(**overrides) -> ppo.PPOHparams:
  """The smoke config's hyper-parameters (PPOHparams has no defaults) with `overrides`; replace()
  runs the validation again."""
  return dataclasses.replace(state_lib.hparams(miniwob_ppo.get_config("smoke")), **overrides)

# ---------------------------------------------------------------- GAE vs rlax's test numbers

# rlax `multistep_test.py::TruncatedGeneralizedAdvantageEstimationTest`: r_t, v_t (T+1 values, the
# last one bootstraps), per-step discounts, expected advantages for three lambdas. Row 2 has
# discount 0 after step 3 (an episode boundary). Our `gae` has one gamma per row and value 0 after
# the last token, so: the bootstrap folds into the last reward (r + gamma * v_T), and row 2 is split
# at its boundary into two rows with gamma 0.9.
_RLAX_EXPECTED = {
    1.0: [[-1.45118, -4.4557, 2.5396, 0.5249, -0.49], [3.0, 2.0, 1.0, 0.0, -4.9]],
    0.7: [[-0.676979, -5.248167, 2.4846, 0.6704, -0.49], [2.2899, 1.73, 1.0, 0.0, -4.9]],
    0.4: [[0.56731, -6.042, 2.3431, 0.815, -0.49], [1.725, 1.46, 1.0, 0.0, -4.9]],
}


@pytest.mark.parametrize("lam", sorted(_RLAX_EXPECTED))
def test_gae_reproduces_rlax_truncated_gae(lam):
  r = np.array([[0.0, 0.0, 1.0, 0.0, -0.5 + 0.99 * -1.0],  # row 1, bootstrap v_T = -1 folded in
                [0.0, 0.0, 0.0, 0.0, 0.0],  # row 2, steps 0..3 (terminal after step 3)
                [1.0 + 0.9 * -1.0, 0.0, 0.0, 0.0, 0.0]])  # row 2, step 4 (bootstrap -1)
  v = np.array([[1.0, 4.0, -3.0, -2.0, -1.0], [-3.0, -2.0, -1.0, 0.0, 0.0], [5.0, 0.0, 0.0, 0.0, 0.0]])
  m = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]], np.float32)
  gamma = np.array([0.99, 0.9, 0.9])
  lam_rows = np.full((3,), lam)  # per-sequence [B] lambda path
  adv, ret = jax.jit(A.gae)(r, v, m, gamma, lam_rows)
  want = np.array(_RLAX_EXPECTED[lam])
  np.testing.assert_allclose(adv[0], want[0], atol=1e-3)
  np.testing.assert_allclose(adv[1, :4], want[1, :4], atol=1e-3)
  np.testing.assert_allclose(adv[2, 0], want[1, 4], atol=1e-3)
  # returns = lambda-returns, from their own recursion (Sutton & Barto eq. 12.18; value 0 after the
  # last token): G_t = r_t + gamma ((1 - lam) V_{t+1} + lam G_{t+1})
  for i, n in enumerate(m.sum(-1).astype(int)):
    g, want_ret = 0.0, np.zeros(n)
    for t in reversed(range(n)):
      v_next = v[i, t + 1] if t + 1 < n else 0.0
      g = r[i, t] + gamma[i] * ((1 - lam) * v_next + lam * g) if t + 1 < n else r[i, t]
      want_ret[t] = g
    np.testing.assert_allclose(ret[i, :n], want_ret, atol=1e-5)
  adv_scalar, _ = A.gae(r, v, m, gamma, lam)  # scalar lambda gives the same
  np.testing.assert_allclose(adv_scalar, adv, atol=1e-6)


# ---------------------------------------------------------------- bad input


def test_check_finite_names_positions():
  r = np.zeros((2, 4), np.float32)
  r[1, 2] = np.nan
  r[0, 3] = np.inf
  with pytest.raises(NonFiniteError) as e:
    check_finite(rewards=r, values=np.zeros(3))
  assert e.value.name == "rewards" and e.value.count == 2
  assert [p for p, _ in e.value.positions] == [(0, 3), (1, 2)]
  assert "rewards[0,3]=inf" in str(e.value) and "rewards[1,2]=nan" in str(e.value)
  with pytest.raises(NonFiniteError, match=r"values\[1\]=-inf"):
    check_finite(rewards=np.zeros(2), values=jnp.array([0.0, -jnp.inf]))
  check_finite(rewards=np.ones((2, 2)), ids=np.arange(3))  # finite / integer arrays pass
  with pytest.raises(NonFiniteError, match=r"and 2 more"):
    check_finite(max_shown=1, x=np.full(3, np.nan))


def test_ppo_update_rejects_nan_rewards_before_training():
  batch = {"rewards": np.array([[0.0, np.nan]], np.float32), "old_logp": np.zeros((1, 2), np.float32)}
  with pytest.raises(NonFiniteError, match=r"rewards\[0,1\]=nan"):
    ppo.ppo_update({}, batch, None, policy_gd=None, critic_gd=None, popt=None, copt=None,
                   hp=_hp(), inputs=None, epochs=1, minibatch_size=1, rng=np.random.default_rng(0), n_real=1)


@pytest.mark.parametrize("agg", L.AGG_MODES)
def test_row_without_model_tokens_gives_zero_loss_not_nan(agg):
  rng = np.random.default_rng(0)
  lp, old, adv = rng.normal(size=(2, 5)) - 1, rng.normal(size=(2, 5)) - 1, rng.normal(size=(2, 5))
  mask = np.array([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0]], np.float32)
  pol = lambda x: L.ppo_policy_loss(x, old, adv, mask, 0.2, 0.28, 3.0, agg)[0]
  val = lambda x: L.value_loss(x, old, adv, mask, 0.2, agg)[0]
  for fn in (pol, val):
    loss, g = jax.value_and_grad(fn)(jnp.asarray(lp))
    assert np.isfinite(float(loss)) and np.isfinite(np.asarray(g)).all()
    np.testing.assert_array_equal(np.asarray(g)[1], 0.0)  # the empty row gets no gradient
    # the empty row adds nothing (seq-mean modes count it as a sequence of loss 0, as verl)
    one = {"pol": lambda x: L.ppo_policy_loss(x[:1], old[:1], adv[:1], mask[:1], 0.2, 0.28, 3.0, agg)[0],
           "val": lambda x: L.value_loss(x[:1], old[:1], adv[:1], mask[:1], 0.2, agg)[0]}
    want = float((one["pol"] if fn is pol else one["val"])(jnp.asarray(lp)))
    scale = 0.5 if agg in ("seq-mean-token-sum", "seq-mean-token-mean") else 1.0
    assert float(loss) == pytest.approx(want * scale, rel=1e-5, abs=1e-6)
  # every row empty: loss and metrics 0, never NaN
  z = np.zeros_like(mask)
  loss, m = L.ppo_policy_loss(lp, old, adv, z, agg=agg)
  assert float(loss) == 0.0 and all(np.isfinite(float(v)) for v in m.values())
  adv0, ret0 = A.gae(adv, lp, z, 1.0, 0.95)
  assert np.isfinite(np.asarray(A.masked_whiten(adv0, z))).all() and float(explained_variance(ret0, lp, z)) == 0.0


def test_unknown_names_list_the_known_ones():
  with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
    L.aggregate(jnp.ones((1, 2)), jnp.ones((1, 2)), "token-sum")
  with pytest.raises(ValueError, match=r"'k1', 'k2', 'k3', 'abs'"):
    L.kl_penalty(jnp.zeros(2), jnp.zeros(2), "k4")
  with pytest.raises(ValueError, match=r"unknown rl.algo 'a2c'.*'drgrpo'"):
    _hp(algo="a2c")
  with pytest.raises(ValueError, match=r"unknown rl.loss_agg 'sum'.*'token-mean'"):
    _hp(loss_agg="sum")
  with pytest.raises(ValueError, match=r"unknown rl.kl_kind 'js'.*'abs'"):
    _hp(kl_kind="js")
  assert _hp(kl_kind="low_var_kl").kl_kind == "low_var_kl"  # verl alias accepted
  for bad in (dict(clip_c=1.0), dict(length_adaptive_alpha=0.0), dict(lam_policy=1.5), dict(kl_coef=-1),
              dict(top_entropy_frac=0.0), dict(top_entropy_frac=1.5)):
    with pytest.raises(ValueError):
      _hp(**bad)


# ---------------------------------------------------------------- length-adaptive lambda in the update


def test_compute_advantages_uses_per_sequence_length_adaptive_lambda():
  rng = np.random.default_rng(1)
  r, v = rng.normal(size=(3, 10)), rng.normal(size=(3, 10))
  m = np.zeros((3, 10), np.float32)
  m[0, :8], m[1, 2:4], m[1, 6:9] = 1, 1, 1  # 8 and 5 model tokens; row 2 empty (padding)
  batch = {"rewards": jnp.asarray(r), "loss_mask": jnp.asarray(m)}
  hp = _hp(gamma=0.9, lam_critic=1.0, length_adaptive_alpha=0.5, whiten_advantages=False)
  lam = [1 - 1 / 4, 1 - 1 / 2.5, 0.0]  # 1 - 1/(0.5 * 8), 1 - 1/(0.5 * 5)
  np.testing.assert_allclose(ppo.policy_lambda(jnp.asarray(m), hp), lam, atol=1e-6)
  adv, ret = ppo.compute_advantages(jnp.asarray(v), batch, hp, jnp.asarray(m))
  want_adv, _ = A.gae(r, v, m, 0.9, np.array(lam))
  _, want_ret = A.gae(r, v, m, 0.9, 1.0)
  np.testing.assert_allclose(adv, want_adv * m, atol=1e-5)
  np.testing.assert_allclose(ret, want_ret * m, atol=1e-5)
  off = _hp(gamma=0.9, lam_policy=0.3, lam_critic=1.0, whiten_advantages=False)
  np.testing.assert_allclose(ppo.compute_advantages(jnp.asarray(v), batch, off, jnp.asarray(m))[0],
                             A.gae(r, v, m, 0.9, 0.3)[0] * m, atol=1e-5)


# ---------------------------------------------------------------- reward shaping


def test_overlong_penalty_dapo_ramp_by_hand():
  # L_max = 20, L_cache = 8: free up to 12, linear to -1 at 20, -1 beyond
  got = [overlong_penalty(n, 20, 8) for n in (0, 12, 13, 16, 20, 21, 100)]
  assert got == pytest.approx([0, 0, -1 / 8, -4 / 8, -1, -1, -1])
  assert overlong_penalty(50, 0, 0) == 0.0  # off
  assert [overlong_penalty(n, 10, 0) for n in (10, 11)] == [0.0, -1.0]  # hard cut


def test_thought_of_replies():
  assert thought_of("Thought: open the menu\nAction: click(start_box='(1,2)')") == "open the menu"
  assert thought_of("Thought: \nAction: wait()") == ""
  assert thought_of("garbage without delimiter") == "garbage without delimiter"


def test_turn_reward_terms_all_terms():
  cfg = RewardConfig(outcome_weight=2.0, format_penalty=-0.2, truncation_reward=-1.0, step_penalty=-0.05,
                     overlong_weight=0.5, overlong_max_tokens=20, overlong_buffer=8)
  t = turn_reward_terms(0.75, invalid=True, truncated=True, cfg=cfg, thought_tokens=16)
  assert t["outcome"] == pytest.approx(1.5) and t["format"] == pytest.approx(-0.2)
  assert t["overlong"] == pytest.approx(0.5 * -0.5) and t["step"] == pytest.approx(-0.05)
  assert t["truncation"] == -1.0
  assert t["total"] == pytest.approx(1.5 - 0.2 - 0.25 - 0.05 - 1.0)
  t = turn_reward_terms(1.0, False, False, cfg, thought_tokens=3)
  assert t["total"] == pytest.approx(2.0 - 0.05) and t["overlong"] == 0.0
  with pytest.raises(ValueError, match="not finite"):
    turn_reward_terms(float("nan"), False, False, cfg)
  with pytest.raises(ValueError, match="overlong_buffer"):
    RewardConfig(overlong_max_tokens=4, overlong_buffer=5)


def test_success_outcome_scores_every_failure_alike():
  # MiniWoB: success +0.8 (time-discounted), a wrong click -1, the agent's own `finished` 0, time-out
  raw, succ = RewardConfig(), RewardConfig(outcome="success", outcome_weight=2.0, truncation_reward=0.0)
  assert [turn_reward_terms(r, False, False, raw)["total"] for r in (0.8, -1.0, 0.0)] == [0.8, -1.0, 0.0]
  assert [turn_reward_terms(r, False, False, succ)["total"] for r in (0.8, -1.0, 0.0)] == [2.0, 0.0, 0.0]
  assert turn_reward_terms(0.0, False, True, succ)["total"] == 0.0  # a time-out: also 0
  assert turn_reward_terms(0.0, True, False, succ)["format"] == -0.1  # the format penalty stays
  with pytest.raises(ValueError, match="outcome"):
    RewardConfig(outcome="binary")
