"""Scripted experts of the desktop and hybrid tasks (`envs_bridge/desktop/tasks.py`): pure decisions.

An expert maps (instruction, view, turn) to (thought, action) like the MiniWoB++ experts of
`experts.py` (which renders the action in the policy's coordinate format and registers these experts
with `reads='desktop_state'`). The view is privileged and never shown to the agent: the desktop
sandbox's debug state, `SandboxClient.desktop_state(sid)` (`DesktopSandbox.debug_state`):
  windows     the window tree, depth first: [{id, name, class, x, y, width, height, depth}], boxes in
              pixels of the width x height screen (top-level windows have depth 0; their widgets follow
              them with depth > 0);
  width, height   the screen, pixels (640 x 480 by default);
  programs    {label: argv} of the task's X programs (the dialog's button labels, its text);
  evaluator   the task's check (`envs_bridge/desktop/checks.py`), with the expected value;
  entries     sorted names in the session directory.
The agent's actions are those of the protocol: GUI clicks, typing and keys through PyAutoGUI, and on
hybrid tasks the SDK functions (terminal, files, MCP; `tars_jax/agent/actions.py`). Typed text holds
no newline (the grammar's content has none), so a shell command is typed, then run with Enter.

X programs run in real time (the sandbox waits `step_ms` after each action, then checks the task):
a step may end before the shell has run a command. Each expert is a fixed plan of the task, indexed
by the turn; past its end the last step repeats (`_plan_step`): a click on the focused window, or on
the button already clicked, or the Save button again, all harmless while the task's check catches up.
The plan depends on the turn because the screen does not say how far it got (the terminal's text is
not in the view); it does not depend on which earlier steps failed, so a lost click is not retried.

Tasks and plans (w: the instruction's word; every click aims inside the window's box):
  desktop/terminal-write-file  click the terminal, type `echo w > answer.txt`, Enter
  desktop/terminal-mkdir       click the terminal, type `mkdir w`, Enter
  desktop/terminal-rename      click the terminal, type `mv draft.txt w.txt`, Enter
  desktop/editor-type-save     click xedit's text area, type w, click Save
  desktop/dialog-choose        click xmessage's button labelled w
  hybrid/dialog-sum-file       run_command summing numbers.txt, click the button with the sum
  hybrid/dialog-count-errors   run_command `grep -c ERROR app.log`, click the button with the count
  hybrid/dialog-code-to-file   write_file code.txt with the code the dialog shows
  hybrid/docs-lookup-editor    mcp_call search_docs, click the editor's text area, type the answer, Save
  hybrid/browser-download-total  click the page's download link until sales.csv is in the session
              directory, then one run_command that sums its amount column into answer.txt (and prints it)
The `@gui` variants (SDK refused) have no expert.
"""

from __future__ import annotations

import json
import re
from typing import Callable, Sequence

from tars_jax.agent import actions as A
from tars_jax.data.sources.experts import ClickAt, ExpertError

XTERM, XEDIT, XMESSAGE = "XTerm", "Xedit", "Xmessage"  # WM_CLASS of the task programs


# -- reading the window tree ----------------------------------------------------------------------------
def top_window(view: dict, cls: str, index: int = 0) -> dict:
  """The `index`-th top-level (depth 0) window of WM_CLASS `cls` (case-insensitive prefix: Chromium's
  class varies with the build). Raises ExpertError when there is none."""
  tops = [w for w in view["windows"] if w["depth"] == 0 and w["class"].lower().startswith(cls.lower())]
  if len(tops) <= index:
    raise ExpertError(f"no {cls} window on the screen")
  return tops[index]


def widgets(view: dict, top: dict) -> list[dict]:
  """The windows inside top-level window `top`: the entries after it in the depth-first tree up to the
  next top-level window."""
  wins = view["windows"]
  i = next(k for k, w in enumerate(wins) if w is top or w["id"] == top["id"])
  out = []
  for w in wins[i + 1:]:
    if w["depth"] == 0:
      break
    out.append(w)
  return out


