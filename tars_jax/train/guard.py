"""Wall-clock guard of a training stage whose budget is a count (updates, iterations).

Every stage ends on a count, so the same config gives the same run on a slower or busier host
(docs/ARCHITECTURE.md, "Research standards"). `max_minutes` is only a guard against a hung or far too
slow host: when it trips, the stage checkpoints what it has and stops loudly with `GuardTripped` (exit
status `EXIT_TRIPPED` through `exit_on_trip`, the message naming the stage and the count reached). The
guard counts this process's time only, so running the same command again resumes from that checkpoint
and continues to the count (experiments/replicate.py does so itself, `--guard_retries`).

SIGTERM (pkill, a scheduler's pre-emption, the end of a session) stops a stage the same way
(`stop_on_sigterm`, installed by tars_jax/train/run.py): the loop checkpoints at its next step and exits
with 128 + SIGTERM, so the work since the last periodic checkpoint is kept. A stage that does not reach
its next step within `STOP_GRACE_S` (an RL rollout, an evaluation) exits then, unwinding through
`finally` and resuming from its last periodic checkpoint. A repeated SIGTERM changes nothing (a stage
of experiments/replicate.py gets one from the driver and often one from whoever stopped the driver);
SIGKILL stops a stage at once.
"""

from __future__ import annotations

import functools
import signal
import sys
import time
from typing import Callable

# Exit status of a stage stopped by its guard (sysexits.h EX_TEMPFAIL): it checkpointed and the same
# command continues it, so a driver (experiments/replicate.py) can resume it rather than count a failure.
EXIT_TRIPPED = 75
# Seconds a SIGTERM'd stage has to reach its next step and checkpoint before it exits without one: inside
# the 30 s a scheduler (Kubernetes, GCE pre-emption) allows before SIGKILL, so `finally` still runs.
STOP_GRACE_S = 20


class StageStopped(RuntimeError):
  """A stage stopped before its count budget, after checkpointing the count it reached.

  Attributes: stage (e.g. "sft"), count (updates / iterations made), total (the budget), unit, and
  exit_status (the process's exit status, `exit_on_trip`).
  """
  exit_status = 1

  def __init__(self, message: str, stage: str, count: int, total: int, unit: str):
    super().__init__(message)
    self.stage, self.count, self.total, self.unit = stage, count, total, unit


class GuardTripped(StageStopped):
  """A stage ran past its wall-clock guard before reaching its count budget (exit status EXIT_TRIPPED)."""
  exit_status = EXIT_TRIPPED

  def __init__(self, stage: str, count: int, total: int, unit: str, max_minutes: float):
    super().__init__(
        f"[{stage}] wall-clock guard of {max_minutes:g} min tripped at {unit} {count} of {total}: the stage "
        f"stopped before its count budget (checkpoint saved at {count}; run the same command again to "
        f"continue, or raise the stage's max_minutes for this host)", stage, count, total, unit)


class Terminated(StageStopped):
  """A stage stopped by a signal (SIGTERM) at `count`, after checkpointing it (exit status 128 + signal)."""

  def __init__(self, stage: str, count: int, total: int, unit: str, signum: int):
    super().__init__(
        f"[{stage}] {signal.Signals(signum).name} received: stopped at {unit} {count} of {total} (checkpoint "
        f"saved at {count}; run the same command again to continue)", stage, count, total, unit)
    self.exit_status = 128 + signum


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
    self.signum: int | None = None  # the signal that asked the stage to stop (`stop_on_sigterm`)

  def minutes(self) -> float:
    """Minutes of this process so far, excluded time (evaluations) not counted."""
    return (time.time() - self.t0 - self.excluded_s) / 60

  def exclude(self, seconds: float) -> None:
    """Leaves `seconds` (e.g. an evaluation's) out of the guarded time."""
    self.excluded_s += seconds

  def tripped(self) -> bool:
    """Whether the loop must checkpoint and stop: past `max_minutes`, or asked to by a signal."""
    return self.signum is not None or self.minutes() > self.max_minutes

  def error(self, count: int) -> StageStopped:
    """Why the loop stopped at `count`, to raise after its checkpoint: `Terminated`, `GuardTripped`, or
    (neither here: a multi-process run stops where any of its processes does) a plain `StageStopped`."""
    if self.signum is not None:
      return Terminated(self.stage, count, self.total, self.unit, self.signum)
    if self.minutes() > self.max_minutes:
      return GuardTripped(self.stage, count, self.total, self.unit, self.max_minutes)
    return StageStopped(f"[{self.stage}] stopped at {self.unit} {count} of {self.total} with another process "
                        f"of the run (its guard or a signal; checkpoint saved at {count})", self.stage, count,
                        self.total, self.unit)


def stop_on_sigterm(guard: Guard, grace_s: float = STOP_GRACE_S) -> None:
  """Makes SIGTERM trip `guard` (the loop checkpoints at its next step, then raises `Terminated`); if the
  process is still running `grace_s` seconds after the first SIGTERM, it exits with 128 + SIGTERM
  through `finally` (sandbox servers stop) and resumes from its last periodic checkpoint. Later SIGTERMs
  are ignored. Call from the main thread (Python runs signal handlers there)."""

  def exit_now(signum, frame):
    sys.exit(128 + signal.SIGTERM)

  def on_sigterm(signum, frame):
    if guard.signum is not None:  # already stopping, its grace timer running
      return
    guard.signum = signum
    print(f"[{guard.stage}] {signal.Signals(signum).name} received: checkpointing at the next {guard.unit} "
          f"(or exiting in {grace_s:g} s)", file=sys.stderr, flush=True)
    signal.signal(signal.SIGALRM, exit_now)
    signal.setitimer(signal.ITIMER_REAL, grace_s)

  signal.signal(signal.SIGTERM, on_sigterm)


def exit_on_trip(main: Callable) -> Callable:
  """`main(argv)` for `absl.app.run`: a `StageStopped` prints its message (stage, count reached, the
  checkpoint) to stderr and exits with its `exit_status` (`EXIT_TRIPPED` for the guard, 128 + signal for
  SIGTERM) instead of a traceback and status 1."""

  @functools.wraps(main)
  def run(*args, **kwargs):
    try:
      return main(*args, **kwargs)
    except StageStopped as e:
      print(f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
      sys.exit(e.exit_status)
  return run
