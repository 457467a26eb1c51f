"""A training run killed with kill -9 and started again with the same command continues as if it had
never stopped: the smoke config (real sandbox server, real Chromium, real Orbax) run for 3 iterations
in one go, and again killed right after its first checkpoint and restarted, write the same
`metrics.jsonl` rows, bit for bit, except wall-clock timings (`perf/*`). Budgets are counts: the same
run pinned to one core ends at the same iteration with the same checkpoint; the wall-clock guard stops
a run loudly.

Why exact equality holds: every random draw of iteration `it` (sampling keys, minibatch shuffles)
derives from (config.seed, it); the train state comes back from Orbax bit for bit; the tasks' seeds
and the sandbox's virtual clock make the pages the same; and both processes run the same jitted
programs on the same shapes, which XLA:CPU evaluates deterministically."""

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from tars_jax.train import checkpoint as ckpt
from tars_jax.train.guard import EXIT_TRIPPED
from tars_jax.train.metrics import MetricsWriter, read_metrics
from _shared import poll

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITERATIONS = 3


def _cmd(workdir):
  return [sys.executable, "-m", "experiments.train", "--config",
          os.path.join(ROOT, "experiments/configs/miniwob_ppo.py:smoke"), "--workdir", str(workdir),
          f"--config.iterations={ITERATIONS}"]


def _run(workdir):
  p = subprocess.run(_cmd(workdir), cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                     text=True, timeout=900)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  return p.stdout


def _rows(workdir):
  with open(workdir / "metrics.jsonl") as f:
    rows = [json.loads(l) for l in f]
  # wall-clock timings (and the throughputs made of them) are the only fields allowed to differ
  return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """The smoke config run for ITERATIONS iterations in one go: the reference of the tests below."""
  d = tmp_path_factory.mktemp("straight")
  _run(d)
  return d


def _params(workdir):
  """The latest checkpoint's arrays as a flat {path: np.ndarray} (Orbax's own restore, no target)."""
  import jax
  mngr = ckpt.manager(str(workdir))
  tree = mngr.restore(mngr.latest_step())["state"]
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.long  # ~3 min: two runs of the trainer against real Chromium
@pytest.mark.browser
def test_run_killed_after_a_checkpoint_resumes_as_if_never_stopped(straight, tmp_path):
  killed = tmp_path / "killed"
  # Same command, killed with SIGKILL as soon as checkpoint 1 is complete (Orbax renames the
  # directory into place when written), i.e. during iteration 2.
  log = open(tmp_path / "killed.log", "w")
  proc = subprocess.Popen(_cmd(killed), cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=log,
                          stderr=subprocess.STDOUT)
  try:
    done = poll(lambda: os.path.isdir(killed / "checkpoints" / "1") or proc.poll() is not None, 600, 0.05)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    log.close()
  assert done and proc.returncode == -signal.SIGKILL, open(tmp_path / "killed.log").read()[-3000:]
  assert not os.path.isdir(killed / "checkpoints" / str(ITERATIONS))  # it really stopped mid-run

  out = _run(killed)
  assert "resumed from" in out and "(iteration 1)" in out, out[-3000:]
  want, got = _rows(straight), _rows(killed)
  assert [r["step"] for r in got] == list(range(1, ITERATIONS + 1))
  assert all(r["train/policy_grad_norm"] > 0 for r in want)  # the weights moved between iterations
  for w, g in zip(want, got):
    assert g == w, {k: (w.get(k), g.get(k)) for k in set(w) | set(g) if w.get(k) != g.get(k)}


