"""Run metrics: one JSON line per iteration in `metrics.jsonl`, mirrored to TensorBoard."""

from __future__ import annotations

import json
import math
import os

import numpy as np

from tensorboardX import SummaryWriter

from tars_jax.agent import actions
from tars_jax.rl.rewards import thought_of


class MetricsWriter:
  """Appends `{"step": s, **scalars}` lines to `<workdir>/metrics.jsonl` and TensorBoard events.

  On resume from step `resume_step`, lines of later steps (written after that checkpoint by the run
  that died) are dropped so each step appears once, and so is a last line cut short by a kill -9
  in the middle of a write (it does not parse and has no newline).
  """

  def __init__(self, workdir: str, resume_step: int | None = None):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.tb_dir = os.path.join(workdir, "tensorboard")
    if resume_step is not None and os.path.exists(self.path):
      with open(self.path) as f:
        keep = [l for l in f if l.endswith("\n") and l.strip() and json.loads(l)["step"] <= resume_step]
      with open(self.path, "w") as f:
        f.writelines(keep)
    self._tb = SummaryWriter(self.tb_dir)

  def write(self, step: int, scalars: dict[str, float]) -> None:
    clean = {k: float(v) for k, v in scalars.items() if v is not None and math.isfinite(float(v))}
    with open(self.path, "a") as f:
      f.write(json.dumps({"step": int(step), **clean}) + "\n")
    for k, v in clean.items():
      self._tb.add_scalar(k, v, int(step))
    self._tb.flush()

  def close(self) -> None:
    self._tb.close()


def write_json(path: str, obj) -> str:
  """Writes `obj` as JSON at `path` atomically (a temporary file renamed into place): a process killed
  while writing leaves the old file or none, never a partial one (drivers take a stage's summary JSON
  as its "done" mark). Returns `path`."""
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2)
  os.replace(tmp, path)
  return path