def dialog_buttons(view: dict) -> dict[str, dict]:
  """{label: box} of xmessage's buttons: its lowest row of depth-2 widgets, left to right, named by
  the `-buttons` list of the dialog program's argv (xmessage lays them out in that order).
  Raises ExpertError without a dialog or when the counts differ."""
  argv = view["programs"].get("dialog")
  if argv is None or "-buttons" not in argv:
    raise ExpertError("the task has no dialog with buttons")
  labels = argv[argv.index("-buttons") + 1].split(",")
  kids = [w for w in widgets(view, top_window(view, XMESSAGE)) if w["depth"] == 2]
  if not kids:
    raise ExpertError("the dialog has no widgets")
  low = max(w["y"] for w in kids)
  row = sorted((w for w in kids if w["y"] == low), key=lambda w: w["x"])
  if len(row) != len(labels):
    raise ExpertError(f"the dialog shows {len(row)} buttons, its program names {len(labels)}")
  return dict(zip(labels, row))


def xedit_parts(view: dict) -> tuple[dict, dict, tuple[dict, ...]]:
  """(text area, Save button, widgets over the text area) of the xedit window. The text area is its
  largest depth-4 widget (the edited file's text; the scroll bar at depth 5 is drawn over its left
  edge); the buttons are the depth-3 widgets of its top row, Quit, Save, Load, left to right.
  Raises ExpertError when the layout is not xedit's."""
  kids = widgets(view, top_window(view, XEDIT))
  texts = [w for w in kids if w["depth"] == 4]
  row = [w for w in kids if w["depth"] == 3]
  if not texts or not row:
    raise ExpertError("the editor's widgets are not on the screen")
  text = max(texts, key=lambda w: w["width"] * w["height"])
  top = min(w["y"] for w in row)
  buttons = sorted((w for w in row if w["y"] == top), key=lambda w: w["x"])
  if len(buttons) < 3:
    raise ExpertError(f"the editor's button row has {len(buttons)} widgets")
  over = tuple(w for w in kids if w["depth"] == 5 and _overlap(w, text))
  return text, buttons[1], over


def _overlap(a: dict, b: dict) -> bool:
  return (a["x"] < b["x"] + b["width"] and b["x"] < a["x"] + a["width"]
          and a["y"] < b["y"] + b["height"] and b["y"] < a["y"] + a["height"])


def _match(pattern: str, instruction: str, task: str) -> re.Match:
  m = re.search(pattern, instruction)
  if not m:
    raise ExpertError(f"{task}: instruction {instruction!r} does not match {pattern!r}")
  return m


def expected(view: dict) -> str:
  """The task check's expected value as text (privileged: the answer the agent must find)."""
  ev = view.get("evaluator") or {}
  if "expected" not in ev:
    raise ExpertError("the task's check has no expected value")
  return str(ev["expected"])


def _plan_step(plan: Sequence[tuple[str, object]], turn: int) -> tuple[str, object]:
  """plan[turn], the last step repeated past the end."""
  return plan[min(turn, len(plan) - 1)]


# -- plans of the pieces ------------------------------------------------------------------------------
def _terminal_plan(view: dict, command: str) -> list:
  term = top_window(view, XTERM)
  return [("the terminal, to type into it", ClickAt(term)),
          (f"type the command: {command}", A.Type(command)),
          ("Enter runs the command", A.Hotkey(("enter",))),
          ("the terminal, while the command runs", ClickAt(term))]


def _editor_plan(view: dict, text: str) -> list:
  area, save, over = xedit_parts(view)
  return [("the editor's text area", ClickAt(area, over)),
          (f"type {text}", A.Type(text)),
          ("the Save button", ClickAt(save))]


def _click_button(view: dict, label: str) -> tuple[str, ClickAt]:
  buttons = dialog_buttons(view)
  if label not in buttons:
    raise ExpertError(f"no dialog button labelled {label!r} (buttons: {sorted(buttons)})")
  return f"the button labelled {label}", ClickAt(buttons[label])


