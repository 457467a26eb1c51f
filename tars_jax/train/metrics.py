"""Run metrics: one JSON line per iteration in `metrics.jsonl`, mirrored to TensorBoard."""

from __future__ import annotations

import json
import math
import os

import numpy as np

from tensorboardX import SummaryWriter

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


def read_metrics(workdir: str) -> list[dict]:
  """All rows of `<workdir>/metrics.jsonl` (empty list if absent)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(l) for l in f if l.strip()]


def episode_metrics(episodes, tasks, tokenizer) -> dict[str, float]:
  """Per-iteration episode statistics (overall and per task); think_tokens = mean tokens of a
  reply's `Thought:` text, steps_per_episode = episode_length = mean turns per episode."""
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
      "think_tokens": float(np.mean([len(tokenizer.encode(thought_of(t.text))) for t in turns])),
  }
  m["steps_per_episode"] = m["episode_length"]
  for task in tasks:
    eps = [e for e in episodes if e.task == task]
    if eps:
      m[f"success/{task}"] = float(np.mean([e.success for e in eps]))
  return m
