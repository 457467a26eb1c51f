"""The inference service in its own process behind HTTP (`rollout/inference_remote.py`): the remote
client draws what the in-process service draws for the same key and weights, weights pushed over the
socket (msgpack) and from an Orbax checkpoint are served with their version, and a request that does
not fit raises the same typed error."""

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
from tars_jax.rollout.inference_remote import RemoteInference
from tars_jax.rollout.episode import InferenceFailed
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


def _start_server(slots: int) -> tuple[subprocess.Popen, str]:
  """An inference server process of the smoke config on a free port, once it answers /health."""
  port = _free_port()
  cmd = [sys.executable, "-m", "tars_jax.rollout.inference_remote", "--config",
         os.path.join(ROOT, "experiments/configs/miniwob_ppo.py:smoke"), "--port", str(port), "--slots", str(slots)]
  proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
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


def _prompt(parts, rng, turns):
  from tars_jax.agent import prompts
  tok = parts.tokenizer
  ids = prompts.encode_episode_prefix(tok, "Click the button.", parts.loop_cfg.system)
  images = []
  for _ in range(turns):
    ids += prompts.encode_observation(tok, parts.loop_cfg.n_img_tokens, None)
    images.append(rng.integers(0, 256, parts.image_hw + (3,), dtype=np.uint8))
  return ids, images


@pytest.mark.slow  # ~60 s: a server process and an in-process service each compile the smoke model
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


@pytest.mark.slow  # ~60 s: its own server process compiles the smoke model; real Chromium
@pytest.mark.browser
def test_a_dead_inference_server_stops_the_pool_as_an_inference_failure_not_a_lost_session():
  """The pool's episodes meet a killed inference server: `take` raises InferenceFailed naming the
  service at once; no sandbox session is counted lost or replayed, and every session the pool opened
  on the sandbox server is closed."""
  cfg = miniwob_ppo.get_config("smoke")
  parts = state_lib.build(cfg)
  proc, url = _start_server(2)
  remote = RemoteInference(url, timeout_s=30)
  proc.kill()
  proc.wait(timeout=30)

  async def go(sandbox_url):
    async with SandboxClient(sandbox_url) as c:
      pool = RolloutPool(remote, [c], job_groups(["miniwob/click-test"], 2, 1, 0), parts.loop_cfg, parts.tokenizer,
                         PoolConfig(concurrency=2, min_batch=2))
      await pool.start()
      with pytest.raises(InferenceFailed, match=r"inference service \(RemoteInference\) failed on miniwob/click-test"):
        await pool.take()
      await pool.close()
      return pool.ledger, await c.health()

  with launch_server() as h:
    ledger, health = run(go(h.url))
  remote.close()
  assert ledger.lost_attempts == 0 and ledger.retried == 0 and ledger.failed >= 1
  assert health["opened"] >= 1 and health["lost"] == 0
  assert health["opened"] == health["closed"] + health["expired"] + health["sessions"] and health["sessions"] == 0
