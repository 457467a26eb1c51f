"""Advantage estimators against plain-Python ports of verl's semantics and hand-worked values."""

from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tars_jax.rl import advantages as A


def verl_gae_reference(rewards, values, mask, gamma, lam):
  """Loop port of verl `compute_gae_advantage_return` (multi-turn, response-mask version).

  gamma / lam may be scalars or per-row sequences; no whitening (the caller whitens).
  """
  b, t = rewards.shape
  gammas, lams = np.broadcast_to(gamma, (b,)), np.broadcast_to(lam, (b,))
  adv = np.zeros((b, t))
  for i in range(b):
    g, l = float(gammas[i]), float(lams[i])
    nextvalues, lastgaelam = 0.0, 0.0
    for k in reversed(range(t)):
      delta = rewards[i, k] + g * nextvalues - values[i, k]
      lastgaelam_ = delta + g * l * lastgaelam
      nextvalues = values[i, k] * mask[i, k] + (1 - mask[i, k]) * nextvalues
      lastgaelam = lastgaelam_ * mask[i, k] + (1 - mask[i, k]) * lastgaelam
      adv[i, k] = lastgaelam
  return adv, adv + values


def verl_group_reference(scores, ids, eps=1e-6, normalize_std=True, rloo=False):
  """Dict-loop port of verl `compute_grpo_outcome_advantage` / `compute_rloo_outcome_advantage`."""
  groups = defaultdict(list)
  for s, i in zip(scores, ids):
    groups[i].append(s)
  out = []
  for s, i in zip(scores, ids):
    g = np.array(groups[i])
    n = len(g)
    mean, std = (0.0, 1.0) if n == 1 else (g.mean(), g.std(ddof=1))
    if rloo:
      out.append(s * n / (n - 1) - mean * n / (n - 1) if n > 1 else s)
    else:
      out.append((s - mean) / (std + eps) if normalize_std else s - mean)
  return np.array(out)


# ---------------------------------------------------------------- GAE, hand-worked


def test_single_turn_gamma1_lam1_is_return_minus_value():
  r = np.array([[0, 0, 0, 1.0]])
  v = np.array([[0.1, 0.2, 0.3, 0.4]])
  adv, ret = A.gae(r, v, np.ones((1, 4)), 1.0, 1.0)
  np.testing.assert_allclose(adv, [[0.9, 0.8, 0.7, 0.6]], atol=1e-6)
  np.testing.assert_allclose(ret, [[1, 1, 1, 1]], atol=1e-6)
  assert adv.dtype == jnp.float32 and ret.dtype == jnp.float32


def test_prompt_tokens_before_response_are_skipped():
  # [p p | a a a]: the response's advantages ignore the prompt, prompt positions carry the first one
  r = np.array([[5.0, 5.0, 0, 0, 1.0]])  # rewards on masked tokens are ignored
  v = np.array([[7.0, 7.0, 0.2, 0.3, 0.4]])
  m = np.array([[0, 0, 1, 1, 1.0]])
  adv, ret = A.gae(r, v, m, 1.0, 1.0)
  np.testing.assert_allclose(adv, [[0.8, 0.8, 0.8, 0.7, 0.6]], atol=1e-6)
  np.testing.assert_allclose(ret[0, 2:], [1, 1, 1], atol=1e-6)


def test_lam0_is_one_step_td():
  r = np.array([[0.0, 0.5, 1.0]])
  v = np.array([[0.2, 0.4, 0.8]])
  adv, ret = A.gae(r, v, np.ones((1, 3)), 0.9, 0.0)
  # delta_t = r_t + 0.9 V_{t+1} - V_t, V_3 = 0
  want = [0.9 * 0.4 - 0.2, 0.5 + 0.9 * 0.8 - 0.4, 1.0 - 0.8]
  np.testing.assert_allclose(adv, [want], atol=1e-6)
  np.testing.assert_allclose(ret, [[0.9 * 0.4, 0.5 + 0.9 * 0.8, 1.0]], atol=1e-6)


