"""Streaming rollout pool (`rollout/pool.py`): accounting over many takes with long-tailed episode
lengths, lost sessions and version swaps (every started episode is taken once, running, queued,
dropped as stale or failed: none lost silently, none taken twice); staleness rules; and the real
thing — the inference service with a tiny model against a real Chromium sandbox whose browser is
killed -9 mid-rollout."""

import asyncio
import collections
import os
import signal

import jax
import numpy as np
import pytest
from flax import nnx

from envs_bridge import protocol as P
from envs_bridge.client import SandboxClient
from envs_bridge.launch import launch_server
from tars_jax.agent.grammar import build_grammar
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.agent.trajectory import Episode, Turn, episode_arrays
from tars_jax.models import Policy
from tars_jax.rollout.episode import LoopConfig
from tars_jax.rollout.inference_server import InferenceService, Reply, max_reply_tokens
from tars_jax.rollout.pool import (PoolConfig, RolloutPool, SandboxesUnreachable, job_groups, mask_stale_tokens,
                                   staleness)

from _shared import TINY_CFG, run

TOK = ByteTokenizer()


# ---- pure logic: a scripted policy and sandbox (the real ones are in the integration test below) ----
class _ScriptedService:
  """`generate` answers after a random number of event-loop ticks with a fixed reply; `version` is what
  the test sets (as the trainer's set_params would)."""

  def __init__(self, rng):
    self.rng, self.version, self.released = rng, 0, 0

  def release(self, session):
    self.released += 1

  async def generate(self, ids, images, session=None):
    for _ in range(int(self.rng.integers(0, 4))):
      await asyncio.sleep(0)
    n = 3
    return Reply(TOK.encode("ok") + [TOK.eos_id], np.full(n, -0.5, np.float32), np.full(n, -1, np.int32),
                 np.full(n, self.version, np.int32))


class _Obs:
  def __init__(self, done, reward):
    self.done, self.reward, self.info = done, reward, {}

  def image(self):
    return np.zeros((8, 8, 3), np.uint8)


class _ScriptedSandbox:
  """Episode lengths long-tailed (geometric, capped by max_turns); each step may lose the session."""

  serves = None

  def __init__(self, rng, p_lost):
    self.rng, self.p_lost, self.sessions, self.closed = rng, p_lost, {}, 0

  async def open(self, task, seed, data_mode="train"):
    sid = f"s{len(self.sessions)}"
    self.sessions[sid] = int(min(self.rng.geometric(0.35), 12))
    return sid, _Obs(False, 0.0)

  async def step(self, sid, text):
    await asyncio.sleep(0)
    if self.rng.random() < self.p_lost:
      raise P.SessionLost("scripted loss")
    self.sessions[sid] -= 1
    return _Obs(self.sessions[sid] <= 0, 1.0 if self.sessions[sid] <= 0 else 0.0)

  async def close(self, sid):
    self.closed += 1


def test_accounting_over_many_takes_with_losses_and_staleness():
  rng = np.random.default_rng(0)
  svc, sb = _ScriptedService(rng), _ScriptedSandbox(rng, p_lost=0.03)
  cfg = LoopConfig(max_turns=12, image_hw=(8, 8), n_img_tokens=2, max_retries=1)
  pool_cfg = PoolConfig(concurrency=12, min_batch=8, max_staleness=2, stale="drop")

  async def go():
    pool = RolloutPool(svc, [sb], job_groups(["t/a", "t/b", "t/c"], 12, 2, 0), cfg, TOK, pool_cfg)
    await pool.start()
    seen, takes = set(), []
    for it in range(40):
      eps = await pool.take()
      pool.ledger.check()
      takes.append(len(eps))
      for e in eps:
        assert (e.task, e.seed, id(e)) not in seen
        seen.add((e.task, e.seed, id(e)))
        assert not e.lost and staleness(e, svc.version) <= 2
        assert all(len(t.versions) == len(t.reply_ids) for t in e.turns)
      svc.version = it + 1  # the trainer's update
    await pool.close()
    return pool, seen, takes

  pool, seen, takes = run(go())
  L = pool.ledger
  L.check()
  assert L.taken == len(seen) == sum(takes) and min(takes) >= 8
  assert L.lost_attempts > 0 and L.retried > 0 and L.failed > 0  # losses happened and were counted
  assert L.dropped_stale > 0  # long episodes outlived the staleness bound
  assert L.running + L.queued > 0  # the pool kept episodes in flight past the last take
  # every opened session was closed except those cancelled by close() mid-step (at most the running ones)
  assert len(sb.sessions) - sb.closed <= L.running
  assert svc.released == len(sb.sessions)  # every episode ended its inference session (KV slot) too
  # each (task, seed) group of 2 shares one task and seed; seeds never repeat across groups
  per_seed = {}
  for task, seed, _ in seen:
    per_seed.setdefault(seed, set()).add(task)
  assert all(len(v) == 1 for v in per_seed.values())


