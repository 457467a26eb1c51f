"""Vertical agents (issue #26 items 2 and 4): routing episodes over a fleet of browser and desktop
servers, GUI-Browsing demonstrations through the experts' collection path, the held-out data mode of
evaluation, and the merge evaluation's arithmetic against hand-computed values."""

import asyncio
import math

import jax
import numpy as np
import pytest

from envs_bridge import protocol as P
from envs_bridge.browser import browse_tasks as bt
from envs_bridge.client import SandboxClient, client_for
from envs_bridge.launch import sandbox_fleet
from experiments.configs import verticals
from tars_jax.agent.grammar import accepts
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.analysis import merge_eval as ME
from tars_jax.data import records
from tars_jax.data.sources import demos
from tars_jax.rollout.agent_loop import run_episodes
from tars_jax.rollout.episode import LoopConfig
from tars_jax.train import state as state_lib

TOK = ByteTokenizer()


def _act(text):
  def act(prompts, images):
    r = TOK.encode(text) + [TOK.eos_id]
    return [(r, np.zeros(len(r), np.float32), np.zeros(len(r), np.int32)) for _ in prompts]
  return act


# -- routing ------------------------------------------------------------------------------------------
def test_client_for_sends_each_task_to_a_server_that_serves_it_round_robin():
  async def go():
    a = SandboxClient("http://127.0.0.1:1", serves=frozenset({"miniwob/click-test", "games/maze"}))
    b = SandboxClient("http://127.0.0.1:2", serves=frozenset({"desktop/terminal-mkdir"}))
    c = SandboxClient("http://127.0.0.1:3", serves=frozenset({"miniwob/click-test"}))
    any_ = SandboxClient("http://127.0.0.1:4")  # serves unknown: takes anything
    try:
      assert [client_for([a, b, c], "miniwob/click-test", k) for k in range(4)] == [a, c, a, c]
      assert [client_for([a, b, c], "desktop/terminal-mkdir", k) for k in range(3)] == [b, b, b]
      assert client_for([a, b, c], "games/maze", 5) is a
      assert [client_for([b, any_], "miniwob/click-test", k) for k in range(2)] == [any_, any_]
      with pytest.raises(P.UnknownTask) as e:
        client_for([a, b], "browse/multi-hop", 0)
      assert e.value.extra["tasks"] == ["desktop/terminal-mkdir", "games/maze", "miniwob/click-test"]
    finally:
      for x in (a, b, c, any_):
        await x.aclose()
  asyncio.run(go())


@pytest.mark.browser
def test_a_fleet_of_browser_and_desktop_servers_plays_each_task_on_its_own_server():
  """The trainer's rollout path (`run_episodes`) over a launched browser + desktop fleet: a MiniWoB++
  task opens on the browser server (160 x 210 screenshot), a desktop task on the desktop server (640 x
  480 X screenshot), and one rollout mixing them ends every episode through its own sandbox."""
  with sandbox_fleet([], step_ms=1000, lease_s=60.0, launch=("browser", "desktop"), desktop_sessions=2,
                     desktop_step_ms=250) as (loop, clients):
    assert len(clients) == 2
    browser, desktop = clients
    assert "miniwob/click-test" in browser.serves and "desktop/terminal-mkdir" not in browser.serves
    assert "desktop/terminal-mkdir" in desktop.serves and "miniwob/click-test" not in desktop.serves
    seen = {}

    async def opened(task):  # the first screenshot of each task, through the routed client
      sid, obs = await client_for(clients, task, 0).open(task, 0)
      seen[task] = obs.image().shape
      await client_for(clients, task, 0).close(sid)
    for t in ("miniwob/click-test", "desktop/terminal-mkdir"):
      loop.run_until_complete(opened(t))
    assert seen == {"miniwob/click-test": (210, 160, 3), "desktop/terminal-mkdir": (480, 640, 3)}
    eps = loop.run_until_complete(run_episodes(
        _act("Thought: \nAction: finished(content='')"), clients,
        [("miniwob/click-test", 0), ("desktop/terminal-mkdir", 0), ("miniwob/click-test", 1)],
        LoopConfig(max_turns=1, image_hw=(224, 168), n_img_tokens=48), TOK))
  assert [e.task for e in eps] == ["miniwob/click-test", "desktop/terminal-mkdir", "miniwob/click-test"]
  assert not any(e.lost for e in eps)
  # finished() without doing the task: every sandbox ends the episode and pays nothing
  assert [(e.turns[-1].done, e.env_return) for e in eps] == [(True, 0.0)] * 3


