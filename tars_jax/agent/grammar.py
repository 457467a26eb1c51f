"""Byte automaton of the reply language, for grammar-constrained decoding.

The reply language is UI-TARS's `Thought: <thought>\nAction: <action>` (DESIGN.md, action grammar).
It is written as a regular expression, compiled to a DFA with `interegular`, pruned of dead states
and laid out as a dense table `[S, V] int32` (next state, -1 = token not allowed) that the sampler
indexes inside jit: the allowed tokens of a row are `table[state] >= 0`.

Special tokens: from an accepting state `EOS` leads to `done`; in `done` only `PAD` is allowed (so a
finished row keeps emitting forced PADs with log-prob 0).

`coord_format`:
  'int'    integers 0..1000 without leading zeros, as UI-TARS writes them;
  'fixed3' exactly three digits 000..999 (same 0-1000 grid once parsed). An exploration aid for
           policies trained from scratch: a uniformly random constrained policy then clicks
           uniformly over the screen instead of favouring short numbers near the top-left corner.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import interegular
import numpy as np

from tars_jax.agent.tokenizer import ByteTokenizer

ALL_ACTIONS = ("click", "left_double", "right_single", "drag", "hotkey", "type", "scroll", "wait",
               "finished", "call_user")
KEYS = (["ctrl", "shift", "alt", "enter", "tab", "backspace", "escape", "space", "up", "down", "left",
         "right", "delete", "home", "end", "pageup", "pagedown"] + [chr(c) for c in range(97, 123)]
        + [str(d) for d in range(10)] + [f"f{i}" for i in range(1, 13)])
# Printable ASCII without newline; free text inside quotes also excludes quote and backslash.
_THOUGHT_CHARS = r"[ -~]"
_CONTENT_CHARS = r"[ -&(-\[\]-~]"


@dataclasses.dataclass(frozen=True)
class Grammar:
  """Dense automaton over token ids. table: [S, V] int32; start/done: state ids; accepting: [S] bool."""

  table: np.ndarray
  start: int
  done: int
  accepting: np.ndarray
  regex: str

  @property
  def num_states(self) -> int:
    return int(self.table.shape[0])


def _coord(fmt: str) -> str:
  if fmt == "int":
    return r"(1000|[1-9][0-9]{0,2}|0)"
  if fmt == "fixed3":
    return r"[0-9]{3}"
  raise ValueError(f"unknown coord_format {fmt!r}; expected 'int' or 'fixed3'")


def reply_regex(actions=ALL_ACTIONS, max_thought_bytes: int = 32, max_content_bytes: int = 32,
                coord_format: str = "int") -> str:
  """The reply language as a regular expression (interegular syntax)."""
  c = _coord(coord_format)
  pt = rf"'\({c},{c}\)'"
  key = "(" + "|".join(sorted(KEYS, key=len, reverse=True)) + ")"
  text = rf"{_CONTENT_CHARS}{{0,{max_content_bytes}}}"
  templates = {
      "click": rf"click\(start_box={pt}\)",
      "left_double": rf"left_double\(start_box={pt}\)",
      "right_single": rf"right_single\(start_box={pt}\)",
      "drag": rf"drag\(start_box={pt}, end_box={pt}\)",
      "hotkey": rf"hotkey\(key='{key}( {key}){{0,2}}'\)",
      "type": rf"type\(content='{text}'\)",
      "scroll": rf"scroll\(start_box={pt}, direction='(up|down|left|right)'\)",
      "wait": r"wait\(\)",
      "finished": rf"finished\(content='{text}'\)",
      "call_user": r"call_user\(\)",
  }
  unknown = set(actions) - set(templates)
  if unknown or not actions:
    raise ValueError(f"unknown actions {sorted(unknown)}; expected a non-empty subset of {ALL_ACTIONS}")
  body = "(" + "|".join(templates[a] for a in actions) + ")"
  return rf"Thought: {_THOUGHT_CHARS}{{0,{max_thought_bytes}}}\nAction: {body}"


@functools.lru_cache(maxsize=32)
def build_grammar(tokenizer: ByteTokenizer = ByteTokenizer(), actions=ALL_ACTIONS, max_thought_bytes: int = 32,
                  max_content_bytes: int = 32, coord_format: str = "int") -> Grammar:
  """Compiles the reply language to a dense `[S, V]` table (see module docstring).

  Raises: ValueError for unknown actions or coord_format.
  """
  regex = reply_regex(tuple(actions), max_thought_bytes, max_content_bytes, coord_format)
  fsm = interegular.parse_pattern(regex).to_fsm()
  states = sorted(fsm.states)
  # Byte -> alphabet symbol (only ASCII can occur in the language).
  sym = {b: fsm.alphabet[chr(b)] for b in range(128)}
  trans = {s: {b: fsm.map.get(s, {}).get(sym[b]) for b in range(128)} for s in states}
  trans = {s: {b: n for b, n in d.items() if n is not None} for s, d in trans.items()}
  # Keep states reachable from the start that can still reach acceptance (no dead ends).
  live = set(fsm.finals)
  changed = True
  while changed:
    changed = False
    for s in states:
      if s not in live and any(n in live for n in trans[s].values()):
        live.add(s)
        changed = True
  reach, frontier = {fsm.initial}, [fsm.initial]
  while frontier:
    s = frontier.pop()
    for n in trans[s].values():
      if n in live and n not in reach:
        reach.add(n)
        frontier.append(n)
  keep = sorted(reach & live)
  idx = {s: i for i, s in enumerate(keep)}
  done = len(keep)
  table = np.full((done + 1, tokenizer.vocab_size), -1, np.int32)
  accepting = np.zeros((done + 1,), bool)
  for s in keep:
    for b, n in trans[s].items():
      if n in idx:
        table[idx[s], b] = idx[n]
    if s in fsm.finals:
      table[idx[s], tokenizer.eos_id] = done
      accepting[idx[s]] = True
  table[done, tokenizer.pad_id] = done
  return Grammar(table=table, start=idx[fsm.initial], done=done, accepting=accepting, regex=regex)


def walk(grammar: Grammar, ids) -> np.ndarray:
  """States before each token of `ids` ([len(ids)] int32); -1 from the first disallowed token on."""
  out, s = np.full((len(ids),), -1, np.int32), grammar.start
  for i, t in enumerate(ids):
    if s < 0:
      break
    out[i] = s
    s = int(grammar.table[s, int(t)])
  return out


def allowed_mask(grammar: Grammar, states: np.ndarray) -> np.ndarray:
  """[..., V] bool allowed tokens for an array of states (negative states allow nothing)."""
  states = np.asarray(states)
  return np.where((states >= 0)[..., None], grammar.table[np.maximum(states, 0)] >= 0, False)


def accepts(grammar: Grammar, text: str, tokenizer: ByteTokenizer = ByteTokenizer()) -> bool:
  """True if `text` followed by EOS is a complete reply of the language."""
  s = grammar.start
  for t in tokenizer.encode(text) + [tokenizer.eos_id]:
    s = int(grammar.table[s, t])
    if s < 0:
      return False
  return s == grammar.done