class _DownSandbox(_ScriptedSandbox):
  """A fleet that is down: every open fails with a retryable error (as a dead server's ConnectError)."""

  async def open(self, task, seed, data_mode="train"):
    await asyncio.sleep(0)
    raise P.SessionLost("connection refused")


def test_a_fleet_that_is_down_stops_the_pool_instead_of_retrying_forever():
  rng = np.random.default_rng(0)
  cfg = LoopConfig(max_turns=3, image_hw=(8, 8), n_img_tokens=2, max_retries=2)

  async def go():
    pool = RolloutPool(_ScriptedService(rng), [_DownSandbox(rng, 0.0)], job_groups(["t/a"], 4, 2, 0), cfg, TOK,
                       PoolConfig(concurrency=4, min_batch=4, max_failed_in_a_row=6))
    await pool.start()
    with pytest.raises(SandboxesUnreachable, match=r"failed all 3 attempts .*last: SessionLost: connection refused"):
      await pool.take()
    await pool.close()
    return pool.ledger

  L = run(go())
  L.check()
  # stopped at the first finished group past 6 failures in a row: 6 failed, and no more than a
  # pool-full (4) of episodes started after the limit was reached
  assert L.taken == 0 and 6 <= L.failed <= 8 and L.started <= L.failed + 4
  assert L.lost_attempts == 3 * L.failed and L.retried == 2 * L.failed


def test_a_lost_episode_is_replayed_on_the_next_server():
  """Two servers, the first down: an episode whose first attempt went there is replayed on the second
  (`client_for(clients, task, k + attempt)`), so none fails; the attempts lost there are counted."""
  rng = np.random.default_rng(0)
  cfg = LoopConfig(max_turns=3, image_hw=(8, 8), n_img_tokens=2, max_retries=1)
  down, up = _DownSandbox(rng, 0.0), _ScriptedSandbox(rng, 0.0)

  async def go():
    pool = RolloutPool(_ScriptedService(rng), [down, up], job_groups(["t/a"], 8, 2, 0), cfg, TOK,
                       PoolConfig(concurrency=8, min_batch=8))
    await pool.start()
    eps = await pool.take()
    await pool.close()
    return pool, eps

  pool, eps = run(go())
  L = pool.ledger
  L.check()
  assert len(eps) == 8 and not any(e.lost for e in eps) and L.failed == 0
  assert L.lost_attempts == L.retried == pool.stats.episodes_lost == pool.stats.episodes_retried > 0
  assert len(up.sessions) >= 8  # every taken episode was played on the server that is up


def test_a_group_larger_than_the_pool_is_refused_at_start():
  """rollout.concurrency < rl.group_size: no group could ever start and `take` would wait forever."""
  rng = np.random.default_rng(0)
  pool = RolloutPool(_ScriptedService(rng), [_ScriptedSandbox(rng, 0.0)], job_groups(["t/a"], 8, 4, 0),
                     LoopConfig(max_turns=3, image_hw=(8, 8), n_img_tokens=2), TOK,
                     PoolConfig(concurrency=2, min_batch=2))
  with pytest.raises(ValueError, match=r"group of 4 episodes.*concurrency=2"):
    run(pool.start())


