"""Multi-turn episodes against sandbox sessions: observe -> think/act -> step, many episodes in lockstep.

Each turn, every live episode's full history (prefix, past turns, new screenshot) is sent to the
policy in one batch; the replies go to their sessions concurrently over HTTP. An episode ends when
the page says done, or after `max_turns` (truncated, step-budget penalty). An episode whose session
cannot be opened or dies (`envs_bridge.protocol.is_retryable`: SessionLost, LeaseExpired, ServerBusy,
an unreachable server) is lost: it is retried from the same seed, counted, and returned with
`lost=True` when every attempt was lost — nothing disappears silently. Any other sandbox error (an
unknown task, a wrong token, ...) is raised at once: no replay would fix it (docs/ARCHITECTURE.md, "Sandbox protocol").
A malformed action is not an error: the server answers it with an observation (`info.error`).

Each turn's prompt comes from `turn_context` (the full history without memory; working / episodic
memory and the token budget of `agent/memory.py` when `LoopConfig.memory` turns them on, the prompt
then recorded in `Turn.context` so training sees exactly it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Callable, Sequence

import numpy as np

from envs_bridge import protocol
from envs_bridge.client import SandboxClient, client_for
from tars_jax.agent import memory as memory_lib
from tars_jax.agent import prompts
from tars_jax.agent.images import preprocess
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.agent.trajectory import Context, Episode, Turn
from tars_jax.rl.rewards import RewardConfig, thought_of, turn_reward_terms

# act(prompts, images) -> [(reply_ids incl. EOS, logprobs [n], states [n])], one per prompt.
ActFn = Callable[[list[list[int]], list[list[np.ndarray]]], list[tuple[list[int], np.ndarray, np.ndarray]]]


@dataclasses.dataclass
class LoopConfig:
  max_turns: int = 3
  image_hw: tuple[int, int] = (224, 168)  # (H, W) the policy sees
  n_img_tokens: int = 48
  system: str = ""
  rewards: RewardConfig = dataclasses.field(default_factory=RewardConfig)
  max_retries: int = 2
  data_mode: str = "train"  # the sandbox's split of task instances ('test': held-out browse questions)
  # working / episodic memory and the context budget (agent/memory.py); the default is off: full history
  memory: memory_lib.MemoryConfig = dataclasses.field(default_factory=memory_lib.MemoryConfig)


@dataclasses.dataclass
class RolloutStats:
  episodes: int = 0  # episodes finished (not lost)
  episodes_lost: int = 0  # attempts that lost their session (or could not open one)
  episodes_retried: int = 0  # replays from the seed after a loss
  episodes_failed: int = 0  # lost on every attempt: returned with lost=True
  env_steps: int = 0
  env_time_s: float = 0.0
  policy_time_s: float = 0.0
  generated_tokens: int = 0
  reward_terms: dict[str, float] = dataclasses.field(default_factory=dict)


class _Live:
  """Book-keeping of one episode in flight."""

  def __init__(self, ep: Episode, client: SandboxClient, sid: str, image: np.ndarray, obs_text: str | None):
    self.ep, self.client, self.sid = ep, client, sid
    self.image, self.obs_text = image, obs_text
    self.pending_obs_ids: list[int] = []
    self.pending_context: Context | None = None


async def open_episode(client: SandboxClient, task: str, seed: int, tok: ByteTokenizer, cfg: LoopConfig,
                       version: int = 0, memory: Sequence[str] = ()) -> tuple[str, Episode, np.ndarray]:
  """Opens a session of `task`/`seed`; returns (session id, the empty Episode with its prefix ids, the
  first screenshot preprocessed to cfg.image_hw: [H, W, 3] uint8). `memory`: episodic summaries of
  earlier episodes of the task for the prefix (`memory.EpisodicMemory.summaries`). Raises: as
  SandboxClient.open."""
  sid, obs = await client.open(task, seed, data_mode=cfg.data_mode)
  instruction = obs.info.get("instruction", "")
  prefix = prompts.encode_episode_prefix(tok, instruction, cfg.system, memory=memory)
  ep = Episode(task=task, seed=seed, instruction=instruction, prefix_ids=prefix, policy_version=version,
               memory=list(memory))
  return sid, ep, preprocess(obs.image(), cfg.image_hw)


def observation_ids(tok: ByteTokenizer, cfg: LoopConfig, ep: Episode, obs_text: str | None) -> list[int]:
  """Observation ids before the next reply of `ep` (`prompts.encode_observation`). The previous
  reply's TURN_END is environment-written, so it opens this observation (none before the first)."""
  return ([tok.turn_end_id] if ep.turns else []) + prompts.encode_observation(tok, cfg.n_img_tokens, obs_text)


