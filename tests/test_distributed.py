"""Multi-process training through `jax.distributed` (issue #27, item 5), on this machine's CPU with
JAX's gloo collectives: real processes, a real coordinator on a loopback port.

1. A PPO update (`ppo.ppo_update`, critic + GAE, two epochs of two minibatches) of a tiny model on a
   (data=2) mesh gives the same losses and parameters when the mesh is two processes of one CPU device
   each as when it is one process with two devices (`--xla_force_host_platform_device_count=2`), on
   the same global batch, both ways a multi-process caller can hold it: each process only its half of
   the rows (`distributed.global_batch_from_local`) or every process the whole batch (what
   experiments/train.py does after gathering the episodes).
2. A dead peer: process 1 is killed with SIGKILL after a checkpointed update; process 0 exits non-zero
   (no hang: bounded by a generous subprocess timeout) naming process 1; re-launching both resumes
   from the last Orbax checkpoint with the parameters it saved.

The workers are this file run as a script (`python tests/test_distributed.py <mode> ...`): the device
count and distributed runtime must be set before JAX starts.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEARTBEAT_S = 10  # the dead-peer test's heartbeat timeout (JAX's default is 100 s)
N_ROWS, MINIBATCH, EPOCHS = 4, 2, 2


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int) -> dict:
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  env.pop("JAX_COORDINATOR_ADDRESS", None)
  return env


def _worker(mode: str, out: str, *, procs: int, port: int = 0, pid: int = 0, extra=()) -> list[str]:
  return [sys.executable, "-u", os.path.abspath(__file__), mode, out, str(procs), str(pid), str(port), *extra]


def _launch_pair(mode: str, out: str, extra=()) -> list[subprocess.Popen]:
  port = _free_port()
  return [subprocess.Popen(_worker(mode, out, procs=2, port=port, pid=p, extra=extra), cwd=ROOT, env=_env(1),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
          for p in (0, 1)]


def _wait(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
  res = []
  for p in procs:
    try:
      out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise AssertionError(f"worker {p.args[3:6]} still running after {timeout} s (a hang)")
    res.append((p.returncode, out))
  return res


# --- fast: the one-process defaults and the work split ---------------------------------------------

def test_blocks_partition_the_jobs_in_order():
  from tars_jax.distributed import _block
  for n in range(0, 11):
    for k in range(1, 5):
      blocks = [_block(n, p, k) for p in range(k)]
      assert [i for s, e in blocks for i in range(s, e)] == list(range(n))  # concatenation = job order
      sizes = [e - s for s, e in blocks]
      assert max(sizes) - min(sizes) <= 1, (n, k, sizes)


def test_one_process_changes_nothing():
  import ml_collections as mlc
  from tars_jax import distributed as dist
  from tars_jax.rollout.episode import RolloutStats
  cfg = mlc.ConfigDict(dict(num_processes=1, process_id=-1, coordinator_address="", heartbeat_timeout_s=100,
                            initialization_timeout_s=300, cpu_collectives="gloo"))
  assert dist.initialize(cfg) == (0, 1)
  jobs, tree = [("t", 1), ("t", 2), ("u", 3)], {"w": np.ones(3)}
  assert dist.share(jobs) == jobs and dist.share_size(32) == 32
  assert dist.allgather_list(jobs) is jobs and dist.local_replica(tree) is tree
  assert dist.server_share(("a", "b")) == ("a", "b") and dist.server_share(()) == ()
  assert dist.process_seed(7) == 7 and dist.is_main() and not dist.is_multi()
  a = RolloutStats(episodes=2, env_steps=5, env_time_s=1.5, reward_terms={"outcome": 1.0})
  b = RolloutStats(episodes=3, episodes_lost=1, env_steps=1, env_time_s=0.5, reward_terms={"outcome": 2.0, "format": -0.1})
  assert dist.merge_counters([a]) is a
  m = dist.merge_counters([a, b])
  assert (m.episodes, m.episodes_lost, m.env_steps, m.env_time_s) == (5, 1, 6, 2.0)
  assert m.reward_terms == {"outcome": 3.0, "format": -0.1}


@pytest.mark.parametrize("n,pid", [(-1, 0), (2, 2), (2, -2)])
def test_bad_process_counts_and_ids_are_errors(n, pid):
  import ml_collections as mlc
  from tars_jax import distributed as dist
  cfg = mlc.ConfigDict(dict(num_processes=n, process_id=pid, coordinator_address="127.0.0.1:1",
                            heartbeat_timeout_s=10, initialization_timeout_s=1, cpu_collectives="gloo"))
  with pytest.raises(ValueError, match="num_processes|process_id"):
    dist.initialize(cfg)


# --- test 1: same update on one and on two processes -----------------------------------------------

@pytest.fixture(scope="module")
def updates(tmp_path_factory):
  d = tmp_path_factory.mktemp("dist")
  single = subprocess.run(_worker("update", str(d / "single.npz"), procs=1), cwd=ROOT, env=_env(2),
                          capture_output=True, text=True, timeout=900)
  assert single.returncode == 0, single.stdout + single.stderr
  pair = _wait(_launch_pair("update", str(d / "multi.npz")), timeout=900)
  for rc, out in pair:
    assert rc == 0, out
  return dict(np.load(d / "single.npz")), dict(np.load(d / "multi.npz"))


def _compare(single: dict, multi: dict, prefix: str):
  """Losses and every parameter leaf equal within float32 rounding of the sharded computations
  (tolerance `f32_atol`: the model's forward + backward summation length, at each array's scale)."""
  from _shared import TINY_CFG, assert_close_f32, forward_terms
  terms = 2 * forward_terms(TINY_CFG, int(single["seq"])) * EPOCHS * (N_ROWS // MINIBATCH)
  keys = [k for k in single if k.startswith("metric/")]
  assert {"metric/pg_loss", "metric/value_loss", "metric/entropy"} <= set(keys), keys
  for k in keys:
    assert_close_f32(multi[prefix + k], single[k], terms=terms, scale=max(1.0, abs(float(single[k]))), err_msg=k)
  params = [k for k in single if k.startswith("param/")]
  assert len(params) > 10, params
  moved = 0.0
  for k in params:
    assert_close_f32(multi[prefix + k], single[k], terms=terms, err_msg=k)
    moved = max(moved, float(np.abs(single[k] - single["init/" + k[len("param/"):]]).max()))
  assert moved > 1e-5, "the update did not move the parameters: the comparison would be vacuous"


@pytest.mark.long  # ~2 min for one process and ~6 min for the pair on a loaded 2-core machine
def test_ppo_update_on_two_processes_equals_one_process_process_local_rows(updates):
  single, multi = updates
  assert int(multi["processes"]) == 2 and int(single["processes"]) == 1
  _compare(single, multi, "local/")


@pytest.mark.long
def test_ppo_update_on_two_processes_equals_one_process_whole_batch(updates):
  single, multi = updates
  _compare(single, multi, "whole/")


# --- test 2: a dead peer, then resume ---------------------------------------------------------------

@pytest.mark.long
def test_dead_peer_fails_fast_naming_its_rank_and_run_resumes(tmp_path):
  work = str(tmp_path / "run")
  # Phase 1: both processes make one update and checkpoint it; then process 1 is SIGKILLed during
  # the next update and process 0 must stop, naming process 1, within the heartbeat timeout.
  (rc0, out0), (rc1, out1) = _wait(_launch_pair("die", work), timeout=600)
  assert rc1 == -9, out1
  assert rc0 != 0, out0
  assert re.search(r"peer process\(es\) \[1\] died|Task 1 heartbeat timeout|"
                   r"stopped sending heartbeats\):\s*1\b", out0), out0
  saved = dict(np.load(os.path.join(work, "after_step1.npz")))
  # Phase 2: the same command again resumes from checkpoint 1 with the parameters it saved.
  for rc, out in _wait(_launch_pair("resume", work), timeout=600):
    assert rc == 0, out
    assert "resumed from step 1" in out, out
  resumed = dict(np.load(os.path.join(work, "resumed.npz")))
  assert saved.keys() == resumed.keys()
  for k in saved:
    np.testing.assert_array_equal(resumed[k], saved[k], err_msg=k)


@pytest.mark.long  # two processes' start-up
def test_one_sigterm_d_process_stops_every_process_of_the_run_at_the_same_iteration():
  """`distributed.any_process` on real gloo collectives: the process that got SIGTERM stops as
  `Terminated`, its peer at the same iteration with a plain stop (it was not signalled itself)."""
  (rc0, out0), (rc1, out1) = _wait(_launch_pair("stop", "-"), timeout=300)
  assert (rc0, rc1) == (0, 0), out0 + out1
  assert "stopped at iteration 3: StageStopped" in out0 and "stopped at iteration 3: Terminated" in out1, out0 + out1


# --- worker (a separate process) ---------------------------------------------------------------------

def _main(mode: str, out: str, procs: int, pid: int, port: int) -> None:
  import ml_collections as mlc

  if procs > 1:
    from tars_jax import distributed as dist
    dist.initialize(mlc.ConfigDict(dict(num_processes=procs, process_id=pid,
                                        coordinator_address=f"127.0.0.1:{port}",
                                        heartbeat_timeout_s=HEARTBEAT_S, initialization_timeout_s=120,
                                        cpu_collectives="gloo")))
  if mode == "stop":  # process 1 alone is SIGTERM'd at iteration 3; both must stop at one iteration
    import signal

    from tars_jax import distributed as dist
    from tars_jax.train.guard import Guard, stop_on_sigterm
    g = Guard("train", 60.0, 1000, "iteration")
    stop_on_sigterm(g)
    for it in range(1000):
      if pid == 1 and it == 3:
        os.kill(os.getpid(), signal.SIGTERM)
      if dist.any_process(g.tripped()):
        break
    print(f"stopped at iteration {it}: {type(g.error(it)).__name__}", flush=True)
    return
  import jax
  from flax import nnx

  from experiments.configs import miniwob_ppo
  from tars_jax import distributed as dist
  from tars_jax import sharding
  from tars_jax.agent.tokenizer import IMAGE
  from tars_jax.models import Policy, ValueModel
  from tars_jax.train import checkpoint as ckpt
  from tars_jax.train import ppo
  from tars_jax.train import state as state_lib
  from _shared import TINY_CFG
  from test_ppo_direction import INPUTS, _batch

  assert jax.device_count() == 2, jax.devices()
  hp = dataclasses.replace(state_lib.hparams(miniwob_ppo.get_config("ppo")),
                           aux_loss_coef=0.0)
  popt = ppo.make_optimizer(1e-3, 1, 1.0, 0.0)
  copt = ppo.make_optimizer(1e-3, 1, 1.0, 0.0)
  mesh = sharding.make_mesh((2, 1, 1, 1))
  rules = sharding.make_rules()
  with sharding.activate(mesh, rules):
    gd, _ = nnx.split(nnx.eval_shape(lambda: Policy(TINY_CFG, rngs=nnx.Rngs(0))))
    cgd, _ = nnx.split(nnx.eval_shape(lambda: ValueModel(TINY_CFG, rngs=nnx.Rngs(0))))
  parts = state_lib.Parts(config=None, tokenizer=None, model_cfg=TINY_CFG, grammar=None, table=None,
                          policy_gd=gd, critic_gd=cgd, popt=popt, copt=copt, hparams=hp, inputs=INPUTS, loop_cfg=None,
                          eval_loop_cfg=None, image_hw=(TINY_CFG.image_h, TINY_CFG.image_w), max_new_tokens=0,
                          mesh=mesh, rules=rules)

  # The same global batch everywhere (seeded): rows of prompt + image + reply, a reward on each last
  # reply token, behaviour log-probs near the initial policy's.
  rng = np.random.default_rng(0)
  batch = _batch(rng, n_rows=N_ROWS)
  last = (batch["loss_mask"] * np.arange(batch["loss_mask"].shape[1])).argmax(1)
  batch["rewards"] = np.zeros_like(batch["loss_mask"])
  batch["rewards"][np.arange(N_ROWS), last] = np.array([1.0, -1.0, 0.5, 0.0], np.float32)
  batch["old_logp"] = ((-3.0 + 0.1 * rng.standard_normal(batch["loss_mask"].shape)) * batch["loss_mask"]
                       ).astype(np.float32)

  def update(state, b, seed=0):
    with parts.activate():
      return ppo.ppo_update(state, b, None, policy_gd=gd, critic_gd=cgd, popt=popt, copt=copt, hp=hp, inputs=INPUTS,
                            epochs=EPOCHS, minibatch_size=MINIBATCH, rng=np.random.default_rng(seed),
                            n_real=N_ROWS)

  def host(tree, prefix):
    flat = jax.tree_util.tree_leaves_with_path(jax.tree.map(dist.to_host, tree))
    return {prefix + jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}

  if mode == "update":
    res = {"processes": np.array(jax.process_count()), "seq": np.array(batch["tokens"].shape[1])}
    init = parts.init_state(0)
    res.update(host(init["policy"], "init/"))
    if procs == 1:
      state, m = update(init, batch)
      res.update(host(state["policy"], "param/"))
      res.update({f"metric/{k}": np.array(v) for k, v in m.items()})
    else:
      for how in ("local", "whole"):
        lo, hi = pid * N_ROWS // 2, (pid + 1) * N_ROWS // 2
        b = (dist.global_batch_from_local({k: v[lo:hi] for k, v in batch.items()}, mesh, rules)
             if how == "local" else batch)
        state, m = update(parts.init_state(0), b)
        res.update(host(state["policy"], f"{how}/param/"))
        res.update({f"{how}/metric/{k}": np.array(v) for k, v in m.items()})
    if jax.process_index() == 0:
      np.savez(out, **res)
    return

  # die / resume: a checkpointed multi-process run (Orbax on every process)
  os.makedirs(out, exist_ok=True)
  mngr = ckpt.manager(out, max_to_keep=2, cleanup_tmp=True)
  state = parts.init_state(0)
  if mode == "die":
    state, _ = update(state, batch)
    ckpt.save(mngr, 1, state, {"iteration": 1})
    if jax.process_index() == 0:
      np.savez(os.path.join(out, "after_step1.npz"), **host(state["policy"], ""))
    else:
      host(state["policy"], "")  # the gather is a collective: every process takes part

    @dist.fail_fast
    def train_on():
      nonlocal state
      for it in range(2, 1000):
        if jax.process_index() == 1 and it == 3:
          os.kill(os.getpid(), 9)  # a worker that dies mid-run (SIGKILL: no clean-up, no goodbye)
        state, _ = update(state, batch, seed=it)
      raise AssertionError("process 0 trained on after its peer died")

    train_on()
  else:
    step, state, meta = ckpt.restore(mngr, state)
    print(f"resumed from step {step} (iteration {meta['iteration']})", flush=True)
    tree = host(state["policy"], "")
    if jax.process_index() == 0:
      np.savez(os.path.join(out, "resumed.npz"), **tree)
    state, _ = update(state, batch, seed=step + 1)  # and it trains on


if __name__ == "__main__":
  _main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
