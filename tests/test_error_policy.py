"""Which sandbox errors lose an episode (replayed from its seed) and which are raised at once: one rule,
`protocol.is_retryable`, for the client's SessionPool and the trainer's agent loop. Against real servers:
an unknown task and a wrong token raise their typed error without a retry; a server that dies for longer
than the retries gives Episodes marked lost (never None), counted, which the evaluator's summary reports
and the trainer's `trainable` turns into a skipped iteration."""

import asyncio

import httpx
import numpy as np
import pytest

from envs_bridge import protocol as P
from envs_bridge.client import SandboxClient, SessionPool
from envs_bridge.launch import free_port, launch_server
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.agent.trajectory import collate
from tars_jax.rollout.agent_loop import run_episodes, trainable
from tars_jax.rollout.episode import LoopConfig, RolloutStats
from tars_jax.rollout.evaluation import summarize
from _shared import run

TOK = ByteTokenizer()


def _act(text="Thought: wait\nAction: wait()"):
  """A scripted policy: the same reply to every prompt (ids incl. EOS, zero logprobs and states)."""
  def act(prompts, images):
    r = TOK.encode(text) + [TOK.eos_id]
    return [(r, np.zeros(len(r), np.float32), np.zeros(len(r), np.int32)) for _ in prompts]
  return act


def test_retryable_errors_are_the_lost_session_ones():
  req = httpx.Request("POST", "http://127.0.0.1:1/sessions")
  retry = [P.SessionLost("x"), P.LeaseExpired("x"), P.ServerBusy("x"), httpx.ConnectError("refused", request=req),
           httpx.ReadTimeout("slow", request=req), httpx.RemoteProtocolError("cut", request=req)]
  final = [P.UnknownTask("x"), P.Unauthorized("x"), P.PayloadTooLarge("x"), P.InvalidAction("x"), P.TaskError("x"),
           P.UnknownSession("x"), P.error_from_body(422, {"detail": "bad"}), P.error_from_body(500, "boom"),
           ValueError("bug")]
  assert [P.is_retryable(e) for e in retry] == [True] * len(retry)
  assert [P.is_retryable(e) for e in final] == [False] * len(final)


@pytest.mark.browser
def test_unknown_task_raises_at_once_and_closes_the_rounds_sessions(server):
  async def go():
    stats = RolloutStats()
    async with SandboxClient(server.url) as c:
      before = (await c.health())["sessions"]
      with pytest.raises(P.UnknownTask) as e:
        await run_episodes(_act(), [c], [("miniwob/click-test", 0), ("miniwob/click-tst", 1)],
                           LoopConfig(max_turns=2, max_retries=2), TOK, stats=stats)
      after = (await c.health())["sessions"]
      async with SessionPool([server.url], max_retries=2) as pool:
        with pytest.raises(P.UnknownTask):
          await pool.run_episode("miniwob/click-tst", 0, lambda s: asyncio.sleep(0, "wait()"))
        return e.value, stats, before, after, pool.stats
  err, stats, before, after, pstats = run(go())
  assert "click-tst" in err.reason
  assert (stats.episodes_lost, stats.episodes_retried, stats.episodes_failed) == (0, 0, 0)
  assert after == before  # the click-test session opened in the same round was closed
  assert (pstats.episodes_lost, pstats.episodes_retried) == (0, 0)


@pytest.mark.browser
def test_wrong_token_raises_unauthorized_at_once():
  with launch_server(token="the-right-token") as h:
    async def go():
      stats = RolloutStats()
      async with SandboxClient(h.url, token="a-wrong-token") as c:
        with pytest.raises(P.Unauthorized) as e:
          await run_episodes(_act(), [c], [("miniwob/click-test", 0)] * 2, LoopConfig(max_turns=2), TOK,
                             stats=stats)
      async with SessionPool([h.url], token="a-wrong-token") as pool:
        with pytest.raises(P.Unauthorized):
          await pool.run_episode("miniwob/click-test", 0, lambda s: asyncio.sleep(0, "wait()"))
        return e.value, stats, pool.stats
    err, stats, pstats = run(go())
  assert "wrong bearer token" in err.reason
  assert (stats.episodes_lost, stats.episodes_retried, pstats.episodes_lost) == (0, 0, 0)


