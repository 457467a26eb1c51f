"""tars_jax.analysis.run_data against hand-computed values."""

import json
import os

import numpy as np

from tars_jax.analysis import run_data

ROWS = [
    {"step": 1, "reward": 0.5, "reward_terms/outcome": 0.5, "reward_terms/format": -0.1},
    {"step": 2, "reward": 0.7, "train/explained_variance": 0.25},
    {"step": 3, "reward": 0.9, "reward_terms/outcome": 1.0},
]


def test_series_skips_rows_without_the_key():
  x, y = run_data.series(ROWS, "reward_terms/outcome")
  np.testing.assert_array_equal(x, [1.0, 3.0])
  np.testing.assert_array_equal(y, [0.5, 1.0])
  x, y = run_data.series(ROWS, "think_tokens")
  assert x.shape == (0,) and y.shape == (0,)


def test_panel_keys_expands_prefixes_and_absent_keys():
  assert run_data.panel_keys(ROWS, ("reward", "reward_terms/*", "think_tokens")) == [
      "reward", "reward_terms/format", "reward_terms/outcome"]
  panels = (("a", ("reward", "think_tokens")), ("b", ("reward_terms/*", "train/clipfrac_*")))
  assert run_data.absent_keys(ROWS, panels) == ["think_tokens", "train/clipfrac_*"]


def test_smooth_trailing_mean_with_nans():
  # windows of 2: [1], [1,3], [3,nan], [nan,nan], [nan,5]
  out = run_data.smooth(np.array([1.0, 3.0, np.nan, np.nan, 5.0]), k=2)
  np.testing.assert_allclose(out, [1.0, 2.0, 3.0, np.nan, 5.0])
  np.testing.assert_allclose(run_data.smooth(np.array([2.0, 4.0, 6.0, 8.0]), k=3), [2.0, 3.0, 4.0, 6.0])


def test_reply_point():
  thought, action, pt = run_data.reply_point("Thought: the ONE button\nAction: click(start_box='(250,690)')", 160, 210)
  assert thought == "the ONE button" and action == "click(start_box='(250,690)')"
  np.testing.assert_allclose(pt, (0.25 * 160, 0.69 * 210))  # (40, 144.9)
  assert run_data.reply_point("Thought: \nAction: finished(content='x')", 160, 210)[2] is None
  assert run_data.reply_point("garbage", 160, 210) == ("", "garbage", None)


def test_saved_episodes(tmp_path):
  for it, ep in (("iter_00002", "ep_0"), ("iter_00001", "ep_1"), ("iter_00001", "ep_0")):
    d = tmp_path / "trajectories" / it / ep
    d.mkdir(parents=True)
    (d / "episode.json").write_text(json.dumps({"task": f"{it}/{ep}", "turns": []}))
  eps = run_data.saved_episodes(str(tmp_path))
  assert [e["task"] for e in eps] == ["iter_00001/ep_0", "iter_00001/ep_1", "iter_00002/ep_0"]
  assert eps[0]["dir"] == os.path.join(str(tmp_path), "trajectories", "iter_00001", "ep_0")
  assert len(run_data.saved_episodes(str(tmp_path), limit=2)) == 2
  assert run_data.saved_episodes(str(tmp_path / "nothing")) == []


def test_budget_and_success_curves():
  budgets = {"checkpoint": 2, "budgets": {"4": {"t": {"success": 0.75}}, "1": {"t": {"success": 0.25}},
                                          "2": {"t": {"success": 0.5}, "u": {"success": 1.0}}}}
  c = run_data.budget_curves(budgets)
  np.testing.assert_array_equal(c["t"][0], [1, 2, 4])
  np.testing.assert_array_equal(c["t"][1], [0.25, 0.5, 0.75])
  np.testing.assert_array_equal(c["u"][0], [2])
  a = run_data.success_curves({1.0: {"t": {"success": 0.5}}, 0.0: {"t": {"success": 0.25}}})
  np.testing.assert_array_equal(a["t"][0], [0.0, 1.0])
  np.testing.assert_array_equal(a["t"][1], [0.25, 0.5])
