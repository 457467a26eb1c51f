"""The replication suite's statistics (tars_jax/analysis/replication.py, against numpy / scipy
references), its driver's plan, config check and result rows (experiments/replicate.py; no subprocess:
scripts/notebooks.sh runs the driver end to end on a smoke sweep), its config, and the wall-clock guard."""

import json
import os

import numpy as np
import pytest
from scipy import stats

from experiments import replicate
from experiments.configs import replication as cfg_mod
from tars_jax.analysis import replication as R

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments/configs/replication.py")


def _rows(variant, p, seeds=(0, 1, 2), tasks=("a", "b", "c", "d"), episodes=100):
  rows = []
  for s in seeds:
    for i, t in enumerate(tasks):
      rows.append({"variant": variant, "seed": s, "task": t, "episodes": episodes,
                   "successes": int(round(episodes * p[s % len(p)][i % len(p[0])]))})
  return rows


P_SFT = [[0.2, 0.3, 0.5, 0.4], [0.25, 0.35, 0.45, 0.3], [0.3, 0.2, 0.55, 0.35]]


def test_aggregate_matches_numpy_mean_and_scipy_iqm():
  x, seeds, tasks = R.score_matrix(_rows("sft", P_SFT), "sft")
  assert seeds == [0, 1, 2] and tasks == ["a", "b", "c", "d"]
  np.testing.assert_allclose(x, np.array(P_SFT))
  a = R.aggregate(x, reps=500)
  assert a["mean"] == pytest.approx(np.mean(P_SFT))
  assert a["iqm"] == pytest.approx(stats.trim_mean(np.ravel(P_SFT), 0.25))
  assert a["mean_lo"] <= a["mean"] <= a["mean_hi"] and a["iqm_lo"] <= a["iqm"] <= a["iqm_hi"]
  # the bootstrap interval lies within the range of the per-task resampled means
  assert np.min(np.mean(P_SFT, 0)) - 1e-9 <= a["mean_lo"] and a["mean_hi"] <= np.max(P_SFT)
  const = R.aggregate(np.full((3, 4), 0.5), reps=200)
  assert const["mean_lo"] == pytest.approx(0.5) and const["mean_hi"] == pytest.approx(0.5)


def test_compare_is_paired_and_decides_only_outside_the_interval():
  sft = _rows("sft", P_SFT)
  better = _rows("ppo", [[p + 0.2 for p in row] for row in P_SFT])
  c = R.compare(sft + better, "ppo", "sft", reps=500)
  # every paired difference is +0.2: the interval is degenerate at it despite the seeds' spread
  assert c["diff"] == pytest.approx(0.2) and c["diff_lo"] == pytest.approx(0.2) and c["diff_hi"] == pytest.approx(0.2)
  assert c["verdict"] == "ppo better" and c["seeds"] == 3 and c["tasks"] == 4
  assert 0.5 < c["poi"] <= 1.0
  shuffled = _rows("grpo", [P_SFT[1], P_SFT[2], P_SFT[0]])  # same values, other seeds: no paired effect
  c2 = R.compare(sft + shuffled, "grpo", "sft", reps=500)
  assert c2["diff"] == pytest.approx(0.0, abs=1e-12) and c2["verdict"] == "inconclusive"
  assert c2["diff_lo"] < 0 < c2["diff_hi"]


def test_fewer_than_three_seeds_is_refused():
  rows = _rows("sft", P_SFT, seeds=(0, 1)) + _rows("ppo", P_SFT, seeds=(0, 1))
  with pytest.raises(R.TooFewSeeds, match="at least 3"):
    R.aggregate(R.score_matrix(rows, "ppo")[0])
  with pytest.raises(R.TooFewSeeds):
    R.compare(rows, "ppo", "sft")
  text = R.report(rows, reps=100)
  assert "refused" in text and "[" not in text.split("\n")[2]  # no interval printed for either variant


def test_bad_rows_are_named():
  rows = _rows("sft", P_SFT)
  with pytest.raises(R.BadRows, match="twice"):
    R.check_rows(rows + rows[:1])
  with pytest.raises(R.BadRows, match="lacks"):
    R.check_rows([{"variant": "sft", "seed": 0}])
  with pytest.raises(R.BadRows, match="no result for"):
    R.score_matrix(rows[:-1], "sft")
  with pytest.raises(R.BadRows, match="successes"):
    R.check_rows([dict(rows[0], successes=101)])


