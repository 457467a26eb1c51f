"""Wall-clock guard of a training stage whose budget is a count (updates, iterations).

Every stage ends on a count, so the same config gives the same run on a slower or busier host
(docs/ARCHITECTURE.md, "Research standards"). `max_minutes` is only a guard against a hung or far too
slow host: when it trips, the stage checkpoints what it has and stops loudly with `GuardTripped` (exit
status `EXIT_TRIPPED` through `exit_on_trip`, the message naming the stage and the count reached). The
guard counts this process's time only, so running the same command again resumes from that checkpoint
and continues to the count (experiments/replicate.py does so itself, `--guard_retries`).
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Callable

# Exit status of a stage stopped by its guard (sysexits.h EX_TEMPFAIL): it checkpointed and the same
# command continues it, so a driver (experiments/replicate.py) can resume it rather than count a failure.
EXIT_TRIPPED = 75


class GuardTripped(RuntimeError):
  """A stage ran past its wall-clock guard before reaching its count budget.

  Attributes: stage (e.g. "sft"), count (updates / iterations made), total (the budget), unit.
  """

  def __init__(self, stage: str, count: int, total: int, unit: str, max_minutes: float):
    super().__init__(
        f"[{stage}] wall-clock guard of {max_minutes:g} min tripped at {unit} {count} of {total}: the stage "
        f"stopped before its count budget (checkpoint saved at {count}; run the same command again to "
        f"continue, or raise the stage's max_minutes for this host)")
    self.stage, self.count, self.total, self.unit = stage, count, total, unit


class Guard:
  """Wall-clock guard of one process of a stage.

  Args:
    stage: the stage's name in messages ("sft", "train", "vpt", "orm").
    max_minutes: the guard (minutes of this process, `exclude`d time not counted).
    total: the count budget; unit: what it counts ("step", "iteration").
  """

  def __init__(self, stage: str, max_minutes: float, total: int, unit: str):
    self.stage, self.max_minutes, self.total, self.unit = stage, float(max_minutes), int(total), unit
    self.t0, self.excluded_s = time.time(), 0.0

  def minutes(self) -> float:
    """Minutes of this process so far, excluded time (evaluations) not counted."""
    return (time.time() - self.t0 - self.excluded_s) / 60

  def exclude(self, seconds: float) -> None:
    """Leaves `seconds` (e.g. an evaluation's) out of the guarded time."""
    self.excluded_s += seconds

  def tripped(self) -> bool:
    return self.minutes() > self.max_minutes

  def error(self, count: int) -> GuardTripped:
    return GuardTripped(self.stage, count, self.total, self.unit, self.max_minutes)


def exit_on_trip(main: Callable) -> Callable:
  """`main(argv)` for `absl.app.run`: a `GuardTripped` prints its message (stage, count reached, the
  checkpoint) to stderr and exits with `EXIT_TRIPPED` instead of a traceback and status 1."""

  @functools.wraps(main)
  def run(*args, **kwargs):
    try:
      return main(*args, **kwargs)
    except GuardTripped as e:
      print(f"GuardTripped: {e}", file=sys.stderr, flush=True)
      sys.exit(EXIT_TRIPPED)
  return run
