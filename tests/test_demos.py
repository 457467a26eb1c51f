"""Expert demonstrations through the real sandbox (tars_jax/data/sources/demos.py): the experts succeed on real
pages, a demonstration is exactly the Episode the agent loop builds when the policy writes the same
replies, only successful episodes are written, and the CLI measures and records."""

import asyncio
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from envs_bridge import protocol as P
from envs_bridge.client import SandboxClient
from experiments.configs import games as games_config
from experiments.configs import miniwob_ppo
from tars_jax.agent.grammar import accepts, walk
from tars_jax.agent.images import preprocess
from tars_jax.data.sources import demos
from tars_jax.data.sources import experts as E
from tars_jax.rollout.agent_loop import run_episodes
from tars_jax.train.state import build

pytestmark = pytest.mark.browser
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(coro):
  return asyncio.new_event_loop().run_until_complete(coro)


def demo_config():
  """The main config with what multi-step demos need: typing, thoughts, a step budget of 8."""
  c = miniwob_ppo.get_config("")
  c.env.max_turns = 8
  c.grammar.actions = ("click", "type")
  c.grammar.max_thought_bytes = E.MAX_THOUGHT_BYTES
  return c


@pytest.fixture(scope="module")
def spec():
  return demos.DemoSpec.from_parts(build(demo_config()))


def replay_act(texts, tok, grammar):
  """An `ActFn` for ONE episode that writes `texts` in turn (ids + EOS, logprobs 0, grammar states)."""
  it = iter(texts)

  def act(prompts, images):
    assert len(prompts) == 1
    ids = tok.encode(next(it)) + [tok.eos_id]
    return [(ids, np.zeros(len(ids), np.float32), walk(grammar, ids))]
  return act


def assert_same_episode(a, b):
  for f in ("task", "seed", "instruction", "prefix_ids", "truncated", "lost", "policy_version"):
    assert getattr(a, f) == getattr(b, f), f
  assert len(a.turns) == len(b.turns)
  for k, (s, t) in enumerate(zip(a.turns, b.turns)):
    for f in dataclasses.fields(s):
      x, y = getattr(s, f.name), getattr(t, f.name)
      if isinstance(x, np.ndarray):
        assert x.dtype == y.dtype and np.array_equal(x, y), (k, f.name)
      else:
        assert x == y, (k, f.name, x, y)


@pytest.mark.parametrize("task,seed,turns", [
    ("miniwob/click-test-2", 2_000_001, 1),  # TWO drawn over ONE's centre: the expert clicks beside it
    ("miniwob/login-user", 2_000_000, 5),  # click, type, click, type, click
    ("miniwob/click-checkboxes", 2_000_002, None),
    ("miniwob/search-engine", 2_000_003, 5),  # click, type, Search, page 2, its 2nd result (the 5th)
])
def test_a_demo_is_the_episode_the_agent_loop_builds_for_the_same_replies(server, spec, task, seed, turns):
  async def go():
    async with SandboxClient(server.url) as c:
      demo, stopped = await demos.play(c, task, seed, spec, E.expert_for(task))
      sid, obs = await c.open(task, seed)
      first = preprocess(obs.image(), spec.loop.image_hw)
      await c.close(sid)
      texts = [t.text for t in demo.turns]
      loop_ep, = await run_episodes(replay_act(texts, spec.tokenizer, spec.grammar), [c], [(task, seed)],
                                    spec.loop, spec.tokenizer)
      return demo, stopped, first, loop_ep
  demo, stopped, first, loop_ep = run(go())
  assert stopped is None and demo.success and not demo.truncated
  if turns is not None:
    assert len(demo.turns) == turns
  # the page's own verdict: MiniWoB rewards a success with a positive raw reward on the last step only
  assert [t.done for t in demo.turns] == [False] * (len(demo.turns) - 1) + [True]
  assert all(t.env_reward == 0 for t in demo.turns[:-1]) and demo.turns[-1].env_reward > 0
  assert demo.turns[-1].reward == demo.turns[-1].env_reward  # no shaping terms in this config's defaults
  tok = spec.tokenizer
  for t in demo.turns:
    assert accepts(spec.grammar, t.text) and t.error is None
    assert t.reply_ids == tok.encode(t.text) + [tok.eos_id]
    assert t.image.shape == (*spec.loop.image_hw, 3) and t.image.dtype == np.uint8
    thought = t.text.split("\n")[0][len("Thought: "):]
    assert 0 < len(thought.encode()) <= E.MAX_THOUGHT_BYTES
  assert np.array_equal(demo.turns[0].image, first)
  assert demo.prefix_ids[0] == tok.bos_id and demo.instruction in tok.decode(demo.prefix_ids)
  assert_same_episode(demo, loop_ep)


