"""The ablation config (experiments/configs/miniwob_ablations.py: RL from the config's own init, no SFT
stage) and experiments/replicate.py's plan for such a config; end to end (`-m long`) on the real sandbox
(Chromium, HTTP server, Orbax): two variants, tiny budget. The `ppo_vpt` variant runs value pretraining
first (experiments/value_pretrain.py) and PPO starts from its critic (--config.critic.init); with the
critic's learning rate at 0 the PPO checkpoint must hold exactly the pretrained critic."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import replicate
from experiments.configs import miniwob_ablations, miniwob_ppo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "experiments/configs/miniwob_ablations.py")
REPLICATION = os.path.join(ROOT, "experiments/configs/replication.py")


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


def test_a_config_without_sft_plans_value_pretraining_rl_and_evaluation_per_seed(tmp_path):
  assert not replicate.has_sft(CONFIG) and replicate.has_sft(REPLICATION)
  assert replicate.stage_args(["grpo", "ppo_vpt"], False) == ["grpo", "ppo_vpt"]
  assert replicate.stage_args(["ppo_thoughts"], True) == ["ppo_thoughts", "sft", "sft_thoughts"]
  st = replicate.plan(CONFIG, str(tmp_path), [0, 1], ["ppo_vpt", "grpo"], "+smoke", overrides=["iterations=3"])
  assert [s["name"] for s in st] == [
      "vpt/seed_0", "ppo_vpt/seed_0", "eval/ppo_vpt/seed_0", "vpt/seed_1", "ppo_vpt/seed_1", "eval/ppo_vpt/seed_1",
      "grpo/seed_0", "eval/grpo/seed_0", "grpo/seed_1", "eval/grpo/seed_1"]
  by = {s["name"]: s for s in st}
  vpt = by["vpt/seed_1"]
  assert vpt["after"] == [] and vpt["argv"][2] == "experiments.value_pretrain"
  assert "--config.seed=1" in vpt["argv"] and "--config.iterations=3" in vpt["argv"]
  assert not any("policy_run" in a or "policy.init" in a for a in vpt["argv"])  # the config's own init
  ppo = by["ppo_vpt/seed_1"]
  assert ppo["after"] == ["vpt/seed_1"] and f"{CONFIG}:ppo_vpt+smoke" in ppo["argv"]
  assert ppo["argv"][-1] == f"--config.critic.init={tmp_path}/vpt/seed_1/critic"
  assert not any("policy.init" in a for a in ppo["argv"]) and "--config.iterations=3" in ppo["argv"]
  grpo = by["grpo/seed_0"]
  assert grpo["after"] == [] and not any("critic.init" in a for a in grpo["argv"])
  assert by["eval/grpo/seed_0"]["argv"][-1] == f"{tmp_path}/grpo/seed_0/eval.json"
  assert by["eval/grpo/seed_0"]["argv"][by["eval/grpo/seed_0"]["argv"].index("--tasks") + 1] == ",".join(
      miniwob_ablations.TASKS)
  with pytest.raises(ValueError, match="no SFT stage"):
    replicate.plan(CONFIG, str(tmp_path), [0], ["grpo"], "+smoke", sft_seed=0)


@pytest.mark.long  # 7 min on the 2-core machine beside an RL run: value pretraining, two RL runs, two evaluations
@pytest.mark.browser
def test_value_pretraining_then_ppo_and_grpo_from_the_configs_init(tmp_path):
  import jax

  from tars_jax.train import checkpoint as ckpt
  from tars_jax.train import state as state_lib
  work = tmp_path / "ablations"
  cmd = [sys.executable, "-m", "experiments.replicate", "--config", CONFIG, "--variants", "ppo_vpt,grpo",
         "--seeds", "0", "--suffix", "+smoke", "--set", "vpt.max_iterations=1", "--set", "rl.critic_lr=0.0",
         "--workdir", str(work)]
  p = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                     timeout=1500)
  logs = "".join(f.read_text()[-3000:] for f in sorted((work / "logs").glob("*.log"))) if (work / "logs").exists() else ""
  assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:] + logs
  assert "Finished runs per variant (seeds with a held-out evaluation): grpo 1, ppo_vpt 1" in p.stdout

  vpt_dir = work / "vpt" / "seed_0"
  summary = json.load(open(vpt_dir / "value_pretrain.json"))
  assert summary["iterations"] == 1 and summary["stopped_by"] in ("thresholds", "max_iterations")
  vrow = json.loads(open(vpt_dir / "metrics.jsonl").readline())
  assert np.isfinite(vrow["train/fresh_value_loss"]) and "train/explained_variance" in vrow
  assert f"critic initialised from {vpt_dir / 'critic'}" in (work / "logs" / "ppo_vpt_seed_0.log").read_text()

  # metrics of issue #4 item 5 in the PPO run; multi-step tasks played with click + type
  row = json.loads(open(work / "ppo_vpt" / "seed_0" / "metrics.jsonl").readline())
  for key in ("reward", "success_rate", "train/entropy", "train/approx_kl", "train/clipfrac_low",
              "train/clipfrac_high", "train/value_loss", "train/explained_variance",
              "train/value_return_corr", "think_tokens", "steps_per_episode", "train/policy_grad_norm",
              "reward_terms/outcome", "reward_terms/format", "reward_terms/overlong", "reward_terms/step",
              "reward_terms/truncation", "train/lam_policy_mean"):
    assert key in row, key
  assert row["train/lam_policy_mean"] == pytest.approx(0.95)
  cfg = json.load(open(work / "ppo_vpt" / "seed_0" / "config.json"))
  assert cfg["tasks"][1] == "miniwob/enter-text" and cfg["grammar"]["actions"] == ["click", "type"]
  assert cfg["policy"]["init"] == ""  # the config's own init: no SFT stage

  # PPO's critic (learning rate 0) is exactly the pretrained one
  parts = state_lib.build(miniwob_ablations.get_config("ppo_vpt+smoke"))
  target = parts.init_state(0)
  pre = ckpt.restore_tree(str(vpt_dir / "critic"), target["critic"])
  _, after, _ = ckpt.restore(ckpt.manager(str(work / "ppo_vpt" / "seed_0")), target)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), after["critic"], pre)
  changed = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), pre, target["critic"])
  assert any(jax.tree.leaves(changed))  # and it is not the random init: pretraining moved it

  grow = json.loads(open(work / "grpo" / "seed_0" / "metrics.jsonl").readline())
  assert "train/informative_fraction" in grow
  # held-out rows of both runs: the config's 4 tasks x its final_eval_episodes (2 at smoke size)
  rows = json.load(open(work / "replication.json"))
  assert sorted({(r["variant"], r["seed"]) for r in rows}) == [("grpo", 0), ("ppo_vpt", 0)]
  assert all(r["episodes"] == 2 for r in rows) and len(rows) == 2 * len(miniwob_ablations.TASKS)
  assert os.path.getsize(work / "curves.png") > 10_000
