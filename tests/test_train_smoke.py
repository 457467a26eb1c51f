"""Smoke run of the real trainer (real sandbox server, real Chromium, real Orbax): it writes a
checkpoint, metrics and trajectories, and a second run resumes from that checkpoint."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(workdir, *extra, config="miniwob_ppo.py:smoke"):
  cmd = [sys.executable, "-m", "experiments.train", "--config",
         os.path.join(ROOT, "experiments/configs", config), "--workdir", str(workdir), *extra]
  env = dict(os.environ, PYTHONPATH=ROOT)
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.long  # ~140 s: two runs of the trainer against real Chromium
@pytest.mark.browser
def test_smoke_run_checkpoints_and_resumes(tmp_path):
  run = tmp_path / "run"
  p = _train(run)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  assert sorted(os.listdir(run / "checkpoints")) == ["1", "2"]
  rows = [json.loads(l) for l in open(run / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1, 2]
  for key in ("reward", "success_rate", "episode_length", "train/entropy", "train/approx_kl",
              "train/clipfrac", "train/explained_variance", "perf/env_steps_per_s", "perf/gen_tokens_per_s"):
    assert key in rows[0], key
  # every smoke episode plays at least one turn, so entropy of the constrained policy is positive
  assert rows[0]["train/entropy"] > 0
  # image dependence of the initial policy's decisions (smoke: every iteration), per decoder layer
  for r in rows:
    assert 0.0 < r["image_dependence/tv"] <= 1.0 and r["image_dependence/layer0"] > 0
    assert "image_dependence/layer1" in r and "image_dependence/final" in r
  ep = json.load(open(run / "trajectories" / "iter_00001" / "ep_0" / "episode.json"))
  assert ep["turns"] and os.path.exists(run / "trajectories" / "iter_00001" / "ep_0" / "turn_0.png")
  assert "Action:" in ep["turns"][0]["reply"]
  assert "checkpoints:" in p.stdout

  # Second run with a larger budget resumes at iteration 2 and appends steps 3..4.
  p2 = _train(run, "--config.iterations=4")
  assert p2.returncode == 0, p2.stdout[-3000:] + p2.stderr[-3000:]
  assert "resumed from" in p2.stdout and "(iteration 2)" in p2.stdout
  rows = [json.loads(l) for l in open(run / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert "4" in os.listdir(run / "checkpoints")


@pytest.mark.browser
def test_smoke_run_grpo_groups_share_a_screen_and_evaluates_held_out_seeds(tmp_path):
  run = tmp_path / "grpo"
  p = _train(run, "--config.rl.algo=grpo", "--config.rl.group_size=2", "--config.iterations=1",
             "--config.eval_every=1", "--config.eval_episodes=2", "--config.log_trajectories=4")
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  row = json.loads(open(run / "metrics.jsonl").readline())
  assert 0.0 <= row["train/informative_fraction"] <= 1.0 and "train/explained_variance" not in row
  assert row["train/groups_dropped_singleton"] == 0  # no episode lost: both groups are pairs
  assert sorted(os.listdir(run / "checkpoints")) == ["1"]
  # the two episodes of a group saw the same page (same task, same seed)
  ep = json.load(open(run / "trajectories" / "iter_00001" / "ep_0" / "episode.json"))
  assert ep["seed"] == 0 and ep["task"] == "miniwob/click-test"
  # In-training eval after iteration 1: 2 held-out seeds per task (env.eval_seed_offset + k), played
  # through the rollout path; eval/<task>/success is the mean of the success the page reported.
  d = run / "trajectories" / "eval_00001"
  evs = [json.load(open(d / f"ep_{i}" / "episode.json")) for i in range(4)]
  assert [(e["task"], e["seed"]) for e in evs] == [(t, 10_000_000 + k) for t in
                                                   ("miniwob/click-test", "miniwob/click-test-2") for k in (0, 1)]
  for task in ("miniwob/click-test", "miniwob/click-test-2"):
    assert row[f"eval/{task}/episodes"] == 2 and row[f"eval/{task}/lost"] == 0
    assert row[f"eval/{task}/success"] == sum(e["success"] for e in evs if e["task"] == task) / 2


def test_vpt_config_refused_without_pretrained_critic(tmp_path):
  # ppo_vpt needs value pretraining first: plain PPO would silently skip it
  p = _train(tmp_path / "vpt", config="miniwob_ablations.py:ppo_vpt+smoke")
  assert p.returncode != 0 and "experiments/replicate.py" in p.stderr and "vpt.enabled" in p.stderr
  assert not os.path.exists(tmp_path / "vpt")  # refused before anything was written


@pytest.mark.long  # ~100 s: the trainer and the inference service compile, against real Chromium
@pytest.mark.browser
def test_streaming_run_trains_on_pool_batches(tmp_path):
  """rollout.streaming with the decoupled objective (rl.decoupled, the importance weight capped): the
  trainer takes finished episodes from the pool while others run on, the inference service swaps in
  each update's weights, and every metrics row's ledger adds up. (Streaming with the plain clipped
  ratio: tests/test_inference_remote.py, through a separate server.)"""
  run = tmp_path / "run"
  p = _train(run, "--config.rollout.streaming=True", "--config.iterations=3", "--config.rollout.concurrency=6",
             "--config.rollout.max_staleness=2", "--config.rl.decoupled=True", "--config.rl.behaviour_weight_cap=2.0")
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  rows = [json.loads(l) for l in open(run / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1, 2, 3]
  for r in rows:
    parts = sum(r[f"pool/{k}"] for k in ("running", "queued", "taken", "dropped_stale", "failed"))
    assert parts == r["pool/started"] and r["pool/started"] >= r["pool/taken"] >= 4 * r["step"]
    assert 0 <= r["pool/trainer_idle_frac"] <= 1 and 0 < r["pool/slot_occupancy"] <= 1
    assert r["pool/staleness_mean"] <= 2 and r["train/entropy"] > 0
    assert r["train/behaviour_weight_mean"] > 0 and 0 <= r["train/behaviour_weight_filtered"] <= 1
  assert rows[-1]["episodes_total"] == rows[-1]["pool/taken"]
  assert sorted(os.listdir(run / "checkpoints"))[-1] == "3"
