"""The inference service in its own process behind HTTP (`experiments/serve.py`,
`rollout/inference_remote.py`): the remote client draws what the in-process service draws for the same
key and weights, weights pushed over the socket (msgpack) and from an Orbax checkpoint are served with
their version, a stale push and a server of another model are refused, a request that does not fit
raises the same typed error; a trainer and the evaluation sample through it."""

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import jax
import numpy as np
import pytest

from envs_bridge.client import SandboxClient
from envs_bridge.launch import launch_server
from experiments.configs import miniwob_ppo
from tars_jax.rollout.inference_remote import ModelMismatch, RemoteInference, StaleWeights
from tars_jax.rollout.episode import InferenceUnavailable
from tars_jax.rollout.inference_server import ContextTooLong
from tars_jax.rollout.pool import PoolConfig, RolloutPool, job_groups
from tars_jax.train import checkpoint as ckpt
from tars_jax.train import state as state_lib

from _shared import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start_server(slots: int, token: str = "", config: str = "experiments/configs/miniwob_ppo.py:smoke"
                  ) -> tuple[subprocess.Popen, str]:
  """An inference server process of `config` (the smoke model) on a free port, once it answers /health."""
  port = _free_port()
  cmd = [sys.executable, "-m", "experiments.serve", "--config", os.path.join(ROOT, config), "--port", str(port),
         "--slots", str(slots)]
  proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, TARS_INFERENCE_TOKEN=token),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  url = f"http://127.0.0.1:{port}"
  deadline = time.time() + 300
  while time.time() < deadline:
    try:
      if httpx.get(url + "/health", timeout=2).status_code == 200:
        break
    except httpx.TransportError:
      time.sleep(0.5)
    if proc.poll() is not None:
      pytest.fail(proc.stdout.read())
  return proc, url


@pytest.fixture(scope="module")
def server():
  proc, url = _start_server(3)
  yield url
  proc.terminate()
  proc.wait(timeout=30)


def test_an_unreachable_or_silent_server_is_named_within_the_time_out():
  """Nothing waits without a bound: a port nobody listens on, and a server that accepts connections
  but never answers, each raise InferenceUnavailable naming the URL (after timeout_s for the silent one)."""
  port = _free_port()
  with pytest.raises(InferenceUnavailable, match=rf"inference service at http://127.0.0.1:{port} unreachable"):
    RemoteInference(f"http://127.0.0.1:{port}", timeout_s=2)
  with socket.socket() as silent:
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)  # the kernel completes the handshake; nothing ever reads or answers
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    with pytest.raises(InferenceUnavailable, match=rf"{url} unreachable or silent for 1.0 s: ReadTimeout"):
      RemoteInference(url, timeout_s=1.0)  # a hang here would end at pytest's time-out, failing


def _prompt(parts, rng, turns):
  from tars_jax.agent import prompts
  tok = parts.tokenizer
  ids = prompts.encode_episode_prefix(tok, "Click the button.", parts.loop_cfg.system)
  images = []
  for _ in range(turns):
    ids += prompts.encode_observation(tok, parts.loop_cfg.n_img_tokens, None)
    images.append(rng.integers(0, 256, parts.image_hw + (3,), dtype=np.uint8))
  return ids, images


