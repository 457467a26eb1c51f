"""Grammar-forced tokens (one allowed token: log-prob 0, entropy 0, no gradient) are not decisions:
they are left out of the entropy mean, the token-mean loss denominators, VAPO's length and the
informative-episode test; results are unchanged when nothing is forced. Hand-worked numbers on a
two-state grammar, then the trainer's loss on a tiny policy and `ppo.prepare` on the smoke config."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.configs import miniwob_ppo
from tars_jax.agent.tokenizer import BOS, IMAGE, PAD, VISION_END, VISION_START
from tars_jax.models import Policy
from tars_jax.rl import advantages as A
from tars_jax.rl import losses as L
from tars_jax.rl import metrics as M
from tars_jax.train import ppo
from tars_jax.train import state as state_lib
from tars_jax.train.step import ModelInputs
from _shared import TINY_CFG

# Two-state grammar over 4 tokens: state 0 allows tokens 0, 1 (-> 0) and 2 (-> 1); state 1 allows
# only token 3 (-> 0), so every token sampled in state 1 is forced.
TABLE = np.array([[0, 0, 1, -1], [-1, -1, -1, 0]], np.int32)
# A 6-token reply 0 2 3 1 2 3 and two padding positions: states before each token 0 0 1 0 0 1,
# forced at positions 2 and 5 (the second like a reply's final EOS).
TOKENS = np.array([[0, 2, 3, 1, 2, 3, 0, 0]])
STATES = np.array([[0, 0, 1, 0, 0, 1, 0, 0]], np.int32)
MASK = np.array([[1, 1, 1, 1, 1, 1, 0, 0]], np.float32)
FREE = np.array([[1, 1, 0, 1, 1, 0, 0, 0]], np.float32)


def _hp(**overrides) -> ppo.PPOHparams:
  return dataclasses.replace(state_lib.hparams(miniwob_ppo.get_config("smoke")), **overrides)


def test_free_decisions_of_the_two_state_grammar():
  np.testing.assert_array_equal(ppo.free_decisions(jnp.asarray(TABLE), jnp.asarray(STATES), MASK), FREE)
  np.testing.assert_array_equal(ppo.free_decisions(None, jnp.asarray(STATES), MASK), MASK)  # no grammar
  np.testing.assert_array_equal(L.decision_mask(MASK, np.array([[3, 3, 1, 3, 3, 1, 1, 3]])), FREE)


def _logits():
  z = np.zeros((1, 8, 4), np.float32)
  z[0, 0] = [np.log(2.0), 0.0, 0.0, 5.0]  # allowed {0, 1, 2}: p = (1/2, 1/4, 1/4); token 3 masked
  return jnp.asarray(z)


def test_entropy_mean_over_free_decisions_by_hand():
  allowed = jnp.asarray(TABLE)[STATES] >= 0
  ent = L.entropy(_logits(), MASK, allowed)
  h0, h_uniform = 1.5 * np.log(2.0), np.log(3.0)  # -(1/2 ln 1/2 + 2 * 1/4 ln 1/4); ln 3
  np.testing.assert_allclose(ent[0], [h0, h_uniform, 0, h_uniform, h_uniform, 0, 0, 0], atol=1e-6)
  want = (h0 + 3 * h_uniform) / 4  # 4 decisions, not 6 tokens
  assert float(L.aggregate(ent, FREE, "token-mean")) == pytest.approx(want, abs=1e-6)
  assert float(L.aggregate(ent, MASK, "token-mean")) == pytest.approx(want * 4 / 6, abs=1e-6)  # diluted


def _pg(logits, adv, mask, agg):
  allowed = jnp.asarray(TABLE)[STATES] >= 0
  lp = jnp.take_along_axis(L.masked_log_softmax(logits, allowed), jnp.asarray(TOKENS)[..., None], -1)[..., 0]
  return L.ppo_policy_loss(lp, jax.lax.stop_gradient(lp), adv, mask, 0.2, 0.28, 3.0, agg)[0]


ADV = jnp.array([[1.0, 2.0, 5.0, 3.0, 6.0, 7.0, 0.0, 0.0]])  # forced tokens carry 5 and 7


@pytest.mark.parametrize("agg,want", [("token-mean", -3.0), ("seq-mean-token-mean", -3.0),
                                      ("seq-mean-token-sum", -12.0), ("seq-mean-token-sum-norm", -12.0 / 8)])
def test_policy_loss_denominator_counts_free_decisions(agg, want):
  # on-policy (ratio 1): loss = -aggregate(A) over the decisions 1, 2, 3, 6 (sum 12, 4 of them)
  assert float(_pg(_logits(), ADV, FREE, agg)) == pytest.approx(want)


def test_forced_tokens_get_zero_gradient_and_free_ones_the_hand_value():
  def loss(z):
    ent = L.aggregate(L.entropy(z, FREE, jnp.asarray(TABLE)[STATES] >= 0), FREE, "token-mean")
    return _pg(z, ADV, FREE, "token-mean") - 0.1 * ent
  g = np.asarray(jax.grad(loss)(_logits()))
  assert (g[0, [2, 5]] == 0).all()  # forced: exactly zero
  assert (g[0, 6:] == 0).all()  # padding
  # position 1: uniform over {0, 1, 2}, sampled token 2, A = 2: d(-A r / 4)/dz = -(A / 4)(onehot - p);
  # the entropy term of a uniform distribution has zero gradient
  np.testing.assert_allclose(g[0, 1], -0.5 * (np.array([0, 0, 1, 0]) - np.array([1, 1, 1, 0]) / 3), atol=1e-6)
  # the same policy-gradient with the forced tokens in the mask: same direction, 4/6 the size
  g_all = np.asarray(jax.grad(lambda z: _pg(z, ADV, MASK, "token-mean"))(_logits()))
  g_pg = np.asarray(jax.grad(lambda z: _pg(z, ADV, FREE, "token-mean"))(_logits()))
  np.testing.assert_allclose(g_all, g_pg * 4 / 6, atol=1e-7)


def test_vapo_lambda_from_free_decisions():
  hp = _hp(gamma=1.0, lam_critic=1.0, length_adaptive_alpha=0.5, whiten_advantages=False)
  free = ppo.free_decisions(jnp.asarray(TABLE), jnp.asarray(STATES), MASK)
  np.testing.assert_allclose(ppo.policy_lambda(free, hp), [1 - 1 / (0.5 * 4)])  # 0.5; 6 tokens: 2/3
  rng = np.random.default_rng(0)
  r, v = rng.normal(size=(1, 8)), rng.normal(size=(1, 8))
  batch = {"rewards": jnp.asarray(r), "loss_mask": jnp.asarray(MASK)}
  adv, ret = ppo.compute_advantages(jnp.asarray(v), batch, hp, free)
  np.testing.assert_allclose(adv, A.gae(r, v, MASK, 1.0, 0.5)[0] * MASK, atol=1e-5)
  np.testing.assert_allclose(ret, A.gae(r, v, MASK, 1.0, 1.0)[1] * MASK, atol=1e-5)
  # whitening: statistics over the 4 decisions (forced tokens get the same affine map)
  white, _ = ppo.compute_advantages(jnp.asarray(v), batch, dataclasses.replace(hp, whiten_advantages=True), free)
  a = np.asarray(adv)[0]
  mu, sd = a[FREE[0] > 0].mean(), a[FREE[0] > 0].std(ddof=1)
  np.testing.assert_allclose(white[0], (a - mu) / sd * MASK[0], atol=1e-4)


def test_nothing_forced_changes_nothing():
  table = np.array([[0, 0, 1, -1], [-1, -1, 0, 0]], np.int32)  # state 1 now allows 2 tokens
  free = ppo.free_decisions(jnp.asarray(table), jnp.asarray(STATES), MASK)
  np.testing.assert_array_equal(free, MASK)  # bitwise: every loss and mean sees the old mask
  hp = _hp(length_adaptive_alpha=0.5)
  np.testing.assert_allclose(ppo.policy_lambda(free, hp), [1 - 1 / (0.5 * 6)])


def test_informative_fraction_by_hand():
  adv = np.array([[0.5, -0.5, 0.0, 0.0], [0.001, -0.003, 5.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
  free = np.array([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], np.float32)  # row 1's 5.0 is forced
  # row 0: mean |A| 0.5 > 0.01; row 1: 0.002 (its forced 5.0 ignored); row 2 has no decision
  assert float(M.informative_fraction(adv, free)) == pytest.approx(0.5)
  assert float(M.informative_fraction(adv, free, eps=1e-3)) == pytest.approx(1.0)
  assert float(M.informative_fraction(adv, np.zeros_like(free))) == 0.0


# ---------------------------------------------------------------- the trainer's loss on a tiny policy


def _policy_batch(rng, q, n_rows=3, reply=8):
  """Rows `BOS <bytes> <vs> IMAGE*n <ve> <reply>`; reply positions 2 and 5 are token `q` sampled in
  grammar state 1 (forced), the rest lowercase letters in state 0."""
  n = TINY_CFG.n_img_tokens
  rows = [[BOS, *rng.integers(0, 255, 3 + i), VISION_START, *[IMAGE] * n, VISION_END] for i in range(n_rows)]
  t = max(len(r) for r in rows) + reply + 1
  tokens, attn = np.full((n_rows, t), PAD, np.int32), np.zeros((n_rows, t), bool)
  loss, states = np.zeros((n_rows, t - 1), np.float32), np.zeros((n_rows, t - 1), np.int32)
  for i, r in enumerate(rows):
    rep = rng.integers(97, 123, reply)
    rep[[2, 5]] = q
    full = r + list(rep)
    tokens[i, :len(full)], attn[i, :len(full)] = full, True
    loss[i, len(r) - 1:len(full) - 1] = 1.0  # target j+1 is a reply token
    states[i, len(r) - 1 + np.array([2, 5])] = 1
  return dict(tokens=tokens, attn_mask=attn, loss_mask=loss, states=states,
              pixel_values=rng.random((n_rows, 1, TINY_CFG.image_h, TINY_CFG.image_w, 3)).astype(np.float32),
              image_mask=np.ones((n_rows, 1), bool))


@pytest.mark.long  # ~30 s: two jitted value-and-grads of a tiny policy
def test_trainer_loss_treats_forced_tokens_as_outside_the_mask():
  v, q = TINY_CFG.vocab_size, ord("q")
  table = np.zeros((2, v), np.int32)  # state 0: every token; state 1: only `q`
  table[1] = -1
  table[1, q] = 0
  table = jnp.asarray(table)
  hp = dataclasses.replace(state_lib.hparams(miniwob_ppo.get_config("")),
                           algo="grpo", ent_coef=0.05, aux_loss_coef=0.0, kl_coef=0.0, loss_agg="token-mean")
  gd, params = nnx.split(Policy(TINY_CFG, nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  mb = {k: jnp.asarray(x) for k, x in _policy_batch(rng, q).items()}
  inputs = ModelInputs(IMAGE, tuple(TINY_CFG.merged_grid))
  logp = ppo.reference_logp(params, mb, table, policy_gd=gd, hp=hp, inputs=inputs)
  forced = np.asarray(mb["states"]) == 1
  assert (np.asarray(logp)[forced] == 0).all()  # one allowed token: probability 1
  mb["old_logp"] = logp
  mb["advantages"] = jnp.asarray(rng.normal(size=mb["loss_mask"].shape), jnp.float32) * mb["loss_mask"]
  free = ppo.free_decisions(table, mb["states"], mb["loss_mask"])
  np.testing.assert_array_equal(np.asarray(free), np.asarray(mb["loss_mask"]) * ~forced)
  grad = jax.value_and_grad(ppo.policy_loss, has_aux=True)
  (loss, m), g = grad(params, gd, table, mb, hp, inputs)
  # the same batch without a grammar and with the forced tokens taken out of the mask: state 0 allows
  # every token, so the free tokens' distributions are the same
  (loss_ref, m_ref), g_ref = grad(params, gd, None, dict(mb, loss_mask=free), hp, inputs)
  assert float(loss) == pytest.approx(float(loss_ref), rel=1e-5, abs=1e-6)
  for k in ("entropy", "pg_loss", "clipfrac", "approx_kl"):
    assert float(m[k]) == pytest.approx(float(m_ref[k]), rel=1e-5, abs=1e-6), k
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), g, g_ref)


# ---------------------------------------------------------------- critic PPO: prepare


@pytest.mark.long  # ~20 s: builds the smoke config's models
def test_prepare_lambda_and_informative_fraction_count_free_decisions():
  cfg = miniwob_ppo.get_config("smoke")
  cfg.rl.algo = "ppo"
  parts = state_lib.build(cfg)
  hp = dataclasses.replace(parts.hparams, length_adaptive_alpha=0.5, whiten_advantages=False, gamma=1.0)
  state = parts.init_state(0)
  rng = np.random.default_rng(0)
  b, t, v = 3, 96, parts.model_cfg.vocab_size
  h, w = parts.image_hw
  tok = np.full((b, t), 65, np.int32)
  tok[:, 0] = parts.tokenizer.bos_id
  tok[:, 8:8 + parts.model_cfg.n_img_tokens] = parts.tokenizer.image_id
  loss = np.zeros((b, t - 1), np.float32)
  loss[0, 60:70], loss[1, 60:66] = 1.0, 1.0  # 10 and 6 model tokens; row 2 is padding
  states = np.zeros((b, t - 1), np.int32)
  states[0, 60:64] = 1  # 4 forced: 6 decisions in each real row
  rew = np.zeros((b, t - 1), np.float32)
  rew[0, 69], rew[1, 65] = 1.0, -1.0
  batch = {k: jnp.asarray(x) for k, x in dict(
      tokens=tok, attn_mask=np.ones((b, t), bool), loss_mask=loss, rewards=rew, states=states,
      old_logp=np.zeros((b, t - 1), np.float32),
      pixel_values=rng.random((b, cfg.env.max_turns, h, w, 3)).astype(np.float32),
      image_mask=np.ones((b, cfg.env.max_turns), bool)).items()}
  table = np.zeros((2, v), np.int32)
  table[1], table[1, 65] = -1, 0
  values, adv, ret, diag = ppo.prepare(state["critic"], batch, jnp.asarray(table), critic_gd=parts.critic_gd, hp=hp,
                                   inputs=parts.inputs)
  lam = 1 - 1 / (0.5 * 6)
  assert float(diag["lam_policy_mean"]) == pytest.approx(lam)  # both rows: 6 decisions
  want_adv, _ = A.gae(rew, np.asarray(values), loss, 1.0, lam)  # values come back zeroed off the mask
  np.testing.assert_allclose(adv, want_adv * loss, atol=1e-5)
  free = loss.copy()
  free[0, 60:64] = 0
  want_abs = np.abs(want_adv)[free > 0].mean()
  assert float(diag["advantage_abs_mean"]) == pytest.approx(want_abs, rel=1e-4)
  rows = [np.abs(want_adv[i])[free[i] > 0].mean() > M.PPO_INFORMATIVE_EPS for i in range(2)]
  assert float(diag["informative_fraction"]) == pytest.approx(np.mean(rows))
  # no table: every model token a decision (10 and 6 tokens)
  _, _, _, d0 = ppo.prepare(state["critic"], batch, None, critic_gd=parts.critic_gd, hp=hp, inputs=parts.inputs)
  assert float(d0["lam_policy_mean"]) == pytest.approx(((1 - 1 / 5) + (1 - 1 / 3)) / 2)
  # Per-task baseline (rl.task_baseline): both real rows one task, the padding row none. The offset is
  # their advantages' mean over free decisions; it is logged whether the baseline is on or off.
  row_task = np.array([3, 3, -1], np.int32)
  want_adv = np.asarray(want_adv)
  offset = float((want_adv * free).sum() / free.sum())
  _, adv_off, _, d_off = ppo.prepare(state["critic"], batch, jnp.asarray(table), row_task,
                                     critic_gd=parts.critic_gd, hp=hp, inputs=parts.inputs)
  np.testing.assert_allclose(adv_off, adv, atol=1e-6)
  assert float(d_off["advantage_task_offset"]) == pytest.approx(abs(offset), rel=1e-4)
  hp_task = dataclasses.replace(hp, task_baseline=True)
  _, adv_on, _, d_on = ppo.prepare(state["critic"], batch, jnp.asarray(table), row_task,
                                   critic_gd=parts.critic_gd, hp=hp_task, inputs=parts.inputs)
  np.testing.assert_allclose(adv_on, (want_adv - offset) * loss, atol=1e-5)
  assert float(d_on["advantage_abs_mean"]) == pytest.approx(np.abs(want_adv - offset)[free > 0].mean(), rel=1e-4)
  with pytest.raises(ValueError, match="task_baseline"):
    ppo.prepare(state["critic"], batch, jnp.asarray(table), critic_gd=parts.critic_gd, hp=hp_task,
                inputs=parts.inputs)
