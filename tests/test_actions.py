"""Action grammar: published UI-TARS variants, typed errors, and 'any string parses or raises'."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tars_jax.agent import actions as A
from tars_jax.agent.grammar import accepts, build_grammar


@pytest.mark.parametrize("text,want", [
    ("click(start_box='(500,250)')", A.Click(0.5, 0.25)),
    ("click(start_box='<|box_start|>(100,200)<|box_end|>')", A.Click(0.1, 0.2)),
    ("click(start_box='(100,200,300,400)')", A.Click(0.2, 0.3)),
    ("click(point='<point>10 990</point>')", A.Click(0.01, 0.99)),
    ("left_double(start_box='(0,1000)')", A.LeftDouble(0.0, 1.0)),
    ("right_single(start_box='(1,2)')", A.RightSingle(0.001, 0.002)),
    ("drag(start_box='(0,0)', end_box='(1000,500)')", A.Drag(0, 0, 1, 0.5)),
    ("drag(start_point='<point>0 0</point>', end_point='<point>10 10</point>')", A.Drag(0, 0, 0.01, 0.01)),
    ("hotkey(key='ctrl c')", A.Hotkey(("ctrl", "c"))),
    ("hotkey(key='Ctrl+Shift+A')", A.Hotkey(("ctrl", "shift", "a"))),
    ("scroll(point='<point>500 0</point>', direction='UP')", A.Scroll(0.5, 0.0, "up")),
    ("click(start_box='[100,200,300,400]')", A.Click(0.2, 0.3)),
    ('type(content="say \\"hi\\"")', A.Type('say "hi"')),
    ("left_single(start_box='(1000,0)')", A.Click(1.0, 0.0)),
    ("  click( start_box = '( 10 , 20 )' )  ", A.Click(0.01, 0.02)),
    ("type(content='it\\'s\\nfine')", A.Type("it's\nfine")),
    ("scroll(start_box='(5,5)', direction='down')", A.Scroll(0.005, 0.005, "down")),
    ("wait()", A.Wait()),
    ("finished(content='done')", A.Finished("done")),
    ("call_user()", A.CallUser()),
])
def test_published_variants(text, want):
  assert A.parse_action(text) == want


def test_response_and_absolute_coordinates():
  thought, act = A.parse_response("Thought: the button is top left\nAction: click(start_box='(84,105)')",
                                  A.CoordSpec("absolute", 168, 210))
  assert thought == "the button is top left" and act == A.Click(0.5, 0.5)
  assert A.to_pixels(act, 160, 210) == {"x": 80.0, "y": 105.0}


def test_action_split_keeps_typed_action_text():
  # the delimiter is the first `Action:` that starts a line, so typed text may contain it
  thought, act = A.parse_response("Thought: type it\nAction: type(content='Action: go')")
  assert (thought, act) == ("type it", A.Type("Action: go"))
  assert A.parse_response("Action: wait()") == ("", A.Wait())
  assert A.parse_response("Thought: a\nb\n\nAction: wait()\n") == ("a\nb", A.Wait())
  assert A.parse("wait()") == A.Wait() and A.parse("Thought: x\nAction: wait()") == A.Wait()


def test_coord_spec_conversions():
  spec = A.CoordSpec("absolute", 160, 210)
  assert A.parse_action("click(start_box='(40,210)')", spec) == A.Click(0.25, 1.0)
  with pytest.raises(A.ActionParseError, match="outside"):
    A.parse_action("click(start_box='(161,0)')", spec)
  assert A.format_action(A.Click(0.25, 1.0), spec) == "click(start_box='(40,210)')"
  assert A.to_pixels(A.Drag(0.0, 0.5, 1.0, 1.0), 160, 210) == {"x1": 0.0, "y1": 105.0, "x2": 160.0, "y2": 210.0}
  assert A.to_pixels(A.Wait(), 160, 210) == {}
  with pytest.raises(ValueError):
    A.CoordSpec("absolute")
  with pytest.raises(ValueError):
    A.CoordSpec("pixels")


@pytest.mark.parametrize("text,reason", [
    ("Thought: no action here", "no 'Action:'"),
    ("Action: jump()", "unknown action 'jump'"),
    ("Action: click(start_box='(1001,5)')", "outside the screenshot"),
    ("Action: click()", "needs start_box"),
    ("Action: scroll(start_box='(1,1)', direction='diagonal')", "direction"),
    ("Action: click(start_box='(1,1)', foo='x')", "unexpected arguments"),
    ("Action: click(start_box='1,1')", "bad point"),
    ("Thought: only a thought, no delimiter", "no 'Action:'"),
    ("Action: click(start_box='(-1,5)')", "outside the screenshot"),
    ("Action: type()", "type needs content"),
    ("Action: hotkey(key='  ')", "at least one key"),
    ("Action: click(start_box='(1,1)', start_box='(2,2)')", "given twice"),
    ("Action: click(start_box=(1,1))", "cannot parse arguments"),
    ("Action: click(start_box='(1,1)') click(start_box='(1,1)')", "cannot parse arguments"),
])
def test_errors_have_reasons(text, reason):
  with pytest.raises(A.ActionParseError) as e:
    A.parse_response(text)
  assert reason in e.value.reason


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=80))
def test_any_string_parses_or_raises_action_parse_error(s):
  for fn in (A.parse_action, A.parse_response, A.parse):
    try:
      out = fn(s)
    except A.ActionParseError as e:
      assert e.reason
    else:
      assert out is not None


_alphabet = st.sampled_from(list("click(start_box='(0123456789,)') Action:Thought:\n\"\\<>|point"))


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=_alphabet, max_size=60))
def test_grammar_like_strings_parse_or_raise(s):
  try:
    A.parse(s)
  except A.ActionParseError:
    pass


@settings(max_examples=200, deadline=None)
@given(st.one_of(
    st.builds(A.Click, st.integers(0, 1000), st.integers(0, 1000)),
    st.builds(A.LeftDouble, st.integers(0, 1000), st.integers(0, 1000)),
    st.builds(A.RightSingle, st.integers(0, 1000), st.integers(0, 1000)),
    st.builds(A.Hotkey, st.lists(st.sampled_from(["ctrl", "shift", "alt", "a", "f5", "enter"]), min_size=1,
                                 max_size=3).map(tuple)),
    st.builds(A.Drag, st.integers(0, 1000), st.integers(0, 1000), st.integers(0, 1000), st.integers(0, 1000)),
    st.builds(A.Type, st.text(max_size=20)), st.builds(A.Finished, st.text(max_size=20)),
    st.builds(A.Scroll, st.integers(0, 1000), st.integers(0, 1000), st.sampled_from(A.DIRECTIONS)),
    st.just(A.Wait()), st.just(A.CallUser())))
def test_format_parse_round_trip(a):
  # integers on the grid -> unit floats, then format -> parse is exact
  if hasattr(a, "x1"):
    a = A.Drag(a.x1 / 1000, a.y1 / 1000, a.x2 / 1000, a.y2 / 1000)
  elif hasattr(a, "x"):
    a = type(a)(a.x / 1000, a.y / 1000, *([a.direction] if isinstance(a, A.Scroll) else []))
  assert A.parse_action(A.format_action(a)) == a


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 167), st.integers(0, 209), st.text(alphabet=st.characters(blacklist_characters="\n\r"),
                                                       max_size=30))
def test_absolute_and_response_round_trip(px, py, thought):
  spec = A.CoordSpec("absolute", 167, 209)
  a = A.Click(px / 167, py / 209)
  text = A.format_action(a, spec)
  assert text == f"click(start_box='({px},{py})')"
  assert A.parse_response(f"Thought: {thought}\nAction: {text}", spec) == (thought.strip(), a)


def test_formatted_click_is_in_the_decoding_grammar():
  g = build_grammar(actions=("click",), max_thought_bytes=8, coord_format="int")
  text = "Thought: go\nAction: " + A.format_action(A.Click(0.25, 0.5))
  assert accepts(g, text)
  assert A.parse_response(text)[1] == A.Click(0.25, 0.5)
