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
