r"""Streaming vs synchronous rollouts side by side in one run (issue #27 item 6; report section 2.5.3).

  .venv/bin/python -m benchmarks.rollout_streaming [--updates 6] [--sessions 8] [--max_turns 8]
  .venv/bin/python -m benchmarks.rollout_streaming --smoke --latency_median_s 1.0   # remote-VM-like steps

Both modes train the same model (the main job's config, `miniwob_ppo.py:ppo`, random init, or
`--smoke` for the tiny one) with the same PPO update on the same long-tailed task mix against one
real Chromium sandbox server: one-step MiniWoB++ tasks, multi-step ones and games played to the step
budget. Synchronous: each update waits for `sessions` lockstep episodes (`agent_loop.run_episodes`
with `BatchedPolicy`). Streaming: `sessions` episodes in flight through the continuous-batching
`InferenceService` (`rollout/pool.py`), each update takes the first finished groups holding
`sessions` episodes and runs in a thread while the others play on. `--latency_median_s`: the sandbox
server waits a log-normal wall-clock delay (that median; `--latency_sigma` in log space) before each
step answers (`envs_bridge.app.StepLatency`), standing in for remote desktop VMs, where asynchronous
rollout is meant to pay (report 2.5.3; AReaL 2.77x, verl's fully asynchronous trainer 2.35-2.67x over
synchronous). Each mode runs two untimed
updates first (compilation), and every update batch is padded to one shape. Prints one table: trajectories trained per second, the trainer's idle
fraction (time waiting for rollouts), generation batch occupancy (busy rows per decode call /
slots per decode step), mean staleness of trained episodes (policy versions), episode lengths, and
the speed-up of streaming.
"""

from __future__ import annotations

import asyncio
import copy
import time

from absl import app, flags
import numpy as np

from benchmarks.command import command_line
from envs_bridge.launch import env_fleet
from experiments.configs import miniwob_ppo
from tars_jax.agent.trajectory import collate
from tars_jax.rollout import pool as pool_lib
from tars_jax.rollout.agent_loop import run_episodes
from tars_jax.rollout.episode import RolloutStats
from tars_jax.rollout.jobs import group_ids, rollout_jobs
from tars_jax.train import ppo
from tars_jax.train import state as state_lib

_UPDATES = flags.DEFINE_integer("updates", 6, "Timed PPO updates per mode.")
_SESSIONS = flags.DEFINE_integer("sessions", 8, "Episodes per update (and in flight when streaming).")
_MAX_TURNS = flags.DEFINE_integer("max_turns", 8, "Step budget per episode.")
_STALENESS = flags.DEFINE_integer("max_staleness", 2, "Streaming: versions a token may lag.")
_SMOKE = flags.DEFINE_bool("smoke", False, "The tiny smoke model instead of the main job's.")
_LATENCY = flags.DEFINE_float("latency_median_s", 0.0, "Median wall-clock seconds a step waits (0: none).")
_SIGMA = flags.DEFINE_float("latency_sigma", 1.0, "Log-space standard deviation of that delay.")
_WARMUP = 2  # untimed updates per mode (compilation of the decode / prefill shapes and the update)
_TASKS = flags.DEFINE_list("tasks", ["miniwob/click-test", "miniwob/click-checkboxes", "miniwob/enter-text",
                                     "games/same-game", "games/shapes"], "The long-tailed task mix.")


def _config():
  c = miniwob_ppo.get_config("smoke" if _SMOKE.value else "ppo")
  c.tasks = tuple(_TASKS.value)
  c.grammar.actions = ("click", "type", "hotkey", "finished")
  c.env.max_turns = _MAX_TURNS.value
  c.env.num_sessions = _SESSIONS.value
  c.env.step_latency_median_s, c.env.step_latency_sigma = _LATENCY.value, _SIGMA.value
  c.rl.group_size = 1
  c.rl.epochs = 1
  c.rl.minibatch_size = min(c.rl.minibatch_size, _SESSIONS.value)
  c.length_multiple = 128
  c.model.image_mean = None  # games and MiniWoB++ alike: the processor default
  c.model.image_std = None
  return c


