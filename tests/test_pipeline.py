"""The main job's pipeline end to end at smoke size (scripts/demo.sh with MOD=smoke): every stage runs
against the real sandbox, hands its output to the next (records, checkpoints, critic), the RL stage
starts from the SFT policy, evaluation reads both stages, and a re-run resumes instead of redoing."""

import json
import os
import subprocess

import numpy as np
import pytest

from tars_jax.data import records
from tars_jax.train.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.browser]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _demo(run, **env):
  env = dict(os.environ, RUN=str(run), MOD="smoke", EVAL_EPISODES="2", **env)
  return subprocess.run(["bash", "scripts/demo.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=1500)


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
  run = tmp_path_factory.mktemp("pipeline") / "main"
  p = _demo(run)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  return run, p.stdout


def test_every_stage_ran_and_handed_on(pipeline_run):
  run, out = pipeline_run
  # data stages: records the SFT stages read, experts measured
  experts = json.load(open(run / "demos" / "experts.json"))
  assert all(t["success_rate"] == 1.0 for t in experts["tasks"].values())
  demos = records.read_episodes(str(run / "demos"))
  assert len(demos) == sum(t["successes"] for t in experts["tasks"].values()) > 0
  assert all(prov["source"] == "expert" and ep.success for ep, prov in demos)
  assert records.read_index(str(run / "grounding" / "data" / "train"))["counts"]["grounding"]
  # the chain of initialisations, as each stage logged it
  assert f"policy initialised from {run}/grounding/checkpoints/" in out  # SFT from the grounding stage
  assert f"policy from {run}/sft/checkpoints/" in out  # value pretraining under the SFT policy
  assert f"policy initialised from {run}/sft/checkpoints/" in out and f"critic initialised from {run}/vpt/critic" in out
  cfg = json.load(open(run / "ppo" / "config.json"))
  assert cfg["policy"]["init"] == f"{run}/sft" and cfg["rl"]["algo"] == "ppo" and cfg["rl"]["lam_critic"] == 1.0
  # every trained RL episode is a record, with the iteration that sampled it as its policy version
  rolled = records.read_episodes(str(run / "ppo" / "rollouts"))
  n_iter = read_metrics(str(run / "ppo"))[-1]["step"]
  assert len(rolled) == n_iter * cfg["env"]["num_sessions"]
  assert {p["policy_version"] for _, p in rolled} == set(range(n_iter)) and {p["source"] for _, p in rolled} == {"rollout"}
  # supervised stages trained on reply tokens and logged held-out metrics
  for stage in ("grounding", "sft"):
    rows = read_metrics(str(run / stage))
    assert any("train/ce" in r for r in rows) and any("heldout/ce" in r for r in rows)
    assert all(np.isfinite(r["train/ce"]) for r in rows if "train/ce" in r)
  # evaluation of both policies, in the format experiments/eval.py always wrote
  for stage in ("sft", "ppo"):
    ev = json.load(open(run / f"eval_{stage}.json"))
    assert set(ev["results"]) == {"miniwob/click-test", "miniwob/click-test-2"}
    assert 0.0 <= ev["miniwob/click-test"]["success"] <= 1.0
  assert (run / "pipeline.png").stat().st_size > 10_000


def test_rerun_resumes_instead_of_redoing(pipeline_run):
  run, _ = pipeline_run
  stamp = {p: os.path.getmtime(run / p) for p in ("grounding/data/done.json", "demos/done.json", "vpt/value_pretrain.json",
                                                  "grounding/done.json", "sft/done.json", "ppo/done.json")}
  steps = {s: read_metrics(str(run / s))[-1]["step"] for s in ("grounding", "sft", "ppo")}
  p = _demo(run)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  assert {p: os.path.getmtime(run / p) for p in stamp} == stamp  # data and critic kept
  # the training stages found their finished checkpoints: no step was trained twice
  assert {s: read_metrics(str(run / s))[-1]["step"] for s in steps} == steps
  assert "resumed from" not in p.stdout  # finished stages are not started again (run.is_done)


def test_critic_by_task_reads_the_rl_runs_rollouts_and_fits_its_critic(pipeline_run):
  """experiments/critic_by_task.py on the pipeline's own PPO run: per task the episodes and successes of its
  recorded rollouts (checked against the records), the value-pretrained critic's values, and after --fit the
  critic steps of value pretraining's update (epochs x minibatches)."""
  import math
  import re
  import sys
  run, _ = pipeline_run
  cfg = json.load(open(run / "ppo" / "config.json"))
  p = subprocess.run([sys.executable, "-m", "experiments.critic_by_task", "--run", str(run / "ppo"), "--critic",
                      str(run / "vpt" / "critic"), "--iterations", "1-2", "--fit", "1", "--passes", "1", "--epochs", "2"],
                     cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  tables = p.stdout.split("\ncritic as loaded")[1].split("\nafter pass 1")
  assert len(tables) == 2
  rolled = [ep for ep, prov in records.read_episodes(str(run / "ppo" / "rollouts")) if prov["policy_version"] < 2]
  for table in tables:
    rows = {m[0]: (int(m[1]), float(m[2]), float(m[3])) for m in
            re.findall(r"\| (\S+) \| (\d+) \| ([\d.]+) \| (-?[\d.]+) \(", table)}
    assert set(rows) == {ep.task for ep in rolled}
    for task, (n, success, value) in rows.items():
      mine = [ep for ep in rolled if ep.task == task]
      assert n == len(mine) and success == pytest.approx(np.mean([ep.success for ep in mine]), abs=5e-4)
      assert np.isfinite(value)
  per_iteration = sum(1 for ep, prov in records.read_episodes(str(run / "ppo" / "rollouts")) if prov["policy_version"] == 0)
  steps = 2 * math.ceil(per_iteration / cfg["vpt"]["minibatch_size"])
  assert f"({steps} critic steps, lr {cfg['vpt']['lr']:g}, 2 epochs per batch)" in p.stdout
