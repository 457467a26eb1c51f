"""Scripted experts: what to do next on a MiniWoB++ task or a game, from privileged page state.

Pure decisions (no browser): an expert maps (instruction, view, turn index) to a reply the policy
could have written, `Thought: <thought>\\nAction: <action>` (`reply_text`), with coordinates in the
policy's coordinate format (`grammar.py`: 'int', 'fixed3', 'tens3'). The view is privileged and never
shown to the agent:
  MiniWoB++ tasks  the task area's visible elements, `SandboxClient.elements(sid)`: dicts {tag, id,
                   classes, type, text, value, checked, focused, leaf, x, y, width, height}, box in
                   pixels of the 160 x 210 screen;
  desktop, hybrid  the desktop sandbox's debug state, `SandboxClient.desktop_state(sid)` (window tree,
                   screen size, the task's programs and check), read by `desktop_experts.py`;
  games            the game's `GAME.debugState()`, `SandboxClient.game_state(sid)`, played by the
                   reference players of `envs_bridge/games/reference.py` (their actions re-written in
                   the policy's coordinate format), calling `finished()` on the last turn of the step
                   budget to cash in the score so far (how games pay, experiments/configs/games.py).
Experts are stateless (decided from the page every turn), like the reference players. The turn index
is used only where the page does not show progress (click-button-sequence) and by the games' budget.

Thoughts name what the expert saw (`the button labelled ONE`, `checkbox 91YPF`, `the username
field`): <= MAX_THOUGHT_BYTES bytes of printable ASCII, never containing the `Action:` delimiter.

Clicks aim at the element's centre rounded to the coordinate grid; when the rounded point leaves the
element (or sits on its edge), the nearest grid point inside it is taken (`grid_point`). Chromium hit-
tests the integer (truncated) pixel of a mouse event, so "inside" means both the exact point and its
truncated pixel are in the box, preferably 1 px away from every edge.

Entry point: `decide(task, instruction, view, turn, ...) -> (thought, action text)`; `EXPERTS` lists
the experts by task. Raises `ExpertError` when the page does not hold what the expert needs (the
collection counts it as a failed episode).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Callable, Sequence

from tars_jax.agent import actions as A
from tars_jax.agent.grammar import DELIMITER, PRINTABLE

WIDTH, HEIGHT = 160, 210  # MiniWoB++ and game screens, pixels
MAX_THOUGHT_BYTES = 48
COORD_FORMATS = ("int", "fixed3", "tens3")
EDGE_MARGIN_PX = 1.0  # preferred distance of a click from every edge of its element


class ExpertError(ValueError):
  """The page does not hold what the expert needs (a missing element, an unparsable instruction)."""


# -- coordinates ------------------------------------------------------------------------------------
def grid_values(coord_format: str) -> range:
  """The values one coordinate may take on the 0-1000 grid: 'int' 0..1000, 'fixed3' 0..999, 'tens3'
  0, 10, .., 990. Raises ValueError for another format."""
  if coord_format == "int":
    return range(0, 1001)
  if coord_format == "fixed3":
    return range(0, 1000)
  if coord_format == "tens3":
    return range(0, 1000, 10)
  raise ValueError(f"unknown coord_format {coord_format!r}; expected one of {COORD_FORMATS}")


def format_value(v: int, coord_format: str) -> str:
  """One grid coordinate as the grammar writes it ('int': no leading zeros, else three digits)."""
  return str(v) if coord_format == "int" else f"{v:03d}"


def _inside(p: float, lo: float, size: float, margin: float = 0.0) -> bool:
  """Pixel coordinate p (and its truncation, what Chromium hit-tests) inside [lo + margin, lo + size - margin)."""
  return lo + margin <= math.floor(p) and p < lo + size - margin


def _axis(lo: float, size: float, total: int, coord_format: str) -> list[tuple[int, float]]:
  """(grid value, pixel) of the grid values whose pixel lies inside [lo, lo + size)."""
  return [(v, v / 1000 * total) for v in grid_values(coord_format) if _inside(v / 1000 * total, lo, size)]


def _covers(box: dict, px: float, py: float) -> bool:
  """True when `box` is within EDGE_MARGIN_PX of the point (px, py) (pixels), on either of its
  exact and truncated positions."""
  m = EDGE_MARGIN_PX
  return (box["x"] - m <= px < box["x"] + box["width"] + m or box["x"] - m <= math.floor(px) < box["x"] + box["width"] + m) \
      and (box["y"] - m <= py < box["y"] + box["height"] + m or box["y"] - m <= math.floor(py) < box["y"] + box["height"] + m)


def grid_point(box: dict, coord_format: str, width: int = WIDTH, height: int = HEIGHT,
               avoid: Sequence[dict] = ()) -> tuple[int, int]:
  """Grid coordinates (0-1000 scale) of a click inside `box` {x, y, width, height} (pixels), off every
  box of `avoid` (elements drawn over it): of the grid points whose pixel and truncated pixel are
  inside, the one nearest the centre, preferring points EDGE_MARGIN_PX inside every edge.
  Raises ExpertError when no grid point is inside and uncovered."""
  cx, cy = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
  best, best_key = None, None
  for vx, px in _axis(box["x"], box["width"], width, coord_format):
    for vy, py in _axis(box["y"], box["height"], height, coord_format):
      if any(_covers(a, px, py) for a in avoid):
        continue
      margin_ok = (_inside(px, box["x"], box["width"], EDGE_MARGIN_PX)
                   and _inside(py, box["y"], box["height"], EDGE_MARGIN_PX))
      key = (not margin_ok, (px - cx) ** 2 + (py - cy) ** 2)
      if best_key is None or key < best_key:
        best, best_key = (vx, vy), key
  if best is None:
    raise ExpertError(f"no {coord_format} grid point inside the box {box['x']:g},{box['y']:g} "
                      f"{box['width']:g}x{box['height']:g} px" + (" off the elements over it" if avoid else ""))
  return best


def requantize(unit: float, total: int, coord_format: str) -> int:
  """A [0, 1] coordinate -> the grid value landing on the same (truncated) pixel, nearest to it; the
  nearest grid value when the grid has no value on that pixel (tens3 steps 1.6 / 2.1 px)."""
  target = unit * total
  px = math.floor(target)
  vals = list(grid_values(coord_format))
  same = [v for v in vals if math.floor(v / 1000 * total) == px]
  return min(same or vals, key=lambda v: abs(v / 1000 * total - target))


# -- actions the experts take ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ClickAt:
  """Click inside an element's box (pixels), off the boxes of `avoid` (elements drawn over it);
  rendered on the grid by `grid_point`."""

  box: dict
  avoid: tuple = ()


def render(action, coord_format: str, width: int = WIDTH, height: int = HEIGHT) -> str:
  """An expert's action -> its text in the policy's format. ClickAt and the typed point actions of
  `agent.actions` get grid coordinates; others are `actions.format_action` text."""
  f = lambda v: format_value(v, coord_format)  # noqa: E731
  if isinstance(action, ClickAt):
    x, y = grid_point(action.box, coord_format, width, height, action.avoid)
    return f"click(start_box='({f(x)},{f(y)})')"

  def pt(ux, uy):
    return f"'({f(requantize(ux, width, coord_format))},{f(requantize(uy, height, coord_format))})'"
  if isinstance(action, A.Click):
    return f"click(start_box={pt(action.x, action.y)})"
  if isinstance(action, A.Drag):
    return f"drag(start_box={pt(action.x1, action.y1)}, end_box={pt(action.x2, action.y2)})"
  if isinstance(action, (A.LeftDouble, A.RightSingle, A.Scroll)):
    raise ExpertError(f"no expert renders {type(action).__name__}")
  return A.format_action(action)


def clean_thought(text: str) -> str:
  """`text` as a thought: printable ASCII only (others dropped), whitespace collapsed, no `Action:`,
  at most MAX_THOUGHT_BYTES bytes."""
  t = " ".join("".join(c if c in PRINTABLE else " " for c in text).split())
  while DELIMITER in t:
    t = t.replace(DELIMITER, "Action")
  return t[:MAX_THOUGHT_BYTES].rstrip()


def reply_text(thought: str, action: str) -> str:
  """`Thought: <thought>\\nAction: <action>` (the grammar's reply; an empty thought gives
  `Thought: \\nAction: ...`)."""
  return f"Thought: {thought}\nAction: {action}"


# -- reading the elements ------------------------------------------------------------------------------
def click_on(elements: Sequence[dict], target: dict) -> ClickAt:
  """A click on `target`, off the leaf elements after it in document order that overlap it (drawn over
  it: click-test-2 places its buttons at random, so TWO can hide part of ONE)."""
  i = next(k for k, e in enumerate(elements) if e is target)
  over = tuple(e for e in elements[i + 1:] if e["leaf"] and _overlap(e, target))
  return ClickAt(target, over)


def _overlap(a: dict, b: dict) -> bool:
  return (a["x"] < b["x"] + b["width"] and b["x"] < a["x"] + a["width"]
          and a["y"] < b["y"] + b["height"] and b["y"] < a["y"] + a["height"])


def _need(cond, what: str):
  if not cond:
    raise ExpertError(what)
  return cond


def _match(pattern: str, instruction: str, task: str) -> re.Match:
  m = re.search(pattern, instruction)
  return _need(m, f"{task}: instruction {instruction!r} does not match {pattern!r}")


def _by_id(elements: Sequence[dict], el_id: str) -> dict:
  for e in elements:
    if e["id"] == el_id:
      return e
  raise ExpertError(f"no visible element #{el_id}")


def _first(elements: Sequence[dict], what: str, pred: Callable[[dict], bool]) -> dict:
  for e in elements:
    if pred(e):
      return e
  raise ExpertError(f"no visible {what}")


def _labelled_inputs(elements: Sequence[dict], input_type: str) -> list[tuple[str, dict]]:
  """(label text, input) of every `input_type` input (checkbox, radio) inside a <label> (MiniWoB
  builds `<label><input>NAME</label>`: the input follows its label in document order)."""
  out, label = [], None
  for e in elements:
    if e["tag"] == "label":
      label = e["text"]
    elif e["tag"] == "input" and e["type"] == input_type:
      out.append((_need(label, f"{input_type} #{e['id']} without a label"), e))
  return out


def _fill_then_submit(elements, fields: Sequence[tuple[str, str, str]], submit_id: str, submit_name: str):
  """Fields (element id, text, name) filled in order (click to focus, then type), then submit."""
  for el_id, text, name in fields:
    e = _by_id(elements, el_id)
    if e["value"] != text:
      if e["focused"] and e["value"] == "":
        return f"the {name}, typing {text}", A.Type(text)
      return f"the {name}", click_on(elements, e)
  return f"the {submit_name} button", click_on(elements, _by_id(elements, submit_id))


# -- MiniWoB++ experts: (instruction, elements, turn) -> (thought, action) -------------------------------
def click_test(instruction, elements, turn):
  b = _by_id(elements, "subbtn")
  return f"the button labelled {b['text']}", click_on(elements, b)


def click_test_2(instruction, elements, turn):
  label = _match(r"Click button (\w+)", instruction, "click-test-2").group(1)
  b = _first(elements, f"button {label}", lambda e: e["tag"] == "button" and e["text"] == label)
  return f"the button labelled {label}", click_on(elements, b)


def click_button(instruction, elements, turn):
  label = _match(r'Click on the "(.*)" button', instruction, "click-button").group(1)
  b = _first(elements, f"button {label}", lambda e: e["tag"] == "button" and e["text"] == label)
  return f"the button labelled {label}", click_on(elements, b)


def click_button_sequence(instruction, elements, turn):
  # The page shows no trace of the first click, so the turn says which button is next.
  label = "ONE" if turn == 0 else "TWO"
  b = _by_id(elements, "subbtn" if turn == 0 else "subbtn2")
  _need(b["text"] == label, f"button #{b['id']} reads {b['text']!r}, not {label}")
  return f"the button labelled {label}", click_on(elements, b)


def click_link(instruction, elements, turn):
  word = _match(r'Click on the link "(.*)"\.', instruction, "click-link").group(1)
  link = _first(elements, f"link {word}", lambda e: "alink" in e["classes"].split() and e["text"] == word)
  return f"the link {word}", click_on(elements, link)


def click_tab(instruction, elements, turn):
  n = _match(r"Click on Tab #(\d+)", instruction, "click-tab").group(1)
  tab = _first(elements, f"tab #{n}", lambda e: e["tag"] == "a" and e["text"] == f"Tab #{n}")
  return f"the tab Tab #{n}", click_on(elements, tab)


def focus_text(instruction, elements, turn):
  return "the textbox", click_on(elements, _by_id(elements, "tt"))


def focus_text_2(instruction, elements, turn):
  pos = _match(r"Focus into the (1st|2nd|3rd) input textbox", instruction, "focus-text-2").group(1)
  return f"the {pos} textbox", click_on(elements, _by_id(elements, "tt" + pos[0]))


def enter_text(instruction, elements, turn):
  text = _match(r'Enter "(.*)" into the text field', instruction, "enter-text").group(1)
  return _fill_then_submit(elements, [("tt", text, "text field")], "subbtn", "Submit")


def login_user(instruction, elements, turn):
  m = _match(r'username "(.*)" and the password "(.*)" into', instruction, "login-user")
  return _fill_then_submit(elements, [("username", m.group(1), "username field"),
                                      ("password", m.group(2), "password field")], "subbtn", "Login")


def enter_password(instruction, elements, turn):
  pw = _match(r'Enter the password "(.*)" into both', instruction, "enter-password").group(1)
  return _fill_then_submit(elements, [("password", pw, "password field"), ("verify", pw, "verify field")],
                           "subbtn", "Submit")


def click_checkboxes(instruction, elements, turn):
  names = _match(r"^Select (.*) and click Submit\.", instruction, "click-checkboxes").group(1)
  wanted = set() if names == "nothing" else set(names.split(", "))
  boxes = _labelled_inputs(elements, "checkbox")
  _need(boxes, "no checkboxes")
  for name, e in boxes:
    if (name in wanted) != e["checked"]:
      return f"checkbox {name}", click_on(elements, e)
  return "the Submit button", click_on(elements, _by_id(elements, "subbtn"))


def enter_text_2(instruction, elements, turn):
  m = _match(r'Type "(.*)" in all (upper|lower) case letters', instruction, "enter-text-2")
  text = m.group(1).upper() if m.group(2) == "upper" else m.group(1).lower()
  return _fill_then_submit(elements, [("tt", text, "text field")], "subbtn", "Submit")


def search_engine(instruction, elements, turn):
  # Type the name, press Search, go to the result's page (3 results per page), click the result.
  m = _match(r'enter "(.*)" and press "Search", then find and click the (\d+)(?:st|nd|rd|th) search result',
             instruction, "search-engine")
  name, k = m.group(1), int(m.group(2))
  box = _by_id(elements, "search-text")
  titles = [e for e in elements if "search-title" in e["classes"].split()]
  if box["value"] != name or not titles:  # results appear only after the name was typed and searched
    return _fill_then_submit(elements, [("search-text", name, "search box")], "search", "Search")
  page = str((k - 1) // 3 + 1)
  active = _first(elements, "active page", lambda e: e["tag"] == "li" and "active" in e["classes"].split())
  if active["text"] != page:
    link = _first(elements, f"page {page}", lambda e: "page-link" in e["classes"].split() and e["text"] == page)
    return f"page {page} of the results", click_on(elements, link)
  _need(len(titles) == 3, f"{len(titles)} results on page {page}")
  return f"result {k}, {titles[(k - 1) % 3]['text']}", click_on(elements, titles[(k - 1) % 3])


def click_option(instruction, elements, turn):
  name = _match(r"^Select (.*) and click Submit\.", instruction, "click-option").group(1)
  radios = _labelled_inputs(elements, "radio")
  e = next((e for n, e in radios if n == name), None)
  _need(e is not None, f"no option {name}")
  if not e["checked"]:
    return f"option {name}", click_on(elements, e)
  return "the Submit button", click_on(elements, _by_id(elements, "subbtn"))


MINIWOB_EXPERTS: dict[str, Callable] = {
    "miniwob/click-test": click_test, "miniwob/click-test-2": click_test_2,
    "miniwob/click-button": click_button, "miniwob/click-button-sequence": click_button_sequence,
    "miniwob/click-link": click_link, "miniwob/click-tab": click_tab, "miniwob/focus-text": focus_text,
    "miniwob/focus-text-2": focus_text_2, "miniwob/enter-text": enter_text, "miniwob/login-user": login_user,
    "miniwob/enter-password": enter_password, "miniwob/click-checkboxes": click_checkboxes,
    "miniwob/click-option": click_option, "miniwob/enter-text-2": enter_text_2,
    "miniwob/search-engine": search_engine,
}


# -- games: the reference players ------------------------------------------------------------------------
def _px(u: float, total: int) -> int:
  return int(u * total)


def game_thought(game: str, action) -> str:
  """What a reference player's move is, in words: `2048: press up`, `maze: click at 40,120 px`."""
  if isinstance(action, A.Hotkey):
    return f"{game}: press {' '.join(action.keys)}"
  if isinstance(action, A.Click):
    return f"{game}: click at {_px(action.x, WIDTH)},{_px(action.y, HEIGHT)} px"
  if isinstance(action, A.Drag):
    return (f"{game}: drag {_px(action.x1, WIDTH)},{_px(action.y1, HEIGHT)} to "
            f"{_px(action.x2, WIDTH)},{_px(action.y2, HEIGHT)}")
  return f"{game}: {type(action).__name__.lower()}"


