"""tars_jax/analysis/critic_by_task.py by hand. experiments/critic_by_task.py on a smoke PPO run's own
rollouts and critic (real sandbox, real checkpoint) is tests/test_pipeline.py's, on the pipeline's run."""

import numpy as np
import pytest

from tars_jax.analysis import critic_by_task as cbt


def test_first_decision_values_are_each_rows_first_model_token():
  values = np.array([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]], np.float32)
  mask = np.array([[0, 0, 1, 1], [1, 0, 1, 0]], np.float32)
  np.testing.assert_array_equal(cbt.first_decision_values(values, mask), np.float32([0.3, 0.5]))
  with pytest.raises(ValueError, match=r"rows \[1\] have no model-written token"):
    cbt.first_decision_values(values, np.array([[1, 0, 0, 0], [0, 0, 0, 0]]))
  with pytest.raises(ValueError, match="differ"):
    cbt.first_decision_values(values, mask[:, :3])


def test_by_task_and_the_share_a_task_only_critic_would_explain():
  tasks = ["b", "a", "a", "b", "a", "b"]
  v = [0.4, 0.1, 0.3, 0.4, 0.2, 0.4]
  ok = [True, False, False, True, True, False]
  rows = cbt.by_task(tasks, np.array(v), ok)
  assert [(r.task, r.episodes) for r in rows] == [("a", 3), ("b", 3)]
  assert rows[0].success == pytest.approx(1 / 3) and rows[1].success == pytest.approx(2 / 3)
  assert rows[0].value == pytest.approx(0.2) and rows[0].value_std == pytest.approx(np.std([0.1, 0.3, 0.2]))
  assert rows[1].value_std == pytest.approx(0.0, abs=1e-12)
  # p = 1/2; between-task sum 3 (1/6)^2 * 2 = 1/6; total 6 * 1/4 = 3/2 -> 1/9
  assert cbt.between_task_share(rows) == pytest.approx(1 / 9)
  # the success variance of episodes about their task's rate is the rest: the law of total variance
  s = np.array(ok, float)
  within = sum(((s[[t == x for t in tasks]] - r.success) ** 2).sum() for x, r in zip("ab", rows))
  assert 1 - within / (len(s) * s.var()) == pytest.approx(cbt.between_task_share(rows))
  assert cbt.between_task_share(cbt.by_task(["a", "b"], np.zeros(2), [True, True])) == 0.0
  with pytest.raises(ValueError, match="2 tasks, 3 values"):
    cbt.by_task(["a", "b"], np.zeros(3), [True, False, True])