@pytest.mark.long  # ~2 min: one run of the trainer on one core
@pytest.mark.browser
def test_budgets_are_counts_a_run_on_one_core_ends_where_and_as_a_run_on_all(straight, tmp_path):
  """The budget is a count: the same command in a process pinned to one core (half this machine's
  speed or less) ends at the same iteration with the same episodes and the same checkpoint values.
  Values agree to float rounding, not bit for bit: XLA:CPU splits its reductions over the cores it
  has, so one core sums in another order (~1e-7 relative in the losses)."""
  one = tmp_path / "one_core"
  p = subprocess.run(["taskset", "-c", "0", *_cmd(one)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                     capture_output=True, text=True, timeout=1200)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  assert ckpt.latest_complete(str(one)) == ckpt.latest_complete(str(straight)) == ITERATIONS
  want, got = _rows(straight), _rows(one)
  assert [r["step"] for r in got] == [r["step"] for r in want]
  for w, g in zip(want, got):
    assert g.keys() == w.keys()
    # what the episodes were (actions sampled, rewards) is exact; the losses agree to rounding
    for k in ("success_rate", "reward", "episodes_total"):
      assert g[k] == w[k], (k, w[k], g[k])
    # metrics are O(1); left out: corr(value, return) of the smoke critic, whose values are nearly
    # constant (the correlation of near-constant vectors amplifies rounding: -0.0005 vs -0.0018)
    for k in set(w) - {"train/value_return_corr"}:
      np.testing.assert_allclose(g[k], w[k], rtol=1e-4, atol=1e-4, err_msg=k)
  a, b = _params(straight), _params(one)
  assert a.keys() == b.keys()
  for k in a:  # 1e-4 of each leaf's magnitude; leaves below 1e-3 (biases trained from 0, Adam's moments)
    # count as 1e-3: Adam's normalised step turns rounding in near-zero gradients into ~1e-8 moves
    scale = max(float(np.max(np.abs(a[k]))) if a[k].size else 0.0, 1e-3)
    np.testing.assert_allclose(b[k], a[k], rtol=1e-3, atol=1e-4 * scale, err_msg=k)


@pytest.mark.long  # ~3 min: two runs of the trainer against real Chromium
@pytest.mark.browser
def test_the_wall_clock_guard_stops_loudly_and_the_same_run_continues_to_its_count(tmp_path):
  """`max_minutes` only guards a process: tripped, the trainer checkpoints, exits with EXIT_TRIPPED and names
  the stage and the iteration reached; run again (here with a guard that does not trip) it resumes
  there and ends at its iteration count."""
  cmd = _cmd(tmp_path / "run")[:-1] + ["--config.iterations=6", "--config.max_minutes=0.05"]
  env = dict(os.environ, PYTHONPATH=ROOT)
  first = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert first.returncode == EXIT_TRIPPED, first.stdout[-2000:] + first.stderr[-2000:]
  m = re.search(r"\[train\] wall-clock guard of 0.05 min tripped at iteration (\d+) of 6",
                              first.stderr)
  assert m, first.stderr[-3000:]
  ended = int(m.group(1))
  assert ended < 6 and (ckpt.latest_complete(str(tmp_path / "run")) or 0) == ended
  again = subprocess.run(cmd[:-1] + ["--config.max_minutes=30"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
  assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
  assert "[train] done: 6 iterations" in again.stdout and ckpt.latest_complete(str(tmp_path / "run")) == 6
  if ended:
    assert f"(iteration {ended})" in again.stdout, again.stdout[-2000:]


# ---------------------------------------------------------------- what a kill -9 leaves behind


def test_metrics_writer_resume_drops_later_and_cut_rows(tmp_path):
  with open(tmp_path / "metrics.jsonl", "w") as f:  # rows 1..3, then a row cut by the kill
    f.write("".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "rew')
  w = MetricsWriter(str(tmp_path), resume_step=2)
  w.write(3, {"reward": 0.5})
  w.close()
  assert read_metrics(str(tmp_path)) == [{"step": 1, "reward": 0.1}, {"step": 2, "reward": 0.2},
                                         {"step": 3, "reward": 0.5}]
  MetricsWriter(str(tmp_path), resume_step=0).close()  # killed before its first checkpoint: start over
  assert read_metrics(str(tmp_path)) == []


def test_checkpoint_manager_of_the_writer_removes_unfinished_saves(tmp_path):
  mngr = ckpt.manager(str(tmp_path))
  ckpt.save(mngr, 1, {"w": np.arange(3.0)}, {"iteration": 1})
  mngr.close()
  # what Orbax leaves when its writer dies mid-save: a temporary directory, never renamed to "2"
  tmp = tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp-1700000000000000"
  (tmp / "state").mkdir(parents=True)
  reader = ckpt.manager(str(tmp_path))
  assert reader.latest_step() == 1 and tmp.is_dir()  # a reader ignores it and leaves it alone
  reader.close()
  writer = ckpt.manager(str(tmp_path), cleanup_tmp=True)
  step, state, meta = ckpt.restore(writer, {"w": np.zeros(3)})
  assert (step, meta, state["w"].tolist()) == (1, {"iteration": 1}, [0.0, 1.0, 2.0])
  # Orbax removes it in a background thread that its next save waits for (restore does not)
  ckpt.save(writer, 2, {"w": np.arange(3.0) + 1}, {"iteration": 2})
  assert not tmp.exists() and writer.latest_step() == 2
  writer.close()
