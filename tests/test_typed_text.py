"""`rl.skip_typed_text`: the typed characters of a reply are found exactly (`typed_text_targets`, against
offsets computed from `actions.format_action`), and the PPO / GRPO policy loss then takes no gradient
from their advantages while every other token's still counts."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tars_jax.agent import actions as A
from tars_jax.agent.tokenizer import BOS, EOS, IMAGE, PAD, TURN_END, TURN_START, VISION_END, VISION_START
from experiments.configs import miniwob_ppo
from tars_jax.models import Policy
from tars_jax.rl.typed_text import typed_text_targets
from tars_jax.train import ppo
from tars_jax.train import state as state_lib
from tars_jax.train.step import ModelInputs
from _shared import TINY_CFG

CFG = TINY_CFG
INPUTS = ModelInputs(IMAGE, tuple(CFG.merged_grid))
HP = dataclasses.replace(state_lib.hparams(miniwob_ppo.get_config("")),
                         algo="grpo", ent_coef=0.0, aux_loss_coef=0.0, kl_coef=0.0)


def _row(parts):
  """parts: [(text or list of ids, is_reply)] -> (ids [T], loss [T-1], expected typed targets [T-1]).
  The expectation comes from the replies' own structure: the content of each Type action sits right
  after its `type(content='` prefix, `len(_q(content))` bytes long."""
  ids, reply, typed = [BOS], [False], [False]
  for part, is_reply in parts:
    if isinstance(part, tuple):  # (action, True): one reply that holds it
      action, = part
      text = "Action: " + A.format_action(action)
      mark = np.zeros(len(text.encode()), bool)
      if isinstance(action, A.Type):
        start = len(("Action: type(content='").encode())
        mark[start:start + len(A._q(action.content).encode())] = True
      ids += list(text.encode()) + [EOS]
      reply += [True] * (len(mark) + 1)
      typed += list(mark) + [False]
    else:
      chunk = list(part.encode()) if isinstance(part, str) else list(part)
      ids += chunk
      reply += [is_reply] * len(chunk)
      typed += [False] * len(chunk)
  ids, reply, typed = np.array(ids), np.array(reply), np.array(typed)
  return ids, reply[1:].astype(np.float32), typed[1:]


ROWS = [
    [("Type the name: type(content='Not me')", False), ([TURN_START], False), ((A.Type("Cheree"),), True),
     ([TURN_END, TURN_START], False), ((A.Click(3, 4),), True)],
    [("obs", False), ((A.Type("it's a \\ back\nslash"),), True), ("next obs", False),
     ((A.Type(""),), True), ("more", False), ((A.Finished("done"),), True)],
    [("prompt", False), ("Action: type(content='cut off", True)],  # no closing quote: nothing typed
]


def _batch(rows):
  built = [_row(r) for r in rows]
  t = max(len(ids) for ids, _, _ in built)
  tokens = np.full((len(built), t), PAD, np.int32)
  loss = np.zeros((len(built), t - 1), np.float32)
  want = np.zeros((len(built), t - 1), bool)
  for i, (ids, lm, ty) in enumerate(built):
    tokens[i, :len(ids)], loss[i, :len(lm)], want[i, :len(ty)] = ids, lm, ty
  return tokens, loss, want


def test_typed_characters_are_exactly_the_type_actions_content():
  tokens, loss, want = _batch(ROWS)
  got = typed_text_targets(tokens, loss)
  np.testing.assert_array_equal(got, want)
  assert want[0].sum() == len("Cheree") and want[1].sum() == len(A._q("it's a \\ back\nslash"))
  assert not want[2].any()
  # the same text outside a reply (the instruction of row 0) is never marked
  assert not got[0][:20].any()


def test_typed_text_targets_refuses_misaligned_shapes():
  tokens, loss, _ = _batch(ROWS)
  with pytest.raises(ValueError, match=r"tokens \[B, T\] and loss_mask \[B, T-1\]"):
    typed_text_targets(tokens, loss[:, :-1])


@pytest.fixture(scope="module")
def model():
  return nnx.split(Policy(CFG, nnx.Rngs(0)))


def _model_batch(rng):
  """Rows `BOS <instruction> <vs> IMAGE*n <ve> <reply typing a name, then a click>`: the reply is the loss."""
  n = CFG.n_img_tokens
  rows = [[("ab" * (i + 1), False), ([VISION_START] + [IMAGE] * n + [VISION_END], False),
           ((A.Type(name),), True), ([TURN_START], False), ((A.Click(i, 2),), True)]
          for i, name in enumerate(["Cheree", "Bo", "Ann", "Lisette"])]
  tokens, loss, typed = _batch(rows)
  attn = tokens != PAD
  attn[:, 0] = True
  return dict(tokens=tokens, attn_mask=attn, loss_mask=loss, states=np.zeros(loss.shape, np.int32),
              pixel_values=rng.random((len(rows), 1, CFG.image_h, CFG.image_w, 3)).astype(np.float32),
              image_mask=np.ones((len(rows), 1), bool)), typed


@functools.partial(jax.jit, static_argnames=("gd", "hp"))
def _grad_fn(params, mb, *, gd, hp):
  return jax.grad(lambda p: ppo.policy_loss(p, gd, None, mb, hp, INPUTS)[0])(params)


def _grad(model, mb, hp):
  gd, params = model
  return jax.tree.leaves(_grad_fn(params, mb, gd=gd, hp=hp))


def test_policy_loss_takes_no_gradient_from_the_typed_characters_advantages(model):
  gd, params = model
  b, typed = _model_batch(np.random.default_rng(0))
  b = {k: jnp.asarray(v) for k, v in b.items()}
  old = ppo.reference_logp(params, b, None, policy_gd=gd, hp=HP, inputs=INPUTS)
  rng = np.random.default_rng(1)
  adv = rng.normal(size=typed.shape).astype(np.float32) * np.asarray(b["loss_mask"])
  other = np.where(typed, rng.normal(size=typed.shape) * 5, adv).astype(np.float32)  # differs on typed only
  mb = dict(b, old_logp=old, **{ppo.TYPED_TEXT: jnp.asarray(typed, jnp.float32)})
  skip = dataclasses.replace(HP, skip_typed_text=True)
  g1 = _grad(model, dict(mb, advantages=jnp.asarray(adv)), skip)
  g2 = _grad(model, dict(mb, advantages=jnp.asarray(other)), skip)
  for x, y in zip(g1, g2):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # without the switch the typed characters' advantages move the gradient
  h1 = _grad(model, dict(mb, advantages=jnp.asarray(adv)), HP)
  h2 = _grad(model, dict(mb, advantages=jnp.asarray(other)), HP)
  assert max(float(jnp.abs(x - y).max()) for x, y in zip(h1, h2)) > 1e-3 * max(float(jnp.abs(x).max()) for x in h1)
  # ... and with it, the other tokens' advantages still do
  g3 = _grad(model, dict(mb, advantages=jnp.asarray(np.where(typed, adv, -adv))), skip)
  assert max(float(jnp.abs(x - y).max()) for x, y in zip(g1, g3)) > 1e-3 * max(float(jnp.abs(x).max()) for x in g1)


def test_ppo_update_masks_the_typed_characters_of_each_minibatch(model):
  """Through `ppo_update` (minibatches cut to their content): the policy gradient's share of the free
  decisions is the untyped reply tokens' share."""
  gd, params = model
  b, typed = _model_batch(np.random.default_rng(2))
  old = ppo.reference_logp(params, {k: jnp.asarray(v) for k, v in b.items()}, None, policy_gd=gd, hp=HP,
                           inputs=INPUTS)
  batch = dict(b, old_logp=np.asarray(old), rewards=np.zeros(typed.shape, np.float32))
  popt = ppo.make_optimizer(1e-5, warmup_steps=1, max_grad_norm=1.0, weight_decay=0.0)
  state = {"step": jnp.zeros((), jnp.int32), "policy": params, "policy_opt": popt.init(params)}
  skip = dataclasses.replace(HP, skip_typed_text=True)
  _, m = ppo.ppo_update(state, batch, None, policy_gd=gd, critic_gd=None, popt=popt, copt=None, hp=skip,
                        inputs=INPUTS, epochs=1, minibatch_size=4, rng=np.random.default_rng(0), n_real=4,
                        scores=np.array([1.0, 0.0, 1.0, 0.0]), group_ids=np.array([0, 0, 1, 1]))
  reply = b["loss_mask"] > 0
  np.testing.assert_allclose(m["pg_token_frac"], (reply & ~typed).sum() / reply.sum(), rtol=1e-6)