# -- GUI-Browsing demonstrations and held-out questions -------------------------------------------------
@pytest.mark.browser
def test_browse_demonstrations_follow_the_question_plan_and_fit_the_verticals_grammar(server, tmp_path):
  """The browse expert plays through `demos.collect` (the path of experiments/demos.py): its episodes
  succeed by the sandbox's own answer check, end with the answer of the question the seed asks, and every
  reply is in the verticals' grammar (the episode would have raised ReplyNotInGrammar otherwise)."""
  config = verticals.get_config("sft+smoke")
  config.data.demo_max_turns = 40  # multi-hop (not in the verticals at this scale) takes 10-40 turns
  parts = state_lib.build(config)
  spec = demos.DemoSpec.from_parts(parts)
  browse = ("browse/multi-hop", "browse/find-page")
  jobs = [(t, s) for t in browse for s in (0, 1)]

  async def go():
    async with SandboxClient(server.url) as c:
      with demos.open_writer(str(tmp_path), spec) as w:
        return await demos.collect([c], jobs, spec, w, progress=False)
  stats = asyncio.run(go())
  for t in browse:
    assert (stats[t].episodes, stats[t].successes, stats[t].expert_errors) == (2, 2, 0), t
  eps = sorted(records.read_episodes(str(tmp_path)), key=lambda p: (p[0].task, p[0].seed))
  assert [(e.task, e.seed) for e, _ in eps] == sorted(jobs)
  for ep, prov in eps:
    q = bt.question(ep.task, ep.seed, "train")
    assert ep.instruction == q.question and prov["source"] == "expert"
    assert ep.turns[-1].text.endswith(f"finished(content='{q.answer}')") and ep.turns[-1].env_reward > 0
    assert all(accepts(parts.grammar, t.text, TOK) for t in ep.turns)


@pytest.mark.browser
def test_evaluation_data_mode_asks_the_held_out_questions(server):
  """`env.eval_data_mode = 'test'` (the verticals' configs): evaluation opens the held-out split, so the
  same seed asks another question than in training."""
  config = verticals.get_config("browsing+smoke")
  parts = state_lib.build(config)
  assert (parts.loop_cfg.data_mode, parts.eval_loop_cfg.data_mode) == ("train", "test")

  async def go():
    async with SandboxClient(server.url) as c:
      return await asyncio.gather(*[
          run_episodes(_act("Thought: \nAction: finished(content='x')"), [c], [("browse/multi-hop", 3)], cfg, TOK)
          for cfg in (parts.loop_cfg, parts.eval_loop_cfg)])
  (train_ep,), (test_ep,) = asyncio.run(go())
  assert train_ep.instruction == bt.question("browse/multi-hop", 3, "train").question
  assert test_ep.instruction == bt.question("browse/multi-hop", 3, "test").question
  assert train_ep.instruction != test_ep.instruction


# -- merge evaluation arithmetic -------------------------------------------------------------------------
def test_alpha_candidates_are_the_interior_simplex_grid_uniform_first():
  assert ME.alpha_candidates(3, 0.25) == [(1 / 3, 1 / 3, 1 / 3), (0.25, 0.25, 0.5), (0.25, 0.5, 0.25),
                                          (0.5, 0.25, 0.25)]
  assert ME.alpha_candidates(2, 0.25) == [(0.5, 0.5), (0.25, 0.75), (0.75, 0.25)]
  with pytest.raises(ValueError):
    ME.alpha_candidates(3, 0.5)  # a 1/2 grid has no interior point for 3 verticals
  with pytest.raises(ValueError):
    ME.alpha_candidates(2, 0.3)


