"""The action grammar of docs/ARCHITECTURE.md (UI-TARS, `bytedance/UI-TARS` `codes/ui_tars/action_parser.py`).

`parse_action` turns one action string into a typed action; `parse_response` a whole
`Thought: …\nAction: …` reply. Coordinates are converted ONCE, here, to floats in [0, 1] relative to
the screenshot:
  CoordSpec('relative1000')       integers on a 0–1000 grid relative to the screenshot (default);
  CoordSpec('absolute', w, h)     pixels of the resized image the model saw (Qwen2.5-VL convention).
Accepted point spellings: `start_box='(x,y)'`, `start_box='<|box_start|>(x,y)<|box_end|>'`,
`start_box='(x1,y1,x2,y2)'` / `[x1,y1,x2,y2]` (box -> centre), `point='<point>x y</point>'`
(`start_point` / `end_point` for drag).

SDK functions (GUI-SDK, report sections 2.1-2.2) share the parser: `run_command(command='…')`,
`read_file(path='…')`, `write_file(path='…', content='…')`, `list_files(path='.')`,
`search_files(pattern='…', path='.')`, `mcp_list_tools(server='…')`,
`mcp_call(server='…', tool='…', arguments='{"json": "object"}')`; `is_sdk(action)` tells them apart.
They parse only with `sdk=True` (sandboxes that have an SDK); otherwise they are ActionParseErrors.

Every string either parses or raises `ActionParseError` (with a reason) — never another exception.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Union


class ActionParseError(ValueError):
  """A reply or action string that is not in the grammar; `.reason` says why."""

  def __init__(self, reason: str):
    super().__init__(reason)
    self.reason = reason


@dataclasses.dataclass(frozen=True)
class Click:
  x: float
  y: float


@dataclasses.dataclass(frozen=True)
class LeftDouble:
  x: float
  y: float


@dataclasses.dataclass(frozen=True)
class RightSingle:
  x: float
  y: float


@dataclasses.dataclass(frozen=True)
class Drag:
  x1: float
  y1: float
  x2: float
  y2: float


@dataclasses.dataclass(frozen=True)
class Hotkey:
  keys: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Type:
  content: str


@dataclasses.dataclass(frozen=True)
class Scroll:
  x: float
  y: float
  direction: str


@dataclasses.dataclass(frozen=True)
class Wait:
  pass


@dataclasses.dataclass(frozen=True)
class Finished:
  content: str = ""


@dataclasses.dataclass(frozen=True)
class CallUser:
  pass


# SDK functions (report sections 2.1-2.2, GUI-SDK): terminal, files and MCP tools in the sandbox.
# They act on the session's shared directory, not on the screen; sandboxes that have no SDK answer
# them with an "invalid action" observation.
@dataclasses.dataclass(frozen=True)
class RunCommand:
  """`run_command(command='ls -l')`: a shell command in the session directory."""

  command: str


@dataclasses.dataclass(frozen=True)
class ReadFile:
  """`read_file(path='notes.txt')`: a text file of the session directory."""

  path: str


@dataclasses.dataclass(frozen=True)
class WriteFile:
  """`write_file(path='out.txt', content='...')`: creates or overwrites a file."""

  path: str
  content: str


@dataclasses.dataclass(frozen=True)
class ListFiles:
  """`list_files(path='.')`: the entries of a directory (path optional)."""

  path: str = "."


@dataclasses.dataclass(frozen=True)
class SearchFiles:
  """`search_files(pattern='total', path='.')`: lines containing `pattern` (literal) under `path`."""

  pattern: str
  path: str = "."


@dataclasses.dataclass(frozen=True)
class McpListTools:
  """`mcp_list_tools(server='docs')`: the tools of a session's MCP server."""

  server: str


@dataclasses.dataclass(frozen=True)
class McpCall:
  """`mcp_call(server='docs', tool='search', arguments='{"query": "x"}')`; `arguments` is a JSON
  object, kept as its canonical text (sorted keys) so the action stays hashable."""

  server: str
  tool: str
  arguments: str = "{}"

  def args(self) -> dict:
    """The arguments as a dict."""
    return json.loads(self.arguments)


GuiAction = Union[Click, LeftDouble, RightSingle, Drag, Hotkey, Type, Scroll, Wait, Finished, CallUser]
SdkAction = Union[RunCommand, ReadFile, WriteFile, ListFiles, SearchFiles, McpListTools, McpCall]
Action = Union[GuiAction, SdkAction]
SDK_TYPES = (RunCommand, ReadFile, WriteFile, ListFiles, SearchFiles, McpListTools, McpCall)
SDK_ACTION_NAMES = ("run_command", "read_file", "write_file", "list_files", "search_files", "mcp_list_tools",
                    "mcp_call")