@pytest.mark.long  # ~60 s: a server process and an in-process service each compile the smoke model
def test_remote_equals_in_process_and_swaps_weights(server, tmp_path):
  cfg = miniwob_ppo.get_config("smoke")
  parts = state_lib.build(cfg)
  state = parts.init_state(cfg.seed)  # the server initialised the same params from the same config
  rng = np.random.default_rng(0)
  reqs = [_prompt(parts, rng, t) for t in (1, 2, 1, 2)]
  keys = [jax.random.PRNGKey(50 + i) for i in range(4)]
  state2 = dict(state, policy=jax.tree.map(lambda x: x * 1.3 if x.dtype == np.float32 else x, state["policy"]))
  with parts.inference_service(state["policy"], slots=3, seed=cfg.seed) as local:
    want = [local.submit(ids, ims, key=k).result(timeout=300) for (ids, ims), k in zip(reqs, keys)]
    local.set_params(state2["policy"], 1)
    want2 = local.submit(*reqs[0], key=keys[0]).result(timeout=300)

  with RemoteInference(server) as remote:
    assert remote.version == 0
    futs = [remote.submit(ids, ims, key=k) for (ids, ims), k in zip(reqs, keys)]  # concurrent: 4 requests, 3 slots
    got = [f.result(timeout=300) for f in futs]
    for w, g in zip(want, got):
      assert g.tokens == w.tokens and g.tokens[-1] == parts.tokenizer.eos_id
      np.testing.assert_array_equal(g.states, w.states)
      np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
      assert set(g.versions.tolist()) == {0}
    remote.set_params(state2["policy"], 1)  # msgpack over the socket
    g2 = run(remote.generate(*reqs[0], key=keys[0]))  # the asyncio API
    assert g2.tokens == want2.tokens and set(g2.versions.tolist()) == {1} and remote.version == 1
    # from an Orbax checkpoint the server reads: the original weights again, as version 2
    ckpt.save(ckpt.manager(str(tmp_path / "run"), 2), 5, state, {"iteration": 5})
    remote.load_checkpoint(str(tmp_path / "run"), 2)
    g3 = remote.submit(*reqs[1], key=keys[1]).result(timeout=300)
    assert g3.tokens == want[1].tokens and set(g3.versions.tolist()) == {2}
    with pytest.raises(ContextTooLong) as e:
      remote.submit(list(range(200)) * 40, []).result(timeout=60)
    assert e.value.prompt_tokens >= 8000 and e.value.capacity < e.value.prompt_tokens
    assert httpx.get(server + "/health").json()["requests"] == 6  # 4 + 1 + 1 replies; the refused one never ran
    with pytest.raises(StaleWeights, match="weights version 1 refused .* serves version 2"):
      remote.set_params(state2["policy"], 1)  # older than the served version
    remote.set_params(state2["policy"], 1, reset=True)  # a resumed trainer's first push
    assert httpx.get(server + "/health").json()["version"] == 1
  assert httpx.get(server + "/health").json()["model"] == parts.served_model_id()
  with pytest.raises(ModelMismatch, match=r"serves model '[0-9a-f]{16}', this config builds model '[0-9a-f]{16}'"):
    other = miniwob_ppo.get_config("smoke")
    other.sampling.temperature = 0.5  # another behaviour policy
    RemoteInference(server, expect_model=state_lib.build(other).served_model_id())


@pytest.mark.long  # ~60 s: its own server process compiles the smoke model; real Chromium
@pytest.mark.browser
def test_a_dead_inference_server_stops_the_pool_as_an_inference_failure_not_a_lost_session():
  """The pool's episodes meet a killed inference server: its probe names it, `take` raises
  InferenceUnavailable naming the service at once; no sandbox session is counted lost or replayed, and every session the pool opened
  on the sandbox server is closed."""
  cfg = miniwob_ppo.get_config("smoke")
  parts = state_lib.build(cfg)
  proc, url = _start_server(2)
  remote = RemoteInference(url, timeout_s=30)
  assert remote.probe() is None  # what `distributed.fail_fast` asks a process whose peer stopped
  proc.kill()
  proc.wait(timeout=30)
  cause = remote.probe(timeout_s=2.0)
  assert isinstance(cause, InferenceUnavailable) and f"inference service at {url} unreachable" in str(cause)

  async def go(sandbox_url):
    async with SandboxClient(sandbox_url) as c:
      pool = RolloutPool(remote, [c], job_groups(["miniwob/click-test"], 2, 1, 0), parts.loop_cfg, parts.tokenizer,
                         PoolConfig(concurrency=2, min_batch=2))
      await pool.start()
      want = rf"inference service \(RemoteInference\) at {url} unreachable or silent on miniwob/click-test"
      with pytest.raises(InferenceUnavailable, match=want):
        await pool.take()
      await pool.close()
      return pool.ledger, await c.health()

  with launch_server() as h:
    ledger, health = run(go(h.url))
  remote.close()
  assert ledger.lost_attempts == 0 and ledger.retried == 0 and ledger.failed >= 1
  assert health["opened"] >= 1 and health["lost"] == 0
  assert health["opened"] == health["closed"] + health["expired"] + health["sessions"] and health["sessions"] == 0


