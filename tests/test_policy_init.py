"""`--config.policy.init` (train.state.load_policy): the policy of another run's checkpoint, from a run dir
(latest step) or a step dir, with a fresh optimiser; clear errors for anything else. Also
experiments/eval.py's choice (`evaluation.resolve_run`) of a pipeline run's newest stage."""

import os

import jax
import numpy as np
import pytest

from experiments.configs import miniwob_pipeline
from tars_jax.rollout.evaluation import resolve_run
from tars_jax.train import checkpoint as ckpt
from tars_jax.train import state as state_lib


@pytest.fixture(scope="module")
def parts():
  return state_lib.build(miniwob_pipeline.get_config("+smoke"))


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_load_policy_from_run_dir_and_step_dir(parts, tmp_path):
  a, b = parts.init_state(1), parts.init_state(2)  # two different "trained" policies at steps 10 / 20
  mngr = ckpt.manager(str(tmp_path / "sft"))
  ckpt.save(mngr, 10, a, {"iteration": 10})
  ckpt.save(mngr, 20, b, {"iteration": 20})
  fresh = parts.init_state(0)
  for path, want, step in ((tmp_path / "sft", b, 20), (tmp_path / "sft" / "checkpoints" / "10", a, 10)):
    state, src = state_lib.load_policy(fresh, str(path), parts.popt)
    assert src.endswith(f"checkpoints/{step}")
    assert all(np.array_equal(x, y) for x, y in zip(_leaves(state["policy"]), _leaves(want["policy"])))
    # the critic is the run's own, the policy optimiser starts fresh (Adam moments zero)
    assert all(np.array_equal(x, y) for x, y in zip(_leaves(state["critic"]), _leaves(fresh["critic"])))
    assert all(not np.any(x) for x in _leaves(state["policy_opt"]) if x.dtype == np.float32)


def test_load_policy_errors(parts, tmp_path):
  with pytest.raises(FileNotFoundError, match="policy.init"):
    state_lib.load_policy(parts.init_state(0), str(tmp_path / "nowhere"), parts.popt)
  mngr = ckpt.manager(str(tmp_path / "run"))
  ckpt.save(mngr, 5, parts.init_state(0), {"iteration": 5})
  with pytest.raises(FileNotFoundError, match="no checkpoint 7"):
    state_lib.load_policy(parts.init_state(0), str(tmp_path / "run" / "checkpoints" / "7"), parts.popt)


def test_eval_resolves_the_newest_stage_of_a_pipeline_run(tmp_path):
  run = tmp_path / "main"
  for stage in ("grounding", "sft"):
    os.makedirs(run / stage / "checkpoints")
    (run / stage / "config.json").write_text("{}")
  assert resolve_run(str(run)) == str(run / "sft")
  os.makedirs(run / "ppo")  # started, no checkpoint yet: not evaluated
  (run / "ppo" / "config.json").write_text("{}")
  assert resolve_run(str(run)) == str(run / "sft")
  os.makedirs(run / "ppo" / "checkpoints")
  assert resolve_run(str(run)) == str(run / "ppo")
  assert resolve_run(str(run / "sft")) == str(run / "sft")
  with pytest.raises(FileNotFoundError, match="no config.json"):
    resolve_run(str(tmp_path / "empty"))


def test_fresh_and_loaded_states_compile_a_jitted_step_once(parts, tmp_path):
  # jax.jit keys its programs on whether each argument is committed and a step's outputs always are:
  # an uncommitted leaf (a fresh optimiser's step count) made the first update compile twice.
  mngr = ckpt.manager(str(tmp_path / "sft"))
  ckpt.save(mngr, 1, parts.init_state(1), {"iteration": 1})
  fresh = parts.init_state(0)
  loaded, _ = state_lib.load_policy(fresh, str(tmp_path / "sft"), parts.popt)
  for state in (fresh, loaded, state_lib.load_critic(fresh, _saved_critic(fresh, tmp_path), parts.copt)):
    assert all(x.committed for x in jax.tree.leaves(state))
    step = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s))
    step(step(state))
    assert step._cache_size() == 1


def _saved_critic(state, tmp_path):
  path = str(tmp_path / "critic")
  if not os.path.isdir(path):
    ckpt.save_tree(path, state["critic"])
  return path


def test_init_state_traces_under_eval_shape(parts):
  # the train state's abstract structure (merge tests, the ORM's loader) comes from tracing init_state
  abstract = jax.eval_shape(parts.init_state, 0)
  concrete = parts.init_state(0)
  assert jax.tree.structure(abstract) == jax.tree.structure(concrete)
  assert all(a.shape == c.shape and a.dtype == c.dtype
             for a, c in zip(jax.tree.leaves(abstract), jax.tree.leaves(concrete)))