def test_think_length_rows_compare_paired_like_numpy_and_rows_without_it_are_named():
  """Row 5's measure: mean thought tokens per turn on the held-out episodes, SFT start vs after RL."""
  res = {"t1": {"success": 0.5, "episodes": 10, "think_tokens": 12.5}, "t2": {"success": 0.1, "episodes": 10}}
  assert R.rows_of_eval("sft_thoughts", 0, res) == [
      {"variant": "sft_thoughts", "seed": 0, "task": "t1", "episodes": 10, "successes": 5, "think_tokens": 12.5},
      {"variant": "sft_thoughts", "seed": 0, "task": "t2", "episodes": 10, "successes": 1}]
  rng = np.random.default_rng(0)
  start = rng.uniform(8, 14, (3, 4))
  after = start - rng.uniform(1, 3, (3, 4))  # shorter on every (seed, task)
  rows = [dict(r, think_tokens=float(m[r["seed"], "abcd".index(r["task"])]))
          for v, m in (("sft_thoughts", start), ("ppo_thoughts", after)) for r in _rows(v, P_SFT)]
  x, _, _ = R.score_matrix(rows, "ppo_thoughts", key="think_tokens")
  np.testing.assert_array_equal(x, after)
  c = R.compare(rows, "ppo_thoughts", "sft_thoughts", reps=500, key="think_tokens")
  assert c["diff"] == pytest.approx(np.mean(after - start)) and c["diff_hi"] < 0
  assert c["verdict"] == "sft_thoughts higher think_tokens" and c["poi"] < 0.5
  text = R.report(rows + _rows("ppo", P_SFT), reps=200, comparisons=[(5, "ppo_thoughts", "sft_thoughts", "-"),
                                                                     (1, "ppo", "sft_thoughts", "-")],
                  key="think_tokens")
  assert "| ppo_thoughts | 3 |" in text and "| ppo |" not in text and "not run (or no think_tokens)" in text
  with pytest.raises(R.BadRows, match="no 'think_tokens'"):
    R.score_matrix(_rows("ppo", P_SFT), "ppo", key="think_tokens")


def test_committed_results_file_is_well_formed():
  path = os.path.join(os.path.dirname(CONFIG), "..", "..", "benchmarks", "results", "replication.json")
  rows = R.load_rows(path)  # docs/replication.md's intervals are computed from it
  assert {"sft", "ppo"} <= {r["variant"] for r in rows}
  assert R.runs_per_variant(rows)["ppo"] >= R.MIN_SEEDS and all(r["episodes"] >= 100 for r in rows)


def test_plan_runs_the_bar_first_and_shares_sft_and_vpt(tmp_path):
  st = replicate.plan(CONFIG, str(tmp_path), [0, 1, 2], ["grpo", "ppo", "ppo_coupled"], "+smoke")
  names = [s["name"] for s in st]
  assert names[0] == "demos"
  assert len(names) == len(set(names))  # SFT and value pretraining once per seed, shared by variants
  first_grpo = names.index("grpo/seed_0")
  assert all(names.index(f"{x}/seed_{s}") < first_grpo for x in ("sft", "ppo", "eval/ppo") for s in (0, 1, 2))
  assert names.count("vpt/seed_0") == 1 and "vpt/seed_0" in next(s for s in st if s["name"] == "ppo_coupled/seed_0")["after"]
  grpo = next(s for s in st if s["name"] == "grpo/seed_1")
  assert grpo["after"] == ["sft/seed_1"] and not any("critic.init" in a for a in grpo["argv"])
  ppo = next(s for s in st if s["name"] == "ppo/seed_2")
  assert f"--config.policy.init={tmp_path}/sft/seed_2" in ppo["argv"]
  assert f"--config.critic.init={tmp_path}/vpt/seed_2/critic" in ppo["argv"] and "--config.seed=2" in ppo["argv"]
  ptx = replicate.plan(CONFIG, str(tmp_path), [0], ["ppo_kl", "ppo_kl_ptx"], "+smoke")
  argv = {s["name"]: s["argv"] for s in ptx}
  assert f"--config.rl.ptx_data=('{tmp_path}/demos',)" in argv["ppo_kl_ptx/seed_0"]
  assert not any("ptx_data" in a for a in argv["ppo_kl/seed_0"])
  thoughts = replicate.plan(CONFIG, str(tmp_path), [0], ["ppo_thoughts"], "+smoke")
  assert [s["name"] for s in thoughts][1:4] == ["sft_thoughts/seed_0", "eval/sft_thoughts/seed_0", "vpt_thoughts/seed_0"]