def test_set_scores_average_success_and_normalised_game_scores():
  summaries = {"miniwob/click-test": {"success": 0.9}, "desktop/terminal-mkdir": {"success": 0.2},
               "games/maze": {"success": 0.0, "normalized_score": 40.0},
               "games/snake": {"success": 1.0, "normalized_score": 110.0}}
  assert ME.set_score(("miniwob/click-test", "desktop/terminal-mkdir"), summaries) == pytest.approx(0.55)
  assert ME.set_score(("games/maze", "games/snake"), summaries) == pytest.approx(0.75)
  with pytest.raises(KeyError, match="browse/multi-hop"):
    ME.set_score(("browse/multi-hop",), summaries)
  assert [ME.episodes_per_task(60, n) for n in (2, 15, 13, 100)] == [30, 4, 5, 1]
  with pytest.raises(ValueError):
    ME.episodes_per_task(10, 0)
  table = ME.format_table({"sft": {"a": 0.5, "b": 0.25}, "merged": {"a": 1.0, "b": 0.0}}, ["a", "b"])
  assert table.splitlines() == ["| model | a | b | mean |", "|---|---|---|---|",
                                "| sft | 0.500 | 0.250 | 0.375 |", "| merged | 1.000 | 0.000 | 0.500 |"]


def _wilson(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
  # Wilson's score interval written out (Wilson 1927; Agresti & Coull 1998, eq. 2): the reference.
  p = k / n
  centre = (p + z * z / (2 * n)) / (1 + z * z / n)
  half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
  return centre - half, centre + half


def test_set_interval_is_wilsons_over_the_sets_pooled_episodes():
  summaries = {"miniwob/click-test": {"success": 0.7, "episodes": 50},
               "miniwob/click-test-2": {"success": 0.46, "episodes": 50},
               "miniwob/focus-text": {"success": 1.0, "episodes": 7},
               "miniwob/focus-text-2": {"success": 0.0, "episodes": 0},
               "games/maze": {"success": 0.0, "normalized_score": 40.0, "episodes": 10}}
  lo, hi = ME.set_interval(("miniwob/click-test", "miniwob/click-test-2"), summaries)
  assert (lo, hi) == pytest.approx(_wilson(58, 100), abs=1e-9)
  assert 0.47 < lo < 0.49 and 0.67 < hi < 0.68  # the 0.58 [0.48, 0.67] of 58 / 100
  assert ME.set_interval(("miniwob/focus-text",), summaries) == pytest.approx(_wilson(7, 7), abs=1e-9)
  assert ME.set_interval(("miniwob/focus-text-2",), summaries) is None  # no episodes
  assert ME.set_interval(("miniwob/click-test", "games/maze"), summaries) is None  # a score, not a rate
  with pytest.raises(KeyError, match="browse/multi-hop"):
    ME.set_interval(("browse/multi-hop",), summaries)
  table = ME.format_table({"sft": {"a": 0.58, "b": 0.25}}, ["a", "b"], {"sft": {"a": (0.4812, 0.6712), "b": None}})
  assert table.splitlines()[2] == "| sft | 0.580 [0.48, 0.67] | 0.250 | 0.415 |"


def test_difference_interval_is_newcombes_hybrid_score_interval():
  """Newcombe 1998 (Statistics in Medicine 17, 873-890), Table II, method 10: published intervals of three
  of its examples, and the interval written out from the two Wilson intervals."""
  for a, b, want in (((56, 70), (48, 80), (0.0524, 0.3339)), ((9, 10), (3, 10), (0.1705, 0.8090)),
                     ((10, 10), (0, 10), (0.6075, 1.0))):
    d, lo, hi = ME.difference_interval(a, b)
    assert d == pytest.approx(a[0] / a[1] - b[0] / b[1]) and (lo, hi) == pytest.approx(want, abs=6e-5)
  (l1, u1), (l2, u2), p1, p2 = _wilson(58, 100), _wilson(42, 100), 0.58, 0.42
  want = (p1 - p2 - math.hypot(p1 - l1, u2 - p2), p1 - p2 + math.hypot(u1 - p1, p2 - l2))
  assert ME.difference_interval((58, 100), (42, 100))[1:] == pytest.approx(want, abs=1e-9)
  for bad in ((0, 0), (11, 10), (-1, 10)):
    with pytest.raises(ValueError, match="episodes"):
      ME.difference_interval(bad, (3, 10))


def _merge_table(rates: dict, episodes: int = 50) -> dict:
  """A merge_eval.json of two sets of two tasks each: {model: {task: success}}."""
  sets = {"click": ["miniwob/click-test", "miniwob/click-test-2"], "focus": ["miniwob/focus-text", "miniwob/focus-text-2"]}
  return {"sets": sets, "tasks": {m: {t: {"success": r, "episodes": episodes} for t, r in tr.items()}
                                  for m, tr in rates.items()}}


def _seed(sft: float, click: float, focus: float, merged: float) -> dict:
  both = lambda x: {t: x for t in ("miniwob/click-test", "miniwob/click-test-2", "miniwob/focus-text",  # noqa: E731
                                   "miniwob/focus-text-2")}
  return _merge_table({"sft": both(sft), "click": both(click), "focus": both(focus), "merged_uniform": both(merged)})


def test_pooled_counts_sum_training_seeds_and_sets_and_refuse_what_does_not_pool():
  s1, s2 = _seed(0.4, 0.6, 0.3, 0.5), _seed(0.2, 0.4, 0.1, 0.3)
  s2["tasks"]["sft"]["miniwob/focus-text"]["success"] = 0.1  # focus set of seed 2: (5 + 10) / 100
  assert ME.pooled_counts([s1, s2], "sft", "click") == (20 + 20 + 10 + 10, 200)
  assert ME.pooled_counts([s1, s2], "sft", "focus") == (20 + 20 + 5 + 10, 200)
  assert ME.pooled_counts([s1, s2], "sft", ME.ALL) == (60 + 55, 400)
  with pytest.raises(KeyError, match="task_arithmetic"):
    ME.pooled_counts([s1], "task_arithmetic", "click")
  with pytest.raises(KeyError, match="checkboxes"):
    ME.pooled_counts([s1], "sft", "checkboxes")
  s3 = _seed(0.4, 0.6, 0.3, 0.5)
  s3["sets"] = {"click": ["miniwob/click-test"]}
  with pytest.raises(ValueError, match="b.json"):
    ME.check_same_sets([s1, s3], ["a.json", "b.json"])
  with pytest.raises(ValueError, match="no merge tables"):
    ME.seeds_table([], [])
  game = {"sets": {"game": ["games/maze"]}, "tasks": {"sft": {"games/maze": {"success": 0.0, "episodes": 5}}}}
  with pytest.raises(ValueError, match="games"):
    ME.pooled_counts([game], "sft", "game")
  assert ME.comparisons(["click", "focus"], ["sft", "click", "focus", "merged_uniform"]) == [
      ("click", "sft", "click", "the vertical improves on its own set"),
      ("focus", "sft", "focus", "the vertical improves on its own set"),
      ("merged_uniform", "sft", "click", "the uniform merge improves on the start"),
      ("merged_uniform", "sft", "focus", "the uniform merge improves on the start"),
      ("merged_uniform", "sft", "all", "the uniform merge improves on the start"),
      ("merged_uniform", "click", "click", "the uniform merge keeps the vertical's skill"),
      ("merged_uniform", "focus", "focus", "the uniform merge keeps the vertical's skill")]


def test_merge_stats_pools_two_training_seeds_into_one_table_with_intervals(tmp_path):
  """experiments/merge_stats.py on two seeds' merge tables: pooled rates are the means over seeds, each
  comparison's difference and interval are difference_interval's of the pooled counts; a file given twice
  is refused."""
  import json
  import subprocess
  import sys
  paths = [tmp_path / "seed1.json", tmp_path / "seed2.json"]
  for p, t in zip(paths, (_seed(0.4, 0.6, 0.3, 0.5), _seed(0.2, 0.4, 0.1, 0.3))):
    p.write_text(json.dumps(t))
  out = tmp_path / "stats.json"
  r = subprocess.run([sys.executable, "-m", "experiments.merge_stats", *map(str, paths), "--json", str(out)],
                     capture_output=True, text=True)
  assert r.returncode == 0, r.stderr[-2000:]
  got = json.loads(out.read_text())
  assert got["table"]["click"]["click"]["rate"] == pytest.approx(0.5)
  assert got["table"]["click"]["click"]["per_seed"] == pytest.approx([0.6, 0.4])
  assert got["table"]["sft"]["all"]["ci"] == pytest.approx(list(_wilson(120, 400)), abs=1e-9)
  row = next(c for c in got["comparisons"] if c["a"] == "click" and c["b"] == "sft")
  assert row["difference"] == pytest.approx(0.2) and row["per_seed"] == pytest.approx([0.2, 0.2])
  assert row["ci"] == pytest.approx(list(ME.difference_interval((100, 200), (60, 200))[1:]))
  assert "| click - sft | click | **+0.200" in r.stdout  # the interval excludes 0: marked
  r = subprocess.run([sys.executable, "-m", "experiments.merge_stats", str(paths[0]), str(paths[0])],
                     capture_output=True, text=True)
  assert r.returncode != 0 and "twice" in r.stderr


def test_vertical_configs_share_what_merging_and_cross_evaluation_need():
  """One model, grammar, prompt and image size across the stages (merge needs one parameter structure,
  and every model plays every set); each vertical trains on its own set; only sets with desktop tasks
  launch a desktop server; every GUI-Browsing answer fits the grammar's content bytes."""
  cfgs = {a: verticals.get_config(a) for a in verticals.STAGES}
  base = cfgs["sft"]
  for a, c in cfgs.items():
    assert c.model.to_dict() == base.model.to_dict() and c.grammar.to_dict() == base.grammar.to_dict(), a
  for v, tasks in verticals.VERTICALS.items():
    assert tuple(cfgs[v].tasks) == tasks
  for c in cfgs.values():  # every stage records the experiment's sets and their step budgets (merge_eval.py)
    assert {v: tuple(x.tasks) for v, x in c.verticals.items()} == verticals.VERTICALS
    assert {v: x.max_turns for v, x in c.verticals.items()} == verticals.MAX_TURNS
  assert set(cfgs["all"].tasks) == set(verticals.ALL_TASKS) == set(cfgs["sft"].tasks)
  assert len(verticals.GAME) == 13 and len(verticals.GENERAL) == 20
  assert cfgs["general"].env.launch == ("browser", "desktop") and cfgs["game"].env.launch == ("browser",)
  assert cfgs["all"].env.launch == ("browser", "desktop")
  suite = bt.prepare()
  longest = max(len(q.answer.encode()) for fam in ("multi-hop", "multi-condition") for split in ("train", "test")
                for q in suite.split(fam, split))
  assert longest <= base.grammar.max_content_bytes
  # every task has an expert: the shared SFT data holds desktop demonstrations (GUI-General) too
  assert tuple(cfgs["sft"].data.demo_tasks) == tuple(cfgs["sft"].tasks)
  assert {*verticals.DESKTOP, *verticals.HYBRID} <= set(cfgs["general"].data.demo_tasks)
  assert dict(cfgs["general"].data.demo_seeds_by_task) == {t: 128 for t in (*verticals.DESKTOP, *verticals.HYBRID)}
  assert not any(t in verticals.DESKTOP for t in verticals.get_config("sft+smoke").data.demo_tasks)  # smoke: cheap
  # every action the experts write: the games' reference players click, drag and press keys; the hybrid
  # experts call the terminal, the files and MCP
  assert {"click", "drag", "type", "hotkey", "finished", "run_command", "write_file", "mcp_call"} <= set(base.grammar.actions)


def test_miniwob_verticals_are_the_multi_turn_suites_ppo_on_three_disjoint_sets():
  """verticals_miniwob.py: each vertical is the multi-turn suite's `ppo` stage (model, grammar, PPO, budget)
  with only its own tasks; the sets are disjoint, "all" plays every set, and every stage records the sets
  for merge_eval.py."""
  from experiments.configs import replication_multiturn, verticals_miniwob as vm
  sets = vm.VERTICALS
  tasks = [t for ts in sets.values() for t in ts]
  assert len(tasks) == len(set(tasks)) == 6
  for smoke in ("", "+smoke"):
    base = replication_multiturn.get_config("ppo" + smoke).to_dict()
    want = vm.SMOKE_VERTICALS if smoke else sets
    for stage in vm.STAGES:
      c = vm.get_config(stage + smoke)
      assert {v: tuple(x.tasks) for v, x in c.verticals.items()} == want
      assert tuple(c.tasks) == (want[stage] if stage in want else tuple(t for ts in want.values() for t in ts))
      d = c.to_dict()
      assert {k for k in d if d[k] != base.get(k)} == {"tasks", "verticals"}, stage
  with pytest.raises(ValueError, match="unknown config arg"):
    vm.get_config("sft")  # no SFT stage: the verticals start from an existing SFT run (scripts/verticals.sh SFT=)


# -- end to end ---------------------------------------------------------------------------------------

@pytest.mark.slow  # CI's slow step (issue #40 item 1); 406 s in .ci/run here: demos of 3 sets, SFT, 3 PPO runs, merges, evaluations
@pytest.mark.browser
def test_verticals_script_end_to_end_at_smoke_size(tmp_path):
  """`scripts/verticals.sh` (MOD=smoke, from a fresh init): the shared SFT stage, a PPO run of each
  vertical from it, the merges (uniform, α searched on validation seeds, task arithmetic with λ searched)
  and every model on every set, with each vertical's run starting from the shared SFT checkpoint."""
  import json
  import os
  import subprocess
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  run = tmp_path / "v"
  env = dict(os.environ, RUN=str(run), MOD="smoke", INIT="", EPISODES="3", VAL_EPISODES="1")
  p = subprocess.run(["bash", "scripts/verticals.sh"], cwd=root, env=env, capture_output=True, text=True, timeout=1700)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  out = json.load(open(run / "merge_eval.json"))
  sets = list(verticals.SMOKE_VERTICALS)
  models = {"sft", *sets, "merged_uniform", "merged_searched", "task_arithmetic"}
  assert set(out["scores"]) == models
  assert all(set(out["scores"][m]) == set(sets) and all(0.0 <= v <= 1.0 for v in out["scores"][m].values())
             for m in models)
  assert len(out["search"]) == len(ME.alpha_candidates(3, 0.25)) and out["search"][0]["alpha"] == [1 / 3] * 3
  assert [r["lambda"] for r in out["ta_search"]] == [0.5, 1.0] and out["ta_lambda"] in (0.5, 1.0)
  # every episode of the evaluation was played at the smoke budget (3 turns), none lost
  for m in models:
    for task, summary in out["tasks"][m].items():
      assert summary["lost"] == 0 and summary["mean_steps"] <= 3, (m, task, summary)
  for v in sets:  # each vertical's PPO started from the shared SFT policy
    assert json.load(open(run / v / "config.json"))["policy"]["init"] == str(run / "sft")
  assert out["alpha"] == max(out["search"], key=lambda r: r["mean"])["alpha"]
  for m in models:  # each set's score is the mean of its tasks' scores in the same JSON
    for s, x in verticals.get_config("all+smoke").verticals.items():
      assert out["scores"][m][s] == pytest.approx(ME.set_score(tuple(x.tasks), out["tasks"][m]))
      # and its interval is set_interval's of the same summaries (None for the game set)
      ci = ME.set_interval(tuple(x.tasks), out["tasks"][m])
      assert (s == "game") == (ci is None) and out["intervals"][m][s] == (ci and pytest.approx(list(ci)))
  # every α candidate's checkpoint is the α-weighted average of the verticals' policies (numpy, float64)
  cfg = verticals.get_config("all+smoke")
  parts = state_lib.build(cfg)
  init = parts.init_state(cfg.seed)
  order = list(cfg.verticals)  # α's order: the verticals sorted by name (ml_collections), as merge_eval.json's sets
  assert order == sorted(sets) == list(out["sets"])
  pol = {v: state_lib.load_policy(init, str(run / v), parts.popt)[0]["policy"] for v in order}
  for i, r in enumerate(out["search"]):
    merged = state_lib.load_policy(init, str(run / "alpha_search" / str(i)), parts.popt)[0]["policy"]
    want = jax.tree.map(lambda *xs: sum(a * np.asarray(x, np.float64) for a, x in zip(r["alpha"], xs)),
                        *[pol[v] for v in order])
    for x, y in zip(jax.tree.leaves(merged), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(x, np.float64), y, rtol=1e-5, atol=1e-6)
  assert (run / "merge_eval.png").stat().st_size > 10_000


@pytest.mark.long  # ~11 min on the 2-core machine: a smoke replication start (SFT, value pretraining), 3 PPO runs, merges
@pytest.mark.browser
def test_verticals_script_runs_another_configs_verticals_from_an_existing_sft_run(tmp_path):
  """`scripts/verticals.sh` with CFG=verticals_miniwob.py, SFT= and CRITIC= (MOD=smoke): no demonstrations or
  SFT stage; the SFT run is linked as the shared start, each of the config's verticals trains from it and
  from the given critic, and merge_eval plays every model on the config's sets."""
  import json
  import os
  import subprocess
  from experiments.configs import verticals_miniwob as vm
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  rep, run = tmp_path / "rep", tmp_path / "v"
  env = dict(os.environ, MOD="smoke", RUN=str(rep), VARIANTS="ppo", SEEDS="0")
  p = subprocess.run(["bash", "scripts/replicate.sh", "--jobs", "1"], cwd=root, env=env, capture_output=True,
                     text=True, timeout=1200)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  env = dict(os.environ, MOD="smoke", RUN=str(run), SFT=str(rep / "sft" / "seed_0"), EPISODES="3", VAL_EPISODES="1",
             CRITIC=str(rep / "vpt" / "seed_0" / "critic"), CFG="experiments/configs/verticals_miniwob.py")
  p = subprocess.run(["bash", "scripts/verticals.sh"], cwd=root, env=env, capture_output=True, text=True, timeout=1700)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  assert os.path.realpath(run / "sft") == str((rep / "sft" / "seed_0").resolve()) and not (run / "demos").exists()
  out = json.load(open(run / "merge_eval.json"))
  assert out["sets"] == {v: list(ts) for v, ts in vm.SMOKE_VERTICALS.items()}
  assert set(out["scores"]) == {"sft", *vm.SMOKE_VERTICALS, "merged_uniform", "merged_searched", "task_arithmetic"}
  for v, tasks in vm.SMOKE_VERTICALS.items():
    cfg = json.load(open(run / v / "config.json"))
    assert tuple(cfg["tasks"]) == tasks and cfg["policy"]["init"] == str(run / "sft")
    assert cfg["critic"]["init"] == str((rep / "vpt" / "seed_0" / "critic").resolve())
