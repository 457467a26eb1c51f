"""Minibatches of the PPO update (`ppo.minibatch_rows`, `ppo.trim_padding`) and the buckets
(`trajectory.pow2_bucket`, `trajectory.half_octave_bucket`) that bound their jit shapes: pure logic,
checked by hand. The equality of trimmed and padded log-probs on a real rollout is in tests/test_on_policy.py."""

import numpy as np
import pytest

from tars_jax.agent.trajectory import half_octave_bucket, pow2_bucket
from tars_jax.train import ppo


def test_pow2_bucket_by_hand():
  assert [pow2_bucket(n, 64, 320) for n in (1, 64, 65, 128, 129, 300, 320)] == [64, 64, 128, 128, 256, 320, 320]
  assert [pow2_bucket(n, 1, 6) for n in (1, 2, 3, 4, 5, 6)] == [1, 2, 4, 4, 6, 6]
  assert pow2_bucket(3, 8, 32) == 8 and pow2_bucket(9, 8, 32) == 16
  with pytest.raises(ValueError, match="exceeds its cap"):
    pow2_bucket(7, 1, 6)


@pytest.mark.parametrize("by_length", [False, True])
def test_each_row_once_per_epoch_and_one_shape(by_length):
  rng = np.random.default_rng(0)
  rows = np.arange(29)
  lengths = rng.integers(40, 600, size=32)
  images = rng.integers(1, 7, size=32)
  mbs = ppo.minibatch_rows(rows, lengths, images, 8, rng, by_length)
  assert [len(m) for m in mbs] == [8, 8, 8, 8]
  firsts = np.concatenate([m for m in mbs])[:29] if not by_length else None
  seen = np.concatenate(mbs)
  assert set(seen) == set(rows)  # every row, and top-ups come from the set
  assert (np.unique(seen, return_counts=True)[1] - 1).sum() == 32 - 29  # only the 3 top-ups repeat
  if not by_length:  # the plain epoch: the permutation of the same generator, cut in order
    want = np.random.default_rng(0)
    want.integers(40, 600, size=32), want.integers(1, 7, size=32)
    np.testing.assert_array_equal(firsts, want.permutation(rows))


def test_by_length_groups_rows_of_one_shape():
  # 16 one-screen rows of ~200 tokens and 16 six-screen rows of ~600: every full minibatch holds one kind
  lengths = np.array([200] * 16 + [600] * 16)
  images = np.array([1] * 16 + [6] * 16)
  mbs = ppo.minibatch_rows(np.arange(32), lengths, images, 8, np.random.default_rng(1), True)
  assert all(len(set(images[m])) == 1 for m in mbs)
  assert sorted(np.concatenate(mbs).tolist()) == list(range(32))
  plain = ppo.minibatch_rows(np.arange(32), lengths, images, 8, np.random.default_rng(1), False)
  assert any(len(set(images[m])) == 2 for m in plain)  # what the grouping avoids


def test_half_octave_bucket_by_hand():
  ns = (1, 64, 65, 96, 97, 128, 129, 158, 192, 193, 257, 300, 385)
  assert [half_octave_bucket(n, 64, 1024) for n in ns] == [64, 64, 96, 96, 128, 128, 192, 192, 192, 256,
                                                            384, 384, 512]
  assert [half_octave_bucket(n, 64, 320) for n in (257, 320)] == [320, 320]  # capped
  with pytest.raises(ValueError, match="exceeds its cap"):
    half_octave_bucket(321, 64, 320)


def test_trim_padding_cuts_every_field_to_the_minibatch():
  b, t, m = 3, 320, 6
  mb = {"tokens": np.zeros((b, t), np.int32), "attn_mask": np.zeros((b, t), bool),
        "loss_mask": np.zeros((b, t - 1)), "advantages": np.zeros((b, t - 1)),
        "pixel_values": np.zeros((b, m, 4, 4, 3)), "image_mask": np.zeros((b, m), bool),
        "row_episode": np.arange(b)}
  out = ppo.trim_padding(mb, np.array([70, 100, 90]), np.array([1, 2, 3]))
  assert out["tokens"].shape == (b, 128) and out["attn_mask"].shape == (b, 128)
  assert out["loss_mask"].shape == (b, 127) and out["advantages"].shape == (b, 127)
  assert out["pixel_values"].shape == (b, 4, 4, 4, 3) and out["image_mask"].shape == (b, 4)
  assert out["row_episode"].shape == (b,)
  # the main job's one-screen rows (158 tokens) in a batch padded for two-screen ones: 192, not 256
  assert ppo.trim_padding(mb, np.array([158, 150, 140]), np.ones(3, int))["tokens"].shape == (b, 192)
  full = ppo.trim_padding(mb, np.array([300, 10, 10]), np.array([5, 1, 1]))
  assert full["tokens"].shape == (b, t) and full["pixel_values"].shape[1] == m
