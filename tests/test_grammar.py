"""Constrained-decoding automaton: accepted language, no dead ends, random walks always parse."""

import json
import re

import interegular
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tars_jax.agent import actions as A
from tars_jax.agent.grammar import (ALL_ACTIONS, KEYS, MCP_MAX_FIELDS, SDK_ACTIONS, accepts, allowed_mask,
                                    build_grammar, walk)
from tars_jax.agent.tokenizer import EOS, PAD, ByteTokenizer

TOK = ByteTokenizer()
CLASSES = {"click": A.Click, "left_double": A.LeftDouble, "right_single": A.RightSingle, "drag": A.Drag,
           "hotkey": A.Hotkey, "type": A.Type, "scroll": A.Scroll, "wait": A.Wait, "finished": A.Finished,
           "call_user": A.CallUser}
GRAMMARS = [dict(), dict(coord_format="fixed3"), dict(actions=("click",)),
            dict(actions=("click",), max_thought_bytes=0, coord_format="fixed3"),
            dict(actions=("type", "hotkey", "wait"), max_thought_bytes=9, max_content_bytes=8,
                 thought_charset="Acino: ")]


def random_reply(g, rng):
  """Token ids of a uniformly random walk through the table, up to and including EOS."""
  s, ids = g.start, []
  while s != g.done:
    t = int(rng.choice(np.flatnonzero(g.table[s] >= 0)))
    ids.append(t)
    s = int(g.table[s, t])
  return ids


def reference_accepts(g, text):
  """Independent reference: Python `re` on the documented regex + the single-'Action:' rule."""
  return re.fullmatch(g.regex, text) is not None and text.count("Action:") == 1


def test_accepts_and_rejects_by_hand():
  g = build_grammar()
  ok = ["Thought: ok\nAction: click(start_box='(0,1000)')",
        "Thought: \nAction: left_double(start_box='(999,5)')",
        "Thought: it's \"here\" \\o/\nAction: right_single(start_box='(10,100)')",
        "Thought: \nAction: drag(start_box='(1,2)', end_box='(3,4)')",
        "Thought: x\nAction: hotkey(key='ctrl shift t')",
        "Thought: x\nAction: hotkey(key='f12')",
        "Thought: x\nAction: type(content='')",
        "Thought: x\nAction: type(content='Hello, world! (a+b)=\"c\"')",
        "Thought: x\nAction: scroll(start_box='(5,5)', direction='left')",
        "Thought: wait\nAction: wait()",
        "Thought: done\nAction: finished(content='42')",
        "Thought: ?\nAction: call_user()",
        "Thought: " + "t" * 32 + "\nAction: wait()",
        "Thought: x\nAction: type(content='" + "c" * 32 + "')",
        "Thought: Action x\nAction: type(content='Action')"]
  bad = ["",
         "Action: wait()",  # no thought line
         "Thought: x\nAction: wait",
         "Thought: x\nAction: wait() ",  # trailing byte
         "Thought: a\nb\nAction: wait()",  # newline inside the thought
         "Thought: " + "t" * 33 + "\nAction: wait()",
         "Thought: x\nAction: type(content='" + "c" * 33 + "')",
         "Thought: x\nAction: click(start_box='(01,5)')",  # leading zero
         "Thought: x\nAction: click(start_box='(1001,5)')",
         "Thought: x\nAction: click(start_box='(-1,5)')",
         "Thought: x\nAction: click(start_box='(1, 5)')",  # space after the comma
         "Thought: x\nAction: click(start_box=\"(1,5)\")",
         "Thought: x\nAction: left_single(start_box='(1,5)')",  # parser variant, not written by us
         "Thought: x\nAction: hotkey(key='ctrl shift alt t')",  # 4 keys
         "Thought: x\nAction: hotkey(key='ctrl  c')",
         "Thought: x\nAction: hotkey(key='ctrl+c')",
         "Thought: x\nAction: hotkey(key='win')",
         "Thought: x\nAction: hotkey(key='')",
         "Thought: x\nAction: type(content='it's')",
         "Thought: x\nAction: type(content='a\\nb')",
         "Thought: x\nAction: scroll(start_box='(5,5)', direction='north')",
         "Thought: x\nAction: wait(1)",
         "Thought: é\nAction: wait()",  # non-ASCII
         # a second 'Action:' is excluded: replies split at 'Action:' (first or last) must be unambiguous
         "Thought: \nAction: type(content='Action: wait()')",
         "Thought: Action: x\nAction: wait()"]
  for s in ok:
    assert accepts(g, s), s
    assert reference_accepts(g, s), s
    A.parse_response(s)
  for s in bad:
    assert not accepts(g, s), s
    assert not reference_accepts(g, s), s


