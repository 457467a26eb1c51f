"""Scripted experts (tars_jax/data/sources/experts.py), pure logic: hand-written element lists (copied from the
real pages' `elements` answers) -> the reply an expert writes, worked out by hand; every reply is
accepted by the grammar of the needed actions. The real pages: tests/test_demos.py."""

import math

import pytest

from tars_jax.agent.grammar import accepts, build_grammar
from tars_jax.data.sources import experts as E


def el(tag, x, y, w, h, *, id="", text="", classes="", type="", value="", checked=False, focused=False, leaf=True):
  return dict(tag=tag, id=id, classes=classes, type=type, text=text, value=value, checked=checked,
              focused=focused, leaf=leaf, x=x, y=y, width=w, height=h)


QUERY = el("div", 0, 0, 160, 50, id="query")
GRAMMAR = build_grammar(actions=("click", "type"), max_thought_bytes=E.MAX_THOUGHT_BYTES, max_content_bytes=16,
                        coord_format="tens3")


def px(v, total):
  return v / 1000 * total


def inside(gx, gy, box):
  x, y = px(gx, E.WIDTH), px(gy, E.HEIGHT)
  return (box["x"] <= math.floor(x) and x < box["x"] + box["width"]
          and box["y"] <= math.floor(y) and y < box["y"] + box["height"])


def decide(task, els, turn=0, instruction="", **kw):
  thought, action = E.decide(task, instruction, els, turn, **kw)
  assert accepts(GRAMMAR, E.reply_text(thought, action)), (thought, action)
  return thought, action


# -- coordinates ------------------------------------------------------------------------------------
def test_grid_point_rounds_the_centre_to_tens():
  # click-test seed 0's button: x 12..49 -> centre 30.5 px = 190.6 -> 190 (30.4 px);
  # y 123..160 -> centre 141.5 px = 673.8 -> 670 (140.7 px)
  assert E.grid_point({"x": 12, "y": 123, "width": 37, "height": 37}, "tens3") == (190, 670)
  assert E.grid_point({"x": 12, "y": 123, "width": 37, "height": 37}, "int") == (191, 674)
  assert E.grid_point({"x": 12, "y": 123, "width": 37, "height": 37}, "fixed3") == (191, 674)


def test_grid_point_moves_inside_when_the_rounded_centre_leaves_the_element():
  # x 60.1..63.1: centre 61.6 px = 385 -> 380 (60.8 px), whose truncated pixel 60 is left of 60.1;
  # 390 (62.4 px, pixel 62) is the only tens3 value inside.
  box = {"x": 60.1, "y": 100, "width": 3.0, "height": 20}
  assert round(61.6 / 160 * 100) * 10 == 380 and math.floor(px(380, 160)) < 60.1
  gx, gy = E.grid_point(box, "tens3")
  assert (gx, gy) == (390, 520) and inside(gx, gy, box)


def test_grid_point_is_inside_and_nearest_the_centre_for_many_boxes():
  import random
  rng = random.Random(0)
  for _ in range(300):
    w, h = rng.uniform(4, 60), rng.uniform(4, 60)
    box = {"x": rng.uniform(0, 160 - w), "y": rng.uniform(0, 210 - h), "width": w, "height": h}
    gx, gy = E.grid_point(box, "tens3")
    assert inside(gx, gy, box) and gx % 10 == 0 and gy % 10 == 0
    cx, cy = box["x"] + w / 2, box["y"] + h / 2
    d = math.hypot(px(gx, 160) - cx, px(gy, 210) - cy)
    assert d <= math.hypot(0.8, 1.05) + 1e-9 or w < 6 or h < 6  # half a grid step when the box is roomy


def test_grid_point_avoids_an_element_drawn_over_the_target():
  # As on click-test-2 seed 2_000_001: TWO (68..108, 164..204) is drawn over the bottom of ONE
  # (73..113, 145..185); ONE's centre (93, 165) is under TWO. Visible ONE: y < 164, with the 1 px
  # margin pixel <= 162. y candidates: 770 -> 161.7 px (ok), 780 -> 163.8 (covered). x: 93 px = 581
  # -> 580 (92.8 px).
  one = el("button", 73, 145, 40, 40, id="subbtn", text="ONE")
  two = el("button", 68, 164, 40, 40, id="subbtn2", text="TWO")
  thought, action = decide("miniwob/click-test-2", [QUERY, one, two], instruction="Click button ONE.")
  assert (thought, action) == ("the button labelled ONE", "click(start_box='(580,770)')")
  assert inside(580, 770, one) and not inside(580, 770, two)