def test_a_variant_that_pretrains_its_critic_otherwise_gets_its_own_value_pretraining_stage(tmp_path):
  st = replicate.plan(CONFIG, str(tmp_path), [0], ["ppo", "ppo_lr1e4", "ppo_lr1e4_vpt30"], "+smoke")
  by_name = {s["name"]: s for s in st}
  assert {"vpt/seed_0", "vpt30/seed_0"} <= set(by_name)
  assert f"--config.critic.init={tmp_path}/vpt/seed_0/critic" in by_name["ppo_lr1e4/seed_0"]["argv"]
  assert f"--config.critic.init={tmp_path}/vpt30/seed_0/critic" in by_name["ppo_lr1e4_vpt30/seed_0"]["argv"]
  assert "vpt30/seed_0" in by_name["ppo_lr1e4_vpt30/seed_0"]["after"]
  assert "ppo_lr1e4_vpt30" in " ".join(by_name["vpt30/seed_0"]["argv"])  # its own config pretrains it
  full = cfg_mod.get_config("ppo_lr1e4_vpt30")
  assert full.vpt.max_iterations == 30 > cfg_mod.get_config("ppo_lr1e4").vpt.max_iterations
  assert {k: v for k, v in full.rl.items()} == {k: v for k, v in cfg_mod.get_config("ppo_lr1e4").rl.items()}


def test_two_variants_that_share_a_value_pretraining_stage_but_pretrain_differently_are_refused():
  vpt_of = {}
  a, b = cfg_mod.get_config("ppo"), cfg_mod.get_config("ppo_kl")
  replicate.check_same_vpt(vpt_of, "vpt", "ppo", a)
  replicate.check_same_vpt(vpt_of, "vpt", "ppo_kl", b)  # same value pretraining: shared
  b.vpt.max_minutes, b.vpt.ckpt_every = 999.0, 3  # bookkeeping: still shared
  replicate.check_same_vpt(vpt_of, "vpt", "ppo_kl", b)
  b.vpt.max_iterations = 30
  with pytest.raises(replicate.ConfigMismatch, match=r"'vpt' is shared by ppo and ppo_kl.*vpt.max_iterations: 10 \(ppo\) vs 30"):
    replicate.check_same_vpt(vpt_of, "vpt", "ppo_kl", b)


def test_one_sft_start_for_every_rl_seed_plans_it_once_and_pairs_its_rows_with_each_rl_seed(tmp_path):
  st = replicate.plan(CONFIG, str(tmp_path), [0, 1, 2], ["ppo_thoughts"], "+smoke", sft_seed=1)
  names = [s["name"] for s in st]
  assert [n for n in names if not n.startswith(("ppo_thoughts", "eval/ppo_thoughts"))] == [
      "demos", "sft_thoughts/seed_1", "eval/sft_thoughts/seed_1", "vpt_thoughts/seed_1"]
  argv = {s["name"]: s["argv"] for s in st}
  assert "--config.seed=1" in argv["sft_thoughts/seed_1"] and "--config.seed=1" in argv["vpt_thoughts/seed_1"]
  for s in (0, 1, 2):
    rl = argv[f"ppo_thoughts/seed_{s}"]
    assert f"--config.seed={s}" in rl and f"--config.policy.init={tmp_path}/sft_thoughts/seed_1" in rl
    assert f"--config.critic.init={tmp_path}/vpt_thoughts/seed_1/critic" in rl
  res = {"miniwob/a": {"success": 0.5, "episodes": 10}}
  for run in ("sft_thoughts/seed_1", "ppo_thoughts/seed_0", "ppo_thoughts/seed_2"):
    os.makedirs(tmp_path / run)
    (tmp_path / run / "eval.json").write_text(json.dumps({"results": res}))
  rows = replicate.collect(st, 1, [0, 1, 2])
  assert sorted((r["variant"], r["seed"], r["sft_seed"]) for r in rows) == [
      ("ppo_thoughts", 0, 1), ("ppo_thoughts", 2, 1), ("sft_thoughts", 0, 1), ("sft_thoughts", 1, 1),
      ("sft_thoughts", 2, 1)]
  R.check_rows(rows)
  replicate.check_same_start({"sft_seed": 1}, 1)
  replicate.check_same_start({}, 1)  # a new work dir
  with pytest.raises(replicate.ConfigMismatch, match="one SFT start per training seed.*from sft seed 1"):
    replicate.check_same_start({"configs": {}}, 1)
  with pytest.raises(replicate.ConfigMismatch, match="from sft seed 0.*one SFT start per training seed"):
    replicate.check_same_start({"sft_seed": 0}, None)