def _pad_length(parts, cfg) -> int:
  """Tokens of the longest episode without observation text (prefix of 256 bytes, then per turn an
  observation and the longest reply), rounded up to `length_multiple`: every update batch of both
  modes is padded to it, so no mode pays a compile the other one paid for."""
  per_turn = parts.loop_cfg.n_img_tokens + 8 + parts.max_new_tokens
  n = len(parts.loop_cfg.system.encode()) + 256 + cfg.env.max_turns * per_turn
  return -(-n // cfg.length_multiple) * cfg.length_multiple


def _update(parts, cfg, state, episodes, it):
  longest = max(len(e.token_ids()) for e in episodes)
  batch = collate(episodes, pad_id=parts.tokenizer.pad_id, max_images=cfg.env.max_turns, image_hw=parts.image_hw,
                  length_multiple=max(_pad_length(parts, cfg), longest), batch_size=cfg.env.num_sessions).as_dict()
  return ppo.ppo_update(state, batch, parts.table, policy_gd=parts.policy_gd, critic_gd=parts.critic_gd,
                        popt=parts.popt, copt=parts.copt, hp=parts.hparams, inputs=parts.inputs, epochs=cfg.rl.epochs,
                        minibatch_size=cfg.rl.minibatch_size, rng=np.random.default_rng([0, it]),
                        n_real=len(episodes), scores=np.array([e.shaped_return for e in episodes], np.float32),
                        group_ids=group_ids(episodes))[0]


def _sync(parts, cfg, state, loop, clients, updates):
  n, tasks = cfg.env.num_sessions, tuple(cfg.tasks)
  policy = parts.batched_policy(state["policy"], batch_size=n, seed=0)
  calls = {"rows": 0, "calls": 0}

  def act(prompts, images):
    calls["rows"] += len(prompts)
    calls["calls"] += -(-len(prompts) // n)
    return policy.act(prompts, images)

  lengths, trained, idle, t_start = [], 0, 0.0, None
  for it in range(updates + _WARMUP):
    if it == _WARMUP:  # the first updates compiled what the mode needs
      t_start, idle, calls["rows"], calls["calls"], lengths, trained = time.perf_counter(), 0.0, 0, 0, [], 0
    t0 = time.perf_counter()
    jobs = rollout_jobs(tasks, n, 1, it, 1000)
    eps = loop.run_until_complete(run_episodes(act, clients, jobs, parts.loop_cfg, parts.tokenizer, version=it,
                                               stats=RolloutStats()))
    eps = [e for e in eps if not e.lost]
    idle += time.perf_counter() - t0
    state = _update(parts, cfg, state, eps, it)
    policy.params = state["policy"]
    lengths += [len(e.turns) for e in eps]
    trained += len(eps)
  wall = time.perf_counter() - t_start
  return dict(traj_s=trained / wall, idle=idle / wall, occupancy=calls["rows"] / max(1, calls["calls"] * n),
              staleness=0.0, lengths=lengths, wall=wall, trained=trained)


def _streaming(parts, cfg, state, loop, clients, updates):
  n, tasks = cfg.env.num_sessions, tuple(cfg.tasks)
  service = parts.inference_service(state["policy"], slots=n, seed=0)
  pool = pool_lib.RolloutPool(service, clients, pool_lib.job_groups(tasks, n, 1, 1000), parts.loop_cfg,
                              parts.tokenizer, pool_lib.PoolConfig(concurrency=n, min_batch=n,
                                                                   max_staleness=_STALENESS.value))
  loop.run_until_complete(pool.start())
  lengths, stale, trained, idle, t_start, occ0 = [], [], 0, 0.0, None, None
  try:
    for it in range(updates + _WARMUP):
      if it == _WARMUP:
        t_start, idle, lengths, stale, trained = time.perf_counter(), 0.0, [], [], 0
        occ0 = copy.copy(service.stats)
      t0 = time.perf_counter()
      eps = loop.run_until_complete(pool.take())
      idle += time.perf_counter() - t0
      stale += [pool_lib.staleness(e, service.version) for e in eps]
      state = loop.run_until_complete(asyncio.to_thread(_update, parts, cfg, state, eps, it))
      service.set_params(state["policy"], it + 1)
      lengths += [len(e.turns) for e in eps]
      trained += len(eps)
    wall = time.perf_counter() - t_start
    s = service.stats
    occ = (s.busy_slot_steps - occ0.busy_slot_steps) / max(1, (s.steps - occ0.steps) * s.slots)
    return dict(traj_s=trained / wall, idle=idle / wall, occupancy=occ, staleness=float(np.mean(stale)),
                lengths=lengths, wall=wall, trained=trained, dropped=pool.ledger.dropped_stale)
  finally:
    loop.run_until_complete(pool.close())
    service.close()


def main(argv):
  del argv
  cfg = _config()
  parts = state_lib.build(cfg)
  with env_fleet(cfg.env) as (loop, clients):
    sync = _sync(parts, cfg, parts.init_state(0), loop, clients, _UPDATES.value)
    stream = _streaming(parts, cfg, parts.init_state(0), loop, clients, _UPDATES.value)
  flags_used = (f"--updates {_UPDATES.value} --sessions {_SESSIONS.value} --max_turns {_MAX_TURNS.value}"
                + (" --smoke" if _SMOKE.value else "")
                + (f" --latency_median_s {_LATENCY.value} --latency_sigma {_SIGMA.value}" if _LATENCY.value else ""))
  print(f"\n{command_line('benchmarks.rollout_streaming', flags_used)}")
  print(f"tasks: {', '.join(cfg.tasks)}; {_UPDATES.value} timed updates per mode, {cfg.env.num_sessions} episodes each; "
        + (f"step latency log-normal, median {_LATENCY.value} s, sigma {_SIGMA.value}" if _LATENCY.value
           else "no step latency"))
  print("| mode | trajectories/s | trainer idle | batch occupancy | mean staleness | episode length mean / p90 / max | trained | wall s |")
  print("|---|---|---|---|---|---|---|---|")
  for name, r in (("synchronous", sync), ("streaming", stream)):
    L = np.asarray(r["lengths"])
    print(f"| {name} | {r['traj_s']:.3f} | {r['idle']:.2f} | {r['occupancy']:.2f} | {r['staleness']:.2f} | "
          f"{L.mean():.1f} / {np.percentile(L, 90):.0f} / {L.max()} | {r['trained']} | {r['wall']:.0f} |")
  print(f"streaming / synchronous trajectories/s: {stream['traj_s'] / sync['traj_s']:.2f}x "
        f"(streaming dropped {stream['dropped']} stale episodes)")


if __name__ == "__main__":
  app.run(main)
