"""PPO / value / entropy / KL / aggregation losses against hand-worked values and numpy ports of verl."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tars_jax.rl import losses as L
from tars_jax.rl.metrics import explained_variance, masked_corr


def verl_policy_loss_reference(old_logp, logp, adv, mask, clip_low, clip_high, clip_c):
  """numpy port of verl `compute_policy_loss` (token-mean): (loss, clipfrac, ppo_kl, clipfrac_lower)."""
  neg_kl = np.clip(logp - old_logp, -20, 20)
  ratio = np.exp(neg_kl)
  mmean = lambda x: (x * mask).sum() / (mask.sum() + 1e-8)
  l1 = -adv * ratio
  l2 = -adv * np.clip(ratio, 1 - clip_low, 1 + clip_high)
  c1 = np.maximum(l1, l2)
  l3 = -adv * clip_c
  c2 = np.minimum(l3, c1)
  pg = np.where(adv < 0, c2, c1)
  return mmean(pg), mmean((l2 > l1).astype(float)), mmean(-neg_kl), mmean((c1 > l3) * (adv < 0))


# ---------------------------------------------------------------- PPO policy loss


def _ppo_case():
  # (ratio, advantage): +A above range (clipped), -A below range (clipped), +A inside,
  # +A below range (unclipped: pessimistic), -A above range (unclipped), +A at 1.25 (inside only
  # thanks to clip-higher 0.28), and a masked token with wild values.
  ratios = np.array([[1.5, 0.5, 1.1, 0.5, 1.5, 1.25, 50.0]])
  adv = np.array([[1.0, -1.0, 1.0, 1.0, -1.0, 2.0, 100.0]])
  mask = np.array([[1, 1, 1, 1, 1, 1, 0.0]])
  return jnp.log(ratios), jnp.zeros_like(adv), jnp.asarray(adv), jnp.asarray(mask), ratios


def test_ppo_clip_higher_cases_by_hand():
  logp, old, adv, mask, ratios = _ppo_case()
  loss, m = L.ppo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
  per_token = [-1.28, 0.8, -1.1, -0.5, 1.5, -2.5]
  assert float(loss) == pytest.approx(np.mean(per_token), abs=1e-5)
  assert float(m["clipfrac"]) == pytest.approx(2 / 6)  # tokens 0 and 1
  assert float(m["clipfrac_high"]) == pytest.approx(1 / 6) and float(m["clipfrac_low"]) == pytest.approx(1 / 6)
  assert float(m["dual_clipfrac"]) == 0.0
  r = ratios[0, :6]
  assert float(m["approx_kl"]) == pytest.approx(-np.mean(np.log(r)), abs=1e-5)
  assert float(m["approx_kl_k3"]) == pytest.approx(np.mean(r - 1 - np.log(r)), abs=1e-5)
  assert float(m["ratio_mean"]) == pytest.approx(np.mean(r), abs=1e-5)
  # symmetric clip 0.2: token 5 (r = 1.25 > 1.2, A > 0) is now clipped to -2.4
  loss, m = L.ppo_policy_loss(logp, old, adv, mask, 0.2, 0.2)
  assert float(loss) == pytest.approx(np.mean([-1.2, 0.8, -1.1, -0.5, 1.5, -2.4]), abs=1e-5)
  assert float(m["clipfrac"]) == pytest.approx(3 / 6) and float(m["clipfrac_high"]) == pytest.approx(2 / 6)


def test_ppo_gradient_is_zero_exactly_on_clipped_tokens():
  logp, old, adv, mask, ratios = _ppo_case()
  g = jax.grad(lambda lp: L.ppo_policy_loss(lp, old, adv, mask, 0.2, 0.28)[0])(logp)
  # d(-A r)/d logp = -A r on unclipped tokens, / 6 tokens; 0 where clipped or masked
  want = [0.0, 0.0, -1.1 / 6, -0.5 / 6, 1.5 / 6, -2.5 / 6, 0.0]
  np.testing.assert_allclose(g[0], want, atol=1e-6)


def test_dual_clip_bounds_negative_advantage_loss():
  ratios = jnp.array([[10.0, 2.0, 10.0, 0.1]])
  adv = jnp.array([[-1.0, -1.0, 1.0, -2.0]])
  mask, old = jnp.ones((1, 4)), jnp.zeros((1, 4))
  loss, m = L.ppo_policy_loss(jnp.log(ratios), old, adv, mask, 0.2, 0.28, clip_c=3.0)
  # token 0: max(10, 1.28) = 10 bounded by -A c = 3 (dual active); token 1: 2 < 3; token 2: A > 0,
  # never dual-clipped: max(-10, -1.28); token 3: max(0.2, 1.6) = 1.6 < 6
  assert float(loss) == pytest.approx((3 + 2 - 1.28 + 1.6) / 4, abs=1e-5)
  assert float(m["dual_clipfrac"]) == pytest.approx(1 / 4)
  loss, m = L.ppo_policy_loss(jnp.log(ratios), old, adv, mask, 0.2, 0.28)
  assert float(loss) == pytest.approx((10 + 2 - 1.28 + 1.6) / 4, abs=1e-5)
  assert float(m["dual_clipfrac"]) == 0.0
  with pytest.raises(ValueError):
    L.ppo_policy_loss(jnp.log(ratios), old, adv, mask, clip_c=1.0)


# clip constants traced (not static), so one compilation serves every example
_ppo_jit = jax.jit(lambda lp, old, a, m, lo, hi, c: L.ppo_policy_loss(lp, old, a, m, lo, hi, c))


@settings(max_examples=30, deadline=None)
@given(st.floats(0.05, 0.4), st.floats(0.05, 0.5), st.floats(1.5, 5.0), st.integers(0, 10_000))
def test_ppo_loss_matches_verl_port(clip_low, clip_high, clip_c, seed):
  rng = np.random.default_rng(seed)
  old, logp = rng.normal(size=(3, 9)) - 2, rng.normal(size=(3, 9)) * 0.7 - 2
  adv = rng.normal(size=(3, 9)); mask = (rng.random((3, 9)) < 0.7).astype(np.float64)
  want = verl_policy_loss_reference(old, logp, adv, mask, clip_low, clip_high, clip_c)
  loss, m = _ppo_jit(logp, old, adv, mask, clip_low, clip_high, clip_c)
  got = (loss, m["clipfrac"], m["approx_kl"], m["dual_clipfrac"])
  np.testing.assert_allclose(np.array(got, np.float64), want, atol=1e-4, rtol=1e-4)
  assert float(m["clipfrac"]) == pytest.approx(float(m["clipfrac_low"] + m["clipfrac_high"]), abs=1e-6)


def test_masked_tokens_do_not_count():
  logp = jnp.array([[0.0, 5.0]]); adv = jnp.array([[1.0, 100.0]])
  loss, m = L.ppo_policy_loss(logp, jnp.zeros((1, 2)), adv, jnp.array([[1.0, 0.0]]))
  assert float(loss) == pytest.approx(-1.0)
  assert float(m["clipfrac"]) == 0.0 and float(m["ratio_mean"]) == pytest.approx(1.0)


# ---------------------------------------------------------------- value loss


def test_value_loss_by_hand():
  v = jnp.array([[1.0, 0.0, 3.0]]); old = jnp.zeros((1, 3)); ret = jnp.array([[2.0, 1.0, 0.0]])
  loss, m = L.value_loss(v, old, ret, jnp.ones((1, 3)), clip=0.5)
  # token0: unclipped (1-2)^2=1 < clipped (0.5-2)^2=2.25; token1: 1 = 1; token2: 9 > (0.5-0)^2
  assert float(loss) == pytest.approx(0.5 * (2.25 + 1 + 9) / 3)
  assert float(m["vf_clipfrac"]) == pytest.approx(1 / 3)
  loss, m = L.value_loss(v, old, ret, jnp.ones((1, 3)))
  assert float(loss) == pytest.approx(0.5 * (1 + 1 + 9) / 3) and float(m["vf_clipfrac"]) == 0.0
  loss, _ = L.value_loss(v, old, ret, jnp.array([[1.0, 1.0, 0.0]]), clip=0.5, agg="seq-mean-token-sum")
  assert float(loss) == pytest.approx(0.5 * (2.25 + 1))
  # gradient flows only through the larger (clipped, hence constant) branch on token 0
  g = jax.grad(lambda x: L.value_loss(x, old, ret, jnp.ones((1, 3)), clip=0.5)[0])(v)
  np.testing.assert_allclose(g[0], [0.0, (0 - 1) / 3, (3 - 0) / 3], atol=1e-6)


# ---------------------------------------------------------------- entropy


def _entropy_reference(logits, allowed, temperature):
  z = np.where(allowed, logits / temperature, -np.inf)
  z = z - z.max(-1, keepdims=True)
  p = np.exp(z); p /= p.sum(-1, keepdims=True)
  return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), -1)


def test_entropy_uniform_over_allowed_is_log_k():
  v = 6
  allowed = np.tril(np.ones((v, v), bool))[None]  # row k allows k + 1 tokens
  logits = jnp.full((1, v, v), 3.7)
  ent = L.entropy(logits, jnp.ones((1, v)), allowed)
  np.testing.assert_allclose(ent[0], np.log(np.arange(1, v + 1)), atol=1e-5)
  assert float(ent[0, 0]) == 0.0  # a single allowed token: exactly 0
  ent = L.entropy(logits, jnp.ones((1, v)))  # unconstrained: log V everywhere
  np.testing.assert_allclose(ent, np.full((1, v), np.log(v)), atol=1e-5)


def test_entropy_matches_reference_with_temperature_and_mask():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 4, 7)) * 3
  allowed = rng.random((2, 4, 7)) < 0.5
  allowed[..., 0] = True
  mask = np.array([[1, 1, 0, 1], [0, 1, 1, 1.0]])
  for temperature in (1.0, 0.7):
    ent = jax.jit(L.entropy)(logits, mask, allowed, temperature)
    np.testing.assert_allclose(ent, _entropy_reference(logits, allowed, temperature) * mask, atol=1e-5)


def test_entropy_safe_with_neg_inf_logits_and_empty_rows():
  logits = jnp.array([[[0.0, -jnp.inf, 1.0, -jnp.inf], [-jnp.inf, 2.0, -jnp.inf, -jnp.inf],
                       [1.0, 1.0, 1.0, 1.0]]])
  allowed = jnp.array([[[1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]]], bool)  # last row: nothing allowed
  mask = jnp.array([[1.0, 1.0, 0.0]])
  f = lambda z: L.entropy(z, mask, allowed)
  ent = f(logits)
  p = np.exp([0.0, 1.0]) / np.exp([0.0, 1.0]).sum()
  np.testing.assert_allclose(ent[0], [-(p * np.log(p)).sum(), 0.0, 0.0], atol=1e-6)
  g = jax.grad(lambda z: f(z).sum())(logits)
  assert np.isfinite(np.asarray(g)).all()
  # gradient of H wrt an allowed logit i: -p_i (log p_i + H); zero on -inf (disallowed) logits
  h = -(p * np.log(p)).sum()
  np.testing.assert_allclose(g[0, 0], [-p[0] * (np.log(p[0]) + h), 0, -p[1] * (np.log(p[1]) + h), 0], atol=1e-6)
  np.testing.assert_allclose(g[0, 1:], 0.0, atol=1e-6)


def test_masked_log_softmax_matches_constrained_distribution():
  logits = jnp.array([[2.0, 1.0, 0.5, -1.0]])
  allowed = jnp.array([[True, False, True, False]])
  lp = L.masked_log_softmax(logits, allowed, temperature=0.5)
  z = np.array([4.0, 1.0])
  want = z - np.log(np.exp(z).sum())
  np.testing.assert_allclose(lp[0, [0, 2]], want, atol=1e-6)
  assert np.all(np.exp(np.asarray(lp[0, [1, 3]])) == 0.0)


# ---------------------------------------------------------------- KL


def test_kl_kinds_by_hand():
  logp, ref = jnp.array([-1.0, -2.0]), jnp.array([-2.0, -1.0])  # d = +1, -1
  np.testing.assert_allclose(L.kl_penalty(logp, ref, "k1"), [1.0, -1.0])
  np.testing.assert_allclose(L.kl_penalty(logp, ref, "k2"), [0.5, 0.5])
  np.testing.assert_allclose(L.kl_penalty(logp, ref, "k3"), [np.exp(-1), np.e - 2], atol=1e-6)
  np.testing.assert_allclose(L.kl_penalty(logp, ref, "abs"), [1.0, 1.0])
  for alias, kind in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")):
    np.testing.assert_allclose(L.kl_penalty(logp, ref, alias), L.kl_penalty(logp, ref, kind))
  with pytest.raises(ValueError):
    L.kl_penalty(logp, ref, "k9")


def test_k3_clamps_like_verl():
  # d = -1e9 (a disallowed token's log-prob) and d = +30: verl clamps d to [-20, 20], then k3 to 10
  kl = L.kl_penalty(jnp.array([-1e9, -1.0, -1.0]), jnp.array([0.0, -31.0, -1.0]), "k3")
  np.testing.assert_allclose(kl, [10.0, 10.0, 0.0], atol=1e-6)
  # clamping d first keeps exp() finite, so the gradient is 0 (not NaN) on saturated tokens
  g = jax.grad(lambda lp: L.kl_penalty(lp, jnp.array([0.0, -31.0, -1.5]), "k3").sum())(
      jnp.array([-1e9, -1.0, -1.0]))
  np.testing.assert_allclose(g, [0.0, 0.0, 1 - np.exp(-0.5)], atol=1e-6)


# ---------------------------------------------------------------- aggregation


def test_aggregation_modes_by_hand_2x3():
  loss = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
  mask = jnp.array([[1, 1, 1], [1, 0, 0.0]])
  assert float(L.aggregate(loss, mask, "token-mean")) == pytest.approx((1 + 2 + 3 + 4) / 4)
  assert float(L.aggregate(loss, mask, "seq-mean-token-sum")) == pytest.approx((6 + 4) / 2)
  assert float(L.aggregate(loss, mask, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)
  assert float(L.aggregate(loss, mask, "seq-mean-token-sum-norm")) == pytest.approx((6 + 4) / 3)  # / T
  with pytest.raises(ValueError):
    L.aggregate(loss, mask, "nope")


def test_aggregation_row_without_tokens_counts_as_zero_loss_sequence():
  loss = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
  mask = jnp.array([[1, 1, 0], [0, 0, 0.0]])
  assert float(L.aggregate(loss, mask, "token-mean")) == pytest.approx(1.5)
  assert float(L.aggregate(loss, mask, "seq-mean-token-sum")) == pytest.approx(3 / 2)
  assert float(L.aggregate(loss, mask, "seq-mean-token-mean")) == pytest.approx(1.5 / 2)
  assert float(L.aggregate(jnp.ones((2, 3)), jnp.zeros((2, 3)), "token-mean")) == 0.0


# ---------------------------------------------------------------- jit + vmap over a leading axis


def test_jit_vmap_equals_loop_for_each_loss():
  rng = np.random.default_rng(5)
  n, b, t, v = 3, 2, 5, 4
  lp, old, adv = rng.normal(size=(n, b, t)) * 0.3 - 1, rng.normal(size=(n, b, t)) * 0.3 - 1, rng.normal(size=(n, b, t))
  mask = (rng.random((n, b, t)) < 0.7).astype(np.float32)
  logits, allowed = rng.normal(size=(n, b, t, v)), rng.random((n, b, t, v)) < 0.6
  fns = {
      "ppo": lambda lp, old, adv, m, *_: L.ppo_policy_loss(lp, old, adv, m, 0.2, 0.28, 3.0, "seq-mean-token-mean"),
      "value": lambda lp, old, adv, m, *_: L.value_loss(lp, old, adv, m, 0.1, "seq-mean-token-sum"),
      "entropy": lambda lp, old, adv, m, z, al: L.entropy(z, m, al, 0.9),
      "kl": lambda lp, old, *_: L.kl_penalty(lp, old, "k3"),
      "agg": lambda lp, old, adv, m, *_: L.aggregate(adv, m, "seq-mean-token-sum-norm"),
      "ev": lambda lp, old, adv, m, *_: explained_variance(adv, lp, m),
      "corr": lambda lp, old, adv, m, *_: masked_corr(adv, lp, m),
  }
  args = (lp, old, adv, mask, logits, allowed)
  for name, fn in fns.items():
    got, one = jax.jit(jax.vmap(fn))(*args), jax.jit(fn)
    for i in range(n):
      want = one(*(a[i] for a in args))
      jax.tree.map(lambda g, w: np.testing.assert_allclose(g[i], w, atol=1e-5, err_msg=name), got, want)


# ---------------------------------------------------------------- critic diagnostics


def test_explained_variance_and_corr():
  ret = jnp.array([[1.0, 2.0, 3.0, 4.0, 99.0]]); m = jnp.array([[1, 1, 1, 1, 0.0]])
  assert float(explained_variance(ret, ret, m)) == pytest.approx(1.0)
  assert float(explained_variance(ret, jnp.full((1, 5), 2.5), m)) == pytest.approx(0.0, abs=1e-6)
  # values = returns shifted by (1, -1, 1, -1): Var[err] (ddof 1) = 4/3, Var[ret] = 5/3
  vals = ret - jnp.array([[1.0, -1.0, 1.0, -1.0, 0.0]])
  assert float(explained_variance(ret, vals, m)) == pytest.approx(1 - (4 / 3) / (5 / 3), abs=1e-5)
  assert float(masked_corr(ret, -2 * ret, m)) == pytest.approx(-1.0, abs=1e-5)
  x = np.array([1.0, 2.0, 3.0, 4.0]); y = np.array([2.0, 1.0, 4.0, 3.0])
  got = masked_corr(jnp.array([[*x, 0.0]]), jnp.array([[*y, 50.0]]), m)
  assert float(got) == pytest.approx(np.corrcoef(x, y)[0, 1], abs=1e-5)


def test_decoupled_ppo_loss_matches_hand_formula_and_reduces_to_ppo_on_policy():
  """loss = mean over tokens of max(-A w r, -A w clip(r)), r = pi/pi_prox, w = pi_prox/pi_behav (Hilton
  et al. 2022 eq. 2), worked in numpy; with pi_prox = pi_behav it is `ppo_policy_loss` exactly."""
  logp = np.array([[-1.0, -0.5, -2.0, -0.1]], np.float32)
  prox = np.array([[-1.2, -0.5, -1.0, -0.3]], np.float32)
  behav = np.array([[-1.5, -0.2, -1.0, -0.3]], np.float32)
  adv = np.array([[1.0, -2.0, 0.5, -1.0]], np.float32)
  mask = np.ones_like(adv)
  r, w = np.exp(logp - prox), np.exp(prox - behav)
  want = np.mean(np.maximum(-adv * w * r, -adv * w * np.clip(r, 0.8, 1.28)))
  loss, m = L.decoupled_ppo_policy_loss(logp, prox, behav, adv, mask, 0.2, 0.28)
  np.testing.assert_allclose(float(loss), want, rtol=1e-6)
  np.testing.assert_allclose(float(m["behaviour_weight_mean"]), w.mean(), rtol=1e-6)
  # the weight carries no gradient: d loss / d logp = that of PPO with advantages w * A
  g = jax.grad(lambda lp: L.decoupled_ppo_policy_loss(lp, prox, behav, adv, mask, 0.2, 0.28)[0])(logp)
  g_ref = jax.grad(lambda lp: L.ppo_policy_loss(lp, prox, adv * w, mask, 0.2, 0.28)[0])(logp)
  np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-6)
  on = L.decoupled_ppo_policy_loss(logp, behav, behav, adv, mask, 0.2, 0.28)[0]
  np.testing.assert_allclose(float(on), float(L.ppo_policy_loss(logp, behav, adv, mask, 0.2, 0.28)[0]), rtol=1e-6)
  # max_weight (AReaL's behav_imp_weight_cap): the first token (w = e^0.3 = 1.35) leaves the loss
  capped, mc = L.decoupled_ppo_policy_loss(logp, prox, behav, adv, mask, 0.2, 0.28, max_weight=1.2)
  want_capped = np.mean(np.maximum(-adv * w * r, -adv * w * np.clip(r, 0.8, 1.28))[:, 1:])
  np.testing.assert_allclose(float(capped), want_capped, rtol=1e-6)
  assert float(mc["behaviour_weight_filtered"]) == pytest.approx(0.25)
  np.testing.assert_allclose(float(mc["behaviour_weight_mean"]), w.mean(), rtol=1e-6)  # over every token


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), frac=st.sampled_from([0.2, 0.5, 0.8]))
def test_top_entropy_mask_matches_numpy_quantile(seed, frac):
  """The kept tokens are those at or above numpy's linear (1 - frac) quantile of the masked entropies;
  about `frac` of the masked tokens survive, none outside the mask."""
  rng = np.random.default_rng(seed)
  ent = rng.gamma(1.0, 0.5, size=(3, 17)).astype(np.float32)
  mask = (rng.random((3, 17)) < 0.7).astype(np.float32)
  mask[0, 0] = 1.0
  got = np.asarray(L.top_entropy_mask(jnp.asarray(ent), jnp.asarray(mask), frac))
  thr = np.quantile(ent[mask > 0], 1.0 - frac)
  np.testing.assert_array_equal(got, mask * (ent >= thr))
  n = mask.sum()
  assert abs(got.sum() - frac * n) <= 1.0 + 1e-6


def test_top_entropy_mask_edge_cases():
  ent = jnp.array([[0.1, 0.9, 0.5, 0.0]])
  mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
  np.testing.assert_array_equal(L.top_entropy_mask(ent, mask, 1.0), mask)  # off
  np.testing.assert_array_equal(L.top_entropy_mask(ent, mask, 0.34), [[0.0, 1.0, 0.0, 0.0]])
  np.testing.assert_array_equal(L.top_entropy_mask(ent, jnp.zeros_like(mask), 0.2), np.zeros((1, 4)))