def test_two_turns_values_carry_across_observation_gap():
  # tokens: [a a | o o | a a], reward 0.3 at the end of turn 1 and 1 at the end; gamma=1, lam=1
  r = np.array([[0, 0.3, 0, 0, 0, 1.0]])
  v = np.array([[0.5, 0.6, 9.0, 9.0, 0.7, 0.8]])  # observation values must be ignored
  m = np.array([[1, 1, 0, 0, 1, 1.0]])
  adv, ret = A.gae(r, v, m, 1.0, 1.0)
  np.testing.assert_allclose(adv[0, [0, 1, 4, 5]], [0.8, 0.7, 0.3, 0.2], atol=1e-6)
  # masked positions hold the carried advantage (that of the next model token), as verl
  np.testing.assert_allclose(adv[0, [2, 3]], [0.3, 0.3], atol=1e-6)
  # lam = 0: token 1's TD error bootstraps from V of token 4 (the next *model* token), not 9.0
  adv, _ = A.gae(r, v, m, 1.0, 0.0)
  np.testing.assert_allclose(adv[0, [0, 1, 4, 5]], [0.6 - 0.5, 0.3 + 0.7 - 0.6, 0.8 - 0.7, 1 - 0.8],
                             atol=1e-6)
  # lam = 0.5, gamma = 0.9: recursion over model tokens only
  adv, _ = A.gae(r, v, m, 0.9, 0.5)
  d5, d4 = 1 - 0.8, 0.9 * 0.8 - 0.7
  d1, d0 = 0.3 + 0.9 * 0.7 - 0.6, 0.9 * 0.6 - 0.5
  a5 = d5; a4 = d4 + 0.45 * a5; a1 = d1 + 0.45 * a4; a0 = d0 + 0.45 * a1
  np.testing.assert_allclose(adv[0, [0, 1, 4, 5]], [a0, a1, a4, a5], atol=1e-6)


def test_fully_masked_row_is_zero_and_leaves_other_rows_alone():
  # row 0 has no model token (a padding row); row 1 is the hand-worked case of
  # test_single_turn_gamma1_lam1_is_return_minus_value
  r = np.array([[1.0, 1.0, 1.0, 1.0], [0, 0, 0, 1.0]])
  v = np.array([[2.0, 2.0, 2.0, 2.0], [0.1, 0.2, 0.3, 0.4]])
  m = np.array([[0, 0, 0, 0], [1, 1, 1, 1.0]])
  adv, ret = A.gae(r, v, m, 1.0, 1.0)
  np.testing.assert_array_equal(adv[0], 0.0)  # no model token: no advantage, whatever r and V hold
  np.testing.assert_allclose(adv[1], [0.9, 0.8, 0.7, 0.6], atol=1e-6)
  np.testing.assert_allclose(ret[1], [1, 1, 1, 1], atol=1e-6)


# ---------------------------------------------------------------- GAE vs the verl port


# One compiled shape for the property tests (keeps them fast); shorter rows are padded with
# mask-0 tokens at the end, which must not change the rows' advantages.
_B, _T = 4, 12
_gae_jit = jax.jit(A.gae)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, _B), st.integers(1, _T), st.floats(0.5, 1.0), st.floats(0.0, 1.0),
       st.floats(0.0, 1.0), st.integers(0, 10_000))
def test_gae_matches_verl_reference(b, t, gamma, lam, p_mask, seed):
  rng = np.random.default_rng(seed)
  r, v = rng.normal(size=(b, t)), rng.normal(size=(b, t))
  m = (rng.random((b, t)) < p_mask).astype(np.float64)
  want_adv, want_ret = verl_gae_reference(r, v, m, gamma, lam)
  pad = lambda x: np.pad(x, ((0, _B - b), (0, _T - t)))
  adv, ret = _gae_jit(pad(r), pad(v), pad(m), gamma, lam)
  np.testing.assert_allclose(adv[:b, :t], want_adv, atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(ret[:b, :t], want_ret, atol=1e-4, rtol=1e-4)
  # bool masks behave like {0, 1} floats
  np.testing.assert_allclose(_gae_jit(pad(r), pad(v), pad(m) > 0, gamma, lam)[0], adv, atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000))
