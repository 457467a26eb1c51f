"""experiments/sweep.py planning and summaries, experiments/plot.py sweep plot, ablation configs
(no subprocesses here; the real end-to-end sweep is tests/test_sweep_e2e.py, marked slow)."""

import json
import os

import numpy as np
import pytest

from experiments import plot, sweep
from experiments.configs import miniwob_ablations, miniwob_ppo
from tars_jax.train import run as run_lib

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "experiments/configs/miniwob_ablations.py")


def test_ablation_variants_share_tasks_budget_and_differ_in_one_knob():
  base = miniwob_ablations.get_config("ppo")
  for v in miniwob_ablations.VARIANTS:
    c = miniwob_ablations.get_config(v)
    assert c.tasks == miniwob_ablations.TASKS and c.iterations == base.iterations
    assert c.env.num_sessions == base.env.num_sessions and c.model == base.model
    assert "type" in c.grammar.actions and c.env.max_turns > 2
  assert miniwob_ablations.get_config("grpo").rl.algo == "grpo"
  assert miniwob_ablations.get_config("ppo_vpt").vpt.enabled and not base.vpt.enabled
  coupled = miniwob_ablations.get_config("ppo_coupled").rl
  assert coupled.lam_policy == coupled.lam_critic == 0.95
  assert miniwob_ablations.get_config("ppo_lenadapt").rl.length_adaptive_alpha == 0.05
  assert base.rl.length_adaptive_alpha is None and (base.rl.lam_policy, base.rl.lam_critic) == (0.95, 1.0)
  with pytest.raises(ValueError, match="expected one of"):
    miniwob_ablations.get_config("ppo+large")
  # the demo config keeps its behaviour: new knobs are off by default
  demo = miniwob_ppo.get_config()
  assert (demo.rl.kl_coef, demo.rl.step_penalty, demo.rl.overlong_weight, demo.critic.init) == (0.0, 0.0, 0.0, "")
  assert demo.rl.length_adaptive_alpha is None and demo.rl.clip_c is None


def test_plan_stages_seeds_and_overrides(tmp_path):
  runs = sweep.plan(CONFIG, ["ppo_vpt", "grpo"], [0, 1], "+smoke", ["iterations=3"], str(tmp_path))
  # seed-major: a sweep cut short still has every variant on its first seeds
  assert [(r["variant"], r["seed"]) for r in runs] == [("ppo_vpt", 0), ("grpo", 0), ("ppo_vpt", 1), ("grpo", 1)]
  vpt_run, grpo_run = runs[2], runs[3]
  assert [s[2] for s in vpt_run["stages"]] == ["experiments.value_pretrain", "experiments.train"]
  pre, train = vpt_run["stages"]
  d = os.path.join(str(tmp_path), "ppo_vpt", "seed_1")
  assert pre[pre.index("--workdir") + 1] == os.path.join(d, "value_pretrain")
  assert train[-1] == f"--config.critic.init={os.path.join(d, 'value_pretrain', 'critic')}"
  assert f"{CONFIG}:ppo_vpt+smoke" in train and "--config.seed=1" in train and "--config.iterations=3" in train
  assert len(grpo_run["stages"]) == 1 and "--config.critic.init" not in " ".join(grpo_run["stages"][0])
  forced = sweep.plan(CONFIG, ["grpo"], [0], "+smoke", ["vpt.enabled=true"], str(tmp_path))
  assert len(forced[0]["stages"]) == 2
  with pytest.raises(ValueError, match="key=value"):
    sweep.plan(CONFIG, ["ppo"], [0], "", ["iterations"], str(tmp_path))


def _fake_run(d, success):
  os.makedirs(d)
  with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    for i, s in enumerate(success):
      f.write(json.dumps({"step": i + 1, "episodes_total": 4 * (i + 1), "success_rate": s, "reward": s}) + "\n")


def test_summary_and_sweep_plot(tmp_path):
  runs = []
  for variant, seeds in (("a", [[0.0, 0.5, 1.0], [0.0, 0.0, 0.5]]), ("b", [[0.0, 0.0, 0.0]])):
    for s, curve in enumerate(seeds):
      d = str(tmp_path / variant / f"seed_{s}")
      _fake_run(d, curve)
      runs.append({"variant": variant, "seed": s, "dir": d, "rc": 0})
  out = sweep.summarize(runs, last=2)
  # finals: a/0 = mean(0.5, 1) = 0.75, a/1 = mean(0, 0.5) = 0.25 -> mean 0.5, std 0.25
  assert out["variants"]["a"] == {"mean": 0.5, "std": 0.25, "seeds": 2}
  assert out["variants"]["b"]["mean"] == 0.0
  png = plot.plot_sweep(runs, str(tmp_path / "cmp.png"))
  assert os.path.getsize(png) > 10_000
  with pytest.raises(FileNotFoundError):
    plot.plot_sweep([{"variant": "c", "seed": 0, "dir": str(tmp_path / "missing")}], str(tmp_path / "x.png"))
  assert np.isnan(sweep.summarize([{"variant": "c", "seed": 0, "dir": str(tmp_path / "missing")}])
                  ["runs"][0]["final_success"])


def test_rerun_skips_finished_stages(tmp_path):
  runs = sweep.plan(CONFIG, ["ppo_vpt"], [0], "+smoke", ["iterations=3"], str(tmp_path))
  run = runs[0]
  assert run["iterations"] == 3
  vpt_dir = os.path.join(run["dir"], "value_pretrain")
  for d, step in ((vpt_dir, 2), (run["dir"], 3)):  # what run.finish leaves: a checkpoint and done.json naming it
    assert not run_lib.is_done(d)
    os.makedirs(os.path.join(d, "checkpoints", str(step)))
    with open(os.path.join(d, "done.json"), "w") as f:
      json.dump({"stage": "x", "checkpoint": step}, f)
    assert run_lib.is_done(d)
  res = sweep._execute(run, timeout_min=1.0)  # both stages done: nothing is launched
  assert res["rc"] == 0
  with open(run["log"]) as f:
    log = f.read()
  assert log.count("[sweep] skip finished stage") == 2 and "[sweep] $" not in log
