"""Streaming rollouts: a pool of episodes that run continuously against the sandboxes while the trainer
updates (report section 2.5.3: asynchronous rollout with partial rollouts and a bounded staleness).

Every episode is an asyncio task on the caller's event loop, played by `episode.play` with the
policy behind the `InferenceService` (`episode.PolicyAgent`: the service batches its turns with
whatever other episodes are decoding) — the turn functions the lockstep loop uses too, so the
trajectories are the same kind; a lost session is replayed by `episode.with_retries`, a failed
inference service stops the pool (`episode.InferenceFailed`, at the next `take`). The pool keeps
`concurrency` episodes in flight, starting a new group of episodes (same task and seed: the group of a
group baseline) as soon as a group's worth of room frees; a group larger than `concurrency` is refused
at `start`. When one episode of a group fails for good, its siblings are cancelled. `take(min_batch)`
returns finished groups as soon as they hold `min_batch` episodes; unfinished episodes keep running
and continue under the newer weights the trainer swaps into the service (partial rollouts).

Every model token records the policy version that produced it (`Turn.versions`). At `take`, an
episode whose oldest token is more than `max_staleness` versions behind the service's version is
dropped and counted (`stale="drop"`), or keeps its turns with the too-old tokens out of the loss
(`stale="mask"`, `Turn.loss_mask`). PPO then uses the behaviour log-probs recorded at sampling time as
the ratio's denominator (`train/ppo.py`: the clipped importance ratio pi_theta / pi_behaviour; with
`rl.decoupled` the decoupled objective of Hilton et al. 2022, "Batch size-invariance for policy
optimization", as AReaL (Fu et al. 2025) applies it to stale rollouts).

Accounting (`PoolLedger`): every started episode is, at any moment, exactly one of running, queued
(finished, not yet taken), taken (handed to the trainer), dropped for staleness, or failed (its
session lost on every attempt, or its group failed); lost attempts, retries and the members of a failed
group that were cancelled are counted on the side. Nothing leaves
silently and nothing is handed out twice (tests/test_pool.py).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import time
from typing import Iterator, Sequence

import numpy as np

from envs_bridge.client import SandboxClient
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.agent.trajectory import Episode
from tars_jax.rollout import episode as episode_lib
from tars_jax.rollout.episode import LoopConfig, RolloutStats
from tars_jax.rollout.jobs import rollout_jobs

STALE_MODES = ("drop", "mask")


@dataclasses.dataclass
class PoolConfig:
  """concurrency: episodes in flight (a multiple of the group size is best); min_batch: episodes per
  `take` (whole groups, so a take may return a few more); max_staleness: versions a token may lag the
  current policy at `take`; stale: 'drop' (the episode) or 'mask' (its too-old tokens);
  max_failed_in_a_row: episodes in a row that failed every attempt (no episode finished between them)
  after which the pool stops with `SandboxesUnreachable` instead of starting more forever (0 = never)."""
  concurrency: int
  min_batch: int
  max_staleness: int = 1
  stale: str = "drop"
  max_failed_in_a_row: int = 16

  def __post_init__(self):
    if self.stale not in STALE_MODES:
      raise ValueError(f"stale must be one of {STALE_MODES}, got {self.stale!r}")
    if self.concurrency < 1 or self.min_batch < 1 or self.max_staleness < 0 or self.max_failed_in_a_row < 0:
      raise ValueError(f"concurrency, min_batch >= 1 and max_staleness >= 0 needed, got {self}")


class SandboxesUnreachable(RuntimeError):
  """`PoolConfig.max_failed_in_a_row` episodes in a row failed every attempt: the sandbox fleet is down
  or refusing, and retrying more episodes would only grow the failure count."""


@dataclasses.dataclass
class PoolLedger:
  """Episode counts since the pool started. Invariant (`check`): started == running + queued + taken +
  dropped_stale + failed. lost_attempts / retried count session losses that were replayed."""
  started: int = 0
  running: int = 0
  queued: int = 0
  taken: int = 0
  dropped_stale: int = 0
  failed: int = 0
  lost_attempts: int = 0
  retried: int = 0
  cancelled: int = 0  # members of a failed group still running when it failed (cancelled, counted failed)
  masked_tokens: int = 0

  def check(self) -> None:
    """Raises AssertionError when an episode is unaccounted for."""
    total = self.running + self.queued + self.taken + self.dropped_stale + self.failed
    if total != self.started:
      raise AssertionError(f"pool ledger does not add up: {self}")


# the ledger's counts that pool metrics report (`pool_metrics`) and sum over processes (`merge_pool_metrics`)
LEDGER_KEYS = ("started", "running", "queued", "taken", "dropped_stale", "failed", "masked_tokens")


def job_groups(tasks: Sequence[str], n: int, group_size: int, seed_offset: int, start_iteration: int = 0,
               share: tuple[int, int] = (0, 1)) -> Iterator[list[tuple[str, int]]]:
  """Endless groups of `group_size` (task, seed) jobs: the groups of `rollout_jobs` for iterations
  start_iteration, start_iteration + 1, ... (the seeds the lockstep trainer would play, in order).
  share=(p, k): only every k-th group from the p-th (process p of k: the processes' groups are
  disjoint and together the whole sequence)."""
  p, k = share
  if not 0 <= p < k:
    raise ValueError(f"share must be (p, k) with 0 <= p < k, got {share}")
  g_all = 0
  for it in itertools.count(start_iteration):
    jobs = rollout_jobs(tasks, n, group_size, it, seed_offset)
    for g in range(0, len(jobs), group_size):
      if g_all % k == p:
        yield jobs[g:g + group_size]
      g_all += 1


def staleness(ep: Episode, version: int) -> int:
  """Versions between `version` and the oldest token of `ep` (0 for an episode without tokens)."""
  vs = [int(t.versions.min()) for t in ep.turns if t.versions is not None and len(t.versions)]
  return version - min(vs) if vs else 0


def mask_stale_tokens(ep: Episode, min_version: int) -> int:
  """Takes the tokens of `ep` produced before `min_version` out of the loss (`Turn.loss_mask` [n]
  float32); returns how many were masked."""
  masked = 0
  for t in ep.turns:
    if t.versions is None:
      continue
    keep = (t.versions >= min_version).astype(np.float32)
    t.loss_mask = keep if t.loss_mask is None else t.loss_mask * keep
    masked += int((keep == 0).sum())
  return masked


class RolloutPool:
  """Episodes in flight on the caller's event loop; `take` hands finished groups to the trainer.

  Args:
    service: the `InferenceService` whose weights the trainer swaps (`set_params(params, version)`).
    clients: sandbox clients (`client_for` routes each task to a server that serves it).
    jobs: endless iterator of groups [(task, seed)] * group_size (`job_groups`).
    cfg, tok: the rollout loop's config and tokenizer (`episode.LoopConfig`).
    pool: `PoolConfig`. stats: a `RolloutStats` the episodes add to (cumulative; `stats_since`).
    episodic: a `memory.EpisodicMemory` whose summaries of a task go into each new episode's prefix
      (the caller writes them, e.g. `memory.remember` on the episodes of each take), or None.

  Raises (from `take`): the first non-retryable sandbox error of any episode (UnknownTask, ...), or
  the inference service's error; the pool is then closed.
  """

  def __init__(self, service, clients: Sequence[SandboxClient], jobs: Iterator[list[tuple[str, int]]],
               cfg: LoopConfig, tok: ByteTokenizer, pool: PoolConfig, stats: RolloutStats | None = None,
               episodic=None):
    self.service, self.clients, self.jobs, self.cfg, self.tok, self.pool = service, clients, jobs, cfg, tok, pool
    self.episodic = episodic
    self.stats = stats if stats is not None else RolloutStats()
    self.ledger = PoolLedger()
    self._done: collections.deque[list[Episode]] = collections.deque()  # finished groups, FIFO
    self._tasks: set[asyncio.Task] = set()
    self._changed: asyncio.Event | None = None
    self._error: BaseException | None = None
    self._next: list[tuple[str, int]] | None = None  # the next group, pulled from `jobs` when room frees
    self._n_started = 0
    self._failed_in_a_row = 0  # episodes that failed every attempt since the last one that finished
    self._last_loss = ""  # the cause of the latest lost attempt, for SandboxesUnreachable

  async def start(self) -> None:
    """Fills the pool to `concurrency` episodes, as tasks of the running event loop. Raises ValueError
    when a group (`rl.group_size` episodes) is larger than `concurrency`: none could ever start."""
    self._changed = asyncio.Event()
    self._fill()

  def _fill(self) -> None:
    while self._error is None:
      if self._next is None:
        self._next = next(self.jobs)
      if len(self._next) > self.pool.concurrency:  # at start: no group could ever begin, take would wait forever
        raise ValueError(f"a group of {len(self._next)} episodes (rl.group_size) cannot start with "
                         f"rollout.concurrency={self.pool.concurrency}: set concurrency >= the group size")
      if self.ledger.running + len(self._next) > self.pool.concurrency:
        break
      group, self._next = self._next, None
      self.ledger.started += len(group)
      self.ledger.running += len(group)
      task = asyncio.get_running_loop().create_task(self._run_group(group, self._n_started))
      self._n_started += len(group)
      self._tasks.add(task)
      task.add_done_callback(self._tasks.discard)

  async def _run_group(self, group: list[tuple[str, int]], first: int) -> None:
    loop = asyncio.get_running_loop()
    members = [loop.create_task(self._run_one(task, seed, first + j)) for j, (task, seed) in enumerate(group)]
    try:
      eps = await asyncio.gather(*members)
    except BaseException as e:
      # gather leaves the other members running: cancel them (their sessions close) and count them
      for t in members:
        if not t.done():
          t.cancel()
          self.ledger.cancelled += 1
      await asyncio.gather(*members, return_exceptions=True)
      if isinstance(e, asyncio.CancelledError):  # close(): the group stays counted as running, never trained
        raise
      if self._error is None:  # non-retryable: the trainer sees it at its next take
        self._error = e
      self.ledger.running -= len(group)
      self.ledger.failed += len(group)
      self._changed.set()
      return
    kept = [e for e in eps if not e.lost]
    self._failed_in_a_row = 0 if kept else self._failed_in_a_row + len(group)
    limit = self.pool.max_failed_in_a_row
    if limit and self._failed_in_a_row >= limit and self._error is None:
      self._error = SandboxesUnreachable(
          f"{self._failed_in_a_row} episodes in a row failed all {self.cfg.max_retries + 1} attempts "
          f"(PoolConfig.max_failed_in_a_row={limit}); last: {self._last_loss}")
    self.ledger.running -= len(group)
    self.ledger.failed += len(group) - len(kept)
    self.ledger.queued += len(kept)
    if kept:
      self._done.append(kept)
    self._changed.set()
    self._fill()

  async def _run_one(self, task: str, seed: int, k: int) -> Episode:
    def lost(i: int, e: BaseException) -> None:  # the ledger's count (stats: `play_retried`)
      self.ledger.lost_attempts += 1
      self._last_loss = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
      if i < self.cfg.max_retries:
        self.ledger.retried += 1

    memory = self.episodic.summaries(task) if self.episodic is not None else ()
    return await episode_lib.play_retried(self.clients, self.service, task, seed, k, cfg=self.cfg, tok=self.tok,
                                          version=lambda: self.service.version, stats=self.stats, memory=memory,
                                          on_loss=lost)

  async def take(self, min_batch: int | None = None) -> list[Episode]:
    """Waits until finished groups hold >= min_batch (default `pool.min_batch`) episodes that pass the
    staleness rule, and returns them (whole groups, oldest first; stale ones dropped or masked and
    counted in the ledger). Episodes still running keep running."""
    need = self.pool.min_batch if min_batch is None else min_batch
    out: list[Episode] = []
    try:
      while len(out) < need:
        if self._error is not None:
          raise self._error
        if not self._done:
          self._changed.clear()
          await self._changed.wait()
          continue
        out += self._take_group()
    except BaseException:
      # the episodes this take already held go back to the queue's front: counted queued, not taken
      if out:
        self._done.appendleft(out)
        self.ledger.queued += len(out)
        self.ledger.taken -= len(out)
        self.stats.episodes -= len(out)
      raise
    return out

  def _take_group(self) -> list[Episode]:
    """The oldest finished group, its stale episodes dropped or masked (counted); counted taken."""
    group = self._done.popleft()
    self.ledger.queued -= len(group)
    version = self.service.version
    kept = []
    for ep in group:
      if staleness(ep, version) <= self.pool.max_staleness:
        kept.append(ep)
      elif self.pool.stale == "drop":
        self.ledger.dropped_stale += 1
      else:
        self.ledger.masked_tokens += mask_stale_tokens(ep, version - self.pool.max_staleness)
        kept.append(ep)
    self.ledger.taken += len(kept)
    self.stats.episodes += len(kept)
    return kept

  async def close(self) -> None:
    """Cancels the episodes in flight (their sessions are closed) and waits for them; they count as
    running no more: the ledger keeps them under `running` (never trained)."""
    self._error = self._error or RuntimeError("pool closed")
    for t in list(self._tasks):
      t.cancel()
    await asyncio.gather(*self._tasks, return_exceptions=True)


def stats_since(now: RolloutStats, before: RolloutStats) -> RolloutStats:
  """The rollout work done between two snapshots (`copy.deepcopy` of a pool's cumulative stats): field
  by field differences, reward terms per key."""
  out = RolloutStats()
  for f in dataclasses.fields(RolloutStats):
    if f.name == "reward_terms":
      out.reward_terms = {k: v - before.reward_terms.get(k, 0.0) for k, v in now.reward_terms.items()}
    else:
      setattr(out, f.name, getattr(now, f.name) - getattr(before, f.name))
  return out


def pool_metrics(pool: RolloutPool, stale: Sequence[int], wait_s: float, iteration_s: float) -> dict:
  """Metrics of one streaming update: the pool's ledger, the mean staleness of the trained episodes
  (`stale`: `staleness(ep, service.version)` of each at take), the trainer's idle fraction (time
  blocked in `take` over the iteration's wall time) and the service's mean slot occupancy."""
  m = {f"pool/{k}": float(getattr(pool.ledger, k)) for k in LEDGER_KEYS}
  m["pool/staleness_mean"] = float(np.mean(stale)) if len(stale) else 0.0
  m["pool/trainer_idle_frac"] = wait_s / max(iteration_s, 1e-9)
  stats = getattr(pool.service, "stats", None)
  if stats is not None:
    m["pool/slot_occupancy"] = stats.occupancy
  return m


def merge_pool_metrics(per_process: Sequence[dict]) -> dict:
  """`pool_metrics` of several processes' pools as one: ledger counts summed (one ledger over every
  pool), the other metrics (staleness, idle fraction, occupancy) averaged. One dict: itself."""
  if len(per_process) == 1:
    return dict(per_process[0])
  out = {}
  for key in per_process[0]:
    vals = [m[key] for m in per_process if key in m]
    out[key] = float(sum(vals)) if key[len("pool/"):] in LEDGER_KEYS else float(np.mean(vals))
  return out