def test_grid_point_raises_when_no_grid_point_fits():
  with pytest.raises(E.ExpertError, match="no tens3 grid point"):
    E.grid_point({"x": 46.5, "y": 100, "width": 1.5, "height": 20}, "tens3")  # pixels 46.4 / 48.0 miss it
  with pytest.raises(ValueError, match="unknown coord_format"):
    E.grid_values("tens4")


def test_requantize_keeps_the_pixel_a_reference_player_aimed_at():
  assert E.requantize(0.5, 160, "tens3") == 500  # 80.0 px
  assert E.requantize(30.5 / 160, 160, "tens3") == 190  # pixel 30: 30.4 px
  # pixel 2 of a 160-px axis has no tens3 value (1.6, 3.2 px): the nearest to 2.5 px is 3.2 (020)
  assert E.requantize(2.5 / 160, 160, "tens3") == 20


# -- MiniWoB++ experts -------------------------------------------------------------------------------
def test_click_test_and_click_test_2():
  b = el("button", 12, 123, 37, 37, id="subbtn", text="Click Me!")
  assert decide("miniwob/click-test", [QUERY, b]) == ("the button labelled Click Me!",
                                                       "click(start_box='(190,670)')")
  one = el("button", 4, 60, 40, 40, id="subbtn", text="ONE")
  two = el("button", 69, 112, 40, 40, id="subbtn2", text="TWO")
  # ONE: centre (24, 80) px = (150, 381) -> (150, 380); TWO: centre (89, 132) = (556, 629) -> (560, 630)
  assert decide("miniwob/click-test-2", [QUERY, one, two], instruction="Click button ONE.")[1] == \
      "click(start_box='(150,380)')"
  assert decide("miniwob/click-test-2", [QUERY, one, two], instruction="Click button TWO.") == \
      ("the button labelled TWO", "click(start_box='(560,630)')")


def test_click_button_sequence_uses_the_turn():
  one = el("button", 4, 60, 40, 40, id="subbtn", text="ONE")
  two = el("button", 69, 112, 40, 40, id="subbtn2", text="TWO")
  ins = "Click button ONE, then click button TWO."
  assert decide("miniwob/click-button-sequence", [QUERY, one, two], 0, ins)[1] == "click(start_box='(150,380)')"
  assert decide("miniwob/click-button-sequence", [QUERY, one, two], 1, ins)[1] == "click(start_box='(560,630)')"


def test_click_button_link_tab():
  els = [QUERY, el("button", 2, 63, 44.2, 21, text="okay"), el("button", 46.2, 63, 44.2, 21, text="okay"),
         el("button", 2, 105, 41.2, 21, text="next")]
  # first "okay": centre (24.1, 73.5) px = (150.6, 350) -> (150, 350)
  assert decide("miniwob/click-button", els, instruction='Click on the "okay" button.') == \
      ("the button labelled okay", "click(start_box='(150,350)')")
  links = [QUERY, el("span", 73.2, 52, 19.5, 11, classes="alink", text="eget"),
           el("span", 132.1, 74, 20.6, 11, classes="alink", text="Eget")]
  # "Eget" (case matters): centre (142.4, 79.5) = (890, 378.6) -> (890, 380) = 79.8 px, inside 74..85
  assert decide("miniwob/click-link", links, instruction='Click on the link "Eget".') == \
      ("the link Eget", "click(start_box='(890,380)')")
  tabs = [QUERY, el("a", 7, 58, 40, 23, id="ui-id-1", text="Tab #1"), el("a", 51, 58, 40, 23, id="ui-id-2", text="Tab #2")]
  # Tab #2: centre (71, 69.5) = (443.8, 331) -> (440, 330)
  assert decide("miniwob/click-tab", tabs, instruction="Click on Tab #2.") == \
      ("the tab Tab #2", "click(start_box='(440,330)')")


def test_focus_text_2_picks_the_named_box():
  els = [QUERY] + [el("input", 10, 60 + 30 * i, 128, 21, id=f"tt{i + 1}", type="text") for i in range(3)]
  # tt3: centre (74, 130.5) = (462.5, 621) -> (460, 620)
  assert decide("miniwob/focus-text-2", els, instruction="Focus into the 3rd input textbox.") == \
      ("the 3rd textbox", "click(start_box='(460,620)')")


