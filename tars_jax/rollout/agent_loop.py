"""Multi-turn episodes against sandbox sessions, many in lockstep: observe -> think/act -> step.

Each turn, every live episode's prompt (`episode.turn_context`) goes to the policy in one batch; the
replies go to their sessions concurrently over HTTP; `episode.record_turn` appends each Turn with its
shaped reward (the turn mechanics of `rollout/episode.py`, which one-at-a-time paths play through
`episode.play`). An episode ends when the page says done, or after `max_turns` (truncated, step-budget
penalty). An episode whose session cannot be opened or dies (`envs_bridge.protocol.is_retryable`:
SessionLost, LeaseExpired, ServerBusy, an unreachable server) is lost: the lost episodes of a round
are played again from their seeds as the next round, counted, and returned with `lost=True` when
every attempt was lost — nothing disappears silently. Any other sandbox error (an unknown task, a
wrong token, ...) is raised at once: no replay would fix it (docs/ARCHITECTURE.md, "Sandbox protocol").
A malformed action is not an error: the server answers it with an observation (`info.error`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Sequence

import numpy as np

from envs_bridge.client import SandboxClient, client_for
from tars_jax.agent import memory as memory_lib
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.agent.trajectory import Context, Episode
from tars_jax.rollout.episode import (LoopConfig, RolloutStats, close_quietly, next_view, note_loss, open_episode,
                                      record_turn, turn_context)

# act(prompts, images) -> [(reply_ids incl. EOS, logprobs [n], states [n])], one per prompt.
ActFn = Callable[[list[list[int]], list[list[np.ndarray]]], list[tuple[list[int], np.ndarray, np.ndarray]]]


class _Live:
  """Book-keeping of one episode in flight."""

  def __init__(self, ep: Episode, client: SandboxClient, sid: str, image: np.ndarray, obs_text: str | None):
    self.ep, self.client, self.sid = ep, client, sid
    self.image, self.obs_text = image, obs_text
    self.pending_obs_ids: list[int] = []
    self.pending_context: Context | None = None


async def _open(client: SandboxClient, task: str, seed: int, tok: ByteTokenizer, cfg: LoopConfig,
                version: int, episodic: memory_lib.EpisodicMemory | None) -> _Live:
  sid, ep, image = await open_episode(client, task, seed, tok, cfg, version,
                                      episodic.summaries(task) if episodic is not None else ())
  return _Live(ep, client, sid, image, None)


async def run_episodes(act: ActFn, clients: Sequence[SandboxClient], jobs: Sequence[tuple[str, int]],
                       cfg: LoopConfig, tok: ByteTokenizer, version: int = 0,
                       stats: RolloutStats | None = None,
                       on_turn: Callable[[int], None] | None = None,
                       episodic: memory_lib.EpisodicMemory | None = None) -> list[Episode]:
  """Plays every (task, seed) job to the end, all concurrently; returns one Episode per job, in job
  order (never None).

  Episodes lost to a retryable error (`protocol.is_retryable`) are retried from their seed up to
  `cfg.max_retries` times; if still lost they are returned with `lost=True` and the turns of their
  last attempt, if any (callers must not train on them; `trainable` filters them). Counted in `stats`:
  episodes_lost (lost attempts), episodes_retried, episodes_failed (lost on every attempt).

  episodic: the per-task store of episode summaries (`memory.EpisodicMemory`, kept by the caller
  across calls): each episode's prefix gets the summaries its task had when the call started, and the
  episodes that were not lost are summarised into it at the end, in job order (`memory.remember`).

  Raises: any other error (UnknownTask, Unauthorized, TaskError, a 422, ...) at once, after closing
  the sessions this round opened; ValueError when cfg.memory.episodic is on without a store.
  """
  if cfg.memory.episodic != "off" and episodic is None:
    raise ValueError(f"memory.episodic={cfg.memory.episodic!r} needs an EpisodicMemory (run_episodes(episodic=...))")
  stats = stats if stats is not None else RolloutStats()
  results: list[Episode | None] = [None] * len(jobs)
  pending = list(range(len(jobs)))
  attempt = 0
  while pending:
    lost_now = await _run_round(act, clients, jobs, pending, attempt, cfg, tok, version, stats, results, on_turn,
                                episodic)
    stats.episodes_lost += len(lost_now)
    if not lost_now or attempt >= cfg.max_retries:
      break
    attempt += 1
    stats.episodes_retried += len(lost_now)
    logging.warning("retrying %d lost episodes (attempt %d)", len(lost_now), attempt)
    pending = lost_now
  stats.episodes += sum(1 for r in results if not r.lost)
  stats.episodes_failed += sum(1 for r in results if r.lost)
  if episodic is not None:
    memory_lib.remember(episodic, results, tok=tok, system=cfg.system, act=act)  # type: ignore[arg-type]
  return results  # type: ignore[return-value]


def trainable(episodes: Sequence[Episode], stats: RolloutStats, what: str) -> list[Episode]:
  """The episodes of `episodes` that were not lost. When every one was lost, logs a warning naming
  `what` (e.g. 'iteration 7') and the counts of `stats`, and returns []: the caller skips that
  update instead of collating an empty batch."""
  kept = [e for e in episodes if not e.lost]
  if episodes and not kept:
    logging.warning("%s skipped: all %d episodes lost (%d lost attempts, %d retries); check the sandbox "
                    "servers", what, len(episodes), stats.episodes_lost, stats.episodes_retried)
  return kept


async def _run_round(act, clients, jobs, idxs, attempt, cfg, tok, version, stats, results, on_turn, episodic
                     ) -> list[int]:
  t0 = time.perf_counter()
  opened = await asyncio.gather(  # job i's attempt a on server i + a: a replay goes to the next server
      *[_open(client_for(clients, jobs[i][0], i + attempt), *jobs[i], tok, cfg, version, episodic) for i in idxs],
      return_exceptions=True)
  stats.env_time_s += time.perf_counter() - t0
  live: dict[int, _Live] = {i: o for i, o in zip(idxs, opened) if not isinstance(o, BaseException)}
  lost: list[int] = []
  for i, o in zip(idxs, opened):
    if isinstance(o, BaseException):
      try:
        note_loss(o, f"episode {jobs[i][0]}/{jobs[i][1]} (open)")
      except BaseException:
        await _close_all(live.values())
        raise
      task, seed = jobs[i]
      results[i] = Episode(task=task, seed=seed, instruction="", prefix_ids=[], lost=True, policy_version=version)
      lost.append(i)

  for turn_idx in range(cfg.max_turns):
    if not live:
      break
    order = list(live)
    prompts_ids, images = [], []
    for i in order:
      lv = live[i]
      ids, imgs, lv.pending_obs_ids, lv.pending_context = turn_context(tok, cfg, lv.ep, lv.image, lv.obs_text)
      prompts_ids.append(ids)
      images.append(imgs)
    t0 = time.perf_counter()
    replies = act(prompts_ids, images)
    stats.policy_time_s += time.perf_counter() - t0
    texts = []
    for i, (ids, lp, st) in zip(order, replies):
      stats.generated_tokens += len(ids)
      texts.append(tok.decode(ids))
    t0 = time.perf_counter()
    outs = await asyncio.gather(*[live[i].client.step(live[i].sid, txt) for i, txt in zip(order, texts)],
                                return_exceptions=True)
    stats.env_time_s += time.perf_counter() - t0
    stats.env_steps += len(order)
    last_turn = turn_idx == cfg.max_turns - 1
    for i, (ids, lp, st), txt, out in zip(order, replies, texts, outs):
      lv = live[i]
      if isinstance(out, BaseException):
        try:
          note_loss(out, f"episode {jobs[i][0]}/{jobs[i][1]} (turn {turn_idx})")
        except BaseException:
          await _close_all(live.values())
          raise
        lv.ep.lost = True
        results[i] = lv.ep
        lost.append(i)
        del live[i]
        continue
      terms = record_turn(lv.ep, out, image=lv.image, obs_ids=lv.pending_obs_ids, reply_ids=ids, logprobs=lp,
                          states=st, text=txt, last_turn=last_turn, cfg=cfg, tok=tok, context=lv.pending_context)
      for k, v in terms.items():
        stats.reward_terms[k] = stats.reward_terms.get(k, 0.0) + v
      if out.done or last_turn:
        results[i] = lv.ep
        del live[i]
        await close_quietly(lv.client, lv.sid)
      else:
        lv.image, lv.obs_text = next_view(out, cfg)
    if on_turn:
      on_turn(turn_idx)
  return lost


async def _close_all(lives) -> None:
  await asyncio.gather(*[close_quietly(lv.client, lv.sid) for lv in lives])