def test_set_overrides_reach_every_training_stage_the_plan_and_the_resolved_configs(tmp_path):
  sets = ["sft.steps=3", "sft.decay_steps=8", "final_eval_episodes=5"]
  st = replicate.plan(CONFIG, str(tmp_path), [0], ["ppo"], "+smoke", overrides=sets)
  argv = {s["name"]: s["argv"] for s in st}
  for name in ("demos", "sft/seed_0", "vpt/seed_0", "ppo/seed_0"):
    assert all(f"--config.{o}" in argv[name] for o in sets), name
  assert argv["eval/ppo/seed_0"][argv["eval/ppo/seed_0"].index("--episodes") + 1] == "5"
  conf = replicate.resolved(CONFIG, ["sft+smoke"], sets)["sft+smoke"]
  assert (conf["sft.steps"], conf["sft.decay_steps"], conf["final_eval_episodes"]) == (3, 8, 5)
  assert replicate.parse_overrides(["a.b=x/y", "c=('p',)", "d=1e-3"]) == {"a.b": "x/y", "c": ("p",), "d": 1e-3}
  with pytest.raises(ValueError, match="not key=value"):
    replicate.parse_overrides(["sft.steps"])
  with pytest.raises(KeyError, match="no setting 'sft.no_such_setting'"):
    replicate.resolved(CONFIG, ["sft+smoke"], ["sft.no_such_setting=1"])
  with pytest.raises(TypeError):
    replicate.resolved(CONFIG, ["sft+smoke"], ["sft.steps=many"])
  with pytest.raises(replicate.ConfigMismatch, match="sft.steps = 3 there, 4 now"):
    replicate.check_same({"sft+smoke": conf}, replicate.resolved(CONFIG, ["sft+smoke"], ["sft.steps=4", *sets[1:]]))


def test_a_workdir_of_another_config_is_refused_naming_the_fields():
  old = replicate.resolved(CONFIG, ["sft+smoke", "ppo+smoke"])
  new = json.loads(json.dumps(old))
  replicate.check_same(old, new)
  new["ppo+smoke"]["rl.new_setting"] = 0  # a setting added to the code since: listed, not a mismatch
  assert replicate.check_same(old, new) == ["rl.new_setting"]
  new["ppo+smoke"]["sft.max_minutes"] = 120.0  # a wall-clock guard raised on a slow host: not a mismatch
  new["ppo+smoke"]["ckpt_every"] = 1  # nor checkpointing more often
  assert replicate.check_same(old, new) == ["rl.new_setting"]
  new["ppo+smoke"]["rl.lr"] = 1.0
  with pytest.raises(replicate.ConfigMismatch, match=r"ppo\+smoke: rl.lr"):
    replicate.check_same(old, new)


def test_collect_reads_finished_evaluations_once(tmp_path):
  st = replicate.plan(CONFIG, str(tmp_path), [0], ["ppo"], "+smoke")
  for name, succ in (("sft/seed_0", 0.5), ("ppo/seed_0", 1.0)):
    os.makedirs(tmp_path / name)
    res = {"miniwob/click-button": {"success": succ, "episodes": 2}, "miniwob/click-link": {"success": 0.0, "episodes": 2}}
    (tmp_path / name / "eval.json").write_text(json.dumps({"results": res}))
  rows = replicate.collect(st)
  R.check_rows(rows)
  assert {(r["variant"], r["task"], r["successes"]) for r in rows} == {
      ("sft", "miniwob/click-button", 1), ("sft", "miniwob/click-link", 0),
      ("ppo", "miniwob/click-button", 2), ("ppo", "miniwob/click-link", 0)}


