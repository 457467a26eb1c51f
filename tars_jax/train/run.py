"""One run lifecycle for every training stage: SFT / CT / grounding (experiments/sft.py), value
pretraining (experiments/value_pretrain.py), PPO / GRPO (experiments/train.py) and the ORM
(experiments/orm.py). big_vision's trainer set-up is the model: each trainer stays a linear script
with its loop body in plain view and calls these steps in order:

  run = run_lib.start("sft", config, workdir, budget=s.steps, unit="step", max_minutes=s.max_minutes)
  state, start, meta = run.resume(state)        # latest complete checkpoint, or (state, 0, {})
  writer = run.writer(config, start)            # config.json + metrics.jsonl / TensorBoard from `start`
  ... loop: run.guard.tripped(), ckpt.save(run.mngr, ...), ckpt.save_at_stop(run.mngr, ...) ...
  run.finish(summary)                           # <stage>.json (the summary) and done.json

What `start` does once per process: the matmul precision (before any computation), the work dir,
quiet absl/Orbax logging, SIGTERM stopping the stage at its next step with a checkpoint (or, past a
grace period, unwinding through `finally`: sandbox servers stop; guard.stop_on_sigterm), an exclusive
lock on the work dir (a second process on it is refused), the stage's name and count budget in
`run.json` (another stage's directory is refused) and the wall-clock guard of the count budget
(tars_jax/train/guard.py); the checkpoint manager is made at first use.

A stage is finished when `is_done(workdir)`: its `done.json` names a complete checkpoint that exists,
or, for a stage that trains nothing (data collection, evaluation), was written by `mark_done`. Stage
drivers (experiments/replicate.py, flywheel.py, and scripts/demo.sh / verticals.sh /
rl_pilot.sh via `python -m tars_jax.train.run --is_done DIR` / `--mark_done DIR`) use that one test.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from typing import Any

import jax

from tars_jax.train import checkpoint as ckpt
from tars_jax.train.guard import Guard, stop_on_sigterm
from tars_jax.train.metrics import MetricsWriter, write_json

RUN_FILE, DONE_FILE, LOCK_FILE = "run.json", "done.json", "run.lock"


class WorkdirInUse(RuntimeError):
  """Another process runs a stage in this work dir, or the dir holds another stage's run."""


class CorruptRun(RuntimeError):
  """A run dir's done.json names a checkpoint that is not there (deleted or cut short)."""


@dataclasses.dataclass
class Run:
  """One stage's run in one process (built by `start`).

  Attributes: stage (name in messages and run.json), workdir, guard (wall-clock guard of the count
    budget), main (this process writes the run's files; Orbax checkpoints are written by every
    process), mngr (Orbax manager of `<workdir>/checkpoints`, made at first use), previous_budget (the
    count budget the dir's run.json recorded before this start when it was another, else None).
  """
  stage: str
  workdir: str
  guard: Guard
  main: bool
  keep_checkpoints: int = 3
  previous_budget: int | None = None
  _lock: Any = dataclasses.field(repr=False, default=None)
  _mngr: Any = dataclasses.field(repr=False, default=None)

  @property
  def mngr(self):
    """The checkpoint manager, made at first use: `checkpoints/` appears only once a trainer's checks
    of its data and config have passed."""
    if self._mngr is None:
      self._mngr = ckpt.manager(self.workdir, self.keep_checkpoints, cleanup_tmp=True)
    return self._mngr

  def resume(self, state: Any) -> tuple[Any, int, dict]:
    """(state, step, meta) of the latest complete checkpoint restored into `state`'s structure, or
    (state, 0, {}) when the run has none. Prints where it resumed from."""
    if self.mngr.latest_step() is None:
      return state, 0, {}
    step, state, meta = ckpt.restore(self.mngr, state)
    count = f" ({self.guard.unit} {meta['iteration']})" if "iteration" in meta else ""
    print(f"[{self.stage}] resumed from {self.mngr.directory}/{step}{count}", flush=True)
    return state, step, meta

  def writer(self, config, start: int):
    """Writes `config.json` and returns the metrics writer continuing at `start` (rows a killed run
    wrote after its checkpoint are dropped); a non-main process gets a writer that writes nothing."""
    if not self.main:
      from tars_jax import distributed as dist
      return dist.NullWriter(self.workdir)
    with open(os.path.join(self.workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2))
    return MetricsWriter(self.workdir, resume_step=start)

  def finish(self, summary: dict, name: str | None = None) -> None:
    """Marks the stage finished: `<name or stage>.json` = `summary`, then `done.json` = {stage, step of
    the latest complete checkpoint, summary file}. Call after the last checkpoint is saved. A re-run of
    a finished stage (done.json already names the latest checkpoint) leaves both as they are."""
    if not self.main:
      return
    step = self.mngr.latest_step()
    if step is None:
      raise CorruptRun(f"[{self.stage}] finish() without a checkpoint in {self.mngr.directory}")
    fname = f"{name or self.stage}.json"
    done = _read_done(self.workdir)
    if done and done.get("checkpoint") == int(step) and os.path.exists(os.path.join(self.workdir, fname)):
      return  # a re-run that trained nothing: keep its summary
    write_json(os.path.join(self.workdir, fname), summary)
    write_json(os.path.join(self.workdir, DONE_FILE), {"stage": self.stage, "checkpoint": int(step),
                                                       "summary": fname})