def is_sdk(a) -> bool:
  """True for SDK-function actions (terminal, files, MCP), False for GUI actions."""
  return isinstance(a, SDK_TYPES)
_POINT_ACTIONS = {"click": Click, "left_single": Click, "left_double": LeftDouble, "right_single": RightSingle}
DIRECTIONS = ("up", "down", "left", "right")


@dataclasses.dataclass(frozen=True)
class CoordSpec:
  """How the model writes coordinates. mode: 'relative1000' or 'absolute' (needs width/height px)."""

  mode: str = "relative1000"
  width: int | None = None
  height: int | None = None

  def __post_init__(self):
    if self.mode not in ("relative1000", "absolute"):
      raise ValueError(f"unknown coordinate mode {self.mode!r}")
    if self.mode == "absolute" and not (self.width and self.height):
      raise ValueError("absolute coordinates need width and height (pixels of the resized image)")

  def to_unit(self, x: float, y: float) -> tuple[float, float]:
    """Model coordinates -> [0, 1] fractions; raises ActionParseError when off the screenshot."""
    w, h = (1000.0, 1000.0) if self.mode == "relative1000" else (float(self.width), float(self.height))
    if not (0 <= x <= w and 0 <= y <= h):
      raise ActionParseError(f"coordinates ({x:g},{y:g}) outside the screenshot (0..{w:g}, 0..{h:g})")
    return x / w, y / h

  def from_unit(self, x: float, y: float) -> tuple[int, int]:
    """[0, 1] fractions -> integer model coordinates (rounded to the grid)."""
    w, h = (1000, 1000) if self.mode == "relative1000" else (self.width, self.height)
    return int(round(x * w)), int(round(y * h))


_NUM = r"-?\d+(?:\.\d+)?"
_CALL = re.compile(r"^\s*([A-Za-z_]\w*)\s*\((.*)\)\s*$", re.S)
_KWARG = re.compile(r"\s*([A-Za-z_]\w*)\s*=\s*(?:'((?:[^'\\]|\\.)*)'|\"((?:[^\"\\]|\\.)*)\")\s*(?:,|$)", re.S)


def _unescape(s: str) -> str:
  out, i = [], 0
  while i < len(s):
    if s[i] == "\\" and i + 1 < len(s):
      nxt = s[i + 1]
      out.append({"n": "\n", "t": "\t", "'": "'", '"': '"', "\\": "\\"}.get(nxt, "\\" + nxt))
      i += 2
    else:
      out.append(s[i])
      i += 1
  return "".join(out)


def _kwargs(args: str) -> dict[str, str]:
  out, pos, args = {}, 0, args.strip()
  while pos < len(args):
    m = _KWARG.match(args, pos)
    if not m:
      raise ActionParseError(f"cannot parse arguments {args[pos:pos + 40]!r}: expected name='value'")
    key = m.group(1)
    if key in out:
      raise ActionParseError(f"argument {key!r} given twice")
    val = m.group(2) if m.group(2) is not None else m.group(3)
    out[key] = _unescape(val)
    pos = m.end()
  return out


def _point(text: str, spec: CoordSpec) -> tuple[float, float]:
  t = text.replace("<|box_start|>", "").replace("<|box_end|>", "").strip()
  m = re.fullmatch(rf"<point>\s*({_NUM})\s+({_NUM})\s*</point>", t)
  if m:
    nums = [float(m.group(1)), float(m.group(2))]
  else:
    m = re.fullmatch(rf"[\(\[]\s*({_NUM})\s*,\s*({_NUM})\s*(?:,\s*({_NUM})\s*,\s*({_NUM})\s*)?[\)\]]", t)
    if not m:
      raise ActionParseError(f"bad point {text[:60]!r}: expected '(x,y)', '(x1,y1,x2,y2)' or '<point>x y</point>'")
    nums = [float(g) for g in m.groups() if g is not None]
  if len(nums) == 4:  # a box: act on its centre
    nums = [(nums[0] + nums[2]) / 2, (nums[1] + nums[3]) / 2]
  return spec.to_unit(nums[0], nums[1])


def _get_point(kw: dict, names: tuple[str, ...], spec: CoordSpec, action: str) -> tuple[float, float]:
  for n in names:
    if n in kw:
      return _point(kw.pop(n), spec)
  raise ActionParseError(f"{action} needs {' or '.join(names)}")


