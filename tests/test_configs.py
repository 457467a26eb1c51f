"""Every config under experiments/configs/ with every arg it accepts (its module's `ARGS`): decoupled
GAE lambdas as in the report (section 2.5.4: lambda_critic = 1, lambda_policy < 1), every field of the
base config set, and the hyper-parameters and reward config the trainer builds from it.
Also: code that reads a config has no defaults of its own (a missing field is an error)."""

import dataclasses
import glob
import importlib
import os

import pytest

from experiments.configs import miniwob_ppo, replication
from tars_jax.train import ppo
from tars_jax.train import state as state_lib

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "configs")
MODULES = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(CONFIG_DIR, "*.py"))
                 if not p.endswith("__init__.py"))
# The one config that couples the lambdas on purpose: the ablation measuring what decoupling buys.
COUPLED = {"ppo_coupled", "ppo_coupled+smoke"}


def _cases():
  for name in MODULES:
    mod = importlib.import_module(f"experiments.configs.{name}")
    assert isinstance(getattr(mod, "ARGS", None), tuple) and mod.ARGS, f"{name}.py has no ARGS tuple"
    for arg in mod.ARGS:
      yield name, arg


CASES = list(_cases())


def _keys(c, prefix=""):
  out = set()
  for k, v in c.items():
    # mesh and verticals hold data keyed by name (axes, task sets), not settings with one default each
    out |= _keys(v, f"{prefix}{k}.") if hasattr(v, "items") and k not in ("mesh", "verticals") else {prefix + k}
  return out


def _hparams(c):
  return state_lib.hparams(c)


def test_every_config_module_is_covered():
  assert {"miniwob_ppo", "miniwob_ablations", "games", "value_pretrain"} <= set(MODULES)
  assert sum(1 for n, _ in CASES if n == "miniwob_ablations") == 11  # "", 5 variants, 5 smoke


@pytest.mark.parametrize("name,arg", CASES)
def test_config_lambdas_fields_and_hparams(name, arg):
  c = importlib.import_module(f"experiments.configs.{name}").get_config(arg)
  hp = _hparams(c)
  r = c.rl
  if arg in COUPLED:
    assert name in ("miniwob_ablations", "value_pretrain", "replication", "replication_multiturn") and (
        r.lam_policy == r.lam_critic == 0.95)
  elif r.algo == "ppo":  # GAE is used: unbiased value targets, lower-variance policy advantages
    assert (r.lam_critic, hp.lam_critic) == (1.0, 1.0)
    if arg.startswith("ppo_kl_mc"):  # the replication suite's Monte-Carlo arm: lambda_policy 1 on purpose
      assert name.startswith("replication") and (r.lam_policy, hp.lam_policy) == (1.0, 1.0)
    else:
      assert 0.0 < r.lam_policy < 1.0 or r.length_adaptive_alpha is not None
  else:  # group-relative: a baseline needs two episodes per group
    assert r.group_size >= 2
  # every config sets every field of the base config (the one place defaults live)
  assert _keys(c) == _keys(miniwob_ppo.get_config(""))
  assert (hp.algo, hp.lam_policy, hp.ent_coef, hp.kl_coef) == (r.algo, r.lam_policy, r.ent_coef, r.kl_coef)
  assert hp.temperature == c.sampling.temperature
  rc = state_lib.reward_config(r)
  assert (rc.truncation_reward, rc.step_penalty) == (r.truncation_reward, r.step_penalty)
  if r.algo == "ppo":
    assert c.env.num_sessions % r.group_size == 0
  assert c.eval_every >= 0 and c.eval_episodes >= 1 and c.env.eval_seed_offset > c.vpt.seed_offset
  if "desktop" in c.env.launch:  # a lockstep batch may be all desktop episodes: each needs its session
    assert c.env.desktop_sessions >= c.env.num_sessions


def test_lambdas_of_the_main_configs():
  # the values of the report's recipe (section 2.5.4), read from the configs the README runs
  for arg in ("", "ppo", "smoke"):
    r = miniwob_ppo.get_config(arg).rl
    assert (r.lam_policy, r.lam_critic) == (0.95, 1.0)


def test_ppo_hparams_have_no_defaults():
  missing = [f.name for f in dataclasses.fields(ppo.PPOHparams)
             if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
  assert missing == [f.name for f in dataclasses.fields(ppo.PPOHparams)]
  with pytest.raises(TypeError):
    ppo.PPOHparams(algo="ppo")


@pytest.mark.parametrize("field", ["kl_coef", "kl_kind", "length_adaptive_alpha", "lam_policy"])
def test_missing_rl_field_is_an_error(field):
  c = miniwob_ppo.get_config("smoke")
  del c.rl[field]
  with pytest.raises(AttributeError, match=field):
    _hparams(c)


def test_a_run_config_without_outcome_keeps_the_raw_reward():
  # config.json of a run made before rl.outcome existed: evaluation and resume read it as trained
  r = miniwob_ppo.get_config("smoke").rl
  del r["outcome"]
  assert state_lib.reward_config(r).outcome == "raw"
  assert state_lib.reward_config(replication.get_config("ppo+smoke").rl).outcome == "success"


@pytest.mark.parametrize("field", ["step_penalty", "overlong_weight", "overlong_max_tokens", "overlong_buffer"])
def test_missing_reward_field_is_an_error(field):
  r = miniwob_ppo.get_config("smoke").rl
  del r[field]
  with pytest.raises(AttributeError, match=field):
    state_lib.reward_config(r)
