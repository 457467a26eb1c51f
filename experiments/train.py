r"""PPO trainer for GUI agents against sandbox servers (one linear script; big_vision style).

  python -m experiments.train --config experiments/configs/miniwob_ppo.py --workdir runs/miniwob_ppo
  python -m experiments.train --config experiments/configs/miniwob_ppo.py:smoke --workdir /tmp/smoke
  python -m experiments.train --config experiments/configs/miniwob_ppo.py:ppo --workdir runs/ppo_vpt \
      --config.critic.init=runs/vpt/critic      # critic from experiments/value_pretrain.py
  python -m experiments.train --config experiments/configs/miniwob_pipeline.py --workdir runs/x/ppo \
      --config.policy.init=runs/x/sft --config.critic.init=runs/x/vpt/critic   # from the SFT policy
  python -m experiments.train --config experiments/configs/miniwob_ppo.py --workdir runs/ppo \
      --config.rollout.inference=http://127.0.0.1:8800   # the policy served by experiments/serve.py

Re-running the same command resumes from the last complete checkpoint in `--workdir`.
Layout of the run dir: config.json, metrics.jsonl, tensorboard/, checkpoints/, trajectories/ (a few
episodes as PNG + JSON for a person), rollouts/ (every trained episode as trajectory records).
Every `eval_every` iterations the policy plays `eval_episodes` held-out seeds per task
(env.eval_seed_offset + k) through the same rollout path, logged as eval/<task>/success.
A config with `vpt.enabled` (value pretraining first) is refused unless `critic.init` holds the
pretrained critic: experiments/replicate.py runs both stages.
"""

from __future__ import annotations

import asyncio
import copy
import os
import time

from absl import app, flags
from ml_collections import config_flags

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from envs_bridge.launch import env_fleet
from tars_jax import distributed as dist
from tars_jax.agent import memory as memory_lib
from tars_jax.agent.trajectory import collate, real_rows
from tars_jax.analysis.image_dependence import image_dependence
from tars_jax.data import records
from tars_jax.rollout import evaluation
from tars_jax.rollout import pool as pool_lib
from tars_jax.rollout.agent_loop import run_episodes, trainable
from tars_jax.rollout.episode import RolloutStats
from tars_jax.rollout.inference_remote import RemoteInference
from tars_jax.rollout.jobs import group_ids, rollout_jobs, task_ids
from tars_jax.train import orm as orm_lib
from tars_jax.train import checkpoint as ckpt
from tars_jax.train import guard as guard_lib
from tars_jax.train import state as state_lib
from tars_jax.train import ppo
from tars_jax.train import sft as sft_lib
from tars_jax.train import run as run_lib
from tars_jax.train.metrics import episode_metrics
from tars_jax.train.trajectories import save_episodes

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (get_config(arg)).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (created; resumed if it has checkpoints).")


