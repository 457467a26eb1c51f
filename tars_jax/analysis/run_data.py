"""Reading run directories for plots (experiments/plot.py) and the notebooks (`notebooks/`): reading a run's metrics into series, the
training-dynamics panels and which of their keys a run logged, smoothing, the clicked point of a
reply, the saved episodes of `<run>/trajectories/`, and success against step budget / merge weight.

Nothing here defines absl flags, so a notebook may import it next to one `experiments.*` module
(experiments/plot.py and experiments/eval.py both define --run: import at most one of them).
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import TYPE_CHECKING, Sequence

import numpy as np

from tars_jax.agent import actions
from tars_jax.train.metrics import read_metrics

if TYPE_CHECKING:
  from tars_jax.agent.trajectory import Episode

__all__ = ["read_metrics", "TRAINING_PANELS", "series", "panel_keys", "absent_keys", "smooth",
           "reply_point", "rollout_episodes", "saved_episodes", "budget_curves", "success_curves"]

# Training-dynamics panels of notebooks/training_dynamics.ipynb: (title, keys). A key ending in '*'
# stands for every logged key with that prefix (reward_terms/* = each reward-shaping term).
TRAINING_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward and success", ("reward", "shaped_return", "success_rate")),
    ("reward-shaping terms (per episode)", ("reward_terms/*",)),
    ("entropy per free decision (nats)", ("explore/entropy_free", "train/entropy")),
    ("think length (tokens per turn)", ("think_tokens",)),
    ("steps per episode", ("steps_per_episode",)),
    ("critic: explained variance, corr(value, return)", ("train/explained_variance", "train/value_return_corr")),
    ("clip fractions", ("train/clipfrac_low", "train/clipfrac_high", "train/vf_clipfrac")),
    ("informative fraction of episodes", ("train/informative_fraction",)),
)


def series(rows: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
  """(steps, values) as float arrays over the rows that have `key` (rows without it are skipped)."""
  xs = [(r["step"], r[key]) for r in rows if key in r]
  return np.array([x for x, _ in xs], float), np.array([y for _, y in xs], float)


def panel_keys(rows: Sequence[dict], keys: Sequence[str]) -> list[str]:
  """The keys of `keys` that some row has, '<prefix>*' expanded to the logged keys with that prefix
  (sorted); order as given."""
  logged = {k for r in rows for k in r}
  out = []
  for k in keys:
    if k.endswith("*"):
      out.extend(sorted(x for x in logged if x.startswith(k[:-1])))
    elif k in logged:
      out.append(k)
  return out


def absent_keys(rows: Sequence[dict], panels=TRAINING_PANELS) -> list[str]:
  """Keys of `panels` that no row has ('<prefix>*' counts as absent when no key has the prefix)."""
  return [k for _, keys in panels for k in keys if not panel_keys(rows, [k])]


def smooth(y: np.ndarray, k: int = 5) -> np.ndarray:
  """Trailing moving average over k points (over fewer at the start); NaNs are skipped in each window
  (NaN when a whole window is NaN)."""
  y = np.asarray(y, float)
  out = np.full(len(y), np.nan)
  for i in range(len(y)):
    w = y[max(0, i + 1 - k): i + 1]
    if np.any(~np.isnan(w)):
      out[i] = np.nanmean(w)
  return out


def reply_point(reply: str, width: int, height: int) -> tuple[str, str, tuple[float, float] | None]:
  """(thought, action text, clicked point in pixels or None) of a `Thought: …\\nAction: …` reply on a
  `width` x `height` screenshot (coordinates on the 0-1000 grid, `actions.CoordSpec()`). A reply that
  does not parse gives ('', the reply, None); an action without a point (type, finished) gives None."""
  try:
    thought, action = actions.parse_response(reply)
  except actions.ActionParseError:
    return "", reply, None
  text = reply.split("Action:", 1)[1].strip() if "Action:" in reply else reply
  px = actions.to_pixels(action, width, height)
  if "x" in px:
    return thought, text, (px["x"], px["y"])
  if "x1" in px:
    return thought, text, (px["x1"], px["y1"])
  return thought, text, None


def rollout_episodes(run_rollouts: str) -> list[tuple[int, Episode]]:
  """(iteration, Episode) of every episode in a run's rollout records (experiments/train.py writes
  `iter_<n>-<k>.array_record` shards into `<run>/rollouts`; the iteration, 1-based, from each shard's
  name), in shard then record order. Raises FileNotFoundError when the directory holds no dataset.json."""
  from tars_jax.data import records
  shards = records.read_index(run_rollouts)["shards"]
  iters = [it for s in shards for it in [int(re.match(r"iter_(\d+)", s["file"]).group(1))] * s["records"]]
  eps = records.read_episodes(run_rollouts)  # shard order, then record order: aligned with `iters`
  return [(it, ep) for it, (ep, _) in zip(iters, eps, strict=True)]


def saved_episodes(run: str, limit: int | None = None) -> list[dict]:
  """Episodes saved for inspection under `<run>/trajectories/<iter>/ep_*/episode.json` (train.py's
  `log_trajectories`), in directory order, each the JSON with 'dir' added (its screenshots are
  `os.path.join(ep['dir'], turn['screenshot'])`). At most `limit`."""
  paths = sorted(glob.glob(os.path.join(run, "trajectories", "*", "ep_*", "episode.json")))
  out = []
  for p in paths[:limit]:
    with open(p) as f:
      out.append(dict(json.load(f), dir=os.path.dirname(p)))
  return out


def budget_curves(budgets: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """{task: (budgets ascending, success)} of `experiments.eval --max_turns ... --json`'s output
  (`{"checkpoint", "budgets": {"2": {task: {"success", ...}}, ...}}`)."""
  return success_curves({int(b): s for b, s in budgets["budgets"].items()})


def success_curves(results: dict[float, dict]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """{task: (x ascending, success)} of {x: {task: {"success", ...}}}: one evaluation per x (a merge
  weight α of θ(α), a step budget)."""
  xs = sorted(results)
  tasks = sorted({t for x in xs for t in results[x]})
  return {t: (np.array([x for x in xs if t in results[x]], float),
              np.array([results[x][t]["success"] for x in xs if t in results[x]], float)) for t in tasks}