def _yarn_untangle(st):
  """reference.policy_yarn_untangle with a tolerance: on a coarse coordinate grid a knot lands up to
  ~1.5 px from its solution point and the exact-match player would drag it again forever."""
  from envs_bridge.games import reference
  for p, q in zip(st["pos"], st["solution"]):
    if math.hypot(p[0] - q[0], p[1] - q[1]) > 2.5:
      return reference.drag(*p, *q)
  return "wait()"


_GAME_POLICIES = {"yarn-untangle": _yarn_untangle}  # where the reference player needs exact coordinates


def game_expert(game: str) -> Callable:
  """The reference player of `game` as an expert: (instruction, state, turn, max_turns) -> (thought,
  typed action); `finished()` on the last turn of the budget (the score so far is paid)."""
  from envs_bridge.games import reference  # the players live with the games
  policy = _GAME_POLICIES.get(game, reference.POLICIES[game])

  def expert(instruction, state, turn, max_turns=None):
    if max_turns is not None and turn >= max_turns - 1:
      return f"{game}: score {state.get('score', 0)}, stop here", A.Finished("")
    text = policy(state)
    try:
      a = A.parse_action(text)
    except A.ActionParseError as e:
      raise ExpertError(f"{game}: reference action {text!r} does not parse: {e.reason}") from None
    return game_thought(game, a), a
  expert.__name__ = f"reference_{game}"
  return expert


