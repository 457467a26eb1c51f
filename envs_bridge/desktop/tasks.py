"""Desktop and hybrid (GUI + SDK) tasks: set-up (files, X programs) and an OSWorld-style evaluator.

Every task is a function `seed -> TaskSpec`; the seed picks the words / numbers, so one seed is one
episode content. Names:
  desktop/<name>   GUI-only tasks on real Debian X programs (xterm, xedit, xmessage).
  hybrid/<name>    tasks that need both the screen and the files of the session (the report's GUI-SDK
                   setting, sections 2.1-2.2): the answer is on the screen and the data in files (or
                   in an MCP server, or behind a browser download). Every hybrid task also has an
                   xterm, so it stays solvable GUI-only; `<name>@gui` is the same task with SDK
                   actions disabled (the report's GUI-only vs GUI-SDK comparison).
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys

# The document set of envs_bridge/mcp_tools/docsearch_server.py (not imported: it pulls in `mcp`).
DEFAULT_DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mcp_tools", "docs")

WIDTH, HEIGHT = 640, 480  # default screen
GUI_SUFFIX = "@gui"
WORDS = ("apple", "river", "piano", "cactus", "violet", "harbor", "meteor", "lantern", "walnut", "glacier",
         "pepper", "falcon", "marble", "orchid", "tundra", "saffron")
XTERM_GEOMETRY = "80x24+0+0"


@dataclasses.dataclass(frozen=True)
class Program:
  """An X program of a task: `label` (for getters), argv, whether its stdout is captured."""

  label: str
  argv: tuple[str, ...]
  capture_stdout: bool = False
  env: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """One episode's content.

  instruction: task text (info.instruction). files: {relative path: text} written into the session
  directory first. programs: started in order on the display. evaluator: checks.evaluate dict.
  end_on_exit: label of a program whose exit ends the episode (a dialog answered). mcp_servers:
  {name: {'command', 'args'}} callable with mcp_call. web: {url path: (content type, body,
  attachment file name or None)} served to the session's browser; '{web}' in program argv is
  replaced by the session's base URL. max_steps: the episode ends (reward 0) after this many steps.
  """

  instruction: str
  files: dict
  programs: tuple[Program, ...]
  evaluator: dict
  end_on_exit: str | None = None
  mcp_servers: dict = dataclasses.field(default_factory=dict)
  web: dict = dataclasses.field(default_factory=dict)
  max_steps: int = 15


def xterm(geometry: str = XTERM_GEOMETRY) -> Program:
  """An xterm running bash (no rc files, prompt '$ ', no history file) in the session directory."""
  return Program("terminal", ("xterm", "-geometry", geometry, "-xrm", "*cursorBlink: false",
                              "-xrm", "*scrollBar: false", "-e", "bash", "--noprofile", "--norc"),
                 env=(("PS1", "$ "), ("HISTFILE", "/dev/null")))


def xedit(path: str, geometry: str = "400x300+0+0") -> Program:
  return Program("editor", ("xedit", "-geometry", geometry, path))


def xmessage(text: str, buttons: list[str], geometry: str = "+420+20") -> Program:
  """A dialog that prints the label of the button clicked, then exits."""
  return Program("dialog", ("xmessage", "-print", "-buttons", ",".join(buttons), "-geometry", geometry, text),
                 capture_stdout=True)


def _file_check(path: str, expected: str, func: str = "exact_match", **options) -> dict:
  ev = {"func": func, "result": {"type": "file_content", "path": path}, "expected": expected}
  if options:
    ev["options"] = options
  return ev


def _dialog_check(expected: str) -> dict:
  return {"func": "exact_match", "result": {"type": "program_output", "program": "dialog"}, "expected": expected}


# -- desktop (GUI-only) ---------------------------------------------------------------------------------
def terminal_write_file(seed: int) -> TaskSpec:
  w = random.Random(seed).choice(WORDS)
  return TaskSpec(f"In the terminal, save the word {w} into a new file named answer.txt.", {}, (xterm(),),
                  _file_check("answer.txt", w))


def terminal_mkdir(seed: int) -> TaskSpec:
  w = random.Random(seed).choice(WORDS)
  return TaskSpec(f"In the terminal, create a directory named {w}.", {}, (xterm(),),
                  {"func": "exact_match", "result": {"type": "is_dir", "path": w}, "expected": True})


def terminal_rename(seed: int) -> TaskSpec:
  w = random.Random(seed).choice(WORDS)
  return TaskSpec(f"In the terminal, rename the file draft.txt to {w}.txt.", {"draft.txt": "first draft\n"},
                  (xterm(),), {"func": "set_equal", "result": {"type": "dir_entries", "path": "."},
                               "expected": [f"{w}.txt"]})


def editor_type_save(seed: int) -> TaskSpec:
  w = random.Random(seed).choice(WORDS)
  return TaskSpec(f"In the text editor, type {w} into notes.txt and save the file.", {"notes.txt": ""},
                  (xedit("notes.txt"),), _file_check("notes.txt", w))


def dialog_choose(seed: int) -> TaskSpec:
  rng = random.Random(seed)
  words = rng.sample(WORDS, 3)
  w = words[rng.randrange(3)]
  return TaskSpec(f"Click the button labelled {w} in the dialog.", {},
                  (xmessage(f"Click {w}", words, geometry="+200+200"),), _dialog_check(w), end_on_exit="dialog")


# -- hybrid (GUI + SDK) ---------------------------------------------------------------------------------
def dialog_sum_file(seed: int) -> TaskSpec:
  rng = random.Random(seed)
  nums = [rng.randint(10, 99) for _ in range(30)]
  total = sum(nums)
  choices = [total, total + rng.choice((-10, 10)), total + rng.choice((-1, 1)) * rng.randint(2, 9)]
  rng.shuffle(choices)
  return TaskSpec("Click the button in the dialog that shows the sum of the numbers in numbers.txt.",
                  {"numbers.txt": "\n".join(map(str, nums)) + "\n"},
                  (xterm(), xmessage("Sum of numbers.txt?", [str(c) for c in choices])),
                  _dialog_check(str(total)), end_on_exit="dialog")


def dialog_count_errors(seed: int) -> TaskSpec:
  rng = random.Random(seed)
  levels = [rng.choice(("INFO", "INFO", "WARN", "ERROR")) for _ in range(40)]
  lines = [f"2024-01-01T00:{i:02d}:00 {lv} worker-{rng.randint(1, 9)} event {rng.randint(100, 999)}"
           for i, lv in enumerate(levels)]
  n = levels.count("ERROR")
  choices = sorted({n, n + 1, max(0, n - 2), n + 3})
  return TaskSpec("Click the button in the dialog that shows how many lines of app.log contain ERROR.",
                  {"app.log": "\n".join(lines) + "\n"},
                  (xterm(), xmessage("ERROR lines in app.log?", [str(c) for c in choices])),
                  _dialog_check(str(n)), end_on_exit="dialog")


def dialog_code_to_file(seed: int) -> TaskSpec:
  code = f"{random.Random(seed).randint(0, 999_999):06d}"
  return TaskSpec("Write the code shown in the dialog into a file named code.txt.", {},
                  (xterm(), xmessage(f"The code is {code}", ["OK"])), _file_check("code.txt", code))


# (question, expected answer) answerable from envs_bridge/mcp_tools/docs via the docs MCP server.
DOC_FACTS = (("the magic number of the test suite", "4817"), ("the clip-higher upper bound of UI-TARS-2", "0.28"),
             ("the JAX version that introduced jax.Array", "0.4.1"),
             ("the default color depth of an Xvfb screen in bits", "24"))


def docs_lookup_editor(seed: int) -> TaskSpec:
  q, a = DOC_FACTS[seed % len(DOC_FACTS)]
  docs = {f"docs/{n}": open(os.path.join(DEFAULT_DOCS, n), encoding="utf-8").read()
          for n in sorted(os.listdir(DEFAULT_DOCS))}  # also on disk, so GUI-only can grep them in the xterm
  return TaskSpec(f"Look up {q} in the documentation (MCP server 'docs', or the docs folder), type it into "
                  f"answer.txt in the text editor and save.", {"answer.txt": "", **docs},
                  (xterm("80x10+0+0"), xedit("answer.txt", geometry="480x300+0+170")), _file_check("answer.txt", a),
                  mcp_servers={"docs": {"command": sys.executable,
                                        "args": ["-m", "envs_bridge.mcp_tools.docsearch_server"]}})


def browser_download_total(seed: int) -> TaskSpec:
  rng = random.Random(seed)
  rows = [(f"item-{i}", rng.randint(1, 500)) for i in range(rng.randint(8, 15))]
  csv = "name,amount\n" + "".join(f"{n},{a}\n" for n, a in rows)
  total = sum(a for _, a in rows)
  page = ("<!doctype html><html><body style='margin:0;font:16px sans-serif'>"
          "<a id='dl' href='sales.csv' style='display:block;width:300px;height:80px;background:#36c;color:#fff;"
          "line-height:80px;text-align:center'>Download sales.csv</a></body></html>")
  return TaskSpec("Download sales.csv from the browser, then write the total of its amount column to answer.txt.",
                  {}, (xterm("80x18+0+200"), Program("browser", ("chromium", "--app={web}index.html"))),
                  _file_check("answer.txt", total, func="number_match"),
                  web={"index.html": ("text/html", page, None), "sales.csv": ("text/csv", csv, "sales.csv")})


DESKTOP_TASKS = {
    "desktop/terminal-write-file": terminal_write_file, "desktop/terminal-mkdir": terminal_mkdir,
    "desktop/terminal-rename": terminal_rename, "desktop/editor-type-save": editor_type_save,
    "desktop/dialog-choose": dialog_choose,
}
HYBRID_TASKS = {
    "hybrid/dialog-sum-file": dialog_sum_file, "hybrid/dialog-count-errors": dialog_count_errors,
    "hybrid/dialog-code-to-file": dialog_code_to_file, "hybrid/docs-lookup-editor": docs_lookup_editor,
    "hybrid/browser-download-total": browser_download_total,
}
TASKS = {**DESKTOP_TASKS, **HYBRID_TASKS}


def task_names() -> tuple[str, ...]:
  """All task names, hybrid ones also with their GUI-only variant `<name>@gui`."""
  return tuple(TASKS) + tuple(n + GUI_SUFFIX for n in HYBRID_TASKS)


def make(name: str, seed: int) -> tuple[TaskSpec, bool]:
  """(TaskSpec, gui_only) for a task name. Raises KeyError for unknown names."""
  base, gui = (name[:-len(GUI_SUFFIX)], True) if name.endswith(GUI_SUFFIX) else (name, False)
  if base not in TASKS or (gui and base not in HYBRID_TASKS):
    raise KeyError(name)
  return TASKS[base](seed), gui