def test_fixed3_restricted_actions_and_thought_charset():
  f3 = build_grammar(actions=("click",), max_thought_bytes=0, coord_format="fixed3")
  assert accepts(f3, "Thought: \nAction: click(start_box='(007,999)')")
  assert accepts(f3, "Thought: \nAction: click(start_box='(000,000)')")
  assert not accepts(f3, "Thought: \nAction: click(start_box='(7,999)')")
  assert not accepts(f3, "Thought: \nAction: click(start_box='(1000,999)')")
  assert not accepts(f3, "Thought: a\nAction: click(start_box='(007,999)')")
  assert not accepts(f3, "Thought: \nAction: wait()")
  g = build_grammar(actions=["wait", "click"], thought_charset="ab ")  # a list works too
  assert accepts(g, "Thought: ab ba\nAction: wait()")
  assert not accepts(g, "Thought: abc\nAction: wait()")
  assert not accepts(g, "Thought: \nAction: call_user()")
  for kw in [dict(actions=("fly",)), dict(actions=()), dict(coord_format="float"),
             dict(thought_charset="a\n"), dict(thought_charset="é"), dict(max_thought_bytes=-1)]:
    with pytest.raises(ValueError):
      build_grammar(**kw)


def test_state_counts_by_hand_and_minimal():
  # click-only, no thought, fixed3: one chain. "Thought: \nAction: click(start_box='(" is 36 bytes,
  # then ddd,ddd (7) and ")')" (3): 46 bytes -> 47 states on the chain + done = 48.
  g = build_grammar(actions=("click",), max_thought_bytes=0, coord_format="fixed3")
  assert g.num_states == 48
  assert (g.table[:47] >= 0).sum(1).tolist() == [1] * 36 + [10] * 3 + [1] + [10] * 3 + [1] * 3 + [1]
  # 'int': each number needs 7 states (start, after 0 / 3 digits / 1000, after [2-9], after 2 digits,
  # after 1, after 10, after 100), so 36 + 2 * 7 + 3 + done = 54.
  assert build_grammar(actions=("click",), max_thought_bytes=0).num_states == 54
  # minimal: same count as interegular's Brzozowski reduction (grammars where 'Action:' cannot recur)
  for kw in [dict(actions=("click",), max_thought_bytes=0), dict(actions=("click", "hotkey", "wait"), max_thought_bytes=0),
             dict(actions=("click", "type", "finished"), max_thought_bytes=0, max_content_bytes=5)]:
    g = build_grammar(**kw)
    assert g.num_states - 1 == len(interegular.parse_pattern(g.regex).to_fsm().reduce().states)
  full, click = build_grammar(), build_grammar(actions=("click",))
  print(f"\nstates: default {full.num_states}, click-only {click.num_states}, click-only fixed3 no "
        f"thought {build_grammar(actions=('click',), max_thought_bytes=0, coord_format='fixed3').num_states}")
  assert 300 <= full.num_states <= 3000 and click.num_states < full.num_states


@pytest.mark.parametrize("kw", GRAMMARS)
def test_no_dead_states_and_special_tokens(kw):
  g = build_grammar(**kw)
  t = g.table
  assert t.shape == (g.num_states, TOK.vocab_size) and t.dtype == np.int32 and g.done == g.num_states - 1
  assert (t[g.done] >= 0).sum() == 1 and t[g.done, PAD] == g.done
  assert (t[:, 128:256] < 0).all()  # non-ASCII bytes never
  assert (t[:, [i for i in range(256, TOK.vocab_size) if i not in (PAD, EOS)]] < 0).all()
  assert (t[:, PAD] >= 0).sum() == 1
  assert ((t[:, EOS] >= 0) == g.accepting).all() and (t[g.accepting, EOS] == g.done).all()
  assert not g.accepting[g.done]
  # every state is reachable from start ...
  reach, frontier = {g.start}, [g.start]
  while frontier:
    s = frontier.pop()
    for n in t[s][t[s] >= 0]:
      if int(n) not in reach:
        reach.add(int(n)); frontier.append(int(n))
  assert reach == set(range(g.num_states))
  # ... has at least one allowed token, and can still reach an accepting state (backward closure)
  assert ((t >= 0).sum(1) >= 1).all()
  live, changed = set(np.flatnonzero(g.accepting).tolist()), True
  while changed:
    changed = False
    for s in range(g.done):
      if s not in live and any(int(n) in live for n in t[s] if 0 <= n != g.done):
        live.add(s); changed = True
  assert live == set(range(g.done))