@dataclasses.dataclass(frozen=True)
class Expert:
  """One task's expert. reads: 'elements' (MiniWoB++ DOM), 'game_state' (a game's debugState),
  'desktop_state' (the desktop sandbox's debug state: `desktop_experts.py`) or 'browse' (the DOM plus
  the question's plan: the stateful `browse_expert.BrowseExpert`, made per episode by
  `tars_jax/data/sources/demos.py`; `fn` is None)."""

  name: str
  reads: str
  fn: Callable


def _game_names() -> tuple[str, ...]:
  from envs_bridge.games import catalog
  return catalog.GAMES


@functools.lru_cache(maxsize=1)
def _all_experts() -> tuple[tuple[str, Expert], ...]:
  out = {t: Expert(f"scripted/{t.split('/', 1)[1]}", "elements", f) for t, f in MINIWOB_EXPERTS.items()}
  out.update({f"games/{g}": Expert(f"reference/{g}", "game_state", game_expert(g)) for g in _game_names()})
  from tars_jax.data.sources import desktop_experts  # local: it imports this module
  out.update({t: Expert(f"scripted/{t.replace('/', '-')}", "desktop_state", f)
              for t, f in desktop_experts.DESKTOP_EXPERTS.items()})
  from envs_bridge.browser import browse_tasks  # local: the table is built once, on first use
  out.update({t: Expert(f"scripted/{t.replace('/', '-')}", "browse", None) for t in browse_tasks.task_names()})
  return tuple(out.items())