def test_status_reads_each_stage_state_from_its_files_without_a_lock(tmp_path):
  import subprocess
  import sys
  w = tmp_path
  (w / "replicate.json").write_text(json.dumps({"config": CONFIG, "suffix": "+smoke", "seeds": [0],
                                                "variants": ["ppo"], "sft_seed": None}))
  os.makedirs(w / "demos")
  (w / "demos" / "experts.json").write_text("{}")
  os.makedirs(w / "ppo" / "seed_0")  # a finished evaluation: its mean held-out success
  (w / "ppo" / "seed_0" / "eval.json").write_text(json.dumps({"results": {
      "miniwob/click-button": {"success": 0.5, "episodes": 2}, "miniwob/enter-text": {"success": 0.0, "episodes": 2}}}))
  sft = w / "sft" / "seed_0"  # running: its lock names this (live) process; the last line half-written
  os.makedirs(sft)
  (sft / "run.json").write_text(json.dumps({"stage": "sft", "budget": 21, "unit": "step"}))
  # resumed at step 10: the time left is at this process's pace (0.5 min per step, 8 steps), not the
  # pace of step 13 in 1.5 min (~1 min), nor the earlier process's
  rows = [(1, 3.0), (10, 9.0), (11, 0.5), (13, 1.5)]
  (sft / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "perf/wall_min": m}) + "\n" for s, m in rows)
                                     + '{"step": 14, "perf/wa')
  (sft / "run.lock").write_text(f"sft (pid {os.getpid()})\n")
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                        text=True).stdout.strip()
  vpt = w / "vpt" / "seed_0"  # interrupted: its lock names a process that has ended
  os.makedirs(vpt)
  (vpt / "run.json").write_text(json.dumps({"stage": "vpt", "budget": 10, "unit": "iteration"}))
  (vpt / "metrics.jsonl").write_text('{"step": 4, "perf/wall_min": 2.0}\n')
  (vpt / "run.lock").write_text(f"vpt (pid {dead})\n")
  os.makedirs(w / "logs")
  (w / "logs" / "eval_sft_seed_0.log").write_text("")  # an evaluation holds no lock: started
  table = replicate.status_table(str(w)).splitlines()
  states = {line.split()[0]: line.split(None, 2)[1:] for line in table[2:]}
  assert states == {"demos": ["done"], "sft/seed_0": ["running", "step 13 / 21, 1.5 min (~4 min left)"],
                    "eval/sft/seed_0": ["started"], "vpt/seed_0": ["started", "step 4 / 10, 2.0 min"], "ppo/seed_0": ["pending"],
                    "eval/ppo/seed_0": ["done", "success 0.250 (2 tasks x 2)"]}
  assert table[0].endswith("driver: not running") and table[1] == "done 2, running 1, started 2, pending 1"
  assert not (w / "replicate.lock").exists()  # nothing written, no lock taken


def test_execute_resumes_a_stage_its_guard_stopped_and_counts_other_failures(tmp_path):
  import sys
  from tars_jax.train.guard import EXIT_TRIPPED
  # A stage process: exits EXIT_TRIPPED on each of its first `trips` starts (as a trainer whose guard
  # tripped after a checkpoint), then finishes (its done file); "fail" exits 1 (an error, not retried).
  script = ("import os, sys; starts, done, trips = sys.argv[1:4]; n = len(open(starts).read()) if "
            "os.path.exists(starts) else 0; open(starts, 'a').write('x'); trips = int(trips); "
            f"sys.exit(1) if trips < 0 else sys.exit({EXIT_TRIPPED}) if n < trips else open(done, 'w').close()")

  def stage(name, trips, after=()):
    return {"name": name, "argv": [sys.executable, "-c", script, str(tmp_path / f"{name}.starts"),
                                   str(tmp_path / f"{name}.done"), str(trips)],
            "done": str(tmp_path / f"{name}.done"), "after": list(after), "dir": None, "heavy": True}

  stages = [stage("twice", 2), stage("always", 5), stage("fail", -1), stage("next", 0, ["twice"]),
            stage("blocked", 0, ["always"])]
  status = replicate.execute(stages, str(tmp_path), timeout_min=2.0, jobs=2, guard_retries=2)
  starts = {n: len((tmp_path / f"{n}.starts").read_text()) for n in ("twice", "always", "fail", "next")}
  assert status == {"twice": "ran", "always": f"failed (rc {EXIT_TRIPPED})", "fail": "failed (rc 1)",
                    "next": "ran", "blocked": "skipped: needs always"}
  assert starts == {"twice": 3, "always": 3, "fail": 1, "next": 1}  # retries only after a guard trip