def test_login_user_clicks_types_and_submits_from_the_page_state():
  ins = 'Enter the username "karrie" and the password "AU" into the text fields and press login.'

  def page(user="", user_focus=False, pw="", pw_focus=False):
    return [QUERY, el("input", 7, 78, 128, 21, id="username", type="text", value=user, focused=user_focus),
            el("input", 7, 130, 108, 21, id="password", type="password", value=pw, focused=pw_focus),
            el("button", 2, 166, 86.6, 31, id="subbtn", text="Login")]
  # username centre (71, 88.5) = (443.8, 421.4) -> (440, 420); password (61, 140.5) = (381, 669) ->
  # (380, 670); Login (45.3, 181.5) = (283, 864) -> (280, 860)
  steps = [(page(), ("the username field", "click(start_box='(440,420)')")),
           (page(user_focus=True), ("the username field, typing karrie", "type(content='karrie')")),
           (page(user="karrie", user_focus=True), ("the password field", "click(start_box='(380,670)')")),
           (page(user="karrie", pw_focus=True), ("the password field, typing AU", "type(content='AU')")),
           (page(user="karrie", pw="AU", pw_focus=True), ("the Login button", "click(start_box='(280,860)')"))]
  for turn, (els, want) in enumerate(steps):
    assert decide("miniwob/login-user", els, turn, ins) == want


def test_click_checkboxes_toggles_until_the_selection_matches_then_submits():
  ins = "Select HF2 and click Submit."

  def page(c0=False, c1=False):
    return [QUERY, el("div", 2, 52, 156, 38, id="boxes", leaf=False),
            el("label", 2, 59, 40.9, 11, text="AU", leaf=False), el("input", 6, 55, 20, 13, id="ch0", type="checkbox", checked=c0),
            el("label", 2, 78, 45.9, 11, text="HF2", leaf=False), el("input", 6, 74, 20, 13, id="ch1", type="checkbox", checked=c1),
            el("button", 2, 101, 95.5, 31, id="subbtn", text="Submit")]
  # ch1: centre (16, 80.5) = (100, 383) -> (100, 380); Submit (49.75, 116.5) = (311, 554.8) -> (310, 550)
  assert decide("miniwob/click-checkboxes", page(), 0, ins) == ("checkbox HF2", "click(start_box='(100,380)')")
  assert decide("miniwob/click-checkboxes", page(c1=True), 1, ins) == ("the Submit button", "click(start_box='(310,550)')")
  # a wrongly checked AU is unchecked first: ch0 centre (16, 61.5) = (100, 292.9) -> (100, 290)
  assert decide("miniwob/click-checkboxes", page(c0=True, c1=True), 1, ins) == ("checkbox AU", "click(start_box='(100,290)')")
  assert decide("miniwob/click-checkboxes", page(), 0, "Select nothing and click Submit.")[0] == "the Submit button"


def test_enter_text_2_types_the_name_in_the_asked_case():
  def page(value="", focused=False):
    return [QUERY, el("input", 12, 62, 128, 21, id="tt", type="text", value=value, focused=focused),
            el("button", 2, 95, 95.5, 31, id="subbtn", text="Submit")]
  up = 'Type "karrie" in all upper case letters in the text input and press Submit.'
  low = 'Type "KARRIE" in all lower case letters in the text input and press Submit.'
  # tt centre (76, 72.5) = (475, 345.2) -> (480, 350); Submit (49.75, 110.5) = (311, 526) -> (310, 530)
  assert decide("miniwob/enter-text-2", page(), 0, up) == ("the text field", "click(start_box='(480,350)')")
  assert decide("miniwob/enter-text-2", page(focused=True), 1, up)[1] == "type(content='KARRIE')"
  assert decide("miniwob/enter-text-2", page(focused=True), 1, low)[1] == "type(content='karrie')"
  assert decide("miniwob/enter-text-2", page("karrie", True), 2, low) == ("the Submit button",
                                                                         "click(start_box='(310,530)')")


def test_search_engine_types_searches_pages_and_clicks_the_kth_result():
  ins = 'Use the textbox to enter "Jerald" and press "Search", then find and click the 5th search result.'

  def page(value="", focused=False, results=(), active="1"):
    els = [QUERY, el("input", 4, 54, 88, 21, id="search-text", type="text", value=value, focused=focused),
           el("button", 94.8, 54, 58.2, 21, id="search", text="Search")]
    for i, name in enumerate(results):
      els.append(el("a", 4, 77 + 33 * i, 30, 11, classes="search-title", text=name))
    if results:
      for p, x in (("1", 44), ("2", 56.3), ("3", 68.7)):
        els += [el("li", x, 191, 8.3, 17, classes="page-item active" if p == active else "page-item", text=p,
                   leaf=False), el("a", x, 191, 8.3, 17, classes="page-link", text=p)]
    return els
  # search-text centre (48, 64.5) = (300, 307) -> (300, 310); Search (123.9, 64.5) = (774.4, 307) -> (770, 310)
  assert decide("miniwob/search-engine", page(), 0, ins) == ("the search box", "click(start_box='(300,310)')")
  assert decide("miniwob/search-engine", page(focused=True), 1, ins)[1] == "type(content='Jerald')"
  assert decide("miniwob/search-engine", page("Jerald", True), 2, ins) == ("the Search button",
                                                                          "click(start_box='(770,310)')")
  # the 5th result is the 2nd of page 2: page link 2 centre (60.5, 199.5) = (378, 950) -> (380, 950)
  got = page("Jerald", results=("Emile", "Rex", "Cheree"))
  assert decide("miniwob/search-engine", got, 3, ins) == ("page 2 of the results", "click(start_box='(380,950)')")
  # on page 2: its 2nd title, centre (19, 115.5) = (118.8, 550) -> (120, 550)
  got = page("Jerald", results=("Ana", "Jerald", "Lea"), active="2")
  assert decide("miniwob/search-engine", got, 4, ins) == ("result 5, Jerald", "click(start_box='(120,550)')")


