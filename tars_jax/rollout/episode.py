"""One episode against a sandbox session, turn by turn: observe -> reply -> step.

The turn mechanics every rollout path shares, and the one loop that plays an episode at its own pace:
- `open_episode`, `turn_context` (the prompt: full history, or working / episodic memory and the
  token budget of `agent/memory.py` when `LoopConfig.memory` turns them on, recorded in
  `Turn.context` so training sees exactly it), `observation_ids`, `record_turn` (the Turn and its
  shaped reward), `next_view`. The lockstep loop (`rollout/agent_loop.py`) plays its batch of
  episodes with these.
- `play(client, task, seed, agent, cfg=, tok=)`: one episode with any `Agent`: the policy behind
  the inference service (`PolicyAgent`: the streaming pool, `rollout/pool.py`), a scripted expert
  (`data/sources/demos.py`), the browsing expert (`data/sources/browse_expert.py`).
- `with_retries(attempt, retries=, what=)`: the one retry of a lost episode (the pool, the
  demonstrations, grounding collection). It tells the failures apart: a sandbox failure
  (`envs_bridge.protocol.is_retryable`: SessionLost, LeaseExpired, ServerBusy, an unreachable sandbox
  server) loses the attempt and replays the seed; the inference service's (`InferenceFailed`) and
  every other error (an unknown task, a wrong token, a reply outside the grammar) propagate at once,
  naming their component: no replay would fix them. `note_loss` is that test; the lockstep loop uses
  it too and replays its lost episodes together in the next batched round.
A malformed action is not an error: the sandbox answers it with an observation (`info.error`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from typing import Awaitable, Callable, Protocol, Sequence, TypeVar

import numpy as np

from envs_bridge import protocol
from envs_bridge.client import SandboxClient, client_for
from tars_jax.agent import memory as memory_lib
from tars_jax.agent import prompts
from tars_jax.agent.images import preprocess
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.agent.trajectory import Context, Episode, Turn
from tars_jax.rl.rewards import RewardConfig, thought_of, turn_reward_terms

T = TypeVar("T")


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


class InferenceFailed(RuntimeError):
  """The policy's inference service failed (in process or over HTTP), not the sandbox: the episode is
  not replayed as a lost session; the error propagates, its cause chained."""


class InferenceUnavailable(InferenceFailed):
  """A remote inference service could not be reached, or did not answer within its time-out
  (`RemoteInference(timeout_s=)`, `rollout.inference_timeout_s`): the wait is bounded, then the run
  stops naming the service's URL."""


class StopEpisode(Exception):
  """Raised by an agent to end its episode where it is (not done: a failure), e.g. a scripted expert
  that cannot decide; `play` returns the message as the reason."""


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


async def close_quietly(client: SandboxClient, sid: str) -> None:
  """Ends a session, best effort: a lost session is already gone, the server's lease reclaims the rest."""
  try:
    await client.close(sid)
  except Exception:
    pass


@dataclasses.dataclass
class TurnView:
  """What an agent sees at turn `turn` of episode `ep` (its instruction and turns so far): the
  policy's prompt (`turn_context`: ids and screenshots [H, W, 3] uint8 in IMAGE-block order; None
  for an agent with `prompt = False`), the last observation's info (e.g. the browsing sandbox's
  `page`; {} at turn 0) and the session, for an expert's debug reads (`SandboxClient.elements`)."""

  turn: int
  ep: Episode
  prompt_ids: list[int] | None
  images: list[np.ndarray] | None
  info: dict
  client: SandboxClient
  sid: str


@dataclasses.dataclass
class Reply:
  """One turn's reply: its text, ids ending with EOS, behaviour log-probs [n] float32 and grammar
  states [n] int32 (zeros / the grammar walk for an expert), per-token policy versions [n] int32 or
  None."""

  text: str
  ids: list[int]
  logprobs: np.ndarray
  states: np.ndarray
  versions: np.ndarray | None = None