def main(argv):
  del argv
  config, workdir = _CONFIG.value, _WORKDIR.value
  # Multi-process run (tars_jax/distributed.py, docs/running.md, "Multi-process runs"): jax.distributed before any
  # computation; one process (distributed.num_processes = 1, the default) changes nothing below.
  dist.initialize(config.distributed)
  dist.default_mesh(config)
  if config.vpt.enabled and not config.critic.init:  # PPO alone would silently skip the stage
    raise app.UsageError("config has vpt.enabled=True: value pretraining must run before PPO; use "
                         "experiments/replicate.py (runs both stages), or run experiments/value_pretrain.py "
                         "and pass --config.critic.init=<its workdir>/critic")
  if config.rl.ptx_coef > 0 and not config.rl.ptx_data:  # refused before the model is built
    raise app.UsageError(f"config.rl.ptx_coef={config.rl.ptx_coef} needs demonstrations: "
                         "--config.rl.ptx_data=\"('runs/x/demos',)\"")
  # The budget is `iterations`; `max_minutes` only guards this process against a hung or far too slow
  # host (tars_jax/train/guard.py): it checkpoints and stops the run loudly.
  run = run_lib.start("train", config, workdir, budget=config.iterations, unit="iteration",
                      max_minutes=config.max_minutes, keep_checkpoints=config.keep_checkpoints,
                      main=dist.is_main())  # the run's files have one writer; Orbax checkpoints run on all
  mngr, guard = run.mngr, run.guard

  # ----------------------------------------------------------------------------------------------
  # Model, optimisers, grammar, checkpoint resume.
  # ----------------------------------------------------------------------------------------------
  parts = state_lib.build(config)
  state = parts.init_state(config.seed)
  print(f"[train] MoE: {nnx.merge(parts.policy_gd, state['policy']).moe_strategy_summary()}")
  if config.policy.init:  # e.g. the SFT stage; loaded on resume too: it is the KL reference
    state, src = state_lib.load_policy(state, config.policy.init, parts.popt)
    print(f"[train] policy initialised from {src}")
  # KL reference = the initial policy (rebuilt from the seed / policy.init on resume: never changes).
  ref_params = jax.tree.map(jnp.copy, state["policy"]) if parts.hparams.kl_coef > 0 else None
  critic_init = config.critic.init
  if critic_init and mngr.latest_step() is None:  # a resumed run has its own (trained) critic
    state = state_lib.load_critic(state, critic_init, parts.copt)
    print(f"[train] critic initialised from {critic_init}")
  state, step, meta = run.resume(state)
  start_iter = int(meta.get("iteration", step))
  writer = run.writer(config, start_iter)
  # Randomness of iteration `it` (sampling keys, minibatch shuffles) derives from (seed, it) only,
  # so a resumed run repeats what an uninterrupted one would have done.
  # (multi-process: each process samples its share of the episodes with its own copy of the policy)
  policy = parts.batched_policy(dist.local_replica(state["policy"]),
                                batch_size=dist.share_size(config.env.num_sessions),
                                seed=dist.process_seed(config.seed))
  # rollout.inference=<url>: the policy is served by `experiments/serve.py` (another process or host);
  # it must build the same model, gets this run's weights now (a resumed run may be behind it) and
  # after every update. Its sampling keys are its own: such a run does not replay from the seed.
  # Several processes share one service: process 0 pushes, the others wait for it and read the version.
  remote = None
  if config.rollout.inference:
    remote = parts.remote_client()
    dist.on_peer_failure(remote.probe)  # a peer stopped by the service: every process names its URL
    push_weights(remote, policy.params, start_iter, reset=True)
    print(f"[train] policy served by {config.rollout.inference} (weights version {start_iter} pushed)")
  act = remote.act if remote is not None else policy.act
  hp = parts.hparams
  # PPO-ptx (rl.ptx_coef): a demonstration batch's SFT loss in every policy step; the stream's position
  # is in each checkpoint, so a resumed run draws the batches an uninterrupted one would have.
  ptx_iter = None
  if hp.ptx_coef > 0:
    sft_lib.check_data(config.rl.ptx_data, image_hw=parts.image_hw, n_img_tokens=parts.loop_cfg.n_img_tokens,
                       tokenizer=parts.tokenizer)
    ptx_iter = iter(sft_lib.demo_batches(
        config.rl.ptx_data, grammar=parts.grammar, tokenizer=parts.tokenizer, thoughts=config.sft.thoughts,
        image_hw=parts.image_hw, length_multiple=config.length_multiple, batch_size=config.rl.ptx_batch_size,
        seed=config.seed))
    if "ptx_data_state" in meta:
      ptx_iter.set_state(meta["ptx_data_state"])
    print(f"[train] PPO-ptx: coefficient {hp.ptx_coef} on {', '.join(config.rl.ptx_data)}")
  ptx_meta = lambda: {"ptx_data_state": ptx_iter.get_state()} if ptx_iter is not None else {}  # noqa: E731
  # Outcome reward: the verifier's (the sandbox's reward), or a generative ORM's P(yes) with
  # rl.orm_run (tars_jax/train/orm.py; report 2.5.2), the verifier's still logged beside it.
  orm = orm_lib.scorer_for_ppo(config, parts)
  if orm is not None:
    print(f"[train] outcome rewards from the ORM {config.rl.orm_run} (P(yes) in {tuple(config.rl.orm_reward_range)})")

  # ----------------------------------------------------------------------------------------------
  # Training loop.
  # ----------------------------------------------------------------------------------------------
  # Sandbox servers: the configured fleet, or one local server subprocess (stopped on any exit).
  with env_fleet(config.env, urls=dist.server_share(config.env.servers)) as (loop, clients):
    t_start, it = time.time(), start_iter
    tasks, n = tuple(config.tasks), config.env.num_sessions
    # Streaming (rollout.streaming): episodes run continuously through the inference service; each
    # update takes the first finished groups (rollout/pool.py). Off: lockstep rollouts per iteration.
    # Episodic memory (memory.episodic): summaries of a task's earlier episodes in each new prefix.
    episodic = (memory_lib.EpisodicMemory(parts.loop_cfg.memory, parts.tokenizer)
                if parts.loop_cfg.memory.episodic != "off" else None)
    # Several processes: one pool per process with its share of the sandbox servers, of the concurrency
    # and of the groups (every k-th); each update takes its share of min_batch from each pool and trains
    # on all of them (allgather), so an episode is trained once, by every process's replica.
    pool = service = None
    if config.rollout.streaming:
      r = config.rollout
      conc = dist.share_size(r.concurrency or n)
      service = remote or parts.inference_service(policy.params, slots=r.slots or conc,
                                                  seed=dist.process_seed(config.seed), version=start_iter)
      pool = pool_lib.RolloutPool(
          service, clients, pool_lib.job_groups(tasks, n, config.rl.group_size, config.env.train_seed_offset,
                                                start_iter, share=(jax.process_index(), jax.process_count())),
          parts.loop_cfg, parts.tokenizer,
          pool_lib.PoolConfig(concurrency=conc, min_batch=dist.share_size(r.min_batch or n),
                              max_staleness=r.max_staleness, stale=r.stale,
                              max_failed_in_a_row=r.max_failed_in_a_row), episodic=episodic)
      loop.run_until_complete(pool.start())

    bar = tqdm(total=config.iterations, initial=start_iter, desc=config.rl.algo, unit="it", dynamic_ncols=True,
               disable=not dist.is_main())
    tripped = False
    try:
      for it in range(start_iter, config.iterations):
        if dist.any_process(guard.tripped()):  # one decision for every process of the run
          tripped = True
          break
        t0 = time.perf_counter()
        if pool is not None:
          before = copy.deepcopy(pool.stats)
          episodes = loop.run_until_complete(pool.take())
          stats = pool_lib.stats_since(pool.stats, before)
          stale = [pool_lib.staleness(e, service.version) for e in episodes]
          if dist.is_multi():  # every process trains on every process's take, in process order
            episodes, stale = dist.allgather_list(episodes), dist.allgather_list(stale)
            stats = dist.merge_counters(dist.allgather_list([stats]))
          if episodic is not None:
            memory_lib.remember(episodic, episodes, tok=parts.tokenizer, system=parts.loop_cfg.system, act=service.act)
        else:
          policy.start_iteration(it)
          jobs = dist.share(rollout_jobs(tasks, n, config.rl.group_size, it, config.env.train_seed_offset))
          stats = RolloutStats()
          episodes = loop.run_until_complete(
              run_episodes(act, clients, jobs, parts.loop_cfg, parts.tokenizer, version=it, stats=stats,
                           episodic=episodic))
          if dist.is_multi():  # every process gets every episode, in job order, and the summed counters
            episodes, stats = dist.allgather_list(episodes), dist.merge_counters(dist.allgather_list([stats]))
        episodes = trainable(episodes, stats, f"iteration {it + 1}")
        if not episodes:  # logged by trainable; the metrics row says why nothing was trained
          writer.write(it + 1, {"episodes_lost": stats.episodes_lost, "episodes_failed": stats.episodes_failed})
          continue
        t_roll = time.perf_counter() - t0
        orm_m = (orm_lib.apply_orm_rewards(episodes, orm, parts.loop_cfg.rewards, tuple(config.rl.orm_reward_range))
                 if orm is not None else {})
        batch = collate(episodes, pad_id=parts.tokenizer.pad_id, max_images=config.env.max_turns,
                        image_hw=parts.image_hw, length_multiple=config.length_multiple,
                        batch_size=max(n, len(episodes))).as_dict()
        image_dep = {}
        if config.image_dependence_every and it % config.image_dependence_every == 0 and len(episodes) > 1:
          # the policy that played this batch (before its update); screenshots swapped between rows
          image_dep = image_dependence(parts.policy_gd, state["policy"], real_rows(batch, len(episodes)),
                                       parts.table, temperature=config.sampling.temperature,
                                       image_token_id=parts.inputs.image_token_id, grid_hw=parts.inputs.grid_hw)
        t1 = time.perf_counter()

        def update(state=state, batch=batch, episodes=episodes):
          with parts.activate():  # activation sharding constraints of config.mesh (no-op without one)
            return ppo.ppo_update(state, batch, parts.table, policy_gd=parts.policy_gd,
                                  critic_gd=parts.critic_gd, popt=parts.popt, copt=parts.copt, hp=hp,
                                  inputs=parts.inputs, epochs=config.rl.epochs, minibatch_size=config.rl.minibatch_size,
                                  rng=np.random.default_rng([config.seed, it]), n_real=len(episodes),
                                  scores=np.array([e.shaped_return for e in episodes], np.float32),
                                  group_ids=group_ids(episodes), ref_params=ref_params,
                                  minibatch_by_length=config.rl.minibatch_by_length, ptx_batches=ptx_iter,
                                  task_ids=task_ids(episodes))

        if pool is not None:  # the update runs in a thread while the loop keeps the pool's episodes going
          state, train_m = loop.run_until_complete(asyncio.to_thread(update))
        else:
          state, train_m = update()
        policy.params = dist.local_replica(state["policy"])  # one gather: the sampler and the services use it
        if remote is not None:
          push_weights(remote, policy.params, it + 1)
        elif service is not None:
          service.set_params(policy.params, it + 1)
        t_train = time.perf_counter() - t1
        train_tokens = train_m.pop("tokens_trained")
        m = episode_metrics(episodes, tasks, parts.tokenizer, parts.table)
        m.update({f"train/{k}": v for k, v in train_m.items()})
        m.update(orm_m)
        m.update({f"reward_terms/{k}": v / max(1, len(episodes)) for k, v in stats.reward_terms.items()})
        m.update({f"image_dependence/{k}": v for k, v in image_dep.items() if k not in ("embed", "decisions")})
        m.update({
            "perf/env_steps_per_s": stats.env_steps / max(t_roll, 1e-9),
            "perf/gen_tokens_per_s": stats.generated_tokens / max(stats.policy_time_s, 1e-9),
            "perf/train_tokens_per_s": train_tokens / max(t_train, 1e-9),
            "perf/rollout_s": t_roll, "perf/train_s": t_train,
            "perf/env_wait_s": stats.env_time_s, "perf/policy_s": stats.policy_time_s,
            "episodes_lost": stats.episodes_lost, "episodes_retried": stats.episodes_retried,
            "episodes_failed": stats.episodes_failed,
            "episodes_total": (it + 1) * n,
            "perf/wall_min": (time.time() - t_start) / 60,  # since this (possibly resumed) process started
        })
        if pool is not None:  # the ledgers of every process's pool, summed
          m.update(pool_lib.merge_pool_metrics(dist.allgather_list(
              [pool_lib.pool_metrics(pool, stale, t_roll, time.perf_counter() - t0)])))
          m["episodes_total"] = m["pool/taken"]
        if config.eval_every and (it + 1) % config.eval_every == 0:
          t2 = time.perf_counter()
          ev = dist.allgather_list(evaluation.play(
              loop, act, clients,
              dist.share(evaluation.eval_jobs(list(tasks), config.eval_episodes, config.env.eval_seed_offset)),
              parts.eval_loop_cfg, parts.tokenizer, sessions=dist.share_size(n), version=it + 1))
          m.update(evaluation.metrics(evaluation.summarize(ev)))
          m["perf/eval_s"] = time.perf_counter() - t2
          if config.log_trajectories and dist.is_main():
            save_episodes(os.path.join(workdir, "trajectories", f"eval_{it + 1:05d}"),
                          ev[: config.log_trajectories])
        writer.write(it + 1, m)
        if config.record_rollouts and dist.is_main():
          _record_rollouts(os.path.join(workdir, "rollouts"), it + 1, episodes, parts)
        if config.log_trajectories and dist.is_main() and (
            it % config.save_trajectories_every == 0 or it + 1 == config.iterations):
          save_episodes(os.path.join(workdir, "trajectories", f"iter_{it + 1:05d}"),
                        episodes[: config.log_trajectories])
        if (it + 1) % config.ckpt_every == 0 or it + 1 == config.iterations:
          ckpt.save(mngr, it + 1, state,
                    {"iteration": it + 1, "episodes": (it + 1) * n, "minutes": guard.minutes(), **ptx_meta()})
        bar.update(1)
        bar.set_postfix(success=f"{m['success_rate']:.2f}", reward=f"{m['reward']:.2f}",
                        kl=f"{train_m.get('approx_kl', 0.0):.3f}",
                        ev=f"{train_m.get('explained_variance', float('nan')):.2f}")
      else:
        it = config.iterations
      if it > start_iter:
        ckpt.save_at_stop(mngr, it, state, {"iteration": it, "episodes": it * n, "minutes": guard.minutes(),
                                            **ptx_meta()})
    finally:
      bar.close()
      if pool is not None:  # episodes in flight are not trained: a resumed run starts new ones
        loop.run_until_complete(pool.close())
      if service is not None:
        service.close()  # an in-process service's decode thread; a remote one's client only
      elif remote is not None:
        remote.close()
      writer.close()
  if tripped:
    raise guard.error(it)
  run.finish({"iterations": it, "episodes": it * n, "minutes": (time.time() - t_start) / 60,
              "checkpoint": f"{mngr.directory}/{mngr.latest_step()}"})
  if dist.is_main():  # the one-line summary
    print(f"[train] done: {it} iterations in {(time.time() - t_start) / 60:.1f} min | "
          f"checkpoints: {mngr.directory} (latest {mngr.latest_step()}) | "
          f"metrics: {writer.path} | tensorboard --logdir {writer.tb_dir} | "
          f"trajectories: {os.path.join(workdir, 'trajectories')}"
          + (f" | rollout records: {os.path.join(workdir, 'rollouts')}" if config.record_rollouts else ""))