class _BrokenTaskSandbox(_ScriptedSandbox):
  """Episodes of task t/broken fail on their 4th step with a non-retryable error (a page that throws);
  the other tasks' episodes run 1-12 steps."""

  def __init__(self, rng, p_lost):
    super().__init__(rng, p_lost)
    self.broken, self.closed_sids = {}, set()  # broken sid -> steps taken

  async def open(self, task, seed, data_mode="train"):
    sid, obs = await super().open(task, seed, data_mode)
    if task == "t/broken":
      self.broken[sid] = 0
    return sid, obs

  async def step(self, sid, text):
    if sid not in self.broken:
      return await super().step(sid, text)
    self.broken[sid] += 1
    if self.broken[sid] == 4:
      raise P.TaskError("the page threw")
    for _ in range(int(self.rng.integers(0, 8))):  # siblings still mid-episode when the first one fails
      await asyncio.sleep(0)
    return _Obs(False, 0.0)

  async def close(self, sid):
    self.closed += 1
    self.closed_sids.add(sid)


def test_a_failed_group_cancels_its_siblings_and_take_returns_what_it_held():
  """A non-retryable error in one episode of a group: the group's other members are cancelled (their
  sessions closed, counted), the trainer gets the error at `take`, and the finished groups that take
  had already collected go back to the queue: counted queued, not taken, handed out by no one."""
  rng = np.random.default_rng(1)
  sb = _BrokenTaskSandbox(rng, 0.0)
  cfg = LoopConfig(max_turns=12, image_hw=(8, 8), n_img_tokens=2, max_retries=1)
  # groups of 4 in job order: iteration 0's t/a groups finish first, then t/broken's group fails
  jobs = job_groups(["t/a", "t/broken"], 16, 4, 0)

  async def go():
    pool = RolloutPool(_ScriptedService(rng), [sb], jobs, cfg, TOK, PoolConfig(concurrency=16, min_batch=16))
    await pool.start()
    with pytest.raises(P.TaskError, match="the page threw"):
      await pool.take(min_batch=64)  # more than finish before the broken group fails
    held = sum(len(g) for g in pool._done)
    await pool.close()
    return pool, held

  pool, held = run(go())
  L = pool.ledger
  L.check()
  assert L.taken == 0 and L.queued == held > 0  # nothing counted taken that the trainer did not get
  assert L.failed == 4 and L.cancelled >= 1  # the broken group: one failed, its still-running siblings cancelled
  assert set(sb.broken) <= sb.closed_sids  # every broken-group session closed (the failed one and by close())


def _episode(versions_per_turn, reward=1.0):
  turns = []
  for v in versions_per_turn:
    n = len(v)
    turns.append(Turn(image=np.zeros((2, 2, 3), np.uint8), obs_ids=[1, 2], reply_ids=list(range(3, 3 + n)),
                      logprobs=np.full(n, -0.1, np.float32), states=np.zeros(n, np.int32), reward=reward,
                      versions=np.asarray(v, np.int32)))
  return Episode(task="t", seed=0, instruction="", prefix_ids=[9], turns=turns)


def test_staleness_and_masking_rules():
  ep = _episode([[3, 3, 4], [4, 5], [6, 6]])
  assert staleness(ep, 6) == 3 and staleness(ep, 3) == 0
  assert mask_stale_tokens(ep, 5) == 4  # tokens of versions 3, 3, 4, 4
  loss = episode_arrays(ep)["loss"]
  # prefix 1 + (obs 2 + reply 3) + (obs 2 + reply 2) + (obs 2 + reply 2)
  np.testing.assert_array_equal(loss, [0] + [0, 0, 0, 0, 0] + [0, 0, 0, 1] + [0, 0, 1, 1])
  with pytest.raises(ValueError, match="stale"):
    PoolConfig(concurrency=2, min_batch=2, stale="ignore")


# ---- the real thing: inference service + Chromium sandbox, kill -9 mid-rollout -------------------------
class _KillBeforeStep:
  """The sandbox client, except that once armed its next `step` first kills -9 the server's Chromium
  (pid from the server's own health report): a session is then certainly open on the dead browser."""

  def __init__(self, client):
    self.client, self.armed, self.killed = client, False, None

  def __getattr__(self, name):
    return getattr(self.client, name)

  async def step(self, sid, text):
    if self.armed:
      self.armed = False
      self.killed = (await self.client.health())["browsers"][0]["pid"]
      os.kill(self.killed, signal.SIGKILL)
    return await self.client.step(sid, text)


