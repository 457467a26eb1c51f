"""Token view of episodes: alignment of masks, rewards and log-probs, worked by hand."""

import numpy as np
import pytest

from tars_jax.agent.trajectory import Episode, Turn, collate, episode_arrays
from tars_jax.rl.rewards import RewardConfig, turn_reward_terms

PAD = 256


def _turn(obs, reply, reward, lp):
  return Turn(image=np.full((4, 2, 3), 255, np.uint8), obs_ids=obs, reply_ids=reply,
              logprobs=np.asarray(lp, np.float32), states=np.arange(len(reply), dtype=np.int32) + 1,
              reward=reward)


def _episode():
  ep = Episode(task="t", seed=0, instruction="", prefix_ids=[257, 10])
  ep.turns.append(_turn([262, 259], [65, 258], 0.0, [-0.5, -0.25]))
  ep.turns.append(_turn([263, 262, 259], [66, 258], 1.0, [-1.0, 0.0]))
  return ep


def test_episode_arrays_by_hand():
  a = episode_arrays(_episode())
  np.testing.assert_array_equal(a["tokens"], [257, 10, 262, 259, 65, 258, 263, 262, 259, 66, 258])
  np.testing.assert_array_equal(a["loss"], [0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1])
  # reward sits on the EOS that closes the turn that earned it
  np.testing.assert_array_equal(a["reward"], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1.0])
  np.testing.assert_allclose(a["logp"], [0, 0, 0, 0, -0.5, -0.25, 0, 0, 0, -1.0, 0])
  np.testing.assert_array_equal(a["state"], [0, 0, 0, 0, 1, 2, 0, 0, 0, 1, 2])


def test_collate_target_alignment_and_padding():
  ep = _episode()
  b = collate([ep], pad_id=PAD, max_images=3, image_hw=(4, 2), length_multiple=8, batch_size=2)
  assert b.tokens.shape == (2, 16) and b.loss_mask.shape == (2, 15)
  # target j is token j+1: the first reply token (65) is at input index 4 -> target index 3
  assert b.tokens[0, 4] == 65 and b.loss_mask[0, 3] == 1 and b.loss_mask[0, 2] == 0
  assert b.old_logp[0, 3] == pytest.approx(-0.5)
  assert b.rewards[0, 9] == 1.0 and b.rewards.sum() == 1.0
  assert b.attn_mask[0].sum() == 11 and not b.attn_mask[1].any()
  assert (b.tokens[0, 11:] == PAD).all()
  np.testing.assert_array_equal(b.image_mask, [[True, True, False], [False, False, False]])
  assert b.pixel_values[0, 0].max() == 1.0 and b.pixel_values[0, 2].max() == 0.0


def test_collate_rejects_too_many_turns():
  with pytest.raises(ValueError, match="max_images"):
    collate([_episode()], pad_id=PAD, max_images=1, image_hw=(4, 2))


def test_reward_terms():
  cfg = RewardConfig(outcome_weight=1.0, format_penalty=-0.1, truncation_reward=-1.0)
  t = turn_reward_terms(0.0, invalid=True, truncated=True, cfg=cfg)
  assert t == {"outcome": 0.0, "format": -0.1, "overlong": 0.0, "step": 0.0, "truncation": -1.0,
               "total": pytest.approx(-1.1)}
  assert turn_reward_terms(0.8, False, False, cfg)["total"] == pytest.approx(0.8)