def push_weights(remote: RemoteInference, params, version: int, reset: bool = False) -> None:
  """The policy (`params`: this process's full copy, `dist.local_replica`) to the remote inference
  service as `version`: process 0 sends it (one copy, not one per process), every process then waits
  at a barrier and reads the served version, so no process samples the next iteration from older
  weights."""
  if dist.is_main():
    remote.set_params(params, version, reset=reset)
  if dist.is_multi():
    dist.barrier(f"weights_{version}")
    remote.refresh_version()


def _record_rollouts(directory: str, iteration: int, episodes, parts) -> None:
  """Writes an iteration's trained episodes as records (prefix `iter_<iteration>`, source 'rollout',
  policy version = the episodes' own). An iteration replayed after a resume is identical to the one a
  killed run already committed (resume is deterministic), so a committed prefix is kept, not rewritten."""
  prefix = f"iter_{iteration:06d}"
  if records.prefix_committed(directory, prefix):
    return
  meta = records.DatasetMeta.for_model(parts.image_hw, parts.loop_cfg.n_img_tokens, parts.tokenizer)
  with records.RecordWriter(directory, meta, prefix=prefix) as w:
    for ep in episodes:
      w.write(ep, source="rollout")


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(dist.fail_fast(guard_lib.exit_on_trip(main)))  # multi-process: a dead peer ends every process, naming it
