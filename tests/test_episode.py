"""The one retry of a lost episode (`rollout.episode.with_retries`) and how it tells the failures
apart: a sandbox failure is replayed, the inference service's (`InferenceFailed`, raised by
`PolicyAgent` whatever the service raised) and every other error are not. Pure logic with stand-ins
for the attempt and the service; the real paths: tests/test_pool.py (a killed Chromium, replayed),
tests/test_inference_remote.py (a killed inference server, not replayed), tests/test_demos.py."""

import httpx
import numpy as np
import pytest

from envs_bridge import protocol as P
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.agent.trajectory import Episode
from tars_jax.rollout.episode import InferenceFailed, InferenceUnavailable, PolicyAgent, TurnView, with_retries

from _shared import run


def _attempts(outcomes):
  """An attempt function that raises / returns `outcomes[k]` at attempt k, recording the k it got."""
  seen = []

  async def attempt(k):
    seen.append(k)
    out = outcomes[k]
    if isinstance(out, BaseException):
      raise out
    return out

  return attempt, seen


def test_a_lost_session_is_replayed_until_an_attempt_returns():
  attempt, seen = _attempts([P.SessionLost("page crashed"), httpx.ConnectError("refused"), "episode"])
  losses = []
  out = run(with_retries(attempt, retries=2, what="episode t/1", on_loss=lambda k, e: losses.append((k, type(e)))))
  assert out == "episode" and seen == [0, 1, 2]
  assert losses == [(0, P.SessionLost), (1, httpx.ConnectError)]


def test_every_attempt_lost_returns_none_after_retries_plus_one():
  attempt, seen = _attempts([P.LeaseExpired("idle"), P.ServerBusy("full"), P.SessionLost("gone")])
  losses = []
  assert run(with_retries(attempt, retries=2, what="episode t/1", on_loss=lambda k, e: losses.append(k))) is None
  assert seen == [0, 1, 2] and losses == [0, 1, 2]


@pytest.mark.parametrize("error", [InferenceFailed("inference service down"), P.UnknownTask("no such task"),
                                   ValueError("a bug")])
def test_other_failures_propagate_at_once_without_a_replay(error):
  attempt, seen = _attempts([error, "never"])
  with pytest.raises(type(error)):
    run(with_retries(attempt, retries=3, what="episode t/1", on_loss=lambda k, e: pytest.fail("counted as lost")))
  assert seen == [0]


class _DeadService:
  """An inference client whose server is gone: its transport error is of the kind a lost sandbox
  raises too (httpx.ConnectError is `protocol.is_retryable`)."""
  version = 3

  def __init__(self):
    self.released = []

  async def generate(self, ids, images, session=None):
    raise httpx.ConnectError("connection refused")

  def release(self, session):
    self.released.append(session)


def test_policy_agent_names_the_inference_service_so_its_transport_error_is_not_replayed():
  assert P.is_retryable(httpx.ConnectError("refused"))  # what it would be taken for without the agent
  service = _DeadService()
  agent = PolicyAgent(service, ByteTokenizer())
  view = TurnView(turn=2, ep=Episode(task="miniwob/click-test", seed=7, instruction="", prefix_ids=[]),
                  prompt_ids=[1, 2, 3], images=[np.zeros((4, 4, 3), np.uint8)], info={}, client=None, sid="s")
  seen = []

  async def attempt(k):
    seen.append(k)
    return await agent.reply(view)

  with pytest.raises(InferenceUnavailable,
                     match=r"_DeadService\) at \? unreachable or silent on miniwob/click-test seed 7 turn 2: ConnectError") as e:
    run(with_retries(attempt, retries=2, what="episode"))
  assert seen == [0] and isinstance(e.value.__cause__, httpx.ConnectError)
  agent.close()
  assert service.released == [agent.session]