def parse_action(text: str, coords: CoordSpec = CoordSpec(), sdk: bool = False) -> Action:
  """One action string (e.g. `click(start_box='(120,455)')`) -> typed action.

  sdk: accept SDK functions (run_command, read_file, ..., mcp_call). Off by default, so a sandbox
    without an SDK (the browser) answers them as invalid actions instead of silently doing nothing;
    the desktop sandbox turns it on (off again for GUI-only sessions).
  Raises: ActionParseError with the reason (unknown action, bad or missing arguments, coordinates
  off the screenshot, an SDK function where `sdk` is False).
  """
  if not isinstance(text, str):
    raise ActionParseError(f"action must be a string, got {type(text).__name__}")
  m = _CALL.match(text.strip())
  if not m:
    raise ActionParseError(f"not an action call: {text.strip()[:60]!r}")
  name, kw = m.group(1), _kwargs(m.group(2))
  if name in _POINT_ACTIONS:
    x, y = _get_point(kw, ("start_box", "point", "start_point"), coords, name)
    act: Action = _POINT_ACTIONS[name](x, y)
  elif name in ("drag", "select"):
    x1, y1 = _get_point(kw, ("start_box", "start_point"), coords, name)
    x2, y2 = _get_point(kw, ("end_box", "end_point"), coords, name)
    act = Drag(x1, y1, x2, y2)
  elif name == "hotkey":
    keys = tuple(k for k in re.split(r"[\s+]+", kw.pop("key", kw.pop("hotkey", "")).strip().lower()) if k)
    if not keys:
      raise ActionParseError("hotkey needs key='...' with at least one key")
    act = Hotkey(keys)
  elif name == "type":
    if "content" not in kw:
      raise ActionParseError("type needs content='...'")
    act = Type(kw.pop("content"))
  elif name == "scroll":
    x, y = _get_point(kw, ("start_box", "point", "start_point"), coords, name)
    d = kw.pop("direction", "").strip().lower()
    if d not in DIRECTIONS:
      raise ActionParseError(f"scroll direction {d!r} not in {DIRECTIONS}")
    act = Scroll(x, y, d)
  elif name == "wait":
    act = Wait()
  elif name == "finished":
    act = Finished(kw.pop("content", ""))
  elif name == "call_user":
    act = CallUser()
  elif name in SDK_ACTION_NAMES:
    if not sdk:
      raise ActionParseError(f"SDK function {name!r} is not available here (GUI actions only)")
    act = _sdk_action(name, kw)
  else:
    raise ActionParseError(f"unknown action {name!r}")
  if kw:
    raise ActionParseError(f"unexpected arguments for {name}: {sorted(kw)}")
  return act


def _need(kw: dict, key: str, name: str) -> str:
  if key not in kw:
    raise ActionParseError(f"{name} needs {key}='...'")
  return kw.pop(key)


def _sdk_action(name: str, kw: dict):
  """SDK function call -> typed action (pops the arguments it uses from `kw`)."""
  if name == "run_command":
    cmd = _need(kw, "command", name)
    if not cmd.strip():
      raise ActionParseError("run_command needs a non-empty command")
    return RunCommand(cmd)
  if name == "read_file":
    return ReadFile(_need(kw, "path", name))
  if name == "write_file":
    return WriteFile(_need(kw, "path", name), _need(kw, "content", name))
  if name == "list_files":
    return ListFiles(kw.pop("path", "."))
  if name == "search_files":
    pat = _need(kw, "pattern", name)
    if not pat:
      raise ActionParseError("search_files needs a non-empty pattern")
    return SearchFiles(pat, kw.pop("path", "."))
  if name == "mcp_list_tools":
    return McpListTools(_need(kw, "server", name))
  server, tool = _need(kw, "server", name), _need(kw, "tool", name)
  raw = kw.pop("arguments", "{}")
  try:
    args = json.loads(raw)
  except (ValueError, RecursionError) as e:  # RecursionError: absurdly nested JSON
    raise ActionParseError(f"mcp_call arguments are not JSON: {str(e)[:80]}") from None
  if not isinstance(args, dict):
    raise ActionParseError("mcp_call arguments must be a JSON object")
  return McpCall(server, tool, json.dumps(args, sort_keys=True, ensure_ascii=False))


_DELIM = "Action:"
_DELIM_AT_LINE = re.compile(r"(?:^|\n)[ \t]*Action:")


