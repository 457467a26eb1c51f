"""`explore/*` metrics of an iteration's episodes (train/metrics.py): free decisions under the real
reply grammar, entropy per free decision from the sampled log-probs, distinct first clicks per screen
(groups and group_size 1), all against hand-worked numbers."""

import numpy as np
import pytest

from tars_jax.agent import grammar as G
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.agent.trajectory import Episode, Turn
from tars_jax.train import metrics as TM

TOK = ByteTokenizer()
TABLE = np.array([[0, 0, 1, -1], [-1, -1, -1, 0]], np.int32)  # state 0: 3 tokens; state 1: forced


def _turn(text="", states=(), logprobs=()):
  return Turn(image=np.zeros((1, 1, 3), np.uint8), obs_ids=[], reply_ids=list(range(len(states))),
              logprobs=np.asarray(logprobs, np.float32), states=np.asarray(states, np.int32), text=text)


def _click(x, y):
  return f"Thought: \nAction: click(start_box='({x},{y})')"


def test_free_tokens_of_a_click_reply_under_the_main_grammar():
  # The main config's grammar (click only, no thought, 'tens3'): of the 47 tokens (46 bytes and EOS)
  # only the first two digits of each coordinate are choices: 43 tokens are forced.
  g = G.build_grammar(TOK, ("click",), max_thought_bytes=0, max_content_bytes=16, coord_format="tens3")
  ids = TOK.encode(_click("570", "610")) + [TOK.eos_id]
  states = G.walk(g, ids)
  assert (states >= 0).all()
  free = TM.free_tokens(states, (g.table >= 0).sum(-1))
  text = _click("570", "610")
  assert [text[i] for i in np.nonzero(free[:-1])[0]] == ["5", "7", "6", "1"]
  assert not free[-1]  # EOS after the closing quote and parenthesis: forced
  assert len(ids) == 47 and free.sum() == 4
  np.testing.assert_array_equal(TM.free_tokens(states, None), np.ones(len(ids), bool))  # no grammar


def test_entropy_free_and_free_decisions_per_turn_by_hand():
  # turn 1: states 0 1 0 -1 (-1 = sampled without grammar: a decision), -log p 0.5 0 1.5 1.0;
  # turn 2: both tokens forced. Free decisions: 3 over 2 turns; entropy estimate (0.5 + 1.5 + 1) / 3.
  ep = Episode("a", 1, "", [], turns=[_turn(_click(5, 5), [0, 1, 0, -1], [-0.5, 0.0, -1.5, -1.0]),
                                      _turn("", [1, 1], [0.0, 0.0])])
  m = TM.exploration_metrics([ep], TABLE)
  assert m["explore/entropy_free"] == pytest.approx(1.0)
  assert m["explore/free_decisions_per_turn"] == pytest.approx(1.5)
  m = TM.exploration_metrics([ep], None)  # every token counted: 3 nats over 6 tokens, 3 per turn
  assert m["explore/entropy_free"] == pytest.approx(0.5)
  assert m["explore/free_decisions_per_turn"] == pytest.approx(3.0)


def test_click_point_parses_the_first_action_point():
  assert TM.click_point(_click("570", "610")) == TM.click_point(_click(570, 610))
  assert TM.click_point(_click("050", "610")) == TM.click_point(_click(50, 610))  # 'tens3' spelling
  assert TM.click_point(_click(50, 610)) != TM.click_point(_click(610, 50))
  assert TM.click_point("Action: left_double(start_box='(1,2)')") == TM.click_point(_click(1, 2))
  assert TM.click_point("Action: drag(start_box='(1,2)', end_box='(3,4)')") == TM.click_point(_click(1, 2))
  assert TM.click_point("Action: type(content='hi')") is None
  assert TM.click_point("Thought: no action") is None
  assert TM.click_point("Action: click(start_box='(1,2") is None  # cut off: does not parse


def test_distinct_clicks_per_screen_with_groups():
  # screen (a, 1): clicks P, P, Q and an invalid reply -> 2 distinct; screen (b, 2): P four times -> 1;
  # screen (a, 3) lost its other episodes -> left out. Mean (2 + 1) / 2.
  p, q = (0.5, 0.6), (0.1, 0.2)
  screens = [("a", 1)] * 4 + [("b", 2)] * 4 + [("a", 3)]
  clicks = [p, p, q, None, p, p, p, p, q]
  assert TM.distinct_clicks_per_screen(screens, clicks) == pytest.approx(1.5)


def test_distinct_clicks_per_screen_without_groups():
  # group_size 1: task a clicks P, P, Q on three screens -> 2 / 3; task b clicks P, Q -> 2 / 2
  p, q = (0.5, 0.6), (0.1, 0.2)
  screens = [("a", 1), ("a", 2), ("a", 3), ("b", 4), ("b", 5)]
  assert TM.distinct_clicks_per_screen(screens, [p, p, q, p, q]) == pytest.approx((2 / 3 + 1) / 2)
  assert TM.distinct_clicks_per_screen(screens, [p] * 5) == pytest.approx((1 / 3 + 1 / 2) / 2)  # collapsed
  assert TM.distinct_clicks_per_screen([], []) == 0.0
  with pytest.raises(ValueError, match="2 screens but 1 clicks"):
    TM.distinct_clicks_per_screen([("a", 1), ("a", 1)], [p])


def test_episode_metrics_reports_exploration_of_the_first_turns():
  eps = [Episode("a", 7, "", [], turns=[_turn(_click(x, 10), [0, 0], [-1.0, -2.0]), _turn(_click(0, 0), [0], [-3.0])])
         for x in (100, 100, 200)]
  m = TM.episode_metrics(eps, ("a",), TOK, TABLE)
  assert m["explore/distinct_clicks_per_screen"] == 2.0  # second turns (all at 0,0) do not count
  assert m["explore/entropy_free"] == pytest.approx(2.0)
  assert m["explore/free_decisions_per_turn"] == pytest.approx(1.5)
  assert m["success/a"] == 0.0


def test_think_tokens_per_task_counts_the_thought_bytes_of_scored_episodes():
  """Held-out think length (docs/replication.md row 5): bytes of the text between `Thought:` and
  `Action:` under the byte tokenizer, averaged over each task's turns; lost episodes are not scored."""
  def ep(task, thoughts, lost=False):
    return Episode(task=task, seed=0, instruction="", prefix_ids=[], lost=lost,
                   turns=[_turn(f"Thought: {t}\nAction: click(start_box='(1,2)')") for t in thoughts])
  eps = [ep("a", ["go", "press ok"]), ep("a", ["abcdef"]), ep("b", [""]), ep("a", ["x" * 40], lost=True),
         ep("c", ["never scored"], lost=True)]
  got = TM.think_tokens_per_task(eps, TOK)
  assert set(got) == {"a", "b", "c"}
  assert got["a"] == pytest.approx((2 + 8 + 6) / 3) and got["b"] == 0.0 and np.isnan(got["c"])
  assert TM.episode_metrics(eps[:2], ["a"], TOK)["think_tokens"] == pytest.approx(got["a"])
