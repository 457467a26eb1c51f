"""Expert demonstrations collected through the sandbox, in the policy's own trajectory format.

An expert (`data/sources/experts.py`) plays an episode through the same protocol as the agent: every
turn it reads the privileged view of its session (`SandboxClient.elements`, `game_state` for games,
`desktop_state` for the desktop and hybrid tasks;
never part of the episode; a GUI-Browsing expert also knows its question's plan, `browse_expert.py`),
decides a reply `Thought: …\\nAction: …` and sends it with `client.step`. The expert is another agent
of the one episode loop (`rollout.episode.play` with an `ExpertAgent`), so the episode is exactly the
Episode `run_episodes` builds when the policy samples the same replies: same prefix and observation
ids, preprocessed screenshots at the policy's image size, reply ids = reply bytes + EOS, shaped reward, env reward, done and
truncation of the step budget (tests/test_demos.py replays demos through `run_episodes` and compares).
Logprobs are 0 (no behaviour policy sampled them); states are the grammar states before each reply
token (`grammar.walk`), as the constrained sampler records them.

Only successful episodes (`Episode.success`: done with positive raw reward) reach the writer; an
episode the expert fails (or gives up on: `ExpertError`) is counted and dropped.

  spec = DemoSpec.from_parts(state.build(config))
  stats = await collect(clients, jobs, spec, writer)      # writer.write(ep, source='expert', ...)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import Any, Sequence

import numpy as np
from tqdm import tqdm

from envs_bridge.browser import browse_tasks
from envs_bridge.client import SandboxClient, client_for
from tars_jax.agent import actions as A
from tars_jax.agent.grammar import Grammar, accepts, walk
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.agent.trajectory import Episode
from tars_jax.data import records
from tars_jax.data.sources import browse_expert
from tars_jax.data.sources import experts as E
from tars_jax.rollout import episode as episode_lib
from tars_jax.rollout.episode import LoopConfig, Reply, StopEpisode, TurnView

SOURCE = "expert"  # provenance of demonstrations in the records (`RecordWriter.write(source=)`)


class ReplyNotInGrammar(ValueError):
  """An expert's reply is outside the configured grammar: the config cannot express the demos (add
  the actions the task needs, raise grammar.max_thought_bytes, or collect without thoughts)."""


@dataclasses.dataclass(frozen=True)
class DemoSpec:
  """What makes a demonstration the policy's own: its loop config (prompt, image size, image slots,
  step budget, rewards), tokenizer, grammar and coordinate format; `thoughts=False` writes empty
  thoughts."""

  loop: LoopConfig
  tokenizer: ByteTokenizer
  grammar: Grammar
  coord_format: str
  thoughts: bool = True

  @classmethod
  def from_parts(cls, parts, thoughts: bool = True) -> "DemoSpec":
    """From `train.state.build(config)`: parts.loop_cfg with the experts' step budget
    max(env.max_turns, data.demo_max_turns) (multi-step tasks need more turns than an RL stage may give
    its policy), tokenizer, grammar, config.grammar.coord_format ('int' when the grammar is
    unconstrained, as the sandbox's parser reads any integers)."""
    g = parts.config.grammar
    loop = dataclasses.replace(parts.loop_cfg, max_turns=max(parts.loop_cfg.max_turns,
                                                             parts.config.data.demo_max_turns))
    return cls(loop, parts.tokenizer, parts.grammar, g.coord_format if g.constrained else "int", thoughts)


@dataclasses.dataclass
class TaskStats:
  """Counts of one task's expert episodes."""

  task: str
  expert: str
  episodes: int = 0  # played to the end (not lost)
  successes: int = 0  # written
  failures: int = 0  # played but not successful (incl. expert errors)
  expert_errors: int = 0  # the expert found no move (ExpertError)
  lost: int = 0  # the session died on every attempt
  turns: int = 0  # turns of the successful episodes
  inexpressible: int = 0  # not played: the grammar cannot write the answer (GUI-Browsing, `answer_expressible`)

  @property
  def success_rate(self) -> float:
    return self.successes / self.episodes if self.episodes else 0.0

  def as_dict(self) -> dict:
    return {**dataclasses.asdict(self), "success_rate": self.success_rate}


class MemoryWriter:
  """Keeps written episodes in memory, with the interface of `data.records.RecordWriter`
  (`write(episode, *, source, policy_version, extra)`, `close() -> counts`)."""

  def __init__(self):
    self.episodes: list[tuple[Episode, dict]] = []

  def write(self, episode: Episode, *, source: str, policy_version: int = 0, extra: dict | None = None) -> None:
    self.episodes.append((episode, {"source": source, "policy_version": policy_version, **(extra or {})}))

  def close(self) -> dict:
    counts: dict[str, int] = {}
    for ep, prov in self.episodes:
      key = f"{prov['source']}/{ep.task}"
      counts[key] = counts.get(key, 0) + 1
    return counts

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def answer_expressible(task: str, seed: int, spec: DemoSpec) -> bool:
  """Whether the policy's grammar can write the answer of the GUI-Browsing question that (`task`, `seed`)
  asks in the spec's data mode: `finished(content=...)` holds printable ASCII without quote or backslash
  (tars_jax/agent/grammar.py), and 6 of the 577 answers over the Python docs hold a quote or a
  typographic dash. Raises KeyError for a task that is not a GUI-Browsing task."""
  answer = browse_tasks.question(task, seed, spec.loop.data_mode).answer
  return accepts(spec.grammar, E.reply_text("", E.render(A.Finished(answer), spec.coord_format)), spec.tokenizer)


def open_writer(directory: str | None, spec: DemoSpec):
  """Where demonstrations go: a `data.records.RecordWriter(directory, DatasetMeta(...))` (ArrayRecord
  shards + dataset.json), or with directory None a `MemoryWriter`."""
  if directory is None:
    return MemoryWriter()
  meta = records.DatasetMeta.for_model(spec.loop.image_hw, spec.loop.n_img_tokens, spec.tokenizer)
  return records.RecordWriter(directory, meta)


def write_demo(writer, episode: Episode, expert: E.Expert) -> None:
  """One successful demonstration to `writer` (source 'expert', policy version 0, the expert's name)."""
  writer.write(episode, source=SOURCE, policy_version=0, extra={"expert": expert.name})


async def _view(client: SandboxClient, sid: str, expert: E.Expert) -> Any:
  if expert.reads == "game_state":
    return await client.game_state(sid)
  if expert.reads == "desktop_state":
    return await client.desktop_state(sid)
  return await client.elements(sid)


class ExpertAgent:
  """A scripted expert as an agent of `episode.play`: each turn it reads its session's privileged view,
  decides (an ExpertError ends the episode where it is: StopEpisode), checks that the run's grammar
  accepts the reply (ReplyNotInGrammar otherwise) and answers with its ids, zero log-probs and the
  grammar states (`grammar.walk`)."""

  prompt = False  # the expert reads the sandbox, not the policy's prompt

  def __init__(self, task: str, seed: int, spec: DemoSpec, expert: E.Expert):
    self.task, self.seed, self.spec, self.expert = task, seed, spec, expert
    self.browse = None
    if expert.reads == "browse":  # follows the plan of the question this (seed, data mode) asks
      question = browse_tasks.question(task, seed, spec.loop.data_mode)
      self.browse, self.page = browse_expert.BrowseExpert(question, spec.coord_format), question.start

  async def reply(self, view: TurnView) -> Reply:
    spec, tok = self.spec, self.spec.tokenizer
    state = await _view(view.client, view.sid, self.expert)
    try:
      if self.browse is not None:
        self.page = view.info.get("page") or self.page
        thought, act = self.browse.decide(state, self.page)
        thought = E.clean_thought(thought) if spec.thoughts else ""
        action = E.render(act, spec.coord_format, self.browse.width, self.browse.height)
      else:
        thought, action = E.decide(self.task, view.ep.instruction, state, view.turn, coord_format=spec.coord_format,
                                   thoughts=spec.thoughts, max_turns=spec.loop.max_turns, expert=self.expert)
    except E.ExpertError as e:
      raise StopEpisode(f"ExpertError: {e}") from e
    text = E.reply_text(thought, action)
    if not accepts(spec.grammar, text, tok):
      raise ReplyNotInGrammar(f"{self.task} seed {self.seed}: the expert's reply {text!r} is not in the configured "
                              "grammar (grammar.actions, max_thought_bytes, max_content_bytes, coord_format)")
    ids = tok.encode(text) + [tok.eos_id]
    return Reply(text, ids, np.zeros(len(ids), np.float32), walk(spec.grammar, ids))

  def close(self) -> None:
    pass


async def play(client: SandboxClient, task: str, seed: int, spec: DemoSpec, expert: E.Expert
               ) -> tuple[Episode, str | None]:
  """Plays one episode of `task`/`seed` with `expert` (`episode.play` with an `ExpertAgent`); returns
  (episode, why it stopped early or None). An ExpertError ends the episode where it is (not done: a
  failure).

  Raises: ReplyNotInGrammar (the config cannot express the expert's reply); the sandbox errors of
  the client (the caller retries the retryable ones).
  """
  return await episode_lib.play(client, task, seed, ExpertAgent(task, seed, spec, expert), cfg=spec.loop,
                                tok=spec.tokenizer)


_NOT_PLAYED = object()  # the result of a job `collect` does not play (an inexpressible answer)


async def collect(clients: Sequence[SandboxClient], jobs: Sequence[tuple[str, int]], spec: DemoSpec,
                  writer, *, concurrency: int = 32, experts: dict[str, E.Expert] | None = None,
                  progress: bool = True) -> dict[str, TaskStats]:
  """Plays every (task, seed) job with its task's expert, `concurrency` episodes at a time spread
  round-robin over `clients`, and writes the successful episodes in the order of `jobs` (`write_demo`), so
  that one job list gives one record file whatever order the sandboxes finish in: the training iterator
  shuffles record indices with a fixed seed, and completion order made two runs of one config train on
  different batches. An episode that ends before an earlier job is held until that job ends (at most
  the jobs in flight, `concurrency`, plus those held behind a retried one).

  A server never gets more episodes at once than its `max_sessions` (its `/health`; `session_caps`): a
  desktop server holds far fewer sessions than a browser one, and ServerBusy replies would use up the
  retries. A session lost to a retryable error (`protocol.is_retryable`) is replayed from its seed up to
  `spec.loop.max_retries` times, then counted as lost. Returns {task: TaskStats}.
  Raises: KeyError (a task without an expert), ReplyNotInGrammar, non-retryable sandbox errors.
  """
  table = E.experts() if experts is None else experts
  chosen = {t: E.expert_for(t, table) for t in dict.fromkeys(t for t, _ in jobs)}
  stats = {t: TaskStats(t, ex.name) for t, ex in chosen.items()}
  sem = asyncio.Semaphore(concurrency)
  caps = await session_caps(clients)
  bar = tqdm(total=len(jobs), desc="expert episodes", unit="ep", disable=not progress)

  ended: dict[int, tuple[str, int, Any]] = {}  # job index -> its result, until every earlier job ended
  next_k = 0

  def ended_job(k: int, task: str, seed: int, res) -> None:
    nonlocal next_k
    ended[k] = (task, seed, res)
    while next_k in ended:
      record(*ended.pop(next_k))
      next_k += 1

  def record(task: str, seed: int, res) -> None:
    st = stats[task]
    if res is _NOT_PLAYED:
      st.inexpressible += 1
      return
    if res is None:
      st.lost += 1
      return
    ep, stopped = res
    st.episodes += 1
    st.expert_errors += stopped is not None
    if ep.success:
      st.successes += 1
      st.turns += len(ep.turns)
      write_demo(writer, ep, chosen[task])
    else:
      st.failures += 1
      logging.info("expert failed %s/%d: return %.2f, %d turns, %s", task, seed, ep.env_return,
                   len(ep.turns), stopped or "played out")

  async def one(k: int, task: str, seed: int):
    if chosen[task].reads == "browse" and not answer_expressible(task, seed, spec):  # counted, never played
      ended_job(k, task, seed, _NOT_PLAYED)
      bar.update(1)
      return
    async def attempt(a: int):
      client = client_for(clients, task, k + a)
      async with caps.get(id(client)) or contextlib.nullcontext():
        return await play(client, task, seed, spec, chosen[task])

    async with sem:
      res = await episode_lib.with_retries(attempt, retries=spec.loop.max_retries,
                                           what=f"expert episode {task}/{seed}")
      ended_job(k, task, seed, res)
      bar.update(1)

  try:
    await asyncio.gather(*[one(k, t, s) for k, (t, s) in enumerate(jobs)])
  finally:
    bar.close()
  return stats


async def session_caps(clients: Sequence[SandboxClient]) -> dict[int, asyncio.Semaphore]:
  """{id(client): Semaphore(max_sessions)} for the clients whose server's `/health` reports
  `max_sessions`; a client whose health cannot be read (or lacks it) gets no cap."""
  caps = {}
  for c in clients:
    try:
      n = (await c.health()).get("max_sessions")
    except Exception:  # an unreachable server fails its episodes with their own typed errors
      continue
    if isinstance(n, int) and n > 0:
      caps[id(c)] = asyncio.Semaphore(n)
  return caps


def seeds_per_task(tasks, rl_tasks, *, seeds: int, rl_seeds: int, by_task=()) -> dict[str, int]:
  """Episodes to attempt per task: `rl_seeds` for the RL stage's tasks (`rl_tasks`), `seeds` for the
  others, then the (task, count) pairs of `by_task` (config `data.demo_seeds_by_task`) over both.
  Raises: ValueError for a count < 0 or a `by_task` task not in `tasks`."""
  out = {t: rl_seeds if t in rl_tasks else seeds for t in tasks}
  for t, n in by_task:
    if t not in out:
      raise ValueError(f"data.demo_seeds_by_task names {t!r}, which is not among the demonstration tasks {list(tasks)}")
    out[t] = int(n)
  if any(n < 0 for n in out.values()):
    raise ValueError(f"negative episode count in {out}")
  return out


def jobs_for(tasks, seeds: int, seed_offset: int, eval_seed_offset: int) -> list[tuple[str, int]]:
  """(task, seed) for seeds seed_offset + k, k < seeds. Raises ValueError when they reach the
  evaluation seeds (eval_seed_offset and up) or are negative."""
  if seeds < 1 or seed_offset < 0:
    raise ValueError(f"need seeds >= 1 and seed_offset >= 0, got {seeds}, {seed_offset}")
  if seed_offset + seeds > eval_seed_offset:
    raise ValueError(f"seeds {seed_offset}..{seed_offset + seeds - 1} reach the evaluation seeds "
                     f"({eval_seed_offset}+); choose a lower --seed_offset")
  return [(t, seed_offset + k) for t in tasks for k in range(seeds)]


def format_stats(stats: dict[str, TaskStats]) -> str:
  """A table of expert success per task."""
  lines = [f"{'task':34s} {'expert':30s} {'success':>8s} {'ok':>5s} {'fail':>5s} {'err':>4s} {'lost':>4s} "
           f"{'turns':>5s} {'inexpr':>6s}"]
  for t, s in stats.items():
    lines.append(f"{t:34s} {s.expert:30s} {s.success_rate:8.3f} {s.successes:5d} {s.failures:5d} "
                 f"{s.expert_errors:4d} {s.lost:4d} {s.turns / max(1, s.successes):5.2f} {s.inexpressible:6d}")
  return "\n".join(lines)
