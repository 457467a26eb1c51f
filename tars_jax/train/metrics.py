"""Run metrics: one JSON line per iteration in `metrics.jsonl`, mirrored to TensorBoard."""

from __future__ import annotations

import json
import math
import os

from tensorboardX import SummaryWriter


class MetricsWriter:
  """Appends `{"step": s, **scalars}` lines to `<workdir>/metrics.jsonl` and TensorBoard events.

  On resume from step `resume_step`, lines of later steps (written after that checkpoint by the run
  that died) are dropped so each step appears once.
  """

  def __init__(self, workdir: str, resume_step: int | None = None):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.tb_dir = os.path.join(workdir, "tensorboard")
    if resume_step is not None and os.path.exists(self.path):
      with open(self.path) as f:
        keep = [l for l in f if l.strip() and json.loads(l)["step"] <= resume_step]
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
