"""Held-out evaluation: per-task success over seeds never used in training."""

from __future__ import annotations

import asyncio
import os
from typing import Sequence

import numpy as np
from tqdm import tqdm

from tars_jax.agent.trajectory import Episode
from tars_jax.rollout import episode as episode_lib
from tars_jax.rollout.agent_loop import run_episodes
from tars_jax.rollout.episode import RolloutStats


def eval_jobs(tasks: list[str], episodes: int, seed_offset: int) -> list[tuple[str, int]]:
  """(task, seed) pairs: seeds `seed_offset + k`, k < episodes, for every task.

  Training uses seeds `train_seed_offset + it * num_sessions + k`; configs keep `eval_seed_offset`
  far above any seed a run can reach, so evaluation seeds are held out.
  """
  return [(t, seed_offset + k) for t in tasks for k in range(episodes)]


def play(loop: asyncio.AbstractEventLoop, act, clients, jobs: Sequence[tuple[str, int]], loop_cfg, tok,
         sessions: int, version: int, progress: str | None = None) -> list[Episode]:
  """Plays `jobs` through `run_episodes` (the training rollout path) `sessions` at a time, on the
  event loop `loop` of the sandbox clients; returns the episodes in job order (lost ones included,
  flagged `lost`). `progress`: a tqdm bar over the batches with this description (None: no bar)."""
  out: list[Episode] = []
  starts = range(0, len(jobs), sessions)
  for s in (starts if progress is None else tqdm(starts, desc=progress, unit="batch")):
    out += loop.run_until_complete(run_episodes(act, clients, jobs[s:s + sessions], loop_cfg, tok,
                                                version=version, stats=RolloutStats()))
  return out


def play_sessions(loop: asyncio.AbstractEventLoop, service, clients, jobs: Sequence[tuple[str, int]], loop_cfg,
                  tok, sessions: int, version: int, progress: str | None = None,
                  stats: RolloutStats | None = None) -> list[Episode]:
  """Plays `jobs` with the policy behind an inference service (`InferenceService`, or `RemoteInference`
  of experiments/serve.py), `sessions` episodes at a time, each episode one inference session
  (`episode.PolicyAgent`): a later turn runs only its new tokens into the slot that holds the episode's
  context (multi-turn KV reuse), where `play`'s lockstep batch prefills every turn's whole history,
  screenshots included, again. An episode starts as soon as one ends (no waiting for a batch's slowest).
  Episodes lost to the sandbox are replayed on the next server (`episode.play_retried`,
  `loop_cfg.max_retries`) and, if lost on every attempt, returned flagged `lost`. Returns the episodes in job order.
  Raises: InferenceFailed / InferenceUnavailable (the service), the sandbox's non-retryable errors.
  Source: report section 2.5.3 (the policy as a service); the streaming pool's episode (`rollout/pool.py`).
  """
  stats = stats if stats is not None else RolloutStats()
  bar = tqdm(total=len(jobs), desc=progress, unit="episode") if progress is not None else None
  gate = asyncio.Semaphore(sessions)

  async def one(k: int, task: str, seed: int) -> Episode:
    async with gate:
      ep = await episode_lib.play_retried(clients, service, task, seed, k, cfg=loop_cfg, tok=tok,
                                          version=lambda: version, stats=stats)
    if bar is not None:
      bar.update(1)
    if not ep.lost:
      stats.episodes += 1
    return ep

  async def everything() -> list[Episode]:
    return list(await asyncio.gather(*(one(k, t, s) for k, (t, s) in enumerate(jobs))))

  try:
    return loop.run_until_complete(everything())
  finally:
    if bar is not None:
      bar.close()


def metrics(summary: dict[str, dict[str, float]]) -> dict[str, float]:
  """Flat `eval/<task>/<key>` scalars (success, episodes, mean_reward, lost) of a `summarize` output,
  for a metrics writer."""
  return {f"eval/{task}/{k}": float(r[k]) for task, r in summary.items()
          for k in ("success", "episodes", "mean_reward", "lost")}


def summarize(episodes: list[Episode]) -> dict[str, dict[str, float]]:
  """{task: {success, episodes, mean_reward, mean_steps, invalid_rate, lost}} over finished episodes."""
  out: dict[str, dict[str, float]] = {}
  for task in sorted({e.task for e in episodes}):
    eps = [e for e in episodes if e.task == task and not e.lost]
    lost = sum(1 for e in episodes if e.task == task and e.lost)
    turns = sum(len(e.turns) for e in eps)
    out[task] = {
        "success": float(np.mean([e.success for e in eps])) if eps else 0.0,
        "episodes": len(eps),
        "mean_reward": float(np.mean([e.env_return for e in eps])) if eps else 0.0,
        "mean_steps": float(np.mean([len(e.turns) for e in eps])) if eps else 0.0,
        "invalid_rate": float(sum(e.num_invalid for e in eps) / max(1, turns)),
        "lost": lost,
    }
  return out


def format_table(summary: dict[str, dict[str, float]]) -> str:
  """Plain-text table of `summarize` output."""
  head = f"{'task':32s} {'success':>8s} {'episodes':>9s} {'reward':>8s} {'steps':>6s} {'invalid':>8s}"
  rows = [head, "-" * len(head)]
  for task, r in summary.items():
    rows.append(f"{task:32s} {r['success']:8.3f} {r['episodes']:9d} {r['mean_reward']:8.3f} "
                f"{r['mean_steps']:6.2f} {r['invalid_rate']:8.3f}")
  return "\n".join(rows)


# Stages of a pipeline run dir (scripts/demo.sh: runs/<name>/{grounding,demos,sft,vpt,ppo}) that hold
# a policy, newest first.
POLICY_STAGES = ("ppo", "sft", "grounding")


def resolve_run(run: str) -> str:
  """The run dir to evaluate: `run` itself when it has a config.json, else the newest stage of a
  pipeline run dir that has checkpoints (`POLICY_STAGES`: ppo, then sft, then grounding).
  Raises: FileNotFoundError naming what was looked for."""
  if os.path.exists(os.path.join(run, "config.json")):
    return run
  for stage in POLICY_STAGES:
    d = os.path.join(run, stage)
    if os.path.exists(os.path.join(d, "config.json")) and os.path.isdir(os.path.join(d, "checkpoints")):
      return d
  raise FileNotFoundError(f"{run}: no config.json, and no pipeline stage {POLICY_STAGES} with checkpoints in it")