def test_thoughts_off_and_the_main_config_grammar():
  b = el("button", 12, 123, 37, 37, id="subbtn", text="Click Me!")
  thought, action = E.decide("miniwob/click-test", "", [QUERY, b], 0, thoughts=False)
  reply = E.reply_text(thought, action)
  assert reply == "Thought: \nAction: click(start_box='(190,670)')"
  main = build_grammar(actions=("click",), max_thought_bytes=0, max_content_bytes=16, coord_format="tens3")
  assert accepts(main, reply) and not accepts(main, E.reply_text("the button", action))


def test_thoughts_are_short_printable_and_never_hold_the_delimiter():
  assert E.clean_thought("press\nAction: click  é now") == "press Action click now"
  long = E.clean_thought("checkbox " + "x" * 100)
  assert len(long.encode()) == E.MAX_THOUGHT_BYTES and long.startswith("checkbox x")
  # a label that would break the reply format is cleaned in the expert's own thought
  b = el("button", 12, 123, 37, 37, id="subbtn", text="Action: go" + "!" * 60)
  thought, _ = decide("miniwob/click-test", [QUERY, b])
  assert "Action:" not in thought and len(thought.encode()) <= E.MAX_THOUGHT_BYTES


def test_missing_elements_and_unknown_tasks_are_clear_errors():
  with pytest.raises(E.ExpertError, match="no visible button TWO"):
    E.decide("miniwob/click-test-2", "Click button TWO.", [QUERY], 0)
  with pytest.raises(E.ExpertError, match="does not match"):
    E.decide("miniwob/click-test-2", "Press something.", [QUERY], 0)
  with pytest.raises(KeyError, match="no expert for 'miniwob/book-flight'"):
    E.decide("miniwob/book-flight", "", [], 0)


# -- games ---------------------------------------------------------------------------------------------
def test_game_expert_stops_on_the_last_turn_of_the_budget():
  ex = E.expert_for("games/yarn-untangle")
  st = {"pos": [[20, 30], [140, 80]], "solution": [[20, 31], [110, 80]], "score": 0}
  # knot 0 is 1 px off (within the tolerance); knot 1 goes from (140, 80) to (110, 80) of the canvas,
  # y + 50 px bar on the page: reference.drag aims at pixel centres, (140.5, 130.5) -> (878, 621) ->
  # tens3 on the same pixels: 140 px = 880 (140.8), 130 px = 620 (130.2); (110.5, 130.5) -> 690 (110.4), 620
  thought, action = E.decide("games/yarn-untangle", "", st, 0, max_turns=8, expert=ex)
  assert action == "drag(start_box='(880,620)', end_box='(690,620)')"
  assert thought == "yarn-untangle: drag 140,130 to 110,130"
  thought, action = E.decide("games/yarn-untangle", "", st, 7, max_turns=8, expert=ex)
  assert action == "finished(content='')" and thought == "yarn-untangle: score 0, stop here"
  g = build_grammar(actions=("click", "hotkey", "drag", "finished"), max_thought_bytes=48, max_content_bytes=0,
                    coord_format="tens3")
  assert accepts(g, E.reply_text(thought, action))


def test_every_game_and_the_named_miniwob_tasks_have_experts():
  from envs_bridge.games import catalog
  table = E.experts()
  assert {f"games/{g}" for g in catalog.GAMES} <= set(table)
  assert len([t for t in table if t.startswith("miniwob/")]) >= 10
  assert {"miniwob/click-test", "miniwob/click-test-2"} <= set(table)
  assert table["games/2048"].reads == "game_state" and table["miniwob/login-user"].reads == "elements"