def test_collect_writes_only_successes_and_a_wrong_expert_writes_nothing(server, spec):
  def wrong(instruction, elements, turn):  # clicks the button the instruction does NOT name
    label = "TWO" if "ONE" in instruction else "ONE"
    b = next(e for e in elements if e["tag"] == "button" and e["text"] == label)
    return f"the button labelled {label}", E.click_on(elements, b)
  bad = {"miniwob/click-test-2": E.Expert("wrong/click-test-2", "elements", wrong)}
  jobs = [("miniwob/click-test-2", 2_000_000 + k) for k in range(4)]
  good_jobs = [("miniwob/login-user", 2_000_000)] + jobs  # 5 turns, played beside four 1-turn episodes

  async def go():
    async with SandboxClient(server.url) as c:
      w_bad, w_good = demos.MemoryWriter(), demos.MemoryWriter()
      s_bad = await demos.collect([c], jobs, spec, w_bad, concurrency=4, experts=bad, progress=False)
      s_good = await demos.collect([c], good_jobs, spec, w_good, concurrency=5, progress=False)
      return s_bad, w_bad, s_good, w_good
  s_bad, w_bad, s_good, w_good = run(go())
  st = s_bad["miniwob/click-test-2"]
  assert (st.episodes, st.successes, st.failures, st.lost, st.expert) == (4, 0, 4, 0, "wrong/click-test-2")
  assert w_bad.episodes == [] and w_bad.close() == {}
  assert s_good["miniwob/click-test-2"].success_rate == 1.0 and s_good["miniwob/login-user"].successes == 1
  assert w_good.close() == {"expert/miniwob/click-test-2": 4, "expert/miniwob/login-user": 1}
  for ep, prov in w_good.episodes:
    assert ep.success and prov == {"source": "expert", "policy_version": 0,
                                   "expert": f"scripted/{ep.task.split('/')[1]}"}
  # in job order although the first job ended last: one job list, one record file
  assert [(ep.task, ep.seed) for ep, _ in w_good.episodes] == good_jobs


def test_the_main_config_as_is_takes_demos_without_thoughts_only(server):
  parts = build(miniwob_ppo.get_config(""))  # click only, no thought bytes, 2 turns

  async def go():
    async with SandboxClient(server.url) as c:
      with pytest.raises(demos.ReplyNotInGrammar, match="not in the configured grammar"):
        await demos.play(c, "miniwob/click-test", 2_000_000, demos.DemoSpec.from_parts(parts),
                         E.expert_for("miniwob/click-test"))
      return await demos.play(c, "miniwob/click-test", 2_000_000, demos.DemoSpec.from_parts(parts, thoughts=False),
                              E.expert_for("miniwob/click-test"))
  ep, stopped = run(go())
  assert stopped is None and ep.success and ep.turns[0].text.startswith("Thought: \nAction: click(start_box='")


def test_game_reference_players_as_experts(server):
  c = games_config.get_config("lights-out")
  c.grammar.max_thought_bytes = E.MAX_THOUGHT_BYTES
  spec = demos.DemoSpec.from_parts(build(c))  # 8 turns: click, hotkey, finished

  async def go():
    async with SandboxClient(server.url) as cl:
      w = demos.MemoryWriter()
      stats = await demos.collect([cl], [("games/lights-out", 2_000_000 + k) for k in range(3)], spec, w,
                                  progress=False)
      sid, _ = await cl.open("miniwob/click-test", 0)
      with pytest.raises(P.InvalidAction, match="not a game"):
        await cl.game_state(sid)
      await cl.close(sid)
      return stats, w
  stats, w = run(go())
  assert stats["games/lights-out"].successes == 3 and len(w.episodes) == 3
  for ep, _ in w.episodes:
    assert ep.turns[-1].done and ep.turns[-1].env_reward > 0
    assert all(t.text.split("\n")[0].startswith("Thought: lights-out: ") for t in ep.turns)


@pytest.mark.slow
def test_cli_measures_the_experts_and_writes_experts_json(tmp_path):
  out = tmp_path / "demos"
  r = subprocess.run([sys.executable, "-m", "experiments.demos", "--config", "experiments/configs/miniwob_ppo.py",
                      "--thoughts=false", "--tasks", "miniwob/click-test,miniwob/click-test-2", "--seeds", "3",
                      "--concurrency", "4", "--out", str(out)],
                     cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "miniwob/click-test-2" in r.stdout
  res = json.load(open(out / "experts.json"))
  assert res["seeds"] == {"miniwob/click-test": 3, "miniwob/click-test-2": 3}  # per task: --seeds for all
  assert res["seed_offset"] == 2_000_000 and res["coord_format"] == "tens3"
  for t in ("miniwob/click-test", "miniwob/click-test-2"):
    assert res["tasks"][t]["success_rate"] == 1.0 and res["tasks"][t]["successes"] == 3


def test_demo_seeds_stay_below_the_evaluation_seeds():
  jobs_for = demos.jobs_for
  assert jobs_for(["a"], 2, 5, 100) == [("a", 5), ("a", 6)]
  with pytest.raises(ValueError, match="reach the evaluation seeds"):
    jobs_for(["a"], 100, 9_999_950, 10_000_000)


def test_seeds_per_task_from_the_config():
  """RL tasks get their own count, the others the default, `data.demo_seeds_by_task` overrides both;
  a task it names that is not demonstrated is an error (a typo would silently change nothing)."""
  got = demos.seeds_per_task(["a", "b", "c"], ("a", "b"), seeds=20, rl_seeds=1500, by_task=(("a", 500),))
  assert got == {"a": 500, "b": 1500, "c": 20}
  assert demos.seeds_per_task(["c"], ("a",), seeds=7, rl_seeds=9) == {"c": 7}
  with pytest.raises(ValueError, match="not among the demonstration tasks"):
    demos.seeds_per_task(["a"], (), seeds=1, rl_seeds=1, by_task=(("miniwob/typo", 5),))