def test_cached_and_read_only():
  g = build_grammar()
  assert build_grammar(TOK, list(ALL_ACTIONS)) is g
  with pytest.raises(ValueError):
    g.table[0, 0] = 1
  assert "click" in g.regex and "1000" in g.regex


def test_walk_and_allowed_mask():
  g = build_grammar(actions=("click",), max_thought_bytes=0, coord_format="fixed3")
  ids = TOK.encode("Thought: \nAction: click(start_box='(123,456)')") + [EOS, PAD, PAD]
  st_ = walk(g, ids)
  assert st_.tolist() == list(range(47)) + [g.done, g.done]  # the chain is numbered in order
  bad = TOK.encode("Thought: X") + [EOS]
  assert walk(g, bad).tolist() == list(range(9)) + [9, -1]  # state before 'X' kept, then -1
  assert walk(g, [EOS]).tolist() == [0]
  m = allowed_mask(g, np.array([[0, 36], [-1, g.done]]))
  assert m.shape == (2, 2, TOK.vocab_size) and m.dtype == bool
  assert np.flatnonzero(m[0, 0]).tolist() == [ord("T")]
  assert np.flatnonzero(m[0, 1]).tolist() == list(range(ord("0"), ord("9") + 1))
  assert not m[1, 0].any() and np.flatnonzero(m[1, 1]).tolist() == [PAD]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(GRAMMARS), st.integers(0, 2), st.integers(0, 127))
def test_language_matches_python_re(seed, kw, op, byte):
  """Walks (and one-byte mutations of them) are accepted exactly when Python's `re` says so."""
  g = build_grammar(**kw)
  rng = np.random.default_rng(seed)
  text = TOK.decode(random_reply(g, rng)[:-1])
  assert reference_accepts(g, text) and accepts(g, text)
  i = int(rng.integers(0, len(text) + 1))
  c = chr(byte)
  mutated = [text[:i] + c + text[i:], text[:i] + text[i + 1:], text[:i] + c + text[i + 1:]][op]
  assert accepts(g, mutated) == reference_accepts(g, mutated), repr(mutated)


def _check_parse(text, allowed):
  thought, act = A.parse_response(text)
  name = text.split("\nAction: ", 1)[1].split("(", 1)[0]
  assert name in allowed and isinstance(act, CLASSES[name])
  assert thought == text.split("\n", 1)[0][len("Thought:"):].strip()
  # coordinates: the written integers on the 0-1000 grid, converted once by the parser
  pairs = re.findall(r"\((\d+),(\d+)\)", text.split("\nAction: ", 1)[1])
  nums = [int(v) for pair in pairs for v in pair]
  if nums:
    fields = ("x1", "y1", "x2", "y2") if name == "drag" else ("x", "y")
    assert [getattr(act, f) for f in fields] == pytest.approx([n / 1000 for n in nums])
  return act


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(GRAMMARS))
def test_random_walks_parse(seed, kw):
  g = build_grammar(**kw)
  ids = random_reply(g, np.random.default_rng(seed))
  assert ids[-1] == EOS and EOS not in ids[:-1]
  _check_parse(TOK.decode(ids[:-1]), kw.get("actions", ALL_ACTIONS))
  states = walk(g, ids + [PAD])
  assert (states >= 0).all() and states[0] == g.start and states[-1] == g.done
  assert allowed_mask(g, states)[np.arange(len(ids) + 1), ids + [PAD]].all()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_hypothesis_driven_walks_parse(data):
  """Hypothesis picks every token (shrinks towards edge cases: first/last allowed byte, max lengths)."""
  g = build_grammar()
  s, ids = g.start, []
  while s != g.done:
    choices = np.flatnonzero(g.table[s] >= 0)
    t = int(choices[data.draw(st.integers(0, len(choices) - 1))])
    ids.append(t)
    s = int(g.table[s, t])
  act = _check_parse(TOK.decode(ids[:-1]), ALL_ACTIONS)
  if isinstance(act, A.Hotkey):
    assert 1 <= len(act.keys) <= 3 and set(act.keys) <= set(KEYS)