def experts() -> dict[str, Expert]:
  """Every expert by task name ('miniwob/<task>', 'games/<game>', 'desktop/<task>', 'hybrid/<task>',
  'browse/<family>'); a fresh dict
  (callers may edit it)."""
  return dict(_all_experts())


def expert_for(task: str, table: dict[str, Expert] | None = None) -> Expert:
  """The expert of `task`. Raises KeyError naming the tasks that have one."""
  table = experts() if table is None else table
  if task not in table:
    raise KeyError(f"no expert for {task!r}; experts exist for {sorted(table)}")
  return table[task]


def decide(task: str, instruction: str, view: Any, turn: int, *, coord_format: str = "tens3",
           thoughts: bool = True, max_turns: int | None = None, expert: Expert | None = None
           ) -> tuple[str, str]:
  """The expert's next reply on `task`: (thought, action text).

  Args:
    view: the elements list (MiniWoB++), the game state dict (games) or the desktop sandbox's debug
      state (desktop / hybrid: clicks are rendered on its `width` x `height` screen), see the module
      docstring.
    turn: 0-based turn index of the episode. max_turns: the step budget (games stop on its last turn).
    coord_format: how the action writes coordinates ('int', 'fixed3', 'tens3').
    thoughts: False gives an empty thought.
    expert: overrides the task's registered expert (tests use a deliberately wrong one).
  Returns: (thought of <= MAX_THOUGHT_BYTES printable ASCII bytes, or '' with thoughts=False; action).
  Raises: ExpertError (the page lacks what the expert needs), KeyError (no expert for `task`),
    ValueError (unknown coord_format).
  """
  grid_values(coord_format)  # validates it
  ex = expert or expert_for(task)
  if ex.reads == "browse":
    raise ValueError(f"{task}: the browse expert is stateful; play it per episode (tars_jax/data/sources/demos.py)")
  size = (WIDTH, HEIGHT)
  if ex.reads == "game_state":
    thought, action = ex.fn(instruction, view, turn, max_turns)
  else:
    thought, action = ex.fn(instruction, view, turn)
    if ex.reads == "desktop_state":
      size = (view["width"], view["height"])
  return (clean_thought(thought) if thoughts else ""), render(action, coord_format, *size)