def test_gae_per_row_gamma_and_lambda_match_reference(seed):
  rng = np.random.default_rng(seed)
  r, v = rng.normal(size=(_B, _T)), rng.normal(size=(_B, _T))
  m = (rng.random((_B, _T)) < 0.6).astype(np.float64)
  gammas, lams = rng.uniform(0.5, 1.0, _B), rng.uniform(0.0, 1.0, _B)
  want, _ = verl_gae_reference(r, v, m, gammas, lams)
  np.testing.assert_allclose(_gae_jit(r, v, m, gammas, lams)[0], want, atol=1e-4, rtol=1e-4)


def test_per_sequence_lambda_matches_closed_forms():
  # one batch, one lambda per row, each row against a closed form of Schulman et al. 2016:
  # lam = 0: A_t = delta_t (eq. 11); lam = 1: A_t = sum_l gamma^l r_{t+l} - V_t (eq. 15);
  # lam = 0.5: A_t = sum_l (gamma lam)^l delta_{t+l} (eq. 16); delta_t = r_t + gamma V_{t+1} - V_t,
  # V = 0 after the last model token. Row 2 ends with two padding tokens.
  rng = np.random.default_rng(0)
  r, v = rng.normal(size=(3, 6)), rng.normal(size=(3, 6))
  m = np.ones((3, 6), np.float32)
  m[2, 4:] = 0
  gamma, lams = 0.9, np.array([0.0, 1.0, 0.5])
  adv, _ = jax.jit(A.gae)(r, v, m, gamma, lams)
  for i, lam in enumerate(lams):
    n = int(m[i].sum())
    v_next = np.append(v[i, 1:n], 0.0)
    delta = r[i, :n] + gamma * v_next - v[i, :n]
    if lam == 1.0:
      want = [sum(gamma ** l * r[i, t + l] for l in range(n - t)) - v[i, t] for t in range(n)]
    else:
      want = [sum((gamma * lam) ** l * delta[t + l] for l in range(n - t)) for t in range(n)]
    np.testing.assert_allclose(adv[i, :n], want, atol=1e-5)


def test_gae_jit_and_vmap_over_leading_axis_equals_loop():
  rng = np.random.default_rng(1)
  r, v = rng.normal(size=(4, 3, 6)), rng.normal(size=(4, 3, 6))
  m = (rng.random((4, 3, 6)) < 0.6).astype(np.float32)
  lams = rng.uniform(0.0, 1.0, (4, 3))
  adv, ret = jax.jit(jax.vmap(lambda *a: A.gae(*a[:3], 0.99, a[3])))(r, v, m, lams)
  for n in range(4):
    want_adv, want_ret = verl_gae_reference(r[n], v[n], m[n], 0.99, lams[n])
    np.testing.assert_allclose(adv[n], want_adv, atol=1e-5)
    np.testing.assert_allclose(ret[n], want_ret, atol=1e-5)


# ---------------------------------------------------------------- decoupled / length-adaptive


def test_decoupled_gae_uses_both_lambdas():
  r = np.array([[0, 0, 1.0]]); v = np.array([[0.2, 0.3, 0.4]]); m = np.ones((1, 3))
  adv, ret = A.decoupled_gae(r, v, m, 1.0, 0.0, 1.0)
  np.testing.assert_allclose(adv, [[0.3 - 0.2, 0.4 - 0.3, 1 - 0.4]], atol=1e-6)  # TD errors
  np.testing.assert_allclose(ret, [[1, 1, 1]], atol=1e-6)  # lam_critic=1: Monte-Carlo returns
  adv, ret = jax.jit(A.decoupled_gae)(r, v, m, 1.0, 1.0, 0.0)
  np.testing.assert_allclose(adv, [[0.8, 0.7, 0.6]], atol=1e-6)
  np.testing.assert_allclose(ret, [[0.3, 0.4, 1.0]], atol=1e-6)  # one-step targets r + V'