def exclusive_lock(path: str, holder: str):
  """(file, None) holding an exclusive flock on `path` while the file stays open (released when the
  process ends, however it ends), with `holder` written in it; or (None, the holder text found there)
  when another process holds it. Shared by the trainers' work dirs and experiments/replicate.py."""
  import fcntl
  f = open(path, "a+")
  try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    f.seek(0)
    found = f.read().strip()
    f.close()
    return None, found
  f.seek(0)
  f.truncate()
  f.write(holder + "\n")
  f.flush()
  return f, None


def _lock(workdir: str, stage: str):
  """The work dir's `run.lock` (`exclusive_lock`). Raises WorkdirInUse naming the holder's stage."""
  f, holder = exclusive_lock(os.path.join(workdir, LOCK_FILE), f"{stage} (pid {os.getpid()})")
  if f is None:
    raise WorkdirInUse(f"[{stage}] {workdir} is in use by {holder or 'another stage'}: two processes would "
                       "write one run; wait for it, stop it, or give this stage its own --workdir")
  return f


def _claim(workdir: str, stage: str, budget: int, unit: str) -> int | None:
  """Records the stage and its count budget in `run.json` ({"stage", "budget", "unit"}, rewritten by each
  process: a resumed run may raise its budget), which readers of a running sweep use
  (experiments/replicate.py --status). Returns the budget recorded before when it differs (printed), else
  None; raises WorkdirInUse if the dir holds another stage's run."""
  previous = None
  path = os.path.join(workdir, RUN_FILE)
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    if old.get("stage") != stage:
      raise WorkdirInUse(f"[{stage}] {workdir} holds a {old.get('stage')!r} run, not a {stage!r} one: give this "
                         "stage its own --workdir")
    if old.get("budget") not in (None, int(budget)):
      previous = int(old["budget"])
      print(f"[{stage}] budget changed {previous} -> {int(budget)} {unit}s", flush=True)
  write_json(path, {"stage": stage, "budget": int(budget), "unit": unit})
  return previous


def start(stage: str, config, workdir: str | None, *, budget: int, unit: str, max_minutes: float,
          keep_checkpoints: int = 3, main: bool = True) -> Run:
  """Sets up one stage's run (see the module docstring) and returns it.

  Args:
    stage: "sft", "vpt", "train", "orm" (messages, run.json, done.json).
    config: the run's ml_collections config (its `matmul_precision` is applied here).
    workdir: the run dir (created).
    budget, unit: the count budget and what it counts ("step", "iteration"); max_minutes its guard.
    keep_checkpoints: checkpoints kept; main: whether this process writes the run's files.
  Raises: ValueError without a workdir; WorkdirInUse (another process on it, or another stage's dir).
  """
  if not workdir:
    raise ValueError(f"[{stage}] --workdir is required")
  jax.config.update("jax_default_matmul_precision", config.matmul_precision)  # before any compute
  os.makedirs(workdir, exist_ok=True)
  logging.getLogger().setLevel(logging.WARNING)
  guard = Guard(stage, max_minutes, budget, unit)
  # SIGTERM (pkill, a scheduler's pre-emption, a session's end) checkpoints at the next step and stops.
  stop_on_sigterm(guard)
  lock, previous = None, None
  if main:
    lock = _lock(workdir, stage)
    previous = _claim(workdir, stage, budget, unit)
  return Run(stage, workdir, guard, main, keep_checkpoints, previous, lock)


def _read_done(workdir: str) -> dict | None:
  """The run dir's done.json, or None when the stage has not finished."""
  path = os.path.join(workdir, DONE_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def mark_done(workdir: str, record: dict | None = None) -> None:
  """Marks a stage that trains nothing (data collection, evaluation, a driver's step) finished:
  done.json = `record` (e.g. its command and minutes) with no checkpoint. `is_done(workdir)` is then
  True. Raises: FileNotFoundError when `workdir` does not exist (the stage wrote nothing)."""
  if not os.path.isdir(workdir):
    raise FileNotFoundError(f"mark_done: {workdir} does not exist (the stage wrote nothing there)")
  write_json(os.path.join(workdir, DONE_FILE), dict(record or {}, checkpoint=None))


def is_done(workdir: str) -> bool:
  """True when the stage in `workdir` finished: its done.json names a complete checkpoint that is
  there, or names none (`mark_done`: a stage that trains nothing).

  Raises: CorruptRun when done.json names a checkpoint that is missing or incomplete.
  """
  done = _read_done(workdir)
  if done is None:
    return False
  if done.get("checkpoint") is None:
    return True
  path, step = os.path.join(workdir, DONE_FILE), int(done["checkpoint"])
  # Orbax renames a step's temporary dir to the bare step number only once its save is complete
  if not os.path.isdir(os.path.join(workdir, "checkpoints", str(step))):
    raise CorruptRun(f"{path} says the {done.get('stage')!r} stage finished at checkpoint {step}, but "
                     f"{workdir}/checkpoints/{step} is missing or incomplete: delete done.json and run the "
                     "stage again to resume from its latest checkpoint")
  return True


if __name__ == "__main__":  # --is_done: exit 0 when finished, 1 when not, 2 with the error when corrupt
  if len(sys.argv) != 3 or sys.argv[1] not in ("--is_done", "--mark_done"):
    sys.exit("usage: python -m tars_jax.train.run --is_done RUN_DIR | --mark_done STAGE_DIR")
  if sys.argv[1] == "--mark_done":
    sys.exit(mark_done(sys.argv[2]))
  try:
    sys.exit(0 if is_done(sys.argv[2]) else 1)
  except CorruptRun as e:
    print(e, file=sys.stderr)
    sys.exit(2)
