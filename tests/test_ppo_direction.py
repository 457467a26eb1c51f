"""One PPO step moves log-probs in the direction of the advantages: on a fixed batch, the trainer's
jitted step (`ppo.policy_step`, the trainer's optimiser) raises the log-probability of every token
with positive advantage and lowers every token with negative advantage; negating the advantages
negates the change. Only the clipped policy-gradient term is on (entropy bonus, MoE aux loss and KL
off), so nothing else can move the log-probs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tars_jax.agent.tokenizer import BOS, IMAGE, PAD, VISION_END, VISION_START
from experiments.configs import miniwob_ppo
from tars_jax.models import Policy
from tars_jax.train import ppo
from tars_jax.train import state as state_lib
from tars_jax.train.step import ModelInputs
from _shared import TINY_CFG

CFG = TINY_CFG
# The main config's hyper-parameters (PPOHparams has no defaults), with only the clipped
# policy-gradient term on.
HP = dataclasses.replace(state_lib.hparams(miniwob_ppo.get_config("")),
                         algo="grpo", ent_coef=0.0, aux_loss_coef=0.0, kl_coef=0.0)
INPUTS = ModelInputs(IMAGE, tuple(CFG.merged_grid))


def _batch(rng, n_rows=4, reply=6):
  """Right-padded training rows `BOS <bytes> <vs> IMAGE*n <ve> <reply bytes>`, loss on the reply."""
  n = CFG.n_img_tokens
  rows = [[BOS, *rng.integers(0, 255, 3 + i)] + [VISION_START] + [IMAGE] * n + [VISION_END]
          for i in range(n_rows)]
  t = max(len(r) for r in rows) + reply + 2
  tokens = np.full((n_rows, t), PAD, np.int32)
  attn = np.zeros((n_rows, t), bool)
  loss = np.zeros((n_rows, t - 1), np.float32)
  for i, r in enumerate(rows):
    full = r + list(rng.integers(97, 123, reply))  # the "reply": lowercase letters
    tokens[i, :len(full)], attn[i, :len(full)] = full, True
    loss[i, len(r) - 1:len(full) - 1] = 1.0  # target j+1 is a reply token
  return dict(tokens=tokens, attn_mask=attn, loss_mask=loss, states=np.zeros((n_rows, t - 1), np.int32),
              pixel_values=rng.random((n_rows, 1, CFG.image_h, CFG.image_w, 3)).astype(np.float32),
              image_mask=np.ones((n_rows, 1), bool))


def _logp(params, gd, mb):
  return np.asarray(ppo.reference_logp(params, mb, None, policy_gd=gd, hp=HP, inputs=INPUTS))


# The trainer's optimiser (global-norm clip + AdamW), built once: it is a static jit argument.
LR = 1e-5
POPT = ppo.make_optimizer(LR, warmup_steps=1, max_grad_norm=1.0, weight_decay=0.0)


def _step(gd, params, mb, adv_per_row):
  state = {"step": jnp.zeros((), jnp.int32), "policy": jax.tree.map(jnp.copy, params)}
  state["policy_opt"] = POPT.init(state["policy"])
  mb = dict(mb, advantages=jnp.asarray(adv_per_row, jnp.float32)[:, None] * mb["loss_mask"])
  state, m = ppo.policy_step(state, mb, None, policy_gd=gd, popt=POPT, hp=HP, inputs=INPUTS)
  return state["policy"], m


def test_one_ppo_step_raises_positive_and_lowers_negative_advantage_tokens():
  gd, params = nnx.split(Policy(CFG, nnx.Rngs(0)))
  batch = {k: jnp.asarray(v) for k, v in _batch(np.random.default_rng(0)).items()}
  before = _logp(params, gd, batch)
  mb = dict(batch, old_logp=jnp.asarray(before))  # on-policy: ratio 1, no clipping at this step
  adv = np.array([1.0, 1.0, -1.0, -1.0])
  mask = np.asarray(batch["loss_mask"]) > 0
  pos, neg = mask & (adv[:, None] > 0), mask & (adv[:, None] < 0)

  new, m = _step(gd, params, mb, adv)
  assert float(m["clipfrac"]) == 0.0 and abs(float(m["ratio_mean"]) - 1.0) < 1e-5
  delta = _logp(new, gd, batch) - before
  # Every token moves the right way (lr 1e-5: changes of 0.007-0.06 nats), each by far more than the
  # float32 noise of a recomputation (eps32 * |logp ~ 6| ~ 1e-6): a sign error anywhere in ratio,
  # advantage or loss flips these.
  margin = 1e-3
  assert (delta[pos] > margin).all(), delta[pos]
  assert (delta[neg] < -margin).all(), delta[neg]

  # Negated advantages negate the step (Adam's first step and global-norm clipping are odd in the
  # gradient), so the change of each token flips sign with matching size (to first order in lr).
  new_neg, _ = _step(gd, params, mb, -adv)
  delta_neg = _logp(new_neg, gd, batch) - before
  assert (delta_neg[pos] < -margin).all() and (delta_neg[neg] > margin).all()
  np.testing.assert_allclose(delta_neg[mask], -delta[mask], rtol=0.1)

  # Zero advantage: the policy-gradient loss is constant, nothing moves.
  new_zero, m0 = _step(gd, params, mb, np.zeros(4))
  assert float(m0["policy_grad_norm"]) == 0.0
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, new_zero), jax.tree.map(np.asarray, params))