class Agent(Protocol):
  """Who writes the replies of `play`. `prompt`: whether it reads the policy's prompt (building it
  costs the memory budget's work); `reply` may raise StopEpisode; `close` ends what it holds."""

  prompt: bool

  async def reply(self, view: TurnView) -> Reply: ...

  def close(self) -> None: ...


class PolicyAgent:
  """The policy behind an inference service (`InferenceService` or `RemoteInference`: `async
  generate(ids, images, session=) -> Reply`, `release(session)`, `version`). The episode is one
  inference session: its later turns run only their new tokens into the slot that holds its context
  (multi-turn KV reuse). A failure of the service raises InferenceFailed;
  InferenceUnavailable when a remote one cannot be reached or does not answer within its time-out."""

  prompt = True

  def __init__(self, service, tok: ByteTokenizer):
    self.service, self.tok, self.session = service, tok, uuid.uuid4().hex

  async def reply(self, view: TurnView) -> Reply:
    import httpx  # local: in-process services never raise it
    try:
      r = await self.service.generate(view.prompt_ids, view.images, session=self.session)
    except (httpx.TransportError, InferenceUnavailable) as e:  # refused, reset, timed out: not the sandbox
      raise InferenceUnavailable(
          f"inference service ({type(self.service).__name__}) at {getattr(self.service, 'url', '?')} unreachable "
          f"or silent on {view.ep.task} seed {view.ep.seed} turn {view.turn}: {type(e).__name__}: {e}") from e
    except Exception as e:
      raise InferenceFailed(f"inference service ({type(self.service).__name__}) failed on {view.ep.task} "
                            f"seed {view.ep.seed} turn {view.turn}: {type(e).__name__}: {e}") from e
    return Reply(self.tok.decode(r.tokens), list(r.tokens), r.logprobs, r.states, np.asarray(r.versions, np.int32))

  def close(self) -> None:
    self.service.release(self.session)


async def play(client: SandboxClient, task: str, seed: int, agent: Agent, *, cfg: LoopConfig, tok: ByteTokenizer,
               version: int = 0, memory: Sequence[str] = (), stats: RolloutStats | None = None
               ) -> tuple[Episode, str | None]:
  """One attempt at an episode of `task`/`seed` with `agent`, turn by turn until the sandbox says
  done, `cfg.max_turns`, or the agent stops (StopEpisode). Returns (episode, why the agent stopped
  or None). `memory`: episodic summaries for the prefix; `stats` (if given) counts time, steps,
  tokens and reward terms. The sandbox session and the agent's own (`close`) end in any case.
  Raises: the sandbox's errors (`with_retries` replays the retryable ones), InferenceFailed, an
  agent's own errors (e.g. ReplyNotInGrammar).
  """
  stats = stats if stats is not None else RolloutStats()
  sid, obs_text, info, stopped = None, None, {}, None
  try:
    t0 = time.perf_counter()
    sid, ep, image = await open_episode(client, task, seed, tok, cfg, version, memory)
    stats.env_time_s += time.perf_counter() - t0
    for turn in range(cfg.max_turns):
      if agent.prompt:
        ids, images, obs_ids, ctx = turn_context(tok, cfg, ep, image, obs_text)
      else:
        ids, images, obs_ids, ctx = None, None, observation_ids(tok, cfg, ep, obs_text), None
      t0 = time.perf_counter()
      try:
        reply = await agent.reply(TurnView(turn, ep, ids, images, info, client, sid))
      except StopEpisode as e:
        stopped = str(e)
        break
      stats.policy_time_s += time.perf_counter() - t0
      stats.generated_tokens += len(reply.ids)
      t0 = time.perf_counter()
      out = await client.step(sid, reply.text)
      stats.env_time_s += time.perf_counter() - t0
      stats.env_steps += 1
      last = turn == cfg.max_turns - 1
      terms = record_turn(ep, out, image=image, obs_ids=obs_ids, reply_ids=reply.ids, logprobs=reply.logprobs,
                          states=reply.states, text=reply.text, last_turn=last, cfg=cfg, tok=tok, context=ctx)
      if reply.versions is not None:
        ep.turns[-1].versions = reply.versions
      for k, v in terms.items():
        stats.reward_terms[k] = stats.reward_terms.get(k, 0.0) + v
      if out.done or last:
        break
      image, obs_text = next_view(out, cfg)
      info = out.info
  finally:
    agent.close()
    if sid is not None:
      await close_quietly(client, sid)
  return ep, stopped