def test_sigterm_to_the_driver_stops_its_running_stages_and_waits_for_them(tmp_path):
  """The driver (a real process running `execute`) passes SIGTERM to its running stage, which records it
  (as a trainer checkpoints) and exits 143; the driver waits for it and exits 143 too, leaving no stage
  behind; the pending stage never starts."""
  import signal
  import subprocess
  import sys
  import time
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  stage = ("import os, signal, sys, time; out = sys.argv[1]; "
           "signal.signal(signal.SIGTERM, lambda *_: (open(out + '.term', 'w').close(), sys.exit(143))); "
           "open(out + '.pid', 'w').write(str(os.getpid())); time.sleep(600)")
  stages = [{"name": "slow", "argv": [sys.executable, "-c", stage, str(tmp_path / "slow")],
             "done": str(tmp_path / "slow.done"), "after": [], "dir": None, "heavy": True},
            {"name": "next", "argv": [sys.executable, "-c", "open(__import__('sys').argv[1], 'w').close()",
                                      str(tmp_path / "next.done")],
             "done": str(tmp_path / "next.done"), "after": ["slow"], "dir": None, "heavy": False}]
  driver = subprocess.Popen(
      [sys.executable, "-c", f"from experiments import replicate; replicate.execute({stages!r}, {str(tmp_path)!r}, 5.0)"],
      cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.monotonic() + 120  # only so a broken test cannot hang
    while not (tmp_path / "slow.pid").exists() or not (tmp_path / "slow.pid").read_text():
      assert driver.poll() is None and time.monotonic() < deadline, driver.communicate()[0]
      time.sleep(0.05)
    pid = int((tmp_path / "slow.pid").read_text())
    driver.send_signal(signal.SIGTERM)
    out, _ = driver.communicate(timeout=60)
  finally:
    if driver.poll() is None:
      driver.kill()
  assert driver.returncode == 128 + signal.SIGTERM, out
  assert "SIGTERM: stopping 1 running stage(s)" in out and (tmp_path / "slow.term").exists()
  assert not os.path.exists(f"/proc/{pid}") and not (tmp_path / "next.done").exists()


def test_result_rows_cli_turns_evaluations_into_rows_and_refuses_a_run_twice(tmp_path):
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  res = {"miniwob/click-test": {"success": 0.57, "episodes": 100}, "miniwob/enter-text": {"success": 0.0, "episodes": 0}}
  (tmp_path / "a.json").write_text(json.dumps({"checkpoint": "x", "results": res}))
  cmd = [sys.executable, "-m", "experiments.result_rows", "--out", str(tmp_path / "rows.json")]
  p = subprocess.run(cmd + [f"grpo_orm:1={tmp_path / 'a.json'}"], cwd=root, capture_output=True, text=True)
  assert p.returncode == 0, p.stderr
  assert R.load_rows(str(tmp_path / "rows.json")) == [  # a task without episodes gives no row
      {"variant": "grpo_orm", "seed": 1, "task": "miniwob/click-test", "episodes": 100, "successes": 57}]
  p = subprocess.run(cmd + [f"x:0={tmp_path / 'a.json'}", f"x:0={tmp_path / 'a.json'}"], cwd=root,
                     capture_output=True, text=True)
  assert p.returncode != 0 and "('x', 0, 'miniwob/click-test') twice" in p.stderr
  p = subprocess.run(cmd + ["x=a.json"], cwd=root, capture_output=True, text=True)
  assert p.returncode != 0 and "expected variant:seed=path" in p.stderr
  # --append: another seed joins the rows already there; the same run again is refused, the file kept
  p = subprocess.run(cmd + ["--append", f"grpo_orm:2={tmp_path / 'a.json'}"], cwd=root, capture_output=True,
                     text=True)
  assert p.returncode == 0, p.stderr
  assert [(r["seed"], r["successes"]) for r in R.load_rows(str(tmp_path / "rows.json"))] == [(1, 57), (2, 57)]
  p = subprocess.run(cmd + ["--append", f"grpo_orm:1={tmp_path / 'a.json'}"], cwd=root, capture_output=True,
                     text=True)
  assert p.returncode != 0 and "('grpo_orm', 1, 'miniwob/click-test') twice" in p.stderr
  assert len(R.load_rows(str(tmp_path / "rows.json"))) == 2


def test_stats_cli_pools_the_runs_of_several_files(tmp_path):
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  better = [[min(1.0, x + 0.1) for x in row] for row in P_SFT]
  for name in ("first", "rerun"):  # the same seed numbers: other runs (a re-made SFT checkpoint)
    (tmp_path / f"{name}.json").write_text(json.dumps(_rows("sft", P_SFT) + _rows("ppo", better)))
  cmd = [sys.executable, "-m", "experiments.replication_stats", "--reps", "200", "--compare", "ppo:sft"]
  p = subprocess.run(cmd + [str(tmp_path / "first.json"), str(tmp_path / "rerun.json")], cwd=root,
                     capture_output=True, text=True)
  assert p.returncode == 0, p.stderr
  assert "training seeds per variant: {'ppo': 6, 'sft': 6}" in p.stdout
  assert "| - | ppo vs sft (as asked) | 6 | +0.100 [" in p.stdout


def test_replication_config_variants_differ_in_one_knob():
  base = cfg_mod.get_config("ppo")
  sft = cfg_mod.get_config("sft")
  assert len([t for t in cfg_mod.TASKS]) >= 3 and base.final_eval_episodes >= 100
  for v in cfg_mod.VARIANTS:
    c = cfg_mod.get_config(v)
    assert (c.tasks, c.env.num_sessions, c.model, c.seed) == (base.tasks, base.env.num_sessions, base.model,
                                                               base.seed)
    assert c.iterations == base.iterations or v in ("ppo_kl_1ep", "ppo_lr1e4_ptx50")  # the two budget variants
  # the budget-allocation variant: more iterations, fewer epochs, no more updates than ppo_kl
  one, kl = cfg_mod.get_config("ppo_kl_1ep"), cfg_mod.get_config("ppo_kl")
  assert one.rl.epochs == 1 and one.iterations > kl.iterations and one.rl.kl_coef == kl.rl.kl_coef
  assert one.iterations * one.rl.epochs <= kl.iterations * kl.rl.epochs
  assert cfg_mod.get_config("grpo").rl.algo == "grpo" and not cfg_mod.get_config("grpo").vpt.enabled
  assert base.vpt.enabled and not cfg_mod.get_config("ppo_novpt").vpt.enabled
  assert (base.rl.lam_policy, base.rl.lam_critic) == (0.95, 1.0)
  c = cfg_mod.get_config("ppo_coupled").rl
  assert c.lam_policy == c.lam_critic == 0.95
  mc, kl = cfg_mod.get_config("ppo_kl_mc").rl, cfg_mod.get_config("ppo_kl").rl
  assert (mc.lam_policy, mc.lam_critic, mc.kl_coef) == (1.0, 1.0, kl.kl_coef)
  ptx = cfg_mod.get_config("ppo_kl_ptx").rl
  assert ptx.ptx_coef > 0 and kl.ptx_coef == base.rl.ptx_coef == 0
  assert {k: v for k, v in ptx.items() if not k.startswith("ptx")} == {k: v for k, v in kl.items()
                                                                       if not k.startswith("ptx")}
  ppo_ptx = cfg_mod.get_config("ppo_ptx").rl  # PPO-ptx without the KL anchor: ppo + the ptx fields
  assert {k: v for k, v in ppo_ptx.items() if not k.startswith("ptx")} == {k: v for k, v in base.rl.items()
                                                                           if not k.startswith("ptx")}
  assert (ppo_ptx.ptx_coef, ppo_ptx.ptx_batch_size) == (ptx.ptx_coef, ptx.ptx_batch_size)
  notext = cfg_mod.get_config("ppo_notext").rl  # ppo with the typed characters out of the policy gradient
  assert notext.skip_typed_text and not base.rl.skip_typed_text
  assert {k: v for k, v in notext.items() if k != "skip_typed_text"} == {k: v for k, v in base.rl.items()
                                                                         if k != "skip_typed_text"}
  low = cfg_mod.get_config("ppo_lr1e4").rl  # ppo with a smaller learning rate and nothing else
  assert low.lr < base.rl.lr and {k: v for k, v in low.items() if k != "lr"} == {k: v for k, v in base.rl.items()
                                                                                 if k != "lr"}
  low_fv = cfg_mod.get_config("ppo_lr1e4_fv").rl  # ppo_lr1e4 with the vision encoders frozen and nothing else
  assert low_fv.freeze_vision and not low.freeze_vision
  assert {k: v for k, v in low_fv.items() if k != "freeze_vision"} == {k: v for k, v in low.items()
                                                                       if k != "freeze_vision"}
  low_task = cfg_mod.get_config("ppo_lr1e4_task").rl  # ppo_lr1e4 with the per-task baseline and nothing else
  assert low_task.task_baseline and not low.task_baseline
  assert {k: v for k, v in low_task.items() if k != "task_baseline"} == {k: v for k, v in low.items()
                                                                         if k != "task_baseline"}
  low_ptx = cfg_mod.get_config("ppo_lr1e4_ptx").rl  # ppo_lr1e4 with ppo_ptx's SFT term and nothing else
  ptx_keys = ("ptx_coef", "ptx_batch_size")
  assert low_ptx.ptx_coef > 0 and low.ptx_coef == 0
  assert {k: low_ptx[k] for k in ptx_keys} == {k: cfg_mod.get_config("ppo_ptx").rl[k] for k in ptx_keys}
  assert {k: v for k, v in low_ptx.items() if k not in ptx_keys} == {k: v for k, v in low.items()
                                                                     if k not in ptx_keys}
  ptx50 = cfg_mod.get_config("ppo_lr1e4_ptx50")  # ppo_lr1e4_ptx with more iterations and nothing else
  assert ptx50.iterations > cfg_mod.get_config("ppo_lr1e4_ptx").iterations and ptx50.rl == low_ptx
  assert cfg_mod.get_config("ppo_thoughts").sft.thoughts and not sft.sft.thoughts
  assert sft.sft.steps == base.sft.steps and sft.data.demo_seeds == base.data.demo_seeds


def test_the_multi_turn_suite_is_the_suite_plus_two_name_copying_tasks_with_experts():
  """replication_multiturn.py changes only the task set, the demonstrations and the SFT budget (1400 updates,
  its guard with them): every other setting is the suite's, for every stage; each task it trains or
  demonstrates has an expert; the turn budget fits search-engine's 5 steps."""
  from experiments.configs import replication_multiturn as multi
  from tars_jax.data.sources import experts
  changed = {"tasks", "data.demo_tasks", "data.demo_seeds_by_task", "sft.steps", "sft.max_minutes"}
  for stage in ("sft", *cfg_mod.VARIANTS):
    a, b = cfg_mod.get_config(stage).to_dict(), multi.get_config(stage).to_dict()
    flat = lambda d, p="": {k2: v2 for k, v in d.items() for k2, v2 in (
        flat(v, f"{p}{k}.").items() if isinstance(v, dict) else [(p + k, v)])}
    fa, fb = flat(a), flat(b)
    assert {k for k in fa if fa[k] != fb[k]} == changed and fa.keys() == fb.keys(), stage
  c = multi.get_config("ppo")
  assert set(c.tasks) - set(cfg_mod.TASKS) == {"miniwob/enter-text-2", "miniwob/search-engine"}
  assert set(c.tasks) | set(c.data.demo_tasks) <= set(experts.experts())
  assert dict(c.data.demo_seeds_by_task)["miniwob/search-engine"] == 240 and c.env.max_turns >= 5
  assert c.sft.steps == 1400 > cfg_mod.get_config("ppo").sft.steps
  assert multi.get_config("ppo+smoke").to_dict() == cfg_mod.get_config("ppo+smoke").to_dict()


def test_execute_runs_what_is_ready_two_at_a_time_one_heavy_and_skips_dependants_of_a_failure(tmp_path):
  """Stages are real subprocesses (python -c) that log their start and end: at most 2 run at once,
  never two heavy ones, none before what it needs, and a failed stage's dependants are skipped."""
  import sys
  log = tmp_path / "events"

  def stage(name, after=(), heavy=False, rc=0):
    code = (f"import time; f=open({str(log)!r},'a'); f.write('+{name}\\n'); f.flush(); time.sleep(0.4); "
            f"f.write('-{name}\\n'); raise SystemExit({rc})")
    done = tmp_path / f"{name}.done"
    if rc == 0:
      code = code.replace("raise SystemExit", f"open({str(done)!r},'w'); raise SystemExit")
    return {"name": name, "argv": [sys.executable, "-c", code], "done": str(done), "after": list(after),
            "dir": None, "heavy": heavy}

  stages = [stage("a", heavy=True), stage("b", heavy=True), stage("c", ["a"]), stage("d", ["a"]),
            stage("bad", ["b"], rc=3), stage("e", ["bad"])]
  status = replicate.execute(stages, str(tmp_path), timeout_min=1, jobs=2)
  assert status == {"a": "ran", "b": "ran", "c": "ran", "d": "ran", "bad": "failed (rc 3)",
                    "e": "skipped: needs bad"}
  running, ended, most, started = set(), set(), 0, []
  needs = {"c": "a", "d": "a", "bad": "b"}
  for line in log.read_text().split():
    name = line[1:]
    if line[0] == "+":
      assert not (name in ("a", "b") and running & {"a", "b"}), "two heavy stages at once"
      assert name not in needs or needs[name] in ended, f"{name} started before {needs[name]} ended"
      running.add(name)
      started.append(name)
      most = max(most, len(running))
    else:
      running.discard(name)
      ended.add(name)
  assert most == 2 and started[0] == "a" and "e" not in started
  again = replicate.execute(stages[:4], str(tmp_path), timeout_min=1, jobs=2)  # a re-run: all done
  assert set(again.values()) == {"done"}


def test_a_second_driver_on_the_same_workdir_is_refused(tmp_path):
  held = replicate.lock_workdir(str(tmp_path))
  with pytest.raises(replicate.WorkdirBusy, match="another experiments/replicate.py"):
    replicate.lock_workdir(str(tmp_path))
  held.close()
  replicate.lock_workdir(str(tmp_path)).close()  # free again once the first one is gone
