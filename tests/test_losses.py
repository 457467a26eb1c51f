"""PPO / value / entropy / KL / aggregation losses against values worked by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tars_jax.rl import losses as L
from tars_jax.rl.metrics import explained_variance, masked_corr


def test_ppo_clip_cases_by_hand():
  # ratios 1.5, 0.5, 1.1, 0.7 with advantages +1, -1, +1, +1; clip_low 0.2, clip_high 0.28
  old = jnp.zeros((1, 4))
  logp = jnp.log(jnp.array([[1.5, 0.5, 1.1, 0.7]]))
  adv = jnp.array([[1.0, -1.0, 1.0, 1.0]])
  mask = jnp.ones((1, 4))
  loss, m = L.ppo_policy_loss(logp, old, adv, mask, 0.2, 0.28)
  # per-token max(-A r, -A clip(r)): -1.28, 0.8, -1.1, -0.7
  assert float(loss) == pytest.approx((-1.28 + 0.8 - 1.1 - 0.7) / 4, abs=1e-5)
  assert float(m["clipfrac"]) == pytest.approx(0.5)  # tokens 0 and 1 clipped
  assert float(m["clipfrac_high"]) == pytest.approx(0.25) and float(m["clipfrac_low"]) == pytest.approx(0.25)
  assert float(m["approx_kl"]) == pytest.approx(-np.mean(np.log([1.5, 0.5, 1.1, 0.7])), abs=1e-5)


def test_dual_clip_bounds_negative_advantage_loss():
  logp = jnp.log(jnp.array([[10.0]])); old = jnp.zeros((1, 1)); adv = jnp.array([[-1.0]])
  loss, m = L.ppo_policy_loss(logp, old, adv, jnp.ones((1, 1)), 0.2, 0.2, clip_c=3.0)
  assert float(loss) == pytest.approx(3.0) and float(m["dual_clipfrac"]) == 1.0
  loss, _ = L.ppo_policy_loss(logp, old, adv, jnp.ones((1, 1)), 0.2, 0.2)
  assert float(loss) == pytest.approx(10.0)


def test_masked_tokens_do_not_count():
  logp = jnp.array([[0.0, 5.0]]); adv = jnp.array([[1.0, 100.0]])
  loss, _ = L.ppo_policy_loss(logp, jnp.zeros((1, 2)), adv, jnp.array([[1.0, 0.0]]))
  assert float(loss) == pytest.approx(-1.0)


def test_value_loss_by_hand():
  v = jnp.array([[1.0, 0.0]]); old = jnp.array([[0.0, 0.0]]); ret = jnp.array([[2.0, 1.0]])
  loss, m = L.value_loss(v, old, ret, jnp.ones((1, 2)), clip=0.5)
  # token0: unclipped (1-2)^2=1, clipped (0.5-2)^2=2.25 -> 2.25; token1: 1 and 1 -> 1
  assert float(loss) == pytest.approx(0.5 * (2.25 + 1) / 2)
  assert float(m["vf_clipfrac"]) == pytest.approx(0.5)
  loss, _ = L.value_loss(v, old, ret, jnp.ones((1, 2)))
  assert float(loss) == pytest.approx(0.5)


def test_entropy_uniform_over_allowed_and_single_token():
  logits = jnp.zeros((1, 2, 5))
  allowed = jnp.array([[[1, 1, 1, 0, 0], [0, 0, 1, 0, 0]]], bool)
  ent = L.entropy(logits, jnp.ones((1, 2)), allowed)
  np.testing.assert_allclose(ent, [[np.log(3), 0.0]], atol=1e-6)
  g = jax.grad(lambda z: L.entropy(z, jnp.ones((1, 2)), allowed).sum())(logits)
  assert np.isfinite(np.asarray(g)).all()


def test_kl_kinds_by_hand():
  logp, ref = jnp.array([-1.0]), jnp.array([-2.0])
  assert float(L.kl_penalty(logp, ref, "k1")[0]) == pytest.approx(1.0)
  assert float(L.kl_penalty(logp, ref, "k2")[0]) == pytest.approx(0.5)
  assert float(L.kl_penalty(logp, ref, "k3")[0]) == pytest.approx(np.exp(-1) + 1 - 1)
  assert float(L.kl_penalty(ref, logp, "abs")[0]) == pytest.approx(1.0)
  with pytest.raises(ValueError):
    L.kl_penalty(logp, ref, "k9")


def test_aggregation_modes_by_hand():
  loss = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
  mask = jnp.array([[1, 1, 0], [1, 0, 0.0]])
  assert float(L.aggregate(loss, mask, "token-mean")) == pytest.approx((1 + 2 + 4) / 3)
  assert float(L.aggregate(loss, mask, "seq-mean-token-sum")) == pytest.approx((3 + 4) / 2)
  assert float(L.aggregate(loss, mask, "seq-mean-token-mean")) == pytest.approx((1.5 + 4) / 2)
  assert float(L.aggregate(loss, mask, "seq-mean-token-sum-norm")) == pytest.approx(7 / 6)
  with pytest.raises(ValueError):
    L.aggregate(loss, mask, "nope")


def test_explained_variance_and_corr():
  ret = jnp.array([[1.0, 2.0, 3.0, 4.0]]); m = jnp.ones((1, 4))
  assert float(explained_variance(ret, ret, m)) == pytest.approx(1.0)
  assert float(explained_variance(ret, jnp.full((1, 4), 2.5), m)) == pytest.approx(0.0, abs=1e-6)
  assert float(masked_corr(ret, -2 * ret, m)) == pytest.approx(-1.0, abs=1e-5)
