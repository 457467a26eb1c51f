"""experiments/plot.py run figure: the exploration row (entropy per free decision, informative
fraction, distinct clicks per screen against iteration) draws exactly the values of metrics.jsonl."""

import json
import os

import numpy as np
import pytest

from experiments import plot
from tars_jax.train.metrics import read_metrics

ROWS = [
    {"step": 1, "episodes_total": 16, "reward": 0.2, "success_rate": 0.2, "train/entropy": 1.9,
     "explore/entropy_free": 2.1, "train/informative_fraction": 0.75, "explore/distinct_clicks_per_screen": 3.5},
    {"step": 2, "episodes_total": 32, "reward": 0.5, "success_rate": 0.5, "train/entropy": 0.8,
     "explore/entropy_free": 0.9, "train/informative_fraction": 0.5, "explore/distinct_clicks_per_screen": 2.0},
    # a row without the update (all episodes lost): only what it has
    {"step": 3, "episodes_total": 48, "reward": 0.5, "success_rate": 0.5},
    {"step": 4, "episodes_total": 64, "reward": 1.0, "success_rate": 1.0, "train/entropy": 0.01,
     "explore/entropy_free": 0.0, "train/informative_fraction": 0.0, "explore/distinct_clicks_per_screen": 1.0},
]


def _line(ax, label):
  (line,) = [l for l in ax.lines if l.get_label() == label]
  return np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)


def test_run_figure_exploration_panels_hold_the_metrics(tmp_path):
  with open(tmp_path / "metrics.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in ROWS)
  rows = read_metrics(str(tmp_path))
  fig = plot.run_figure(rows, "run")
  ent, inf, clicks = fig.axes[3:6]
  assert [a.get_title() for a in (ent, inf, clicks)] == [t for t, _ in plot.EXPLORE_PANELS]
  assert all(a.get_xlabel() == "iteration" for a in (ent, inf, clicks))
  nan = np.nan
  for ax, label, want in ((ent, "sampled (rollout)", [2.1, 0.9, nan, 0.0]),
                          (ent, "update (mean over steps)", [1.9, 0.8, nan, 0.01]),
                          (inf, "informative episodes", [0.75, 0.5, nan, 0.0]),
                          (clicks, "distinct clicks", [3.5, 2.0, nan, 1.0])):
    x, y = _line(ax, label)
    np.testing.assert_array_equal(x, [1, 2, 3, 4])  # iterations, not episodes
    np.testing.assert_array_equal(y, want)  # raw values, not smoothed
  out = plot.plot_run(str(tmp_path), str(tmp_path / "curve.png"))
  assert os.path.getsize(out) > 10_000


def test_run_figure_leaves_out_metrics_no_row_has():
  rows = [{k: v for k, v in r.items() if not k.startswith("explore/")} for r in ROWS]
  fig = plot.run_figure(rows)
  ent, _, clicks = fig.axes[3:6]
  assert [l.get_label() for l in ent.lines] == ["update (mean over steps)"] and not clicks.lines
  with pytest.raises(ValueError, match="no metrics rows"):
    plot.run_figure([])
