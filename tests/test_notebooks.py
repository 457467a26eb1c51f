"""Every notebook executes against runs made here (`scripts/notebooks.sh`: a smoke replication suite, then
each notebook through papermill with its paths as parameters). A slow test, so CI's slow step runs the
notebooks beside the other slow test files (two pytest-xdist workers) instead of as a step of their own.
Checks that they run, not what the smoke curves say."""

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.slow, pytest.mark.browser]


# 8-20 min in CI's slow step (486 s on 2026-12-04, 1219 s on 12-06 beside the other worker): the smoke suite (demos, SFT, value pretraining,
# PPO, GRPO), then 5 notebooks
def test_every_notebook_executes_on_the_smoke_suite(tmp_path):
  runs = tmp_path / "nb"
  p = subprocess.run(["bash", "scripts/notebooks.sh"], cwd=ROOT, env=dict(os.environ, NB_RUNS=str(runs)),
                     capture_output=True, text=True, timeout=1700)
  assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
  executed = sorted(f for f in os.listdir(runs / "executed"))
  want = sorted(f for f in os.listdir(os.path.join(ROOT, "notebooks")) if f.endswith(".ipynb"))
  assert executed == want, (executed, want)
  assert "all notebooks ran" in p.stdout