def test_length_adaptive_lambda_numbers():
  lam = A.length_adaptive_lambda(np.array([100.0, 1000.0, 10.0, 0.0, 20.0]), 0.05)
  # 1 - 1/(0.05 l): 1 - 1/5, 1 - 1/50, 1 - 2 -> 0, 0 -> 0, 1 - 1 = 0
  np.testing.assert_allclose(lam, [0.8, 0.98, 0.0, 0.0, 0.0], atol=1e-6)
  lam = jax.jit(A.length_adaptive_lambda)(jnp.array([40, 200]), 0.1)
  np.testing.assert_allclose(lam, [0.75, 0.95], atol=1e-6)
  got = jax.vmap(A.length_adaptive_lambda, in_axes=(0, None))(jnp.array([[100.0], [1000.0]]), 0.05)
  np.testing.assert_allclose(got[:, 0], [0.8, 0.98], atol=1e-6)


def test_length_adaptive_lambda_feeds_gae_per_row():
  rng = np.random.default_rng(2)
  r, v = rng.normal(size=(2, 8)), rng.normal(size=(2, 8))
  m = np.array([[1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 1, 0, 0, 0]], np.float32)
  lam = A.length_adaptive_lambda(m.sum(-1), 0.5)  # 1 - 1/4 = 0.75, 1 - 1/1.5 = 1/3
  np.testing.assert_allclose(lam, [0.75, 1 / 3], atol=1e-6)
  want, _ = verl_gae_reference(r, v, m, 1.0, np.asarray(lam))
  np.testing.assert_allclose(A.gae(r, v, m, 1.0, lam)[0], want, atol=1e-5)


# ---------------------------------------------------------------- masked statistics


def test_masked_mean_var_whiten():
  x = jnp.array([[1.0, 2.0, 100.0, 3.0]]); m = jnp.array([[1, 1, 0, 1.0]])
  assert float(A.masked_mean(x, m)) == pytest.approx(2.0)
  np.testing.assert_allclose(A.masked_mean(jnp.array([[1.0, 3.0], [5.0, 7.0]]),
                                           jnp.array([[1, 1], [0, 1.0]]), axis=-1), [2.0, 7.0])
  assert float(A.masked_mean(x, jnp.zeros_like(m))) == 0.0
  assert float(A.masked_var(x, m)) == pytest.approx(1.0)  # var of 1,2,3 unbiased
  assert float(A.masked_var(x, m, unbiased=False)) == pytest.approx(2 / 3, rel=1e-6)
  w = A.masked_whiten(x, m)
  np.testing.assert_allclose(np.asarray(w)[0, [0, 1, 3]], [-1, 0, 1], atol=1e-4)
  w = A.masked_whiten(x, m, shift_mean=False)
  np.testing.assert_allclose(np.asarray(w)[0, [0, 1, 3]], [1, 2, 3], atol=1e-4)


_var_jit, _whiten_jit = jax.jit(A.masked_var), jax.jit(A.masked_whiten)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000))
def test_masked_var_matches_numpy_ddof1(seed):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(2, 16)) * 3 + 1
  m = rng.random((2, 16)) < rng.uniform(0.1, 1.0)
  m[0, :2] = True  # at least two entries
  assert float(_var_jit(x, m)) == pytest.approx(np.var(x[m], ddof=1), rel=1e-4)
  w = np.asarray(_whiten_jit(x, m))[m]
  assert np.mean(w) == pytest.approx(0.0, abs=1e-4) and np.std(w, ddof=1) == pytest.approx(1.0, rel=1e-3)


def test_masked_whiten_vmap_equals_loop():
  rng = np.random.default_rng(3)
  x = rng.normal(size=(3, 2, 5)); m = (rng.random((3, 2, 5)) < 0.8).astype(np.float32)
  got = jax.jit(jax.vmap(A.masked_whiten))(x, m)
  for n in range(3):
    np.testing.assert_allclose(got[n], A.masked_whiten(x[n], m[n]), atol=1e-5)