async def with_retries(attempt: Callable[[int], Awaitable[T]], *, retries: int, what: str,
                       on_loss: Callable[[int, BaseException], None] | None = None) -> T | None:
  """`await attempt(k)` for k = 0, 1, ... until one returns (its result) or `retries + 1` attempts were
  lost (None). An attempt is lost to a sandbox failure (`protocol.is_retryable`): logged with `what`
  (e.g. "episode miniwob/click-test/7"), `on_loss(k, error)` called, and the next attempt replays
  it (attempt k may pick another server: `client_for(clients, task, i + k)`). Raises every other
  error at once: InferenceFailed (the policy's service), the sandbox's non-retryable errors
  (UnknownTask, Unauthorized, ...), the caller's own."""
  for k in range(retries + 1):
    try:
      return await attempt(k)
    except Exception as e:
      note_loss(e, f"{what} (attempt {k + 1} of {retries + 1})")
      if on_loss is not None:
        on_loss(k, e)
  return None


async def play_retried(clients: Sequence[SandboxClient], service, task: str, seed: int, k: int, *, cfg: LoopConfig,
                       tok: ByteTokenizer, version: Callable[[], int], stats: RolloutStats,
                       memory: Sequence[str] = (), on_loss: Callable[[int, BaseException], None] | None = None
                       ) -> Episode:
  """The one episode of the service paths (the streaming pool, `evaluation.play_sessions`): `task`/`seed`
  played by the policy behind `service` (`PolicyAgent`: one inference session per episode, multi-turn KV
  reuse), attempt i on `client_for(clients, task, k + i)` (a replay goes to the next server that serves
  the task), replayed up to `cfg.max_retries` times when lost to the sandbox (`with_retries`). `version()`
  is read at each attempt (the policy version its tokens come from). Counts in `stats`:
  `episodes_lost` per lost attempt, `episodes_retried` per replay, `episodes_failed` when every attempt was
  lost; then returns an empty Episode flagged `lost`. `on_loss(i, error)`: the caller's own accounting.
  Raises: as `with_retries` (InferenceFailed, the sandbox's non-retryable errors)."""
  async def attempt(i: int) -> Episode:
    ep, _ = await play(client_for(clients, task, k + i), task, seed, PolicyAgent(service, tok), cfg=cfg, tok=tok,
                       version=version(), memory=memory, stats=stats)
    return ep

  def lost(i: int, e: BaseException) -> None:
    stats.episodes_lost += 1
    if i < cfg.max_retries:
      stats.episodes_retried += 1
    if on_loss is not None:
      on_loss(i, e)

  ep = await with_retries(attempt, retries=cfg.max_retries, what=f"episode {task}/{seed}", on_loss=lost)
  if ep is not None:
    return ep
  stats.episodes_failed += 1
  return Episode(task=task, seed=seed, instruction="", prefix_ids=[], lost=True, policy_version=version())


def note_loss(error: BaseException, what: str) -> None:
  """The one test of "lost to the sandbox, replay it": logs a sandbox failure
  (`protocol.is_retryable`) as `what` lost; raises `error` itself for every other failure (the
  inference service's InferenceFailed, a non-retryable sandbox error, the caller's own). Used by
  `with_retries` and by the lockstep loop (`rollout/agent_loop.py`), which replays its lost episodes
  as one batch."""
  if not protocol.is_retryable(error):
    raise error
  logging.warning("%s lost: %s: %s", what, type(error).__name__, getattr(error, "reason", None) or error)
