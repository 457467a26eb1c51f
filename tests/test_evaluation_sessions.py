"""`evaluation.play_sessions`: held-out episodes through an inference service, each episode one session
(multi-turn KV reuse), against real Chromium; beside the lockstep `evaluation.play` on the same jobs."""

import dataclasses

import numpy as np
import pytest

from envs_bridge.launch import env_fleet
from experiments.configs import miniwob_ppo
from tars_jax.rollout import evaluation
from tars_jax.train import state as state_lib


@pytest.mark.long  # ~90 s: the smoke policy compiled for the service and the lockstep sampler; real Chromium
@pytest.mark.browser
def test_play_sessions_reuses_each_episodes_context_and_plays_the_same_task_instances():
  cfg = miniwob_ppo.get_config("smoke")
  parts = state_lib.build(cfg)
  params = parts.init_state(0)["policy"]
  jobs = [("miniwob/enter-text", 10_000_000 + k) for k in range(4)] + [("miniwob/click-test", 10_000_000)]
  loop_cfg = dataclasses.replace(parts.loop_cfg, max_turns=3)
  with parts.inference_service(params, slots=2, seed=0, max_turns=3) as svc, env_fleet(cfg.env) as (loop, clients):
    got = evaluation.play_sessions(loop, svc, clients, jobs, loop_cfg, parts.tokenizer, sessions=2, version=5)
    stats = dataclasses.replace(svc.stats)
    pol = dataclasses.replace(parts.batched_policy(params, batch_size=2, seed=0), max_images=3)
    lock = evaluation.play(loop, pol.act, clients, jobs, loop_cfg, parts.tokenizer, sessions=2, version=5)
  assert [(e.task, e.seed) for e in got] == jobs and not any(e.lost for e in got)
  assert all(1 <= len(e.turns) <= 3 and e.policy_version == 5 for e in got)
  for a, b in zip(got, lock):  # the same task instances: instruction and first screenshot
    assert a.instruction == b.instruction
    np.testing.assert_array_equal(a.turns[0].image, b.turns[0].image)
  turns = sum(len(e.turns) for e in got)
  assert turns > len(jobs)  # some episodes went on after their first reply (random policy, 3 turns)
  # every later turn continued its episode's context: only its new tokens ran
  assert stats.reused == turns - len(jobs)
  assert stats.requests == turns
