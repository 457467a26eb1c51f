"""Constrained-decoding automaton: accepted language, no dead ends, random walks always parse."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tars_jax.agent import actions as A
from tars_jax.agent.grammar import ALL_ACTIONS, accepts, allowed_mask, build_grammar, walk
from tars_jax.agent.tokenizer import EOS, PAD, ByteTokenizer

TOK = ByteTokenizer()


def random_reply(g, rng):
  s, ids = g.start, []
  while s != g.done:
    choices = np.flatnonzero(g.table[s] >= 0)
    t = int(rng.choice(choices))
    ids.append(t)
    s = int(g.table[s, t])
  return ids


def test_accepts_and_rejects():
  g = build_grammar()
  assert accepts(g, "Thought: ok\nAction: click(start_box='(0,1000)')")
  assert accepts(g, "Thought: \nAction: drag(start_box='(1,2)', end_box='(3,4)')")
  assert accepts(g, "Thought: x\nAction: hotkey(key='ctrl shift t')")
  assert accepts(g, "Thought: x\nAction: scroll(start_box='(5,5)', direction='up')")
  assert not accepts(g, "Thought: x\nAction: click(start_box='(01,5)')")  # leading zero
  assert not accepts(g, "Thought: x\nAction: click(start_box='(1001,5)')")
  assert not accepts(g, "Action: wait()")
  assert not accepts(g, "Thought: a\nb\nAction: wait()")  # newline inside the thought
  f3 = build_grammar(actions=("click",), max_thought_bytes=0, coord_format="fixed3")
  assert accepts(f3, "Thought: \nAction: click(start_box='(007,999)')")
  assert not accepts(f3, "Thought: \nAction: click(start_box='(7,999)')")
  assert not accepts(f3, "Thought: a\nAction: click(start_box='(007,999)')")
  with pytest.raises(ValueError):
    build_grammar(actions=("fly",))


@pytest.mark.parametrize("kw", [dict(), dict(actions=("click",), max_thought_bytes=0, coord_format="fixed3")])
def test_no_dead_states_and_done_only_pads(kw):
  g = build_grammar(**kw)
  t = g.table
  assert (t[g.done] >= 0).sum() == 1 and t[g.done, PAD] == g.done
  # every non-done state has a move, and every EOS move is from an accepting state
  for s in range(g.num_states):
    if s != g.done:
      assert (t[s] >= 0).any()
      assert (t[s, EOS] >= 0) == g.accepting[s]
  # every state reaches done (backwards closure from done covers all)
  live, changed = {g.done}, True
  while changed:
    changed = False
    for s in range(g.num_states):
      if s not in live and any(int(n) in live for n in t[s] if n >= 0):
        live.add(s); changed = True
  assert live == set(range(g.num_states))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_random_walks_parse(seed):
  g = build_grammar()
  ids = random_reply(g, np.random.default_rng(seed))
  assert ids[-1] == EOS
  thought, act = A.parse_response(TOK.decode(ids[:-1]))
  assert isinstance(act, tuple(getattr(A, n) for n in
                               ("Click", "LeftDouble", "RightSingle", "Drag", "Hotkey", "Type", "Scroll",
                                "Wait", "Finished", "CallUser")))
  states = walk(g, ids)
  assert (states >= 0).all() and states[0] == g.start
  assert allowed_mask(g, states)[np.arange(len(ids)), ids].all()


def test_click_only_fixed3_is_uniform_over_the_screen():
  g = build_grammar(actions=("click",), max_thought_bytes=0, coord_format="fixed3")
  rng = np.random.default_rng(0)
  first = np.zeros(10)
  for _ in range(2000):
    a = A.parse_response(TOK.decode(random_reply(g, rng)[:-1]))[1]
    assert isinstance(a, A.Click)
    first[min(int(a.x * 10), 9)] += 1
  chi2 = ((first - 200) ** 2 / 200).sum()
  assert chi2 < 27.9  # 9 dof, p = 0.001
  print("states:", g.num_states, "full grammar states:", build_grammar().num_states)
