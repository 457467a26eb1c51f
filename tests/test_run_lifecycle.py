"""The run lifecycle shared by every trainer (tars_jax/train/run.py): resume from the latest complete
checkpoint, the done marker and its check, and the refusals (two processes on one work dir, a stage
in another stage's dir, a done marker without its checkpoint). Real Orbax checkpoints; the trainers'
own resume tests (test_train_smoke, test_sft, test_value_pretrain, test_orm) run it end to end."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
import pytest

from tars_jax.train import checkpoint as ckpt
from tars_jax.train import run as run_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config():
  return mlc.ConfigDict({"matmul_precision": "float32", "seed": 3})


def _state(x: float):
  return {"w": jnp.full((3,), x, jnp.float32)}


def test_resume_returns_the_latest_complete_checkpoint_and_finish_marks_it(tmp_path):
  d = str(tmp_path / "run")
  run = run_lib.start("sft", _config(), d, budget=4, unit="step", max_minutes=5.0)
  state, start, meta = run.resume(_state(0.0))
  assert start == 0 and meta == {} and not run_lib.is_done(d)
  writer = run.writer(_config(), start)
  writer.write(1, {"loss": 1.0})
  writer.close()
  ckpt.save(run.mngr, 2, _state(2.0), {"iteration": 2})
  assert json.load(open(os.path.join(d, "config.json")))["seed"] == 3
  run._lock.close()  # the process "ends": its lock is released

  again = run_lib.start("sft", _config(), d, budget=4, unit="step", max_minutes=5.0)
  state, start, meta = again.resume(_state(0.0))
  assert start == 2 and meta["iteration"] == 2
  np.testing.assert_array_equal(np.asarray(state["w"]), np.full((3,), 2.0, np.float32))
  ckpt.save(again.mngr, 4, _state(4.0), {"iteration": 4})
  again.finish({"steps": 4})
  assert json.load(open(os.path.join(d, "sft.json"))) == {"steps": 4}
  assert json.load(open(os.path.join(d, "done.json")))["checkpoint"] == 4
  assert run_lib.is_done(d)
  again._lock.close()
  rerun = run_lib.start("sft", _config(), d, budget=4, unit="step", max_minutes=5.0)  # nothing left to train
  assert rerun.resume(_state(0.0))[1] == 4
  rerun.finish({"steps": 4, "final": {}})
  assert json.load(open(os.path.join(d, "sft.json"))) == {"steps": 4}  # the summary of the run that trained


def test_a_done_marker_without_its_checkpoint_is_corrupt(tmp_path):
  d = str(tmp_path / "run")
  run = run_lib.start("vpt", _config(), d, budget=1, unit="iteration", max_minutes=5.0)
  ckpt.save(run.mngr, 1, _state(1.0), {"iteration": 1})
  run.finish({"iterations": 1}, "value_pretrain")
  assert run_lib.is_done(d)
  os.rename(os.path.join(d, "checkpoints", "1"), os.path.join(d, "checkpoints", "1.orbax-checkpoint-tmp-9"))
  with pytest.raises(run_lib.CorruptRun, match="'vpt' stage finished at checkpoint 1"):
    run_lib.is_done(d)
  p = subprocess.run([sys.executable, "-m", "tars_jax.train.run", "--is_done", d], cwd=ROOT,
                     capture_output=True, text=True)
  assert p.returncode == 2 and "missing or incomplete" in p.stderr


def test_finish_without_a_checkpoint_is_refused(tmp_path):
  run = run_lib.start("orm", _config(), str(tmp_path / "r"), budget=1, unit="step", max_minutes=5.0)
  with pytest.raises(run_lib.CorruptRun, match="without a checkpoint"):
    run.finish({})
  assert not os.path.exists(tmp_path / "r" / "done.json")


def test_another_stage_s_directory_is_refused_naming_both(tmp_path, capsys):
  d = str(tmp_path / "run")
  first = run_lib.start("sft", _config(), d, budget=1, unit="step", max_minutes=5.0)
  first._lock.close()
  assert first.previous_budget is None and "budget changed" not in capsys.readouterr().out
  again = run_lib.start("sft", _config(), d, budget=7, unit="step", max_minutes=5.0)  # resumed, raised
  again._lock.close()
  assert again.previous_budget == 1 and "[sft] budget changed 1 -> 7 steps" in capsys.readouterr().out
  with open(os.path.join(d, "run.json")) as f:
    assert json.load(f) == {"stage": "sft", "budget": 7, "unit": "step"}
  with pytest.raises(run_lib.WorkdirInUse, match="holds a 'sft' run, not a 'train' one"):
    run_lib.start("train", _config(), d, budget=1, unit="iteration", max_minutes=5.0)


def test_two_processes_on_one_work_dir_are_refused(tmp_path):
  """A live process holds the lock: a second start (here another process) is refused, naming it."""
  d = str(tmp_path / "run")
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys, ml_collections as m; from tars_jax.train import run as r; "
       f"run = r.start('train', m.ConfigDict({{'matmul_precision': 'float32'}}), {d!r}, budget=1, unit='iteration', "
       "max_minutes=1.0); print('ready', flush=True); sys.stdin.read()"],
      cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "ready"
    with pytest.raises(run_lib.WorkdirInUse, match=r"in use by train \(pid"):
      run_lib.start("train", _config(), d, budget=1, unit="iteration", max_minutes=5.0)
  finally:
    holder.stdin.close()
    holder.wait(timeout=60)
  run_lib.start("train", _config(), d, budget=1, unit="iteration", max_minutes=5.0)  # released at exit


def test_is_done_is_false_for_a_run_in_progress_or_absent(tmp_path):
  assert not run_lib.is_done(str(tmp_path / "nothing"))
  p = subprocess.run([sys.executable, "-m", "tars_jax.train.run", "--is_done", str(tmp_path)], cwd=ROOT)
  assert p.returncode == 1


def test_mark_done_finishes_a_stage_that_trains_nothing(tmp_path):
  """Data collection and evaluation stages of the drivers: done.json without a checkpoint."""
  d = tmp_path / "demos"
  with pytest.raises(FileNotFoundError, match="does not exist"):
    run_lib.mark_done(str(d))
  d.mkdir()
  run_lib.mark_done(str(d), {"argv": ["demos"], "minutes": 1.5})
  assert run_lib.is_done(str(d))
  assert json.load(open(d / "done.json")) == {"argv": ["demos"], "minutes": 1.5, "checkpoint": None}
  e = tmp_path / "grounding_data"
  e.mkdir()
  cli = [sys.executable, "-m", "tars_jax.train.run"]
  assert subprocess.run(cli + ["--is_done", str(e)], cwd=ROOT).returncode == 1
  assert subprocess.run(cli + ["--mark_done", str(e)], cwd=ROOT).returncode == 0
  assert subprocess.run(cli + ["--is_done", str(e)], cwd=ROOT).returncode == 0
