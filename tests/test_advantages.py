"""GAE and group advantages against a plain-Python port of verl's semantics and hand-worked values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tars_jax.rl import advantages as A


def verl_gae_reference(rewards, values, mask, gamma, lam):
  """Loop port of verl `compute_gae_advantage_return` (multi-turn, response-mask version)."""
  b, t = rewards.shape
  adv = np.zeros((b, t))
  for i in range(b):
    nextvalues, lastgaelam = 0.0, 0.0
    for k in reversed(range(t)):
      delta = rewards[i, k] + gamma * nextvalues - values[i, k]
      lastgaelam_ = delta + gamma * lam * lastgaelam
      nextvalues = values[i, k] * mask[i, k] + (1 - mask[i, k]) * nextvalues
      lastgaelam = lastgaelam_ * mask[i, k] + (1 - mask[i, k]) * lastgaelam
      adv[i, k] = lastgaelam
  return adv, adv + values


def test_single_turn_gamma1_lam1_is_return_minus_value():
  r = np.array([[0, 0, 0, 1.0]])
  v = np.array([[0.1, 0.2, 0.3, 0.4]])
  m = np.ones((1, 4))
  adv, ret = A.gae(r, v, m, 1.0, 1.0)
  np.testing.assert_allclose(adv, [[0.9, 0.8, 0.7, 0.6]], atol=1e-6)
  np.testing.assert_allclose(ret, [[1, 1, 1, 1]], atol=1e-6)


def test_lam0_is_one_step_td():
  r = np.array([[0.0, 0.5, 1.0]])
  v = np.array([[0.2, 0.4, 0.8]])
  adv, _ = A.gae(r, v, np.ones((1, 3)), 0.9, 0.0)
  # delta_t = r_t + 0.9 V_{t+1} - V_t, V_3 = 0
  np.testing.assert_allclose(adv, [[0.9 * 0.4 - 0.2, 0.5 + 0.9 * 0.8 - 0.4, 1.0 - 0.8]], atol=1e-6)


def test_two_turns_values_carry_across_observation_gap():
  # tokens: [a a | o o | a a], reward 1 at the end; gamma=1, lam=1
  r = np.array([[0, 0, 0, 0, 0, 1.0]])
  v = np.array([[0.5, 0.6, 9.0, 9.0, 0.7, 0.8]])  # observation values must be ignored
  m = np.array([[1, 1, 0, 0, 1, 1.0]])
  adv, ret = A.gae(r, v, m, 1.0, 1.0)
  np.testing.assert_allclose(adv[0, [0, 1, 4, 5]], [0.5, 0.4, 0.3, 0.2], atol=1e-6)
  # lam = 0.5, gamma = 1: delta at token 1 uses V of token 4 (next *model* token)
  adv, _ = A.gae(r, v, m, 1.0, 0.5)
  d5, d4, d1, d0 = 1 - 0.8, 0.8 - 0.7, 0.7 - 0.6, 0.6 - 0.5
  a5 = d5; a4 = d4 + 0.5 * a5; a1 = d1 + 0.5 * a4; a0 = d0 + 0.5 * a1
  np.testing.assert_allclose(adv[0, [0, 1, 4, 5]], [a0, a1, a4, a5], atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.integers(1, 12), st.floats(0.5, 1.0), st.floats(0.0, 1.0), st.integers(0, 10_000))
def test_gae_matches_verl_reference(b, t, gamma, lam, seed):
  rng = np.random.default_rng(seed)
  r, v = rng.normal(size=(b, t)), rng.normal(size=(b, t))
  m = (rng.random((b, t)) < 0.6).astype(np.float64)
  want_adv, want_ret = verl_gae_reference(r, v, m, gamma, lam)
  adv, ret = A.gae(r, v, m, gamma, lam)
  np.testing.assert_allclose(adv, want_adv, atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(ret, want_ret, atol=1e-4, rtol=1e-4)


def test_per_sequence_lambda_equals_rowwise_and_jit_vmap():
  rng = np.random.default_rng(0)
  r, v = rng.normal(size=(3, 7)), rng.normal(size=(3, 7))
  m = (rng.random((3, 7)) < 0.7).astype(np.float32)
  lams = np.array([0.0, 0.5, 0.99])
  adv, _ = jax.jit(A.gae)(r, v, m, 1.0, lams)
  for i in range(3):
    row, _ = A.gae(r[i:i + 1], v[i:i + 1], m[i:i + 1], 1.0, lams[i])
    np.testing.assert_allclose(adv[i], row[0], atol=1e-5)
  batched = jax.vmap(lambda r_, v_, m_: A.gae(r_, v_, m_, 1.0, 0.9)[0])(r[:, None], v[:, None], m[:, None])
  np.testing.assert_allclose(batched[:, 0], A.gae(r, v, m, 1.0, 0.9)[0], atol=1e-5)


def test_decoupled_gae_uses_both_lambdas():
  r = np.array([[0, 0, 1.0]]); v = np.array([[0.2, 0.3, 0.4]]); m = np.ones((1, 3))
  adv, ret = A.decoupled_gae(r, v, m, 1.0, 0.0, 1.0)
  np.testing.assert_allclose(adv, A.gae(r, v, m, 1.0, 0.0)[0], atol=1e-6)
  np.testing.assert_allclose(ret, [[1, 1, 1]], atol=1e-6)  # lam_critic=1: Monte-Carlo returns


def test_length_adaptive_lambda():
  np.testing.assert_allclose(A.length_adaptive_lambda(np.array([100.0, 1000.0]), 0.05),
                             [0.8, 0.98], atol=1e-6)
  assert float(A.length_adaptive_lambda(np.array([10.0]), 0.05)[0]) == 0.0  # 1 - 2 clipped to 0


def test_masked_whiten_and_var():
  x = jnp.array([[1.0, 2.0, 100.0, 3.0]]); m = jnp.array([[1, 1, 0, 1.0]])
  assert float(A.masked_var(x, m)) == pytest.approx(1.0)  # var of 1,2,3 unbiased
  w = A.masked_whiten(x, m)
  np.testing.assert_allclose(np.asarray(w)[0, [0, 1, 3]], [-1, 0, 1], atol=1e-4)


def test_grpo_and_rloo_by_hand():
  scores = jnp.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
  gid = jnp.array([0, 0, 0, 1, 1, 2])
  g = A.grpo_advantages(scores, gid)
  std0 = np.std([1, 0, 0], ddof=1)
  np.testing.assert_allclose(g[:3], np.array([2 / 3, -1 / 3, -1 / 3]) / (std0 + 1e-6), rtol=1e-5)
  np.testing.assert_allclose(g[3:], [0, 0, 0], atol=1e-6)
  np.testing.assert_allclose(A.grpo_advantages(scores, gid, normalize_std=False)[:3], [2 / 3, -1 / 3, -1 / 3],
                             atol=1e-6)
  r = A.rloo_advantages(scores, gid)
  np.testing.assert_allclose(r, [1.0, -0.5, -0.5, 0.0, 0.0, 0.0], atol=1e-6)