def test_click_only_fixed3_is_uniform_over_the_screen():
  g = build_grammar(actions=("click",), max_thought_bytes=0, coord_format="fixed3")
  rng = np.random.default_rng(0)
  fx, fy = np.zeros(10), np.zeros(10)
  for _ in range(2000):
    a = _check_parse(TOK.decode(random_reply(g, rng)[:-1]), ("click",))
    fx[int(a.x * 10)] += 1
    fy[int(a.y * 10)] += 1
  for f in (fx, fy):
    chi2 = ((f - 200) ** 2 / 200).sum()
    assert chi2 < 27.88, f  # 9 degrees of freedom, p = 0.001
  # 'int' for contrast: short numbers are favoured, so x < 0.1 is ~2.5x likelier than uniform
  # (P = 1/10 for '0' + 9/10 * (1/11 + 10/11 * 1/11) ~ 0.257)
  gi = build_grammar(actions=("click",), max_thought_bytes=0)
  xs = np.array([_check_parse(TOK.decode(random_reply(gi, rng)[:-1]), ("click",)).x for _ in range(1000)])
  assert 0.2 < (xs < 0.1).mean() < 0.32


def test_tens3_clicks_on_a_100_lattice_uniformly():
  g = build_grammar(actions=("click",), max_thought_bytes=0, coord_format="tens3")
  rng = np.random.default_rng(1)
  seen = set()
  fx = np.zeros(10)
  for _ in range(2000):
    reply = TOK.decode(random_reply(g, rng)[:-1])
    m = re.search(r"\((\d{3}),(\d{3})\)", reply)
    assert m and m[1][-1] == "0" and m[2][-1] == "0", reply
    a = _check_parse(reply, ("click",))
    assert a.x == int(m[1]) / 1000 and a.y == int(m[2]) / 1000
    seen.add(int(m[1]))
    fx[int(a.x * 10)] += 1
  assert len(seen) > 90  # 100 possible x values
  assert ((fx - 200) ** 2 / 200).sum() < 27.88  # uniform tens digit, p = 0.001
  assert not accepts(g, "Thought: \nAction: click(start_box='(455,420)')")
  assert accepts(g, "Thought: \nAction: click(start_box='(450,420)')")


def test_count_automaton_counts_overlapping_occurrences():
  from tars_jax.agent.grammar import _count_automaton

  def count(pattern, text, max_count=9):
    a, m = _count_automaton(pattern, max_count), 0
    for ch in text:
      m = int(a[m, ord(ch)])
      if m < 0:
        return None  # more than max_count
    return m // len(pattern)
  for pattern, text in [("aa", "aaaa"), ("abab", "abababxabab"), ("Action:", "Action:Action: xAction"),
                        ("aba", "ababa aba")]:
    want = sum(text.startswith(pattern, i) for i in range(len(text)))  # overlapping count
    assert count(pattern, text) == want, (pattern, text)
  assert count("Action:", "Action: Action:", max_count=1) is None
  assert count("Action:", "Actio Action:", max_count=1) == 1


# --- GUI-SDK functions (report sections 2.1-2.2) -----------------------------------------------------
SDK_CLASSES = {"run_command": A.RunCommand, "read_file": A.ReadFile, "write_file": A.WriteFile,
               "list_files": A.ListFiles, "search_files": A.SearchFiles, "mcp_list_tools": A.McpListTools,
               "mcp_call": A.McpCall}
SDK_GRAMMARS = [dict(actions=SDK_ACTIONS, max_thought_bytes=4, max_content_bytes=6),
                dict(actions=("click", "mcp_call"), max_thought_bytes=0, max_content_bytes=5,
                     coord_format="tens3")]


def test_sdk_names_are_the_parsers():
  assert SDK_ACTIONS == A.SDK_ACTION_NAMES and not set(SDK_ACTIONS) & set(ALL_ACTIONS)
  assert set(SDK_CLASSES) == set(SDK_ACTIONS)


