"""The data flywheel (tars_jax/data/flywheel.py, experiments/flywheel.py; report section 2.3).

Fast tests on hand-made trajectories: validation (verifier, ORM through a stub scorer), routing (every
sample in exactly one set, lost ones in neither, counts per task), the records of an iteration
(provenance round trip, idempotent re-routing, accumulation over iterations, corrupt samples), the table
and the plot. Slow: one smoke flywheel iteration end to end against the real sandbox, and its re-run.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from array_record.python import array_record_module

from tars_jax.data import flywheel_cli as driver
from experiments import plot
from tars_jax.agent.prompts import ChatTemplate
from tars_jax.agent.trajectory import Episode, Turn
from tars_jax.data import flywheel as fw
from tars_jax.data import records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HW = (12, 16)
N_IMG = 4
META = records.DatasetMeta(image_hw=HW, n_img_tokens=N_IMG, tokenizer="byte", vocab_size=264)
TPL = ChatTemplate(n_img_tokens=N_IMG)


def episode(task: str, seed: int, rewards=(0.0,), done: bool = True, lost: bool = False, version: int = 0) -> Episode:
  """A hand-made episode: one turn per env reward, the last one `done`; lost = no turns, flagged."""
  if lost:
    return Episode(task=task, seed=seed, instruction="", prefix_ids=[], lost=True, policy_version=version)
  rng = np.random.default_rng(seed)
  turns = []
  for k, r in enumerate(rewards):
    text = f"Thought: \nAction: click(start_box='({seed % 100},{k})')"
    reply = TPL.reply(text)
    turns.append(Turn(image=rng.integers(0, 256, (*HW, 3), dtype=np.uint8), obs_ids=TPL.observation(after_reply=k > 0),
                      reply_ids=reply, logprobs=np.full(len(reply), -0.5, np.float32),
                      states=np.zeros(len(reply), np.int32), text=text, reward=float(r) - 0.1, env_reward=float(r),
                      done=done and k == len(rewards) - 1))
  return Episode(task=task, seed=seed, instruction=f"{task} {seed}", prefix_ids=TPL.prefix(f"{task} {seed}"),
                 turns=turns, truncated=not done, policy_version=version)


def hand_made(version: int = 0) -> list[Episode]:
  """10 samples of two tasks: successes, failures, a truncated episode with a positive return (not done:
  no success), a two-turn success, and two lost episodes."""
  return [
      episode("miniwob/a", 1, (1.0,), version=version), episode("miniwob/a", 1, (-1.0,), version=version),
      episode("miniwob/a", 2, (0.7,), version=version), episode("miniwob/a", 2, lost=True, version=version),
      episode("miniwob/a", 3, (0.5,), done=False, version=version),
      episode("games/b", 4, (0.0, 1.0), version=version), episode("games/b", 4, (0.0,), version=version),
      episode("games/b", 5, (-1.0,), version=version), episode("games/b", 5, lost=True, version=version),
      episode("games/b", 6, (0.2, 0.3), version=version),
  ]


EPS = hand_made()
V = [1, 0, 1, fw.LOST, 0, 1, 0, 0, fw.LOST, 1]  # Episode.success: done with a positive env return


# ------------------------------------------------------------------------------------------- validation

def test_verifier_verdicts_are_the_sandbox_success_and_lost_has_none():
  v = fw.verify(EPS)
  assert v.dtype == np.int8 and v.tolist() == V
  assert v.tolist() == [fw.LOST if e.lost else int(any(t.done for t in e.turns) and e.env_return > 0) for e in EPS]


def test_task_checks_override_the_verifier_by_name_or_family():
  long_ones = lambda e: len(e.turns) == 2  # noqa: E731  (e.g. an exact-match check on the episode)
  v = fw.verify(EPS, checks={"games/": long_ones}).tolist()
  assert v == [1, 0, 1, fw.LOST, 0, 1, 0, 0, fw.LOST, 1]  # games/b: two turns <-> pass
  v = fw.verify(EPS, checks={"miniwob/a": lambda e: e.seed == 3}).tolist()
  assert v[:5] == [0, 0, 0, fw.LOST, 1] and v[5:] == V[5:]


class StubScorer:
  """An ORM stand-in: P(yes) = a fixed value per (task, seed), and the episodes it was asked about."""

  def __init__(self, p):
    self.p, self.asked = p, []

  def p_yes(self, episodes):
    self.asked.append(list(episodes))
    return np.array([self.p[(e.task, e.seed)] for e in episodes], np.float32)


def test_orm_verdicts_threshold_the_stub_scores_and_skip_lost_episodes():
  p = {("miniwob/a", 1): 0.9, ("miniwob/a", 2): 0.5, ("miniwob/a", 3): 0.51, ("games/b", 4): 0.1,
       ("games/b", 5): 0.0, ("games/b", 6): 1.0}
  scorer = StubScorer(p)
  v, p_yes = fw.orm_verdicts(EPS, scorer, threshold=0.5)
  assert [e.lost for e in scorer.asked[0]] == [False] * 8  # lost episodes are not scored
  assert v.tolist() == [1, 1, 0, fw.LOST, 1, 0, 0, 0, fw.LOST, 1]  # > threshold, strictly: 0.5 -> V = 0
  assert np.isnan(p_yes[[3, 8]]).all() and p_yes[0] == np.float32(0.9)
  assert fw.orm_verdicts(EPS, scorer, threshold=0.95)[0].tolist() == [0, 0, 0, fw.LOST, 0, 0, 0, 0, fw.LOST, 1]
  with pytest.raises(ValueError, match="threshold"):
    fw.orm_verdicts(EPS, scorer, threshold=1.5)
  bad = StubScorer(p)
  bad.p_yes = lambda eps: np.zeros(3, np.float32)
  with pytest.raises(ValueError, match="shape"):
    fw.orm_verdicts(EPS, bad, 0.5)
  bad.p_yes = lambda eps: np.full(len(eps), 2.0, np.float32)
  with pytest.raises(ValueError, match="outside"):
    fw.orm_verdicts(EPS, bad, 0.5)


# ---------------------------------------------------------------------------------------------- routing

def test_every_sample_lands_in_exactly_one_set_and_lost_ones_in_neither():
  sft, ct, counts = fw.route(EPS, V, iteration=3)
  assert sorted(sft + ct) == [i for i, e in enumerate(EPS) if not e.lost] and not set(sft) & set(ct)
  assert [EPS[i].success for i in sft] == [True] * 4 and [EPS[i].success for i in ct] == [False] * 4
  assert (counts.iteration, counts.generated, counts.v1, counts.v0, counts.lost) == (3, 10, 4, 4, 2)
  assert counts.v1_fraction == 0.5  # lost ones are not in the denominator
  assert counts.per_task == {"miniwob/a": {"generated": 5, "v1": 2, "v0": 2, "lost": 1},
                             "games/b": {"generated": 5, "v1": 2, "v0": 2, "lost": 1}}
  d = counts.as_dict()
  assert d["per_task"]["games/b"]["v1_fraction"] == 0.5 and fw.IterationCounts.from_dict(d) == counts
  assert fw.route([], [], 1)[2].as_dict()["v1_fraction"] is None


@pytest.mark.parametrize("v,match", [([1] * 9, "verdicts of shape"), ([2] + V[1:], "expected 1, 0"),
                                      (V[:3] + [1] + V[4:], "lost=True but verdict 1"),
                                      ([fw.LOST] + V[1:], "lost=False but verdict -1")])
def test_route_refuses_verdicts_that_do_not_fit(v, match):
  with pytest.raises(ValueError, match=match):
    fw.route(EPS, v)


def test_sample_jobs_k_per_task_on_seeds_no_other_iteration_uses():
  jobs = fw.sample_jobs(["a", "b"], 3, 2, iteration=2, seed_offset=100, eval_seed_offset=1000)
  assert len(jobs) == 12 and all(sum(1 for j in jobs if j[0] == t) == 6 for t in "ab")
  assert sorted({s for _, s in jobs}) == [103, 104, 105]  # iteration 1 had 100..102
  assert not {s for _, s in fw.sample_jobs(["a"], 3, 1, 1, 100, 1000)} & {s for _, s in jobs}
  with pytest.raises(ValueError, match="evaluation seeds"):
    fw.sample_jobs(["a"], 3, 1, 301, 100, 1000)  # seeds 1000..1002
  with pytest.raises(ValueError):
    fw.sample_jobs(["a"], 0, 1, 1, 100, 1000)


# ---------------------------------------------------------------------------------------------- records

def _stage(root, t, eps, v, **kw):
  samples = os.path.join(root, f"iter_{t:02d}", "generate", "samples")
  fw.write_samples(samples, eps, v, META, iteration=t, validator="verifier", policy=f"run/{t - 1}", **kw)
  return samples


def test_iteration_records_carry_v_and_iteration_and_route_once(tmp_path):
  root = str(tmp_path)
  samples = _stage(root, 1, EPS, V)
  staged = records.read_episodes(samples)
  assert len(staged) == len(EPS)  # every sample, lost ones included
  for (ep, prov), want, v in zip(staged, EPS, V):
    assert (ep.task, ep.seed, ep.lost, ep.env_return) == (want.task, want.seed, want.lost, want.env_return)
    assert prov["source"] == "flywheel" and prov["policy_version"] == 0
    assert prov["extra"] == {"iteration": 1, "v": v, "validator": "verifier", "env_return": want.env_return,
                             "policy": "run/0"}
  counts = fw.route_records(samples, root, 1)
  assert (counts.generated, counts.v1, counts.v0, counts.lost, counts.corrupt) == (10, 4, 4, 2, 0)
  dirs = fw.set_dirs(root)
  sft, ct = records.read_episodes(dirs["sft"]), records.read_episodes(dirs["ct"])
  assert [(e.task, e.seed, e.env_return) for e, _ in sft] == [(EPS[i].task, EPS[i].seed, EPS[i].env_return)
                                                               for i in range(10) if V[i] == 1]
  assert [(e.task, e.seed, e.env_return) for e, _ in ct] == [(EPS[i].task, EPS[i].seed, EPS[i].env_return)
                                                             for i in range(10) if V[i] == 0]
  assert all(p["extra"]["v"] == 1 and e.success for e, p in sft)
  assert all(p["extra"]["v"] == 0 and not e.success for e, p in ct)
  assert all(p["extra"]["iteration"] == 1 and p["source"] == "flywheel" for _, p in sft + ct)
  assert records.read_index(dirs["sft"])["counts"] == {"flywheel": {"miniwob/a": 2, "games/b": 2}}
  assert {s["file"].split("-")[0] for s in records.read_index(dirs["ct"])["shards"]} == {"iter_00001"}

  # a re-run of the committed iteration writes nothing twice; a set lost before its commit is redone alone
  assert fw.route_records(samples, root, 1) == counts
  assert (fw.dataset_size(dirs["sft"]), fw.dataset_size(dirs["ct"])) == (4, 4)
  for name in os.listdir(dirs["ct"]):
    os.remove(os.path.join(dirs["ct"], name))
  fw.route_records(samples, root, 1)
  assert (fw.dataset_size(dirs["sft"]), fw.dataset_size(dirs["ct"])) == (4, 4)
  with pytest.raises(FileExistsError):  # the staged samples are committed once
    _stage(root, 1, EPS, V)
  with pytest.raises(ValueError, match="iteration 1"):  # samples of another iteration
    fw.route_records(samples, root, 2)


def test_iterations_accumulate_and_sizes_are_read_per_iteration(tmp_path):
  root = str(tmp_path)
  fw.route_records(_stage(root, 1, EPS, V), root, 1)
  eps2 = hand_made(version=1)[:3]  # iteration 2: two successes and a failure of the next policy
  c2 = fw.route_records(_stage(root, 2, eps2, [1, 0, 1]), root, 2)
  assert (c2.generated, c2.v1, c2.v0, c2.lost) == (3, 2, 1, 0)
  dirs = fw.set_dirs(root)
  assert [fw.dataset_size(dirs["sft"], t) for t in (0, 1, 2)] == [0, 4, 6]
  assert [fw.dataset_size(dirs["ct"], t) for t in (0, 1, 2)] == [0, 4, 5]
  base = str(tmp_path / "demos")  # a base set of another prefix counts at every iteration
  with records.RecordWriter(base, META) as w:
    w.write(EPS[0], source="expert")
  assert fw.dataset_size([base, dirs["sft"]], 1) == 5 and fw.dataset_size(str(tmp_path / "none")) == 0
  sft = records.read_episodes(dirs["sft"])
  assert [(p["extra"]["iteration"], p["policy_version"]) for _, p in sft] == [(1, 0)] * 4 + [(2, 1)] * 2


def test_a_corrupt_sample_raises_with_file_and_index_unless_skipped_by_config(tmp_path):
  root = str(tmp_path)
  samples = _stage(root, 1, EPS, V)
  (shard,) = [s["file"] for s in records.read_index(samples)["shards"]]
  path = os.path.join(samples, shard)
  reader = array_record_module.ArrayRecordReader(path)
  raw = [reader.read([i])[0] for i in range(len(EPS))]
  reader.close()
  raw[2] = b"\x93 not a record"  # sample 2 (a success) damaged
  w = array_record_module.ArrayRecordWriter(path, records.WRITER_OPTIONS)
  for r in raw:
    w.write(r)
  w.close()
  with pytest.raises(records.CorruptRecord) as e:
    fw.route_records(samples, root, 1)
  assert (e.value.file, e.value.index) == (path, 2)
  assert not os.path.exists(fw.set_dirs(root)["sft"])  # nothing routed from a damaged iteration
  counts = fw.route_records(samples, root, 1, skip_corrupt=True)
  assert (counts.generated, counts.v1, counts.v0, counts.lost, counts.corrupt) == (9, 3, 4, 2, 1)
  assert fw.dataset_size(fw.set_dirs(root)["sft"]) == 3


def test_write_samples_checks_its_inputs(tmp_path):
  with pytest.raises(ValueError, match="validator"):
    fw.write_samples(str(tmp_path / "s"), EPS, V, META, iteration=1, validator="vibes", policy="")
  with pytest.raises(ValueError, match="ORM scores"):
    fw.write_samples(str(tmp_path / "s"), EPS, V, META, iteration=1, validator="orm", policy="", p_yes=[0.5])
  assert not os.path.exists(tmp_path / "s")
  fw.write_samples(str(tmp_path / "o"), EPS[:2], [1, 0], META, iteration=1, validator="orm", policy="",
                   p_yes=[0.9, 0.2])
  got = [p["extra"]["p_yes"] for _, p in records.read_episodes(str(tmp_path / "o"))]
  assert got == [pytest.approx(0.9), pytest.approx(0.2)]


# ------------------------------------------------------------------------------------- driver and plot

ROWS = [
    {"iteration": 0, "policy": "runs/main/ppo", "heldout": {"t/a": 0.5, "t/b": 0.25}},
    {"iteration": 1, "generated": 8, "v1": 2, "v0": 6, "lost": 0, "v1_fraction": 0.25, "sft_set": 12, "ct_set": 6,
     "stages": ["generate", "sft", "ppo", "eval"], "heldout": {"t/a": 0.75, "t/b": 0.25},
     "per_task": {"t/a": {"v1_fraction": 0.5}, "t/b": {"v1_fraction": 0.0}}},
    {"iteration": 2, "generated": 8, "v1": 4, "v0": 3, "lost": 1, "v1_fraction": 4 / 7, "sft_set": 16, "ct_set": 9,
     "stages": ["generate", "ct", "sft", "ppo", "eval"],
     "per_task": {"t/a": {"v1_fraction": 0.75}, "t/b": {"v1_fraction": None}}, "heldout": {"t/a": 1.0, "t/b": 0.5}},
]


def test_table_and_figure_hold_the_rows(tmp_path):
  table = driver.format_table(ROWS, ["t/a", "t/b"]).splitlines()
  assert table[2].split()[:3] == ["0", "initial", "policy"] and table[2].split()[-2:] == ["0.500", "0.250"]
  assert table[4].split() == ["2", "8", "4", "3", "1", "0.571", "16", "9", "generate,ct,sft,ppo,eval", "1.000", "0.500"]
  fig = plot.flywheel_figure(ROWS, ["t/a", "t/b"])
  lines = {(i, l.get_label()): l for i, ax in enumerate(fig.axes) for l in ax.lines}
  assert list(lines[0, "all tasks"].get_xdata()) == [1, 2]
  assert np.allclose(lines[0, "all tasks"].get_ydata(), [0.25, 4 / 7])
  assert np.allclose(lines[0, "b"].get_ydata(), [0.0, np.nan], equal_nan=True)
  assert list(lines[1, "a"].get_xdata()) == [0, 1, 2] and list(lines[1, "a"].get_ydata()) == [0.5, 0.75, 1.0]
  assert list(lines[2, "CT set (V = 0, with its base)"].get_ydata()) == [6, 9]
  with open(tmp_path / "flywheel.json", "w") as f:
    json.dump({"tasks": ["t/a", "t/b"], "rows": ROWS}, f)
  assert plot.flywheel_plot(str(tmp_path)) == str(tmp_path / "flywheel.png")
  assert (tmp_path / "flywheel.png").stat().st_size > 10_000


def test_driver_passes_its_config_overrides_on():
  argv = ["--config", "c.py:smoke", "--workdir", "x", "--config.flywheel.init=r", "--config.sft.lr", "0.1",
          "--config.sft.data=('a',)"]
  assert driver.forwarded_overrides(argv) == ["--config.flywheel.init=r", "--config.sft.lr=0.1",
                                              "--config.sft.data=('a',)"]
  assert driver.config_spec("experiments/configs/flywheel.py:smoke") == \
      os.path.join(os.getcwd(), "experiments/configs/flywheel.py") + ":smoke"


# ------------------------------------------------------------------------------ end to end (real sandbox)

def _flywheel(workdir, *overrides):
  cmd = [sys.executable, "-m", "experiments.flywheel", "--config", "experiments/configs/flywheel.py:smoke",
         "--workdir", str(workdir), *overrides]
  return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, server):
  """One smoke flywheel iteration (fresh tiny policy; every stage: generate, CT, SFT, PPO, eval) on the
  real sandbox; the SFT set starts from real expert demonstrations (the report's bootstrap set)."""
  import asyncio

  from envs_bridge.client import SandboxClient
  from experiments.configs import flywheel as cfg
  from tars_jax.data.sources import demos
  from tars_jax.train import state as state_lib
  tmp = tmp_path_factory.mktemp("flywheel")
  spec = demos.DemoSpec.from_parts(state_lib.build(cfg.get_config("smoke")), thoughts=False)

  async def collect():
    client = SandboxClient(server.url)
    try:
      writer = demos.open_writer(str(tmp / "demos"), spec)
      await demos.collect([client], [("miniwob/click-test", 2_000_000), ("miniwob/click-test-2", 2_000_000)],
                          spec, writer, progress=False)
      writer.close()
    finally:
      await client.aclose()

  asyncio.run(collect())
  run = tmp / "fw"
  overrides = ("--config.flywheel.iterations=1", f"--config.flywheel.sft_base=('{tmp / 'demos'}',)")
  p = _flywheel(run, *overrides, f"--config.env.servers=('{server.url}',)")
  assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
  return run, tmp / "demos", p.stdout, overrides


@pytest.mark.long
@pytest.mark.browser
def test_smoke_iteration_end_to_end(smoke_run):
  run, demos_dir, out, _ = smoke_run
  (row,) = json.load(open(run / "flywheel.json"))["rows"]
  # generate: k = 2 seeds x 2 samples per task, every one validated (or lost) and routed
  assert row["generated"] == 8 == row["v1"] + row["v0"] + row["lost"]
  assert {t: c["generated"] for t, c in row["per_task"].items()} == {"miniwob/click-test": 4, "miniwob/click-test-2": 4}
  staged = records.read_episodes(str(run / "iter_01" / "generate" / "samples"))
  assert sorted((e.task, e.seed) for e, _ in staged) == sorted(
      (t, 6_000_000 + j) for t in ("miniwob/click-test", "miniwob/click-test-2") for j in (0, 1) for _ in (0, 1))
  # the sets hold exactly the counted samples, their V = the environment's verdict read from the record
  sets = {name: records.read_episodes(d) if os.path.exists(d) else [] for name, d in fw.set_dirs(str(run)).items()}
  assert (len(sets["sft"]), len(sets["ct"])) == (row["v1"], row["v0"]) == (row["sft_generated"], row["ct_generated"])
  for name, v in (("sft", 1), ("ct", 0)):
    for ep, prov in sets[name]:
      assert prov["source"] == "flywheel" and prov["policy_version"] == 0 == ep.policy_version
      assert prov["extra"]["iteration"] == 1 and prov["extra"]["v"] == v
      assert prov["extra"]["env_return"] == ep.env_return and int(ep.success) == v
      assert v == int(any(t.done for t in ep.turns) and sum(t.env_reward for t in ep.turns) > 0)
  n_demos = fw.dataset_size(str(demos_dir))
  assert n_demos > 0 and row["sft_set"] == n_demos + row["v1"] and row["ct_set"] == row["v0"]
  # every stage ran, each from the previous one's weights: fresh init -> CT -> SFT -> PPO -> eval
  assert row["stages"] == ["generate", "ct", "sft", "ppo", "eval"]
  ct_cfg = json.load(open(run / "iter_01" / "ct" / "config.json"))
  assert ct_cfg["policy"]["init"] == "" and ct_cfg["sft"]["ct_ratio"] == 0.5
  assert ct_cfg["sft"]["ct_data"] == [str(run / "data" / "ct")] and ct_cfg["sft"]["data"][0] == str(demos_dir)
  sft_cfg = json.load(open(run / "iter_01" / "sft" / "config.json"))
  assert sft_cfg["policy"]["init"] == str(run / "iter_01" / "ct") and sft_cfg["sft"]["ct_data"] == []
  assert f"policy initialised from {run}/iter_01/sft/checkpoints/" in out
  ppo_cfg = json.load(open(run / "iter_01" / "ppo" / "config.json"))
  assert ppo_cfg["policy"]["init"] == str(run / "iter_01" / "sft") and ppo_cfg["iterations"] == 1
  ev = json.load(open(run / "iter_01" / "eval" / "eval.json"))
  assert row["heldout"] == {t: r["success"] for t, r in ev["results"].items()}
  assert row["heldout_episodes"] == {"miniwob/click-test": 2, "miniwob/click-test-2": 2}
  assert (run / "flywheel.png").stat().st_size > 10_000
  assert "[flywheel]" in out.splitlines()[-1] and "flywheel.json" in out.splitlines()[-1]


@pytest.mark.long
@pytest.mark.browser
def test_smoke_rerun_skips_finished_stages_and_writes_nothing_twice(smoke_run):
  run, _, _, overrides = smoke_run
  stamps = {p: os.path.getmtime(run / "iter_01" / p / "done.json") for p in ("generate", "ct", "sft", "ppo", "eval")}
  sizes = {n: fw.dataset_size(d) for n, d in fw.set_dirs(str(run)).items()}
  before = json.load(open(run / "flywheel.json"))
  p = _flywheel(run, *overrides)  # no server given: none is launched, none is needed
  assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
  assert p.stdout.count("finished before") == 5 and "sandbox servers" not in p.stdout
  assert {q: os.path.getmtime(run / "iter_01" / q / "done.json") for q in stamps} == stamps
  assert {n: fw.dataset_size(d) for n, d in fw.set_dirs(str(run)).items()} == sizes
  assert json.load(open(run / "flywheel.json"))["rows"] == before["rows"]
