"""The wall-clock guard of a count budget and SIGTERM's stop at the next step (tars_jax/train/guard.py), on
real signals delivered to this process; the trainers' use of both is tested end to end in test_sft.py and
test_resume.py (`-m long`)."""

import os
import signal
import time

import pytest

from tars_jax.train.guard import EXIT_TRIPPED, Guard, GuardTripped, Terminated, exit_on_trip, stop_on_sigterm
from tars_jax.train.run import start


def test_guard_trips_with_the_stage_and_count():
  g = Guard("sft", 0.0, 800, "step")
  assert g.tripped()
  e = g.error(123)
  assert isinstance(e, GuardTripped) and (e.stage, e.count, e.total) == ("sft", 123, 800)
  assert "[sft]" in str(e) and "step 123 of 800" in str(e)
  g2 = Guard("train", 10.0, 5, "iteration")
  g2.exclude(-1e9)  # excluded time is subtracted: a negative exclusion adds guarded time
  assert g2.tripped() and not Guard("vpt", 10.0, 5, "iteration").tripped()


@pytest.fixture
def sigterm_restored():
  """Puts back this process's SIGTERM / SIGALRM handlers and cancels the grace timer after a test."""
  term, alrm = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGALRM)
  yield
  signal.setitimer(signal.ITIMER_REAL, 0)
  signal.signal(signal.SIGTERM, term)
  signal.signal(signal.SIGALRM, alrm)


def test_sigterm_trips_the_guard_and_the_stop_names_the_signal_and_count(sigterm_restored, capsys):
  g = Guard("sft", 60.0, 800, "step")
  stop_on_sigterm(g, grace_s=30)
  assert not g.tripped()
  os.kill(os.getpid(), signal.SIGTERM)  # the handler runs in this (main) thread before kill returns
  assert g.tripped() and g.signum == signal.SIGTERM
  assert "checkpointing at the next step" in capsys.readouterr().err
  e = g.error(321)
  assert isinstance(e, Terminated) and (e.stage, e.count, e.total) == ("sft", 321, 800)
  assert e.exit_status == 128 + signal.SIGTERM and "stopped at step 321 of 800" in str(e)
  with pytest.raises(SystemExit) as stopped:  # how a trainer's main leaves: message, then its status
    exit_on_trip(lambda: (_ for _ in ()).throw(e))()
  assert stopped.value.code == 128 + signal.SIGTERM and "Terminated: [sft] SIGTERM" in capsys.readouterr().err
  os.kill(os.getpid(), signal.SIGTERM)  # a repeated SIGTERM (the driver's, after the killer's) changes nothing
  assert g.signum == signal.SIGTERM and capsys.readouterr().err == ""


def test_a_sigtermed_stage_that_does_not_reach_its_next_step_exits_after_the_grace(sigterm_restored):
  g = Guard("train", 60.0, 5, "iteration")
  stop_on_sigterm(g, grace_s=0.2)
  os.kill(os.getpid(), signal.SIGTERM)
  t0 = time.monotonic()
  with pytest.raises(SystemExit) as out:  # a long rollout: the grace timer ends it through `finally`
    time.sleep(30)
  assert out.value.code == 128 + signal.SIGTERM and time.monotonic() - t0 < 30


def test_the_guards_exit_status_is_the_one_the_driver_retries(capsys):
  with pytest.raises(SystemExit) as out:
    exit_on_trip(lambda: (_ for _ in ()).throw(Guard("vpt", 0.0, 5, "iteration").error(2)))()
  assert out.value.code == EXIT_TRIPPED and "GuardTripped: [vpt] wall-clock guard" in capsys.readouterr().err


def test_a_run_stops_on_sigterm_through_its_own_guard(sigterm_restored, tmp_path):
  """`run_lib.start` installs the handler for the guard of the run it returns."""
  import ml_collections
  run = start("orm", ml_collections.ConfigDict({"matmul_precision": "highest"}), str(tmp_path), budget=10,
              unit="iteration", max_minutes=60.0)
  os.kill(os.getpid(), signal.SIGTERM)
  assert run.guard.tripped() and isinstance(run.guard.error(4), Terminated)


def test_a_process_stopped_with_its_run_but_not_itself_says_so():
  """A multi-process run stops where any process does (distributed.any_process): a process whose own
  guard did not trip and that got no signal stops with a plain StageStopped, not a guard's message."""
  from tars_jax.train.guard import StageStopped
  e = Guard("train", 60.0, 5, "iteration").error(2)
  assert type(e) is StageStopped and "with another process of the run" in str(e) and e.exit_status == 1
