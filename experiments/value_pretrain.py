r"""Value pretraining (report section 2.5.4): train only the critic on rollouts of a fixed policy with
lambda = 1, stop when value loss and explained variance meet the config's thresholds, save the critic.

  python -m experiments.value_pretrain --config experiments/configs/value_pretrain.py --workdir runs/vpt
  python -m experiments.value_pretrain --config experiments/configs/value_pretrain.py:smoke --workdir /tmp/vpt
  python -m experiments.train --config experiments/configs/miniwob_ablations.py:ppo \
      --config.critic.init=runs/vpt/critic --workdir runs/ppo_vpt

Any training config with a `vpt` section works (the ablation configs have one): the policy is that
config's initial policy (same `seed`, or `policy.init` = the policy the PPO run starts from), or the
latest checkpoint of the run dir `vpt.policy_run`. Writes <workdir>/critic (Orbax), metrics.jsonl, tensorboard/,
config.json and value_pretrain.json (why it stopped, final metrics).

Resumable: every `vpt.ckpt_every` iterations the critic, its optimiser state and the stop rule's streak
go to <workdir>/checkpoints; a re-run continues from the latest one (`vpt.max_minutes` is a guard of one
process, tars_jax/train/guard.py: tripped, it checkpoints and exits non-zero). Iteration `it` samples
with keys and shuffles minibatches with an rng derived from (seed, it) alone, so a resumed run makes the
updates an uninterrupted one makes.
"""

from __future__ import annotations

import os

from absl import app, flags
from ml_collections import config_flags

import numpy as np

from envs_bridge.launch import env_fleet
from tars_jax.agent.trajectory import collate
from tars_jax.rollout.agent_loop import run_episodes, trainable
from tars_jax.rollout.episode import RolloutStats
from tars_jax.rollout.jobs import rollout_jobs
from tars_jax.train import checkpoint as ckpt
from tars_jax.train import guard as guard_lib
from tars_jax.train import ppo
from tars_jax.train import run as run_lib
from tars_jax.train import state as state_lib
from tars_jax.train import value_pretrain as vpt
from tars_jax.train.metrics import episode_metrics

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file with a `vpt` section.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (critic checkpoint in <workdir>/critic).")


def main(argv):
  del argv
  config, workdir = _CONFIG.value, _WORKDIR.value
  if "vpt" not in config:
    raise app.UsageError("config has no `vpt` section (see experiments/configs/value_pretrain.py)")
  v = config.vpt
  # The budget is `vpt.max_iterations` (or the stop rule); `vpt.max_minutes` only guards this process
  # against a hung or far too slow host: it checkpoints and stops loudly (tars_jax/train/guard.py).
  run = run_lib.start("vpt", config, workdir, budget=v.max_iterations, unit="iteration", max_minutes=v.max_minutes)
  mngr, guard = run.mngr, run.guard

  # ----------------------------------------------------------------------------------------------
  # Fixed policy, critic, stop rule.
  # ----------------------------------------------------------------------------------------------
  parts = state_lib.build(config)
  full = parts.init_state(config.seed)
  if v.policy_run or config.policy.init:  # the fixed policy: vpt.policy_run, else the PPO run's start
    full, src = state_lib.load_policy(full, v.policy_run or config.policy.init, parts.popt)
    print(f"[vpt] policy from {src}")
  r = config.rl
  copt = ppo.make_optimizer(v.lr, r.warmup_steps, r.max_grad_norm, r.weight_decay)  # vpt's own lr
  state = vpt.init_critic_state(full["critic"], copt)
  hp = vpt.pretrain_hparams(parts.hparams, v.value_clip if v.value_clip > 0 else None)
  rule = vpt.StopRule(v.stop_value_loss, v.stop_explained_variance, v.patience)
  state, start, meta = run.resume(state)
  streak = int(meta.get("streak", 0))
  writer = run.writer(config, start)
  policy = parts.batched_policy(full["policy"], batch_size=config.env.num_sessions, seed=config.seed * 100_003)
  # rollout.inference=<url>: the fixed policy sampled by experiments/serve.py instead (weights pushed once)
  remote = parts.remote_policy(full["policy"], 0) if config.rollout.inference else None
  act = remote.act if remote is not None else policy.act

  # ----------------------------------------------------------------------------------------------
  # Rollouts of the fixed policy -> critic updates until the stop rule holds.
  # ----------------------------------------------------------------------------------------------
  def save(done: int) -> None:
    ckpt.save(mngr, done, state, {"iteration": done, "streak": streak, "minutes": guard.minutes()})

  with env_fleet(config.env) as (loop, clients):
    done, m = start, {}
    tasks, n = tuple(config.tasks), config.env.num_sessions
    try:
      # the checks come first: a resumed run whose thresholds or budget were already met does nothing more
      while done < v.max_iterations and streak < rule.patience and not guard.tripped():
        it = done
        policy.start_iteration(it)
        rng = np.random.default_rng([config.seed, 7, it])
        jobs = rollout_jobs(tasks, n, config.rl.group_size, it, v.seed_offset)
        stats = RolloutStats()
        episodes = loop.run_until_complete(
            run_episodes(act, clients, jobs, parts.loop_cfg, parts.tokenizer, version=0, stats=stats))
        episodes = trainable(episodes, stats, f"value pretraining iteration {it + 1}")
        if episodes:
          batch = collate(episodes, pad_id=parts.tokenizer.pad_id, max_images=config.env.max_turns,
                          image_hw=parts.image_hw, length_multiple=config.length_multiple, batch_size=n).as_dict()
          state, train_m = vpt.value_update(state, batch, critic_gd=parts.critic_gd, copt=copt, hp=hp,
                                            inputs=parts.inputs, epochs=v.epochs, minibatch_size=v.minibatch_size, rng=rng,
                                            n_real=len(episodes),
                                            minibatch_by_length=config.rl.minibatch_by_length)
          m = episode_metrics(episodes, tasks, parts.tokenizer, parts.table)
          m.update({f"train/{k}": x for k, x in train_m.items()})
          m.update({f"reward_terms/{k}": x / max(1, len(episodes)) for k, x in stats.reward_terms.items()})
          m["perf/wall_min"] = guard.minutes()
          writer.write(it + 1, m)
          streak = rule.streak(streak, train_m["fresh_value_loss"], train_m["explained_variance"])
          print(f"[vpt] it {it + 1}: value loss (fresh) {train_m['fresh_value_loss']:.4f}, "
                f"explained var {train_m['explained_variance']:.3f}, corr {train_m['value_return_corr']:.3f}")
        else:  # every episode lost (logged by trainable): no update
          writer.write(it + 1, {"episodes_lost": stats.episodes_lost, "episodes_failed": stats.episodes_failed})
        done = it + 1
        if done % v.ckpt_every == 0:
          save(done)
    finally:
      writer.close()
      if remote is not None:
        remote.close()
  reason = "thresholds" if streak >= rule.patience else "max_iterations" if done >= v.max_iterations else "guard"
  ckpt.save_at_stop(mngr, done, state, {"iteration": done, "streak": streak, "minutes": guard.minutes()})
  if reason == "guard":
    raise guard.error(done)
  path = ckpt.save_tree(os.path.join(workdir, "critic"), state["critic"])
  summary = {"iterations": done, "stopped_by": reason, "critic": path,
             "final": {k: x for k, x in m.items() if k.startswith("train/")}}
  run.finish(summary, "value_pretrain")  # value_pretrain.json, done.json
  print(f"[vpt] stopped by {reason} after {done} iterations | critic: {path} | "
        f"use --config.critic.init={path}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(guard_lib.exit_on_trip(main))
