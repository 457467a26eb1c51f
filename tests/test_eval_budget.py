"""Step-budget scaling of experiments/eval.py (`--max_turns 2,4,8,16`; UI-TARS-2 report section 3):
each budget plays the same held-out seeds through the agent loop with at most that many turns.

Reference: the scripted experts (tars_jax/data/sources/experts.py, played by `data.demos.play`, a code path of
its own) solve a task in a known number of turns (login-user 5, click-test 1). Their replies replayed
through eval's budget plumbing (`play_budgets`, real sandbox) must succeed exactly at the budgets that
reach the expert's turn count and be cut at the budget below it. The CLI (run as a command: it
defines --run, as experiments/plot.py does) is run on the untrained policy of a smoke run: every
episode within its budget, the several-budget JSON / table / plot, and the one-budget JSON in the
format eval.py always wrote.
"""

import asyncio
import json
import os
import re
import subprocess
import sys

import ml_collections as mlc
import numpy as np
import pytest

from envs_bridge.client import SandboxClient
from envs_bridge.launch import env_fleet
from experiments.configs import miniwob_ppo
from tars_jax.data.sources import demos
from tars_jax.data.sources import experts as E
from tars_jax.rollout import step_budget as SB
from tars_jax.rollout.episode import LoopConfig
from tars_jax.rollout.evaluation import summarize
from tars_jax.train.state import build
from tests.test_demos import demo_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUMMARY_KEYS = {"success", "episodes", "mean_reward", "mean_steps", "invalid_rate", "lost", "think_tokens"}


def run_eval_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "experiments.eval", *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout)


def test_budgets_are_validated_and_each_gets_its_own_loop_config(tmp_path):
  for bad in (["2", "0"], ["-3"], ["x"], ["2.5"], ["4", "4"]):  # each message names the offending value
    with pytest.raises(ValueError, match=re.escape(repr(bad[-1]))):
      SB.parse_budgets(bad)
  with pytest.raises(ValueError, match="0"):
    SB.budget_loop_cfgs(LoopConfig(), [2, 0])
  assert SB.parse_budgets(["16", " 2", "4"]) == [16, 2, 4] and SB.parse_budgets([]) is None
  base = LoopConfig(max_turns=2, system="sys", n_img_tokens=12)
  cfgs = SB.budget_loop_cfgs(base, [1, 16])
  assert (base.max_turns, base.system) == (2, "sys")  # the run's loop config is not touched
  assert {b: (c.max_turns, c.system, c.n_img_tokens, c.image_hw) for b, c in cfgs.items()} == \
      {1: (1, "sys", 12, base.image_hw), 16: (16, "sys", 12, base.image_hw)}

  s = {2: {"miniwob/a": {"success": 0.25, "mean_steps": 1.5}},
       8: {"miniwob/a": {"success": 0.75, "mean_steps": 3.25}, "miniwob/b": {"success": 1.0, "mean_steps": 1.0}}}
  lines = SB.format_budget_table(s).splitlines()
  assert "max_turns=2" in lines[1] and lines[1].index("max_turns=2") < lines[1].index("max_turns=8")
  row_a, = [x for x in lines if x.startswith("miniwob/a")]
  row_b, = [x for x in lines if x.startswith("miniwob/b")]
  assert row_a.split()[1:] == ["0.250", "(1.50)", "0.750", "(3.25)"]
  assert row_b.split()[1:] == ["-", "1.000", "(1.00)"]  # no result at budget 2
  assert SB.budgets_json(7, s) == {"checkpoint": 7, "budgets": {"2": s[2], "8": s[8]}}
  png = SB.plot_budgets(s, str(tmp_path / "b.png"))
  with open(png, "rb") as f:
    head = f.read(24)
  assert head[:8] == b"\x89PNG\r\n\x1a\n"
  assert int.from_bytes(head[16:20], "big") == 600 and int.from_bytes(head[20:24], "big") == 400
  # the CLI refuses a bad budget before loading anything, naming it
  p = run_eval_cli("--run", str(tmp_path / "none"), "--max_turns", "2,0")
  assert p.returncode != 0 and "'0'" in p.stderr and "max_turns" in p.stderr


# (task, seed): seeds of the experts' own test (tests/test_demos.py) and the held-out range.
JOBS = [("miniwob/login-user", 2_000_000), ("miniwob/login-user", 10_000_001), ("miniwob/click-test", 10_000_000)]
BUDGETS = [1, 4, 5, 8]