@pytest.mark.long  # ~150 s: a server process, a streaming trainer and an evaluation, against real Chromium
@pytest.mark.browser
def test_a_trainer_and_the_evaluation_sample_through_a_separate_server(tmp_path):
  """rollout.inference=<url>: the streaming trainer's episodes are sampled by the server process,
  which gets each update's weights with its version; `eval --inference` samples through it too."""
  proc, url = _start_server(4)
  try:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "experiments.train", "--config",
           os.path.join(ROOT, "experiments/configs/miniwob_ppo.py:smoke"), "--workdir", str(run_dir),
           f"--config.rollout.inference={url}", "--config.rollout.streaming=True", "--config.iterations=2",
           "--config.rollout.concurrency=4", "--config.rollout.max_staleness=2"]
    p = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"policy served by {url}" in p.stdout
    health = httpx.get(url + "/health").json()
    assert health["version"] == 2 and health["requests"] >= 8  # 2 updates pushed; every turn sampled there
    rows = [json.loads(l) for l in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["pool/taken"] >= 8

    out = tmp_path / "eval.json"  # a subprocess: experiments.eval's flags would clash with other scripts'
    p = subprocess.run([sys.executable, "-m", "experiments.eval", "--run", str(run_dir), "--tasks", "miniwob/click-test",
                        "--episodes", "2", "--inference", url, "--json", str(out)], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ev = json.loads(out.read_text())
    assert ev["checkpoint"] == 2 and ev["results"]["miniwob/click-test"]["episodes"] == 2
    assert httpx.get(url + "/health").json()["requests"] > health["requests"]
  finally:
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.long  # ~30 s: a server process compiles the smoke model
def test_a_server_with_a_token_refuses_clients_without_it():
  """serve.py with a token (env TARS_INFERENCE_TOKEN): requests and weight pushes without it, or with
  another, get Unauthorized naming the server; the right one is served. Without a token, serve.py
  refuses to bind a non-loopback interface."""
  from envs_bridge import protocol as P
  cfg = miniwob_ppo.get_config("smoke")
  parts = state_lib.build(cfg)
  state = parts.init_state(cfg.seed)
  proc, url = _start_server(1, token="s3cret")
  try:
    ids, ims = _prompt(parts, np.random.default_rng(0), 1)
    for wrong in ("", "guess"):
      with RemoteInference(url, token=wrong) as c:  # /health is open: the model check still runs
        with pytest.raises(P.Unauthorized, match=rf"inference service at {url}"):
          c.set_params(state["policy"], 1)
        with pytest.raises(P.Unauthorized):
          c.submit(ids, ims).result(timeout=60)
    with RemoteInference(url, token="s3cret", expect_model=parts.served_model_id()) as c:
      c.set_params(state["policy"], 1)
      assert c.submit(ids, ims).result(timeout=300).tokens[-1] == parts.tokenizer.eos_id
  finally:
    proc.terminate()
    proc.wait(timeout=30)
  p = subprocess.run([sys.executable, "-m", "experiments.serve", "--config",
                      os.path.join(ROOT, "experiments/configs/miniwob_ppo.py:smoke"), "--host", "0.0.0.0"],
                     cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, TARS_INFERENCE_TOKEN=""), capture_output=True,
                     text=True, timeout=300)
  assert p.returncode != 0 and "refusing to bind '0.0.0.0' without a token" in p.stderr


@pytest.mark.long  # ~120 s: a server process, the flywheel's generate stage and value pretraining, real Chromium
@pytest.mark.browser
def test_the_flywheel_and_value_pretraining_sample_through_a_separate_server(tmp_path):
  """rollout.inference=<url> in the data stages: the flywheel's generate stage and value pretraining
  push their policy's weights and sample every turn on the server, and their outputs are complete."""
  proc, url = _start_server(4, config="experiments/configs/flywheel.py:smoke")
  env = dict(os.environ, PYTHONPATH=ROOT)
  try:
    fw_dir = tmp_path / "fw"
    p = subprocess.run([sys.executable, "-m", "experiments.flywheel", "--config", "experiments/configs/flywheel.py:smoke",
                        "--workdir", str(fw_dir), "--generate=1", f"--config.rollout.inference={url}"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    counts = json.loads((fw_dir / "iter_01" / "generate" / "counts.json").read_text())
    assert counts["generated"] == counts["v1"] + counts["v0"] + counts["lost"] == 8
    served = httpx.get(url + "/health").json()
    assert served["version"] == 0 and served["requests"] >= 8  # every sample's turns were sampled there
    # one session per sample: a second turn (random policy, 2 turns: most samples) ran only its new tokens
    assert 1 <= served["reused"] <= served["requests"] - 8

    vpt_dir = tmp_path / "vpt"
    p = subprocess.run([sys.executable, "-m", "experiments.value_pretrain", "--config",
                        "experiments/configs/flywheel.py:smoke", "--workdir", str(vpt_dir),
                        "--config.vpt.max_iterations=1", f"--config.rollout.inference={url}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "stopped by max_iterations after 1 iterations" in p.stdout
    assert httpx.get(url + "/health").json()["requests"] >= served["requests"] + 4
  finally:
    proc.terminate()
    proc.wait(timeout=30)
