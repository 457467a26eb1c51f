"""`rl.freeze_vision` (`ppo.PPOHparams.freeze_vision`): the PPO update computes each model's screenshot
features once per rollout batch and never moves the vision encoders. Checked against the update that
trains them: the model's outputs from precomputed features equal those from the screenshots, and one
PPO step moves every other parameter exactly as the unfrozen step does (no gradient of the decoder or
heads passes through the encoder's parameters; plain SGD, no clipping, so nothing couples them)."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

from experiments.configs import miniwob_ppo
from tars_jax.train import ppo
from tars_jax.train import state as state_lib
from tars_jax.train import step as step_lib
from tars_jax.train import value_pretrain
from test_ptx import _batch as _ptx_batch


def _batch(parts, cfg, b, t, seed):
  """`test_ptx._batch` (random tokens, one screenshot's IMAGE block a row) with the loss on the last 40
  positions, a +-1 reward on the last one and one screenshot slot in use."""
  batch = _ptx_batch(parts, cfg, b, t, seed, slice(t - 41, t - 1))
  batch["rewards"][:, t - 2] = np.random.default_rng(seed).choice([-1.0, 1.0], b)
  batch["image_mask"][:, 1:] = False
  return batch


@pytest.fixture(scope="module")
def setup():
  cfg = miniwob_ppo.get_config("smoke")
  parts = state_lib.build(cfg)
  return cfg, parts, _batch(parts, cfg, 4, 320, 0)


def _is_visual(path) -> bool:
  return any(getattr(k, "key", None) == "visual" for k in path)


def _split(tree):
  """(leaves inside the vision encoder, the other leaves) of a parameter tree, as numpy arrays."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return ([np.asarray(v) for p, v in flat if _is_visual(p)], [np.asarray(v) for p, v in flat if not _is_visual(p)])


def test_precomputed_features_give_the_models_own_outputs(setup):
  cfg, parts, batch = setup
  state = parts.init_state(0)
  b = {k: jax.numpy.asarray(v) for k, v in batch.items()}
  for gd, params in ((parts.policy_gd, state["policy"]), (parts.critic_gd, state["critic"])):
    feats = step_lib.image_features(gd, params, b["pixel_values"], b["image_mask"])
    n = parts.model_cfg.n_img_tokens
    assert feats.shape[:2] == b["pixel_values"].shape[:2] and feats.shape[3] == n
    assert not np.asarray(feats[:, 1:]).any()  # unused screenshot slots are zeros
    want = np.asarray(step_lib.forward(gd, params, b, parts.inputs)[0])
    got = np.asarray(step_lib.forward(gd, params, {k: v for k, v in b.items() if k != "pixel_values"},
                                      parts.inputs, feats)[0])
    np.testing.assert_allclose(got, want, atol=1e-5 * max(1.0, float(np.abs(want).max())))


SGD = optax.sgd(1.0)  # the step is minus the gradient: compared linearly (Adam's g / (|g| + eps) is not)


def _init(parts):
  state = parts.init_state(0)
  return dict(state, policy_opt=SGD.init(state["policy"]), critic_opt=SGD.init(state["critic"]))


def _one_step(parts, batch, freeze):
  hp = dataclasses.replace(parts.hparams, freeze_vision=freeze)
  # 4 rows, minibatches of 4, one epoch: exactly one policy and one critic step
  return ppo.ppo_update(_init(parts), batch, None, policy_gd=parts.policy_gd, critic_gd=parts.critic_gd,
                        popt=SGD, copt=SGD, hp=hp, inputs=parts.inputs, epochs=1, minibatch_size=4,
                        rng=np.random.default_rng(0), n_real=4)


@pytest.mark.long  # ~1 min: two compiled PPO updates of a tiny policy and critic
def test_a_frozen_step_keeps_the_encoders_and_moves_the_rest_as_the_unfrozen_step(setup):
  cfg, parts, batch = setup
  init = _init(parts)
  frozen, fm = _one_step(parts, batch, True)
  trained, tm = _one_step(parts, batch, False)
  for model in ("policy", "critic"):
    vis0, _ = _split(init[model])
    vis_f, rest_f = _split(frozen[model])
    vis_t, rest_t = _split(trained[model])
    assert vis0 and all(np.array_equal(a, b) for a, b in zip(vis_f, vis0))  # bit-equal: not moved at all
    assert any(not np.array_equal(a, b) for a, b in zip(vis_t, vis0))  # the unfrozen step does move them
    _, rest0 = _split(init[model])
    moved = max(float(np.abs(a - b).max()) for a, b in zip(rest_t, rest0))
    assert moved > 0
    for a, b, c in zip(rest_f, rest_t, rest0):  # every other parameter: the same step
      np.testing.assert_allclose(a - c, b - c, atol=1e-4 * moved)
  for k in ("pg_loss", "value_loss", "entropy", "explained_variance"):
    assert fm[k] == pytest.approx(tm[k], rel=1e-4, abs=1e-6)


def test_ptx_gradient_under_freeze_skips_the_encoder_and_keeps_the_rest(setup):
  """PPO-ptx's demonstration gradient with the encoder frozen: zero on the encoder (its backward is not
  run), every other leaf as the unfrozen gradient's."""
  cfg, parts, batch = setup
  state = parts.init_state(0)
  demos = {k: jax.numpy.asarray(batch[k]) for k in ("tokens", "attn_mask", "loss_mask", "states", "pixel_values",
                                                    "image_mask")}
  grads = {}
  for freeze in (True, False):
    hp = dataclasses.replace(parts.hparams, freeze_vision=freeze, ptx_coef=1.0)
    grads[freeze], _ = ppo.ptx_gradients(state["policy"], demos, None, policy_gd=parts.policy_gd, hp=hp,
                                         inputs=parts.inputs)
  vis_f, rest_f = _split(grads[True])
  vis_t, rest_t = _split(grads[False])
  assert vis_f and not any(a.any() for a in vis_f) and any(a.any() for a in vis_t)
  scale = max(float(np.abs(a).max()) for a in rest_t)
  assert scale > 0
  for a, b in zip(rest_f, rest_t):
    np.testing.assert_allclose(a, b, atol=1e-5 * scale)


def test_keep_frozen_takes_only_the_named_modules_from_the_old_tree():
  old = {"trunk": {"visual": {"w": np.zeros(2)}, "decoder": {"w": np.zeros(2)}}, "head": np.zeros(1)}
  new = jax.tree.map(lambda x: x + 1, old)
  out = ppo.keep_frozen(new, old)
  assert (out["trunk"]["visual"]["w"] == 0).all()
  assert (out["trunk"]["decoder"]["w"] == 1).all() and (out["head"] == 1).all()
  assert (ppo.keep_frozen(new, old, ())["trunk"]["visual"]["w"] == 1).all()


def test_value_pretraining_trains_the_whole_critic():
  hp = dataclasses.replace(state_lib.hparams(miniwob_ppo.get_config("smoke")), freeze_vision=True)
  assert value_pretrain.pretrain_hparams(hp).freeze_vision is False