def parse_response(text: str, coords: CoordSpec = CoordSpec(), sdk: bool = False) -> tuple[str, Action]:
  """`Thought: …\\nAction: …` (or just `Action: …`) -> (thought, action).

  The action starts at the first `Action:` that begins a line (else the first `Action:` anywhere),
  so a typed content like `type(content='Action: x')` stays intact. The thought is the text before
  it, without a leading `Thought:`, stripped (may be '').

  Raises: ActionParseError when there is no `Action:` or the action does not parse.
  """
  if not isinstance(text, str):
    raise ActionParseError(f"reply must be a string, got {type(text).__name__}")
  m = _DELIM_AT_LINE.search(text)
  if m:
    start, end = m.end() - len(_DELIM), m.end()
  else:
    start = text.find(_DELIM)
    if start < 0:
      raise ActionParseError("no 'Action:' in the reply")
    end = start + len(_DELIM)
  thought = text[:start].strip()
  if thought.startswith("Thought:"):
    thought = thought[len("Thought:"):].strip()
  return thought, parse_action(text[end:], coords, sdk)


def parse(text: str, coords: CoordSpec = CoordSpec(), sdk: bool = False) -> Action:
  """A reply (`Thought: …` / `… Action: …`) or a bare action string -> action (what sandboxes run).

  Raises: ActionParseError (see parse_response / parse_action).
  """
  if not isinstance(text, str):
    raise ActionParseError(f"action must be a string, got {type(text).__name__}")
  if text.lstrip().startswith("Thought:") or _DELIM in text:
    return parse_response(text, coords, sdk)[1]
  return parse_action(text, coords, sdk)


def _q(s: str) -> str:
  return s.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")


def format_action(a: Action, coords: CoordSpec = CoordSpec()) -> str:
  """Canonical UI-TARS text of an action, points as `'(x,y)'` integers of `coords`.

  parse_action(format_action(a, c), c) == a up to rounding to the integer grid of `c`.
  Raises: TypeError if `a` is not an action.
  """
  def pt(x, y):
    px, py = coords.from_unit(x, y)
    return f"'({px},{py})'"
  if isinstance(a, Click):
    return f"click(start_box={pt(a.x, a.y)})"
  if isinstance(a, LeftDouble):
    return f"left_double(start_box={pt(a.x, a.y)})"
  if isinstance(a, RightSingle):
    return f"right_single(start_box={pt(a.x, a.y)})"
  if isinstance(a, Drag):
    return f"drag(start_box={pt(a.x1, a.y1)}, end_box={pt(a.x2, a.y2)})"
  if isinstance(a, Hotkey):
    return f"hotkey(key='{' '.join(a.keys)}')"
  if isinstance(a, Type):
    return f"type(content='{_q(a.content)}')"
  if isinstance(a, Scroll):
    return f"scroll(start_box={pt(a.x, a.y)}, direction='{a.direction}')"
  if isinstance(a, Wait):
    return "wait()"
  if isinstance(a, Finished):
    return f"finished(content='{_q(a.content)}')"
  if isinstance(a, CallUser):
    return "call_user()"
  if isinstance(a, RunCommand):
    return f"run_command(command='{_q(a.command)}')"
  if isinstance(a, ReadFile):
    return f"read_file(path='{_q(a.path)}')"
  if isinstance(a, WriteFile):
    return f"write_file(path='{_q(a.path)}', content='{_q(a.content)}')"
  if isinstance(a, ListFiles):
    return f"list_files(path='{_q(a.path)}')"
  if isinstance(a, SearchFiles):
    return f"search_files(pattern='{_q(a.pattern)}', path='{_q(a.path)}')"
  if isinstance(a, McpListTools):
    return f"mcp_list_tools(server='{_q(a.server)}')"
  if isinstance(a, McpCall):
    return f"mcp_call(server='{_q(a.server)}', tool='{_q(a.tool)}', arguments='{_q(a.arguments)}')"
  raise TypeError(f"not an action: {a!r}")


def to_pixels(a: Action, width: int, height: int) -> dict[str, float]:
  """Pixel coordinates (float px) of an action's points on a `width` x `height` page.

  Returns {'x', 'y'} for Click/LeftDouble/RightSingle/Scroll, {'x1', 'y1', 'x2', 'y2'} for Drag,
  {} for actions without a point.
  """
  if isinstance(a, Drag):
    return {"x1": a.x1 * width, "y1": a.y1 * height, "x2": a.x2 * width, "y2": a.y2 * height}
  if hasattr(a, "x"):
    return {"x": a.x * width, "y": a.y * height}
  return {}
