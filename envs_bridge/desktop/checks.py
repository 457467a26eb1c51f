"""OSWorld-style task checks: a getter reads the state, a metric compares it with the expected value.

An evaluator is a dict, as in OSWorld's task JSON (`xlang-ai/OSWorld`, `desktop_env/evaluators/`):
  {"func": "exact_match", "result": {"type": "file_content", "path": "answer.txt"}, "expected": "42"}
`evaluate(evaluator, state) -> (score in [0, 1], reason)`. Getters read only what the sandbox
holds (`CheckState`: the session directory and the captured stdout of its programs); metrics are
pure functions, unit-tested on their own.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from envs_bridge.sdk import files


@dataclasses.dataclass
class CheckState:
  """What getters may read: `root` (session directory), `outputs` ({program label: stdout text})."""

  root: str
  outputs: dict[str, str] = dataclasses.field(default_factory=dict)


# -- getters: CheckState, spec -> value ---------------------------------------------------------------
def get_file_content(st: CheckState, spec: dict) -> str | None:
  """Text of `spec['path']` in the session directory, or None if missing / outside it."""
  try:
    full = files.resolve(st.root, spec["path"])
  except files.PathRefused:
    return None
  if not os.path.isfile(full):
    return None
  with open(full, "rb") as f:
    return f.read(1 << 20).decode("utf-8", errors="replace")


def get_is_dir(st: CheckState, spec: dict) -> bool:
  """Whether `spec['path']` is a directory inside the session directory."""
  try:
    return os.path.isdir(files.resolve(st.root, spec["path"]))
  except files.PathRefused:
    return False


def get_dir_entries(st: CheckState, spec: dict) -> list[str]:
  """Sorted names in `spec.get('path', '.')` (hidden files skipped), [] if missing."""
  try:
    full = files.resolve(st.root, spec.get("path", "."))
  except files.PathRefused:
    return []
  return sorted(n for n in os.listdir(full) if not n.startswith(".")) if os.path.isdir(full) else []


def get_program_output(st: CheckState, spec: dict) -> str | None:
  """Captured stdout of the program labelled `spec['program']` (e.g. xmessage -print), or None."""
  return st.outputs.get(spec["program"])


GETTERS: dict[str, Callable[[CheckState, dict], Any]] = {
    "file_content": get_file_content, "is_dir": get_is_dir, "dir_entries": get_dir_entries,
    "program_output": get_program_output,
}


# -- metrics: (result, expected) -> score --------------------------------------------------------------
def exact_match(result, expected) -> float:
  """1.0 if equal; strings are compared with surrounding whitespace stripped."""
  if isinstance(result, str) and isinstance(expected, str):
    return float(result.strip() == expected.strip())
  return float(result == expected)


def contains(result, expected: str) -> float:
  """1.0 if the string `expected` occurs in `result`."""
  return float(isinstance(result, str) and expected in result)


def number_match(result, expected: float, tol: float = 1e-6) -> float:
  """1.0 if `result` parses as a number within `tol` of `expected` (whitespace, thousands commas ok)."""
  if not isinstance(result, str):
    return 0.0
  try:
    return float(abs(float(result.strip().replace(",", "")) - float(expected)) <= tol)
  except ValueError:
    return 0.0


def set_equal(result, expected) -> float:
  """1.0 if both hold the same elements."""
  return float(set(result or ()) == set(expected))


METRICS: dict[str, Callable[..., float]] = {
    "exact_match": exact_match, "contains": contains, "number_match": number_match, "set_equal": set_equal,
}


def evaluate(evaluator: dict, st: CheckState) -> tuple[float, str]:
  """Runs one evaluator -> (score, reason). Raises KeyError for unknown getter / metric names."""
  spec = evaluator["result"]
  value = GETTERS[spec["type"]](st, spec)
  score = METRICS[evaluator["func"]](value, evaluator["expected"], **evaluator.get("options", {}))
  shown = repr(value)[:120]
  return score, f"{evaluator['func']}({spec['type']}={shown}, expected={evaluator['expected']!r}) -> {score:g}"
