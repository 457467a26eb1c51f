"""Streaming PPO across processes (issue #39 item 2), on loopback with real parts: two trainer processes
(`jax.distributed`, gloo), one inference service process (`experiments/serve.py`) and one sandbox server
(real Chromium). Each trainer process runs its own pool over every other group of jobs; each update
trains every process's take. Checked: every episode is trained once across the processes (the rollout
records hold each (task, seed) once and as many as the summed ledgers' `taken`), the service serves the
last update's weights; a run that resumes and then loses the inference service stops on both
processes, each with InferenceUnavailable naming its URL (one meets it; the other, waiting in a
collective for the first, probes the service: `distributed.on_peer_failure`), unless JAX's runtime
aborts the waiting one first;
a killed trainer process ends the other one naming its rank."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from envs_bridge.launch import launch_server
from tars_jax.data import records

from test_distributed import _env, _free_port, _wait
from test_inference_remote import _start_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.long, pytest.mark.browser]


def _trainers(work: str, sandbox: str, inference: str, iterations: int) -> list[subprocess.Popen]:
  port = _free_port()
  cmd = [sys.executable, "-m", "experiments.train", "--config",
         os.path.join(ROOT, "experiments/configs/miniwob_ppo.py:smoke"), "--workdir", work,
         "--config.distributed.num_processes=2", f"--config.distributed.coordinator_address=127.0.0.1:{port}",
         "--config.distributed.heartbeat_timeout_s=10", f"--config.rollout.inference={inference}",
         "--config.rollout.inference_timeout_s=20", "--config.rollout.streaming=True",
         "--config.rollout.concurrency=4", "--config.rollout.max_staleness=3",
         f"--config.env.servers=('{sandbox}',)", f"--config.iterations={iterations}", "--config.ckpt_every=1"]
  return [subprocess.Popen(cmd + [f"--config.distributed.process_id={p}"], cwd=ROOT, env=_env(1),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for p in (0, 1)]


def _rows(work):
  return [json.loads(line) for line in open(os.path.join(work, "metrics.jsonl"))]


def test_two_trainer_processes_stream_through_one_service(tmp_path):
  work = str(tmp_path / "run")
  with launch_server(lease_s=120.0) as sandbox:
    proc, url = _start_server(4)
    try:
      # 1. Two iterations: every trained episode once, the ledgers of both pools add up.
      for rc, out in _wait(_trainers(work, sandbox.url, url, 2), timeout=900):
        assert rc == 0, out[-3000:]
      rows = _rows(work)
      assert [r["step"] for r in rows] == [1, 2]
      for r in rows:
        parts = sum(r[f"pool/{k}"] for k in ("running", "queued", "taken", "dropped_stale", "failed"))
        assert parts == r["pool/started"]
      eps = [ep for ep, _ in records.read_episodes(os.path.join(work, "rollouts"))]
      keys = [(e.task, e.seed) for e in eps]
      assert len(keys) == len(set(keys)) == rows[-1]["pool/taken"] >= 8  # each trained once, none missing
      assert httpx.get(url + "/health").json()["version"] == 2

      # 2. Resumed for two more iterations, the inference service killed once the first of them ran:
      #    both processes stop, naming the service (or, waiting in a collective, the peer that stopped).
      trainers = _trainers(work, sandbox.url, url, 4)
      deadline = time.time() + 600
      while httpx.get(url + "/health").json()["version"] < 3 and time.time() < deadline:
        time.sleep(0.5)
      proc.send_signal(signal.SIGKILL)
      proc.wait(timeout=30)
      results = _wait(trainers, timeout=900)
      named = [bool(re.search(rf"InferenceUnavailable.*{re.escape(url)}", out, re.S)) for _, out in results]
      for (rc, out), by_url in zip(results, named):
        assert rc != 0 and "resumed from" in out, out[-3000:]
        # a process waiting in a collective when its peer stopped probes the service and names it too,
        # unless JAX's runtime aborted it first (its heartbeat path: no Python runs there)
        assert by_url or "JAX distributed service detected fatal errors" in out, out[-3000:]
      assert any(named), [out[-2000:] for _, out in results]

      # 3. A new service; the resumed run loses trainer process 1: process 0 exits naming rank 1.
      proc, url = _start_server(4)
      trainers = _trainers(work, sandbox.url, url, 6)
      deadline = time.time() + 600
      while httpx.get(url + "/health").json()["version"] < 4 and time.time() < deadline:
        time.sleep(0.5)
      trainers[1].send_signal(signal.SIGKILL)
      (rc0, out0), (rc1, _) = _wait(trainers, timeout=900)
      assert rc1 == -9 and rc0 != 0, out0[-3000:]
      assert re.search(r"peer process\(es\) \[1\] died|Task 1 heartbeat timeout|"
                       r"stopped sending heartbeats\):\s*1\b", out0), out0[-3000:]
    finally:
      if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=30)