def test_sdk_functions_accepted_and_rejected_by_hand():
  g = build_grammar(actions=ALL_ACTIONS + SDK_ACTIONS)
  gui_only = build_grammar()
  ok = {"Thought: x\nAction: run_command(command='ls -l | wc')": A.RunCommand("ls -l | wc"),
        "Thought: \nAction: read_file(path='notes.txt')": A.ReadFile("notes.txt"),
        "Thought: \nAction: write_file(path='a/b.txt', content='x = \"1\"')": A.WriteFile("a/b.txt", 'x = "1"'),
        "Thought: \nAction: list_files(path='.')": A.ListFiles("."),
        "Thought: \nAction: search_files(pattern='total', path='.')": A.SearchFiles("total", "."),
        "Thought: \nAction: mcp_list_tools(server='docs')": A.McpListTools("docs"),
        "Thought: \nAction: mcp_call(server='docs', tool='read_doc', arguments='{}')": A.McpCall("docs", "read_doc"),
        "Thought: \nAction: mcp_call(server='docs', tool='search_docs', arguments='{\"query\": \"a b\", \"k\": -12}')":
            A.McpCall("docs", "search_docs", '{"k": -12, "query": "a b"}')}
  for text, want in ok.items():
    assert accepts(g, text), text
    assert not accepts(gui_only, text)  # SDK functions only where named
    assert A.parse_response(text, sdk=True)[1] == want
  bad = ["Thought: \nAction: list_files()",  # canonical spelling only: the path is written
         "Thought: \nAction: run_command(command=\"ls\")",
         "Thought: \nAction: read_file(path='it\\'s')",
         "Thought: \nAction: mcp_call(server='d', tool='t', arguments='{\"a\":1}')",  # json.dumps spacing
         "Thought: \nAction: mcp_call(server='d', tool='t', arguments='{\"a\": 007}')",  # not JSON
         "Thought: \nAction: mcp_call(server='d', tool='t', arguments='{\"a\": [1]}')",
         "Thought: \nAction: mcp_call(server='d', tool='t', arguments='{\"a\": 1, \"b\": 2, \"c\": 3, \"d\": 4}')",
         "Thought: \nAction: mcp_call(server='d', tool='t', arguments='{\"\": 1}')",
         "Thought: \nAction: mcp_call(server='d', tool='t')"]
  for text in bad:
    assert not accepts(g, text), text


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(SDK_GRAMMARS))
def test_sdk_random_walks_parse(seed, kw):
  """Every reply a constrained sampler can write with SDK functions parses (sdk=True) to the named
  function; mcp_call arguments are always a JSON object; format_action writes the same text back."""
  g = build_grammar(**kw)
  ids = random_reply(g, np.random.default_rng(seed))
  text = TOK.decode(ids[:-1])
  assert reference_accepts(g, text)
  line = text.split("\nAction: ", 1)[1]
  name = line.split("(", 1)[0]
  assert name in kw["actions"]
  act = A.parse_response(text, sdk=True)[1]
  if name in SDK_CLASSES:
    assert isinstance(act, SDK_CLASSES[name])
    if name == "mcp_call":
      written = re.search(r"arguments='(.*)'\)$", line).group(1)
      assert isinstance(json.loads(written), dict) and act.args() == json.loads(written)
      assert len(act.args()) <= MCP_MAX_FIELDS
    else:
      assert A.format_action(act) == line  # canonical spelling
  else:
    _check_parse(text, kw["actions"])


def _before_minimising(actions):
  """The reply automaton of `actions` as `grammar._build` has it right before `_minimise`."""
  from tars_jax.agent import grammar as G
  return G._prune(*G._product(*G._fsm_table(G.reply_regex(actions)), G._count_automaton(G.DELIMITER, 1)))


def test_hashed_moore_rounds_find_the_exact_partition():
  """The row hash changes only the cost: on the GUI grammar its partition is the exact rounds' one."""
  from tars_jax.agent import grammar as G
  table, _, acc = _before_minimising(ALL_ACTIONS)
  exact, hashed = G._partition(table, acc, exact=True), G._partition(table, acc, exact=False)
  n = int(exact.max()) + 1
  assert 1 < n < table.shape[0]  # minimising merges states here
  assert int(hashed.max()) + 1 == n and np.unique(np.stack([exact, hashed]), axis=1).shape[1] == n  # same classes


def test_minimise_falls_back_to_exact_rounds_when_the_hash_collides(monkeypatch):
  """All multipliers 1: a row's hash is the sum of its entries, so different rows collide and the
  hashed partition merges states with different futures; `_minimise` must notice and give the exact
  minimal automaton anyway."""
  from tars_jax.agent import grammar as G
  table, start, acc = _before_minimising(ALL_ACTIONS)
  want = G._minimise(table, start, acc)
  n_exact = int(G._partition(table, acc, exact=True).max()) + 1
  assert want[0].shape[0] == n_exact
  monkeypatch.setattr(G, "_ROW_HASH", np.ones_like(G._ROW_HASH))
  assert int(G._partition(table, acc, exact=False).max()) + 1 < n_exact  # the collisions do merge states
  got = G._minimise(table, start, acc)
  np.testing.assert_array_equal(got[0], want[0])
  assert got[1] == want[1]
  np.testing.assert_array_equal(got[2], want[2])