@pytest.mark.browser
def test_a_server_dead_for_longer_than_the_retries_gives_lost_episodes():
  """The server dies during the first policy call (sessions open, no step answered) and stays dead:
  every episode is lost on each of its 1 + max_retries attempts (the step, then the re-opens)."""
  n, retries = 3, 2
  with launch_server() as h:
    def act(prompts, images):
      if h.alive():
        h.stop()  # SIGTERM, then SIGKILL of its process group: the port refuses from now on
      return _act()(prompts, images)

    async def go():
      stats = RolloutStats()
      async with SandboxClient(h.url, timeout_s=30.0) as c:
        eps = await run_episodes(act, [c], [("miniwob/click-test", s) for s in range(n)],
                                 LoopConfig(max_turns=3, max_retries=retries), TOK, stats=stats)
      return eps, stats
    eps, stats = run(go())
  assert [(e.task, e.seed, e.lost) for e in eps] == [("miniwob/click-test", s, True) for s in range(n)]
  assert stats.episodes == 0 and stats.episodes_failed == n
  assert stats.episodes_lost == n * (1 + retries) and stats.episodes_retried == n * retries
  # the evaluator scores none of them and says so; the trainer skips the iteration
  assert summarize(eps)["miniwob/click-test"] == {"success": 0.0, "episodes": 0, "mean_reward": 0.0,
                                                   "mean_steps": 0.0, "invalid_rate": 0.0, "lost": n}
  assert trainable(eps, stats, "iteration 1") == []


def test_unreachable_server_gives_lost_episodes_and_pool_results():
  url = f"http://127.0.0.1:{free_port()}"  # nothing listens there

  async def go():
    stats = RolloutStats()
    async with SandboxClient(url, timeout_s=5.0) as c:
      eps = await run_episodes(_act(), [c], [("miniwob/click-test", 0), ("games/x", 1)],
                               LoopConfig(max_turns=2, max_retries=1), TOK, stats=stats)
    async with SessionPool([url], max_retries=1, timeout_s=5.0) as pool:
      res = await pool.run_episode("miniwob/click-test", 0, lambda s: asyncio.sleep(0, "wait()"))
      return eps, stats, res, pool.stats
  eps, stats, res, pstats = run(go())
  assert [(e.task, e.seed, e.lost, e.turns) for e in eps] == [("miniwob/click-test", 0, True, []), ("games/x", 1, True, [])]
  assert (stats.episodes, stats.episodes_lost, stats.episodes_retried, stats.episodes_failed) == (0, 4, 2, 2)
  assert res.lost and res.attempts == 2 and all(r.startswith("ConnectError") for r in res.lost_reasons)
  assert (pstats.episodes_lost, pstats.episodes_retried, pstats.episodes_failed) == (2, 1, 1)


@pytest.mark.browser
def test_an_episode_lost_on_one_server_is_replayed_on_the_next(server):
  """The lockstep loop's replay of a lost episode goes to the next server that serves its task: job 0's
  first attempt meets a URL nothing listens on, its replay the real server."""
  down = f"http://127.0.0.1:{free_port()}"

  async def go():
    stats = RolloutStats()
    async with SandboxClient(down, timeout_s=5.0) as d, SandboxClient(server.url) as up:
      eps = await run_episodes(_act(), [d, up], [("miniwob/click-test", 0)], LoopConfig(max_turns=2, max_retries=1),
                               TOK, stats=stats)
    return eps, stats
  eps, stats = run(go())
  assert not eps[0].lost and len(eps[0].turns) >= 1
  assert (stats.episodes, stats.episodes_lost, stats.episodes_retried, stats.episodes_failed) == (1, 1, 1, 0)


def test_all_lost_iteration_is_skipped_not_collated(caplog):
  from tars_jax.agent.trajectory import Episode
  eps = [Episode(task="t", seed=s, instruction="", prefix_ids=[], lost=True) for s in range(2)]
  stats = RolloutStats(episodes_lost=6, episodes_retried=4, episodes_failed=2)
  with caplog.at_level("WARNING"):
    assert trainable(eps, stats, "iteration 5") == []
  assert "iteration 5 skipped: all 2 episodes lost (6 lost attempts, 4 retries)" in caplog.text
  kept = Episode(task="t", seed=9, instruction="", prefix_ids=[1])
  assert trainable(eps + [kept], stats, "iteration 6") == [kept]
  with pytest.raises(ValueError, match="no episodes"):
    collate([], pad_id=0, max_images=1, image_hw=(4, 4))


@pytest.mark.slow  # ~1-2.5 min: builds the smoke trainer; the skip rule itself is tested above, fast
def test_trainer_skips_iterations_whose_episodes_are_all_lost(tmp_path):
  """The real trainer against a server that never answers: each iteration's episodes are lost on every
  attempt, the iteration is logged and skipped (a metrics row with the counts, no update), and the run
  ends normally instead of crashing in collate."""
  import json
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
  cmd = [sys.executable, "-m", "experiments.train", "--config",
         os.path.join(root, "experiments/configs/miniwob_ppo.py:smoke"), "--workdir", str(tmp_path / "run"),
         f"--config.env.servers=('{url}',)", "--config.iterations=2"]
  p = subprocess.run(cmd, cwd=root, env=dict(os.environ, PYTHONPATH=root), capture_output=True, text=True,
                     timeout=600)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  rows = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
  n = rows[0]["episodes_failed"]
  assert n > 0 and [r["step"] for r in rows] == [1, 2]
  assert all(r["episodes_failed"] == n and r["episodes_lost"] == 3 * n for r in rows)  # 1 + max_retries=2
  assert "iteration 1 skipped: all" in p.stderr and "iteration 2 skipped: all" in p.stderr