def read_metrics(workdir: str) -> list[dict]:
  """All rows of `<workdir>/metrics.jsonl` (empty list if absent)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(l) for l in f if l.strip()]


def free_tokens(states: np.ndarray, num_allowed: np.ndarray | None) -> np.ndarray:
  """[n] bool: which reply tokens were sampled decisions (the grammar allowed more than one token).

  states: [n] int32 grammar state before each reply token (`Turn.states`; -1 = sampled without
  the grammar, a decision). num_allowed: [S] int, allowed tokens per grammar state
  (`(table >= 0).sum(-1)`), or None (no grammar: every token is a decision).
  The numpy twin of `rl.losses.decision_mask` for episodes (turns) instead of padded batches.
  """
  states = np.asarray(states, np.int64)
  if num_allowed is None:
    return np.ones(states.shape, bool)
  return (states < 0) | (np.asarray(num_allowed)[np.maximum(states, 0)] > 1)


# Coordinates compared as written (whatever the run's coordinate mode): a huge "absolute" screen
# accepts every non-negative point and maps distinct points to distinct keys.
_ANY_COORDS = actions.CoordSpec("absolute", width=10 ** 9, height=10 ** 9)


def click_point(text: str) -> tuple[float, float] | None:
  """The point a reply acts on (click, left_double, right_single, scroll; a drag's start), in the
  reply's own coordinates scaled by 1e-9 (only equality matters); None for a reply that does not
  parse or whose action has no point (type, hotkey, wait, ...)."""
  try:
    a = actions.parse(text, _ANY_COORDS)
  except actions.ActionParseError:
    return None
  if isinstance(a, actions.Drag):
    return (a.x1, a.y1)
  if isinstance(a, (actions.Click, actions.LeftDouble, actions.RightSingle, actions.Scroll)):
    return (a.x, a.y)
  return None


def distinct_clicks_per_screen(screens: list[tuple[str, int]], clicks: list) -> float:
  """How spread the first clicks are on each screen: collapse onto one fixed click shows as 1.

  screens: [N] (task, seed) of each episode (a group of a group baseline); clicks: [N] the point
  of its first-turn action (`click_point`) or None (no point: not counted as a click).
  With groups (some (task, seed) holds >= 2 episodes): the number of distinct points among each
  group's first clicks, averaged over groups of >= 2 episodes (a group whose other episodes were
  lost says nothing about spread); between 0 and the group size.
  Without groups (every (task, seed) holds one episode, group_size 1 / PPO): for each task, the
  number of distinct first clicks over its episodes divided by its episodes, averaged over tasks;
  in (0, 1], 1 / episodes when every episode of the task clicks the same point.
  0.0 for no episodes.
  Raises: ValueError if the two lists differ in length.
  """
  if len(screens) != len(clicks):
    raise ValueError(f"{len(screens)} screens but {len(clicks)} clicks")
  groups: dict[tuple[str, int], list] = {}
  for key, c in zip(screens, clicks):
    groups.setdefault(tuple(key), []).append(c)
  if any(len(g) > 1 for g in groups.values()):
    return float(np.mean([len({c for c in g if c is not None}) for g in groups.values() if len(g) > 1]))
  by_task: dict[str, list] = {}
  for (task, _), g in groups.items():
    by_task.setdefault(task, []).extend(g)
  if not by_task:
    return 0.0
  return float(np.mean([len({c for c in g if c is not None}) / len(g) for g in by_task.values()]))


def exploration_metrics(episodes, table=None) -> dict[str, float]:
  """`explore/*` statistics of an iteration's episodes: how much the policy still explores.

  entropy_free: mean over sampled (free) decisions of -log p of the sampled token under the
    distribution the sampler drew from (`Turn.logprobs`: grammar-masked, temperature-scaled), in
    nats: a Monte-Carlo estimate of the entropy per decision at rollout time (its expectation is
    the entropy). Grammar-forced tokens (log-prob 0) are left out, so it does not move with reply
    length or format; 0 = every decision collapsed onto one token.
  free_decisions_per_turn: free decisions per reply (turn).
  distinct_clicks_per_screen: `distinct_clicks_per_screen` of the first-turn actions.
  table: [S, V] grammar table (numpy or jax; -1 = not allowed) the replies were sampled under, or
    None (no grammar: every reply token is a decision).
  """
  num_allowed = None if table is None else (np.asarray(table) >= 0).sum(-1)
  turns = [t for e in episodes for t in e.turns]
  free = [free_tokens(t.states, num_allowed) for t in turns]
  n_free = sum(int(f.sum()) for f in free)
  neg_logp = sum(float(-np.asarray(t.logprobs, np.float64)[f].sum()) for t, f in zip(turns, free))
  return {
      "explore/entropy_free": neg_logp / max(1, n_free),
      "explore/free_decisions_per_turn": n_free / max(1, len(turns)),
      "explore/distinct_clicks_per_screen": distinct_clicks_per_screen(
          [(e.task, e.seed) for e in episodes], [click_point(e.turns[0].text) if e.turns else None
                                                 for e in episodes]),
  }


def think_tokens(turns, tokenizer) -> float:
  """Mean tokens (`tokenizer.encode`) of the `Thought:` text of `turns`' replies (0 for a reply
  without one); NaN for no turns. The think length of report section 2.5.3 (docs/replication.md row 5)."""
  return float(np.mean([len(tokenizer.encode(thought_of(t.text))) for t in turns])) if turns else float("nan")


def think_tokens_per_task(episodes, tokenizer) -> dict[str, float]:
  """{task: `think_tokens` over the turns of its scored (not lost) episodes} (held-out evaluations)."""
  return {task: think_tokens([t for e in episodes if e.task == task and not e.lost for t in e.turns], tokenizer)
          for task in sorted({e.task for e in episodes})}


def episode_metrics(episodes, tasks, tokenizer, table=None) -> dict[str, float]:
  """Per-iteration episode statistics (overall and per task); think_tokens = mean tokens of a
  reply's `Thought:` text (`think_tokens`), steps_per_episode = episode_length = mean turns per episode; plus
  `exploration_metrics(episodes, table)` (pass the grammar table the run samples under)."""
  turns = [t for e in episodes for t in e.turns]
  m = {
      "reward": float(np.mean([e.env_return for e in episodes])),
      "shaped_return": float(np.mean([e.shaped_return for e in episodes])),
      "success_rate": float(np.mean([e.success for e in episodes])),
      "episode_length": float(np.mean([len(e.turns) for e in episodes])),
      "invalid_action_rate": float(np.sum([e.num_invalid for e in episodes]) /
                                   max(1, sum(len(e.turns) for e in episodes))),
      "truncated_rate": float(np.mean([e.truncated for e in episodes])),
      "reply_tokens": float(np.mean([len(t.reply_ids) for t in turns])),
      "think_tokens": think_tokens(turns, tokenizer),
  }
  m["steps_per_episode"] = m["episode_length"]
  for task in tasks:
    eps = [e for e in episodes if e.task == task]
    if eps:
      m[f"success/{task}"] = float(np.mean([e.success for e in eps]))
  m.update(exploration_metrics(episodes, table))
  return m