@pytest.mark.slow  # ~50 s: the service compiles, real Chromium is killed and recovers
@pytest.mark.browser
def test_real_pool_survives_a_killed_browser_and_accounts_for_every_episode():
  cfg_m = TINY_CFG
  gd, params = nnx.split(Policy(cfg_m, nnx.Rngs(0)))
  g = build_grammar(actions=("click",), max_thought_bytes=4, coord_format="fixed3")
  loop_cfg = LoopConfig(max_turns=3, image_hw=(cfg_m.image_h, cfg_m.image_w), n_img_tokens=cfg_m.n_img_tokens,
                        max_retries=2)
  with launch_server(lease_s=60.0) as h, InferenceService(
      gd, params, tokenizer=TOK, grammar=g, slots=4, context_len=512, max_images=3,
      image_hw=loop_cfg.image_hw, max_new_tokens=max_reply_tokens(g), length_multiple=64, jump_forward=8) as svc:
    async def go():
      async with SandboxClient(h.url) as raw:
        c = _KillBeforeStep(raw)
        pool = RolloutPool(svc, [c], job_groups(["miniwob/click-test", "miniwob/click-test-2"], 4, 2, 0),
                           loop_cfg, TOK, PoolConfig(concurrency=4, min_batch=4, max_staleness=1))
        await pool.start()
        got = []
        for it in range(4):
          if it == 1:  # the next step of an episode in flight meets a killed Chromium
            c.armed = True
          got += await pool.take()
          pool.ledger.check()
          svc.set_params(params, it + 1)
        await pool.close()
        assert c.killed is not None and not c.armed
        return pool, got, await raw.health()
    pool, got, health = run(go())
  L = pool.ledger
  L.check()
  assert L.taken == len(got) >= 16 and L.lost_attempts >= 1 and L.retried >= 1
  assert health["browser_restarts"] >= 1
  # the ledger against counts it does not keep: the sandbox server's sessions and what the trainer got
  assert len({id(e) for e in got}) == len(got)  # nothing handed out twice
  assert max(collections.Counter((e.task, e.seed) for e in got).values()) <= 2  # group_size 2 per (task, seed)
  # every attempt opens one session, except an attempt lost while opening (the browser killed under it)
  assert L.started - L.lost_attempts <= health["opened"] <= L.started + L.retried
  # each trained episode ended by closing its session; each lost attempt lost one; none left unaccounted
  assert health["closed"] >= L.taken and health["lost"] >= 1
  assert health["opened"] == health["closed"] + health["lost"] + health["expired"] + health["sessions"]
  for e in got:  # real episodes: rewards read from the page, versions per token, replies parsed by the server
    assert e.turns and all(len(t.versions) == len(t.reply_ids) for t in e.turns)
    assert all(t.reply_ids[-1] == TOK.eos_id for t in e.turns)
    assert e.env_return == pytest.approx(sum(t.env_reward for t in e.turns))
    vs = np.concatenate([t.versions for t in e.turns])
    assert np.all(np.diff(vs) >= 0)  # an episode's tokens come from non-decreasing policy versions


def test_job_group_shares_are_disjoint_and_cover_the_sequence():
  """share=(p, k): process p plays every k-th group; together the processes play exactly the groups of
  one process, each once. A bad share is refused."""
  import itertools
  one = list(itertools.islice(job_groups(["t/a", "t/b", "t/c"], 8, 2, 100), 24))
  parts = [list(itertools.islice(job_groups(["t/a", "t/b", "t/c"], 8, 2, 100, share=(p, 3)), 8)) for p in range(3)]
  assert [g for k in range(8) for g in (parts[0][k], parts[1][k], parts[2][k])] == one
  with pytest.raises(ValueError, match="share"):
    next(job_groups(["t/a"], 2, 1, 0, share=(2, 2)))


def test_pool_metrics_of_several_processes_sum_the_ledgers():
  from tars_jax.rollout.pool import merge_pool_metrics
  a = {"pool/started": 6.0, "pool/taken": 4.0, "pool/staleness_mean": 1.0, "pool/trainer_idle_frac": 0.2}
  b = {"pool/started": 5.0, "pool/taken": 4.0, "pool/staleness_mean": 0.0, "pool/trainer_idle_frac": 0.4}
  m = merge_pool_metrics([a, b])
  assert m["pool/started"] == 11 and m["pool/taken"] == 8
  assert m["pool/staleness_mean"] == pytest.approx(0.5) and m["pool/trainer_idle_frac"] == pytest.approx(0.3)
  assert merge_pool_metrics([a]) == a