@pytest.mark.browser
def test_expert_replies_through_the_budget_loop_succeed_exactly_from_the_experts_turn_count(server, tmp_path):
  spec = demos.DemoSpec.from_parts(build(demo_config()))

  async def expert_episodes():
    async with SandboxClient(server.url) as c:
      return [await demos.play(c, task, seed, spec, E.expert_for(task)) for task, seed in JOBS]
  played = asyncio.new_event_loop().run_until_complete(expert_episodes())
  need = []  # the reference: turns the expert needs on each job
  for (ep, stopped), (task, _) in zip(played, JOBS):
    assert stopped is None and ep.success, (task, stopped)
    need.append(len(ep.turns))
  assert need == [5, 5, 1]  # precondition: a multi-step task below some budgets, a one-step task
  texts = [[t.text for t in ep.turns] for ep, _ in played]
  prefixes = [list(ep.prefix_ids) for ep, _ in played]
  tok, first_turns = spec.tokenizer, []

  def act_for(budget):
    # sessions=1: one episode at a time in job order; a first turn (one screenshot) starts the next job
    job = [-1]

    def act(prompts, images):
      assert len(prompts) == 1
      if len(images[0]) == 1:
        job[0] += 1
        first_turns.append(budget)
      k = job[0]
      assert prompts[0][:len(prefixes[k])] == prefixes[k], "prompt of another episode"
      ids = tok.encode(texts[k][len(images[0]) - 1]) + [tok.eos_id]
      return [(ids, np.zeros(len(ids), np.float32), np.full(len(ids), -1, np.int32))]
    return act

  env = mlc.ConfigDict(dict(servers=(server.url,), step_ms=1000, lease_s=60.0))
  with env_fleet(env) as (loop, clients):
    out = SB.play_budgets(loop, act_for, clients, JOBS, spec.loop, tok, BUDGETS, sessions=1, version=0)
  r = {"first_turns": len(first_turns), "base_max_turns": spec.loop.max_turns,
       "budgets": {str(b): [[e.task, e.seed, len(e.turns), bool(e.success), bool(e.truncated), bool(e.lost)]
                            for e in eps] for b, eps in out.items()},
       "summaries": {str(b): summarize(eps) for b, eps in out.items()}}

  assert list(r["budgets"]) == [str(b) for b in BUDGETS]
  assert r["first_turns"] == len(JOBS) * len(BUDGETS)  # every job played once per budget
  assert r["base_max_turns"] == 8
  for b in BUDGETS:
    eps = r["budgets"][str(b)]
    assert [(task, seed) for task, seed, *_ in eps] == JOBS  # the same seeds at every budget
    for (task, seed, turns, success, truncated, lost), n in zip(eps, need):
      assert not lost
      assert turns == min(b, n), (task, seed, b)  # cut at the budget, or done when the expert is
      assert success == (b >= n), (task, seed, b)  # success exactly from the expert's turn count on
      assert truncated == (b < n), (task, seed, b)
    s = r["summaries"][str(b)]
    assert s["miniwob/login-user"]["success"] == (1.0 if b >= 5 else 0.0)
    assert s["miniwob/login-user"]["mean_steps"] == min(b, 5)
    assert s["miniwob/click-test"]["success"] == 1.0 and s["miniwob/click-test"]["mean_steps"] == 1


@pytest.mark.slow  # ~4 min on 2 busy cores: three CLI runs, each compiling the smoke policy
@pytest.mark.browser
def test_cli_on_an_untrained_policy_several_budgets_and_the_one_budget_format(server, tmp_path):
  run = tmp_path / "run"
  os.makedirs(run)
  cfg = miniwob_ppo.get_config("smoke")  # env.max_turns = 2
  (run / "config.json").write_text(cfg.to_json_best_effort(indent=2))
  common = ["--run", str(run), "--checkpoint", "0", "--episodes", "2", "--sessions", "2", "--servers", server.url]

  p = run_eval_cli(*common, "--max_turns", "1,3", "--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png"),
                   "--trajectories", str(tmp_path / "eps"))
  assert p.returncode == 0, p.stderr[-3000:]
  out = json.loads((tmp_path / "b.json").read_text())
  for b, s in out["budgets"].items():  # the saved episodes are the scored ones: their turns give mean_steps
    for task, r in s.items():
      saved = _saved(tmp_path / "eps" / f"turns_{b}" / task)
      assert len(saved) == r["episodes"] and [e["seed"] for e in saved] == sorted(e["seed"] for e in saved)
      assert np.mean([len(e["turns"]) for e in saved]) == pytest.approx(r["mean_steps"])
      assert np.mean([e["success"] for e in saved]) == pytest.approx(r["success"])
  assert set(out) == {"checkpoint", "budgets"} and out["checkpoint"] == 0
  assert list(out["budgets"]) == ["1", "3"]
  for b, s in out["budgets"].items():
    assert set(s) == set(cfg.tasks)
    for task, r in s.items():
      assert SUMMARY_KEYS <= set(r) and r["episodes"] + r["lost"] == 2
      assert 1 <= r["mean_steps"] <= int(b), (b, task, r)
  assert all(r["mean_steps"] == 1 for r in out["budgets"]["1"].values())
  assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert "max_turns=1" in p.stdout and "max_turns=3" in p.stdout
  assert all(any(line.startswith(t) for line in p.stdout.splitlines()) for t in cfg.tasks)

  for extra, name in (([], "default.json"), (["--max_turns", "2", "--trajectories", str(tmp_path / "one")], "one.json")):
    p = run_eval_cli(*common, *extra, "--json", str(tmp_path / name))
    assert p.returncode == 0, p.stderr[-3000:]
    one = json.loads((tmp_path / name).read_text())
    # the format eval.py always wrote: {"checkpoint", "results", **results}
    assert set(one) == {"checkpoint", "results", *cfg.tasks} and one["checkpoint"] == 0
    for task in cfg.tasks:
      assert one[task] == one["results"][task] and set(one[task]) == SUMMARY_KEYS
      assert one[task]["episodes"] + one[task]["lost"] == 2 and 1 <= one[task]["mean_steps"] <= 2
      assert one[task]["think_tokens"] >= 0  # the thoughts the grammar lets the policy write
  for task in cfg.tasks:
    saved = _saved(tmp_path / "one" / task)
    assert len(saved) == one[task]["episodes"]
    assert np.mean([len(e["turns"]) for e in saved]) == pytest.approx(one[task]["mean_steps"])


def _saved(task_dir) -> list[dict]:
  """The episode.json of each ep_<k> under a task's folder, k in order; each turn's screenshot exists."""
  eps = []
  for k in range(len(os.listdir(task_dir))):
    e = json.loads((task_dir / f"ep_{k}" / "episode.json").read_text())
    assert all((task_dir / f"ep_{k}" / t["screenshot"]).stat().st_size > 0 for t in e["turns"])
    eps.append(e)
  return eps