def turn_context(tok: ByteTokenizer, cfg: LoopConfig, ep: Episode, image: np.ndarray, obs_text: str | None
                 ) -> tuple[list[int], list[np.ndarray], list[int], Context | None]:
  """The prompt of the next reply of `ep`, the one function every rollout path builds it with.

  image: this turn's screenshot [H, W, 3] uint8 (cfg.image_hw); obs_text: observation text or None.
  Returns (prompt ids, screenshots in IMAGE-block order — what the act function gets —, this turn's
  observation ids `observation_ids`, the `Context` to record in the Turn: None when cfg.memory is
  off, where the prompt is the full history `ep.token_ids() + obs_ids` with every screenshot).
  Raises: memory.ContextBudgetError when the prompt cannot fit cfg.memory's budget.
  """
  obs_ids = observation_ids(tok, cfg, ep, obs_text)
  ids, images, ctx = memory_lib.build_context(ep, obs_ids, image, cfg=cfg.memory, tok=tok, system=cfg.system)
  return ids, images, obs_ids, (ctx if cfg.memory.enabled else None)


def record_turn(ep: Episode, out: protocol.Observation, *, image: np.ndarray, obs_ids: list[int],
                reply_ids: list[int], logprobs, states, text: str, last_turn: bool, cfg: LoopConfig,
                tok: ByteTokenizer, context: Context | None = None) -> dict[str, float]:
  """Appends the Turn of one reply (`text`, its ids ending with EOS) and the sandbox's answer `out`
  to `ep`, with the shaped reward of `rl.rewards.turn_reward_terms`; sets `ep.truncated` (last turn
  of the step budget and not done). `context`: the reply's prompt from `turn_context` (None without
  memory). Returns the reward terms (for the rollout stats)."""
  error = out.info.get("error")
  truncated = last_turn and not out.done
  terms = turn_reward_terms(out.reward, error is not None, truncated, cfg.rewards,
                            thought_tokens=len(tok.encode(thought_of(text))))
  ep.turns.append(Turn(image=image, obs_ids=obs_ids, reply_ids=list(reply_ids),
                       logprobs=np.asarray(logprobs, np.float32), states=np.asarray(states, np.int32),
                       text=text, reward=terms["total"], env_reward=float(out.reward),
                       done=bool(out.done), error=error,
                       info={k: v for k, v in out.info.items() if k != "instruction"}, context=context))
  ep.truncated = truncated
  return terms


def next_view(out: protocol.Observation, cfg: LoopConfig) -> tuple[np.ndarray, str | None]:
  """What the next turn sees after `out`: (screenshot at cfg.image_hw [H, W, 3] uint8, observation
  text or None). SDK results (desktop/hybrid sandboxes) and errors are observations too."""
  return (preprocess(out.image(), cfg.image_hw),
          "\n".join(filter(None, [out.info.get("tool_output"), out.info.get("error")])) or None)


async def _open(client: SandboxClient, task: str, seed: int, tok: ByteTokenizer, cfg: LoopConfig,
                version: int, episodic: memory_lib.EpisodicMemory | None) -> _Live:
  sid, ep, image = await open_episode(client, task, seed, tok, cfg, version,
                                      episodic.summaries(task) if episodic is not None else ())
  return _Live(ep, client, sid, image, None)


async def _safe_close(live: _Live) -> None:
  try:
    await live.client.close(live.sid)
  except Exception:  # closing a dead session is best-effort; the server reclaims it by lease anyway
    pass


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
    lost_now = await _run_round(act, clients, jobs, pending, cfg, tok, version, stats, results, on_turn, episodic)
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


async def _run_round(act, clients, jobs, idxs, cfg, tok, version, stats, results, on_turn, episodic) -> list[int]:
  t0 = time.perf_counter()
  opened = await asyncio.gather(
      *[_open(client_for(clients, jobs[i][0], k), *jobs[i], tok, cfg, version, episodic)
        for k, i in enumerate(idxs)],
      return_exceptions=True)
  stats.env_time_s += time.perf_counter() - t0
  live: dict[int, _Live] = {i: o for i, o in zip(idxs, opened) if not isinstance(o, BaseException)}
  lost: list[int] = []
  for i, o in zip(idxs, opened):
    if isinstance(o, BaseException):
      if not protocol.is_retryable(o):
        await _close_all(live.values())
        raise o
      logging.warning("open %s failed: %s: %s", jobs[i], type(o).__name__, getattr(o, "reason", o))
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
        if not protocol.is_retryable(out):
          await _close_all(live.values())
          raise out
        logging.warning("episode %s lost at turn %d: %s: %s", jobs[i], turn_idx, type(out).__name__,
                        getattr(out, "reason", out))
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
        await _safe_close(lv)
      else:
        lv.image, lv.obs_text = next_view(out, cfg)
    if on_turn:
      on_turn(turn_idx)
  return lost


async def _close_all(lives) -> None:
  await asyncio.gather(*[_safe_close(lv) for lv in lives])