# -- desktop (GUI-only) experts: (instruction, view, turn) -> (thought, action) ------------------------------
def terminal_write_file(instruction, view, turn):
  w = _match(r"save the word (\S+) into a new file named answer\.txt", instruction, "terminal-write-file").group(1)
  return _plan_step(_terminal_plan(view, f"echo {w} > answer.txt"), turn)


def terminal_mkdir(instruction, view, turn):
  w = _match(r"create a directory named (\S+?)\.?$", instruction, "terminal-mkdir").group(1)
  return _plan_step(_terminal_plan(view, f"mkdir {w}"), turn)


def terminal_rename(instruction, view, turn):
  m = _match(r"rename the file (\S+) to (\S+?)\.?$", instruction, "terminal-rename")
  return _plan_step(_terminal_plan(view, f"mv {m.group(1)} {m.group(2)}"), turn)


def editor_type_save(instruction, view, turn):
  w = _match(r"type (\S+) into notes\.txt and save", instruction, "editor-type-save").group(1)
  return _plan_step(_editor_plan(view, w), turn)


def dialog_choose(instruction, view, turn):
  w = _match(r"Click the button labelled (\S+?) in the dialog", instruction, "dialog-choose").group(1)
  return _click_button(view, w)


# -- hybrid (GUI + SDK) experts ------------------------------------------------------------------------------
def dialog_sum_file(instruction, view, turn):
  if turn == 0:  # bash arithmetic over the lines joined by '+' (no quotes: the grammar's content has none of ')
    return "sum numbers.txt in the shell", A.RunCommand("echo $(($(paste -sd+ numbers.txt)))")
  return _click_button(view, expected(view))


def dialog_count_errors(instruction, view, turn):
  if turn == 0:
    return "count the ERROR lines of app.log", A.RunCommand("grep -c ERROR app.log")
  return _click_button(view, expected(view))


def dialog_code_to_file(instruction, view, turn):
  argv = view["programs"].get("dialog") or []
  m = re.search(r"The code is (\d+)", argv[-1] if argv else "")
  if not m:
    raise ExpertError("the dialog shows no code")
  return f"write the code {m.group(1)} to code.txt", A.WriteFile("code.txt", m.group(1))


def docs_lookup_editor(instruction, view, turn):
  q = _match(r"^Look up (.+?) in the documentation", instruction, "docs-lookup-editor").group(1)
  if turn == 0:
    return "search the docs", A.McpCall("docs", "search_docs", json.dumps({"query": q, "k": 1}, sort_keys=True))
  return _plan_step(_editor_plan(view, expected(view)), turn - 1)


# <= 72 bytes (the verticals' grammar.max_content_bytes)
SUM_AMOUNTS = "echo $(($(tail -n+2 sales.csv|cut -d, -f2|paste -sd+)))|tee answer.txt"


def browser_download_total(instruction, view, turn):
  if "sales.csv" not in view.get("entries", ()):  # Chromium names it so once the download is complete
    page = top_window(view, "chromium")
    link = {"x": page["x"], "y": page["y"], "width": min(page["width"], 300), "height": min(page["height"], 80)}
    return "the download link of sales.csv", ClickAt(link)
  return "sum the amount column into answer.txt", A.RunCommand(SUM_AMOUNTS)


DESKTOP_EXPERTS: dict[str, Callable] = {
    "desktop/terminal-write-file": terminal_write_file, "desktop/terminal-mkdir": terminal_mkdir,
    "desktop/terminal-rename": terminal_rename, "desktop/editor-type-save": editor_type_save,
    "desktop/dialog-choose": dialog_choose,
    "hybrid/dialog-sum-file": dialog_sum_file, "hybrid/dialog-count-errors": dialog_count_errors,
    "hybrid/dialog-code-to-file": dialog_code_to_file, "hybrid/docs-lookup-editor": docs_lookup_editor,
    "hybrid/browser-download-total": browser_download_total,
}