# ---------------------------------------------------------------- GRPO / RLOO


_grpo_jit = jax.jit(A.grpo_advantages, static_argnames="normalize_std")
_rloo_jit = jax.jit(A.rloo_advantages)


def test_grpo_and_rloo_by_hand():
  scores = jnp.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
  gid = jnp.array([7, 7, 7, 3, 3, 42])  # arbitrary ids; 42 is a group of one
  g = _grpo_jit(scores, gid)
  std0 = np.sqrt(1 / 3)  # unbiased std of (1, 0, 0)
  np.testing.assert_allclose(g[:3], np.array([2 / 3, -1 / 3, -1 / 3]) / (std0 + 1e-6), rtol=1e-5)
  np.testing.assert_allclose(g[3:5], [0, 0], atol=1e-6)  # identical scores -> no signal
  assert float(g[5]) == pytest.approx(0.5 / (1 + 1e-6))  # verl: a group of one has mean 0, std 1
  dr = _grpo_jit(scores, gid, normalize_std=False)
  np.testing.assert_allclose(dr, [2 / 3, -1 / 3, -1 / 3, 0, 0, 0.5], atol=1e-6)
  r = _rloo_jit(scores, gid)
  np.testing.assert_allclose(r, [1.0, -0.5, -0.5, 0.0, 0.0, 0.5], atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.booleans(), st.integers(0, 10_000))
def test_group_advantages_match_verl_loops(n_groups, normalize_std, seed):
  rng = np.random.default_rng(seed)
  b = 12
  scores = rng.integers(0, 3, b).astype(np.float64) + rng.normal(size=b) * rng.integers(0, 2)
  ids = rng.integers(0, n_groups, b) * 1000 - 17  # non-contiguous, negative ids too
  got = _grpo_jit(scores, ids, normalize_std=normalize_std)
  np.testing.assert_allclose(got, verl_group_reference(scores, ids, normalize_std=normalize_std),
                             atol=1e-3, rtol=1e-4)
  np.testing.assert_allclose(_rloo_jit(scores, ids), verl_group_reference(scores, ids, rloo=True),
                             atol=1e-5)


def test_group_advantages_vmap_equals_loop():
  rng = np.random.default_rng(4)
  scores = rng.normal(size=(3, 8)); ids = rng.integers(0, 3, (3, 8))
  for fn in (_grpo_jit, _rloo_jit):
    got = jax.jit(jax.vmap(fn))(scores, ids)
    for n in range(3):
      np.testing.assert_allclose(got[n], fn(scores[n], ids[n]), atol=1e-5)


def test_task_centered_subtracts_each_tasks_weighted_mean_and_leaves_rows_without_a_task():
  """Per-task baseline: a loop over tasks computes the weighted means; task ids are arbitrary ints."""
  rng = np.random.default_rng(0)
  adv = rng.normal(size=(5, 4)).astype(np.float32) * 3.0
  w = (rng.random((5, 4)) > 0.3).astype(np.float32)
  w[4] = 0.0  # a task (id 9) whose only row has no weighted token: no offset
  row_task = np.array([7, 100, 7, -1, 9])
  want_off = np.zeros(5)
  for t in (7, 100):
    rows = row_task == t
    want_off[rows] = (adv[rows] * w[rows]).sum() / w[rows].sum()
  centered, off = A.task_centered(jnp.asarray(adv), jnp.asarray(w), jnp.asarray(row_task))
  np.testing.assert_allclose(off, want_off, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(centered, adv - want_off[:, None], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(centered)[3], adv[3])  # padding row (-1) unchanged
  for t in (7, 100):  # what is left has weighted mean 0 within each task
    rows = row_task == t
    assert abs(float((np.asarray(centered)[rows] * w[rows]).sum())) < 1e-4 * float(np.abs(adv).sum())
  jitted = jax.jit(A.task_centered)(jnp.asarray(adv), jnp.asarray(w), jnp.asarray(row_task))
  np.testing.assert_allclose(jitted[0], centered, rtol=1e-6, atol=1e-6)

