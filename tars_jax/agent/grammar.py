"""Byte automaton of the reply language, for grammar-constrained decoding.

The reply language is UI-TARS's `Thought: <thought>\\nAction: <action>` (docs/ARCHITECTURE.md, action grammar;
`bytedance/UI-TARS` `codes/ui_tars/action_parser.py`), with actions written exactly as UI-TARS writes
them:

  click(start_box='(x,y)')          left_double(start_box='(x,y)')     right_single(start_box='(x,y)')
  drag(start_box='(x1,y1)', end_box='(x2,y2)')                         hotkey(key='ctrl c')  (1-3 KEYS)
  type(content='...')               scroll(start_box='(x,y)', direction='up|down|left|right')
  wait()                            finished(content='...')            call_user()

and, for sandboxes with a GUI-SDK (report sections 2.1-2.2; `SDK_ACTIONS`, off unless named in
`actions`), the SDK functions in the canonical spelling of `actions.format_action` (the command
starts with a non-space character and the pattern is non-empty, as the parser requires):

  run_command(command='...')        read_file(path='...')              list_files(path='...')
  write_file(path='...', content='...')                                mcp_list_tools(server='...')
  search_files(pattern='...', path='...')
  mcp_call(server='...', tool='...', arguments='{"key": "text", "k": 3}')

mcp_call's arguments are a flat JSON object of 0..3 fields (`MCP_MAX_FIELDS`): keys of 1..16 bytes
`[A-Za-z0-9_]`, values a JSON string (content characters without `"`) or an integer of 1..6 digits
(no leading zero), so every accepted reply is valid JSON; nested objects, lists, floats and booleans
are not in the language (a tool that needs them is called unconstrained).

<thought> is 0..max_thought_bytes characters of `thought_charset` (default printable ASCII, never a
newline); content is 0..max_content_bytes printable ASCII without quote, backslash or newline (so no
escaping is ever needed). On top of the regular expression, the literal `Action:` may occur only once
(as the delimiter): a thought or content containing it would make the split at `Action:` depend on
the parser's rule (first / last / line-start occurrence, as UI-TARS parsers variously do), so the
language excludes it and every accepted reply parses the same way under all of them.

Pipeline: regular expression -> DFA (`interegular`) -> byte table -> product with a small "count
`Action:`" automaton -> dead states pruned -> minimised (Moore partition refinement) -> dense table
`[S, V] int32` (next state, -1 = token not allowed) that the sampler indexes inside jit: the allowed
tokens of a row are `table[state] >= 0`. Every state reachable from `start` has an allowed token and
can still reach `done`, so a constrained sampler never ends up with every token masked.

Special tokens: from an accepting state `EOS` leads to `done`; in `done` only `PAD` is allowed (so a
finished row keeps emitting forced PADs with log-prob 0). No other special token is ever allowed.

`coord_format` (all parse to the same 0-1000 relative grid, `actions.CoordSpec('relative1000')`):
  'int'    integers 0..1000 without leading zeros, as UI-TARS writes them;
  'fixed3' exactly three digits 000..999. An exploration aid for policies trained from scratch: a
           uniformly random constrained policy then clicks uniformly over the screen (each digit is
           one uniform choice) instead of favouring short numbers near the top-left corner.
  'tens3'  three digits with a forced final 0 (000, 010, ..., 990): the 'fixed3' exploration aid on
           a 100 x 100 lattice of click points (1.6 x 2.1 px on a 160 x 210 MiniWoB screen). The last
           digit of 'fixed3' is below a pixel and only adds action-space noise to the policy gradient.
"""

from __future__ import annotations

import dataclasses
import functools

import interegular
import numpy as np

from tars_jax.agent.actions import SDK_ACTION_NAMES
from tars_jax.agent.tokenizer import ByteTokenizer

ALL_ACTIONS = ("click", "left_double", "right_single", "drag", "hotkey", "type", "scroll", "wait",
               "finished", "call_user")
KEYS = tuple(["ctrl", "shift", "alt", "enter", "tab", "backspace", "escape", "space", "up", "down", "left",
              "right", "delete", "home", "end", "pageup", "pagedown"] + [chr(c) for c in range(97, 123)]
             + [str(d) for d in range(10)] + [f"f{i}" for i in range(1, 13)])
DIRECTIONS = ("up", "down", "left", "right")
SDK_ACTIONS = SDK_ACTION_NAMES  # GUI-SDK functions: the parser's names, one list for both
MCP_MAX_FIELDS = 3  # fields of an mcp_call arguments object
_MCP_KEY_BYTES = 16
_MCP_INT_DIGITS = 6
PRINTABLE = "".join(chr(c) for c in range(0x20, 0x7f))  # default thought charset
CONTENT_CHARSET = "".join(c for c in PRINTABLE if c not in "'\\")
DELIMITER = "Action:"  # may occur exactly once in a reply
_ASCII = 128  # only ASCII bytes can occur in the language


@dataclasses.dataclass(frozen=True)
class Grammar:
  """Dense automaton over token ids (arrays are read-only: builds are cached and shared).

  table: [S, V] int32 next state for (state, token), -1 = not allowed.
  start: state before the first reply token; done: state after EOS (only PAD -> done allowed).
  accepting: [S] bool, states where EOS is allowed (done itself is not accepting).
  regex: the reply language as a regular expression (documentation; the single-`Action:` rule and
    the special tokens are applied on top of it).
  """

  table: np.ndarray
  start: int
  done: int
  accepting: np.ndarray
  regex: str

  @property
  def num_states(self) -> int:
    return int(self.table.shape[0])


def _char_class(chars: str) -> str:
  """Regex character class matching exactly `chars` (each written as \\xHH: no escaping rules)."""
  return "[" + "".join(f"\\x{ord(c):02x}" for c in sorted(set(chars))) + "]"


def _coord(fmt: str) -> str:
  if fmt == "int":
    return r"(1000|[1-9][0-9]{0,2}|0)"
  if fmt == "fixed3":
    return r"[0-9]{3}"
  if fmt == "tens3":
    return r"[0-9]{2}0"
  raise ValueError(f"unknown coord_format {fmt!r}; expected 'int', 'fixed3' or 'tens3'")


def _json_object(max_value_bytes: int) -> str:
  """Regex of a flat JSON object as `json.dumps` writes it: {"k": "v", "n": 12} (0..MCP_MAX_FIELDS
  fields; string values of 0..max_value_bytes content characters without a double quote)."""
  key = rf'"[A-Za-z0-9_]{{1,{_MCP_KEY_BYTES}}}"'
  chars = _char_class(CONTENT_CHARSET.replace('"', ""))
  value = rf'("{chars}{{0,{max_value_bytes}}}"|-?(0|[1-9][0-9]{{0,{_MCP_INT_DIGITS - 1}}}))'  # JSON: no leading 0
  field = f"{key}: {value}"
  return rf"\{{({field}(, {field}){{0,{MCP_MAX_FIELDS - 1}}})?\}}"


def reply_regex(actions=ALL_ACTIONS, max_thought_bytes: int = 32, max_content_bytes: int = 32,
                coord_format: str = "int", thought_charset: str | None = None) -> str:
  """The reply language as a regular expression (interegular / Python `re` syntax).

  Raises: ValueError for unknown or no actions, unknown coord_format, negative lengths, or a
  thought_charset with characters outside printable ASCII.
  """
  if max_thought_bytes < 0 or max_content_bytes < 0:
    raise ValueError(f"lengths must be >= 0, got {max_thought_bytes}, {max_content_bytes}")
  charset = PRINTABLE if thought_charset is None else thought_charset
  bad = sorted(set(c for c in charset if c not in PRINTABLE))
  if bad:
    raise ValueError(f"thought_charset must be printable ASCII without newline; got {bad!r}")
  c = _coord(coord_format)
  pt = rf"'\({c},{c}\)'"
  key = "(" + "|".join(KEYS) + ")"
  text = rf"{_char_class(CONTENT_CHARSET)}{{0,{max_content_bytes}}}"
  # what the parser requires (actions._sdk_action): a command that is not blank, a non-empty pattern
  command = (rf"{_char_class(CONTENT_CHARSET.replace(' ', ''))}{_char_class(CONTENT_CHARSET)}"
             rf"{{0,{max(max_content_bytes - 1, 0)}}}")
  pattern = rf"{_char_class(CONTENT_CHARSET)}{{1,{max(max_content_bytes, 1)}}}"
  templates = {
      "click": rf"click\(start_box={pt}\)",
      "left_double": rf"left_double\(start_box={pt}\)",
      "right_single": rf"right_single\(start_box={pt}\)",
      "drag": rf"drag\(start_box={pt}, end_box={pt}\)",
      "hotkey": rf"hotkey\(key='{key}( {key}){{0,2}}'\)",
      "type": rf"type\(content='{text}'\)",
      "scroll": rf"scroll\(start_box={pt}, direction='({'|'.join(DIRECTIONS)})'\)",
      "wait": r"wait\(\)",
      "finished": rf"finished\(content='{text}'\)",
      "call_user": r"call_user\(\)",
      "run_command": rf"run_command\(command='{command}'\)",
      "read_file": rf"read_file\(path='{text}'\)",
      "write_file": rf"write_file\(path='{text}', content='{text}'\)",
      "list_files": rf"list_files\(path='{text}'\)",
      "search_files": rf"search_files\(pattern='{pattern}', path='{text}'\)",
      "mcp_list_tools": rf"mcp_list_tools\(server='{text}'\)",
      "mcp_call": rf"mcp_call\(server='{text}', tool='{text}', arguments='{_json_object(max_content_bytes)}'\)",
  }
  unknown = sorted(set(actions) - set(templates))
  if unknown or not actions:
    raise ValueError(f"unknown actions {unknown}; expected a non-empty subset of {ALL_ACTIONS + SDK_ACTIONS}")
  body = "(" + "|".join(templates[a] for a in actions) + ")"
  thought = f"{_char_class(charset)}{{0,{max_thought_bytes}}}" if charset and max_thought_bytes else ""
  return rf"Thought: {thought}\nAction: {body}"


# ---------------------------------------------------------------------------------------------------
# Automaton construction on numpy byte tables: (table [S, 128] int32, start, accepting [S] bool).


def _fsm_table(regex: str):
  """interegular DFA -> byte table [S, 128] (any dead states it has are pruned later)."""
  fsm = interegular.parse_pattern(regex).to_fsm()
  states = sorted(fsm.states)
  idx = {s: i for i, s in enumerate(states)}
  sym = [fsm.alphabet[chr(b)] for b in range(_ASCII)]  # unknown chars -> anything_else symbol
  table = np.full((len(states), _ASCII), -1, np.int32)
  for s in states:
    row = fsm.map.get(s, {})
    for b in range(_ASCII):
      n = row.get(sym[b])
      if n is not None and n in idx:
        table[idx[s], b] = idx[n]
  acc = np.array([s in fsm.finals for s in states], bool)
  return table, idx[fsm.initial], acc


def _count_automaton(pattern: str, max_count: int) -> np.ndarray:
  """[M, 128] int32 automaton counting occurrences of `pattern` (KMP DFA); -1 once > max_count.

  State m = count * L + k, where k < L is the length of the pattern prefix matched so far.
  """
  p = [ord(ch) for ch in pattern]
  L = len(p)
  kmp = np.zeros((L, _ASCII), np.int32)  # k -> matched length after one more byte, in 0..L
  kmp[0, p[0]] = 1
  border = 0  # state the automaton would be in had it read p[1:k]
  for k in range(1, L):
    kmp[k] = kmp[border]
    kmp[k, p[k]] = k + 1
    border = kmp[border, p[k]]
  # After a full match, continue from the pattern's longest proper border (overlapping matches).
  out = np.full(((max_count + 1) * L, _ASCII), -1, np.int32)
  for c in range(max_count + 1):
    for k in range(L):
      full = kmp[k] == L
      nc = c + full
      nk = np.where(full, border, kmp[k])
      out[c * L + k] = np.where(nc <= max_count, nc * L + nk, -1)
  return out


def _product(table, start, acc, counter):
  """Intersection of the table's language with 'the counter automaton never overflows'."""
  s0, m = table.shape[0], counter.shape[0]
  ids = np.full(s0 * m, -1, np.int64)
  ids[start * m] = 0
  order = [np.array([start * m], np.int64)]
  frontier, n = order[0], 1
  while frontier.size:
    s, c = np.divmod(frontier, m)
    ns, nc = table[s], counter[c]
    nxt = np.where((ns >= 0) & (nc >= 0), ns.astype(np.int64) * m + nc, -1)
    cand = np.unique(nxt[nxt >= 0])
    new = cand[ids[cand] < 0]
    ids[new] = np.arange(n, n + new.size)
    n += new.size
    order.append(new)
    frontier = new
  pairs = np.concatenate(order)
  s, c = np.divmod(pairs, m)
  ns, nc = table[s], counter[c]
  nxt = np.where((ns >= 0) & (nc >= 0), ns.astype(np.int64) * m + nc, -1)
  out = np.where(nxt >= 0, ids[np.maximum(nxt, 0)], -1).astype(np.int32)
  return out, 0, acc[s]


def _prune(table, start, acc):
  """Keeps the states reachable from start that can still reach acceptance (no dead ends)."""
  live = acc.copy()
  while True:
    succ_live = np.where(table >= 0, live[np.maximum(table, 0)], False).any(1)
    new = live | succ_live
    if (new == live).all():
      break
    live = new
  if not live[start]:
    raise ValueError("the reply language is empty")
  table = np.where((table >= 0) & live[np.maximum(table, 0)], table, -1)
  reach = np.zeros_like(live)
  reach[start] = True
  while True:
    new = reach.copy()
    nxt = table[reach]
    new[nxt[nxt >= 0]] = True
    if (new == reach).all():
      break
    reach = new
  return _renumber(table, start, acc, reach)


def _renumber(table, start, acc, keep):
  """Restricts to `keep` states, numbered in BFS order from start (start = 0), each state's successors
  in byte order: the numbering depends only on the automaton's shape, not on the old state ids."""
  order, seen, frontier = [start], {start}, [start]
  while frontier:
    nxt = []
    for s in frontier:
      for n in table[s]:
        n = int(n)
        if n >= 0 and keep[n] and n not in seen:
          seen.add(n)
          nxt.append(n)
    order += nxt
    frontier = nxt
  new_id = np.full(table.shape[0], -1, np.int32)
  new_id[order] = np.arange(len(order))
  t = table[order]
  t = np.where(t >= 0, new_id[np.maximum(t, 0)], -1)
  return t.astype(np.int32), 0, acc[order]


# Odd 64-bit multipliers of `_refine`'s row hash (fixed: builds are reproducible).
_ROW_HASH = np.random.default_rng(0).integers(1, 2**63, size=_ASCII + 1, dtype=np.uint64) | np.uint64(1)


def _refine(cls, table, exact: bool):
  """One Moore round: states [S] int64 classes `cls`, table [S, 128] -> [S] int64 classes of
  (class, successor classes). exact=False hashes each row to one uint64 (sum of (x + 1) * odd
  multiplier, mod 2^64) so `np.unique` sorts S numbers instead of S rows of 129: a collision can
  only merge classes, which `_minimise` checks for."""
  rows = np.concatenate([cls[:, None], np.where(table >= 0, cls[np.maximum(table, 0)], -1)], 1)
  if exact:
    _, inv = np.unique(rows, axis=0, return_inverse=True)
  else:
    _, inv = np.unique(((rows + 1).astype(np.uint64) * _ROW_HASH).sum(1), return_inverse=True)
  return inv.reshape(-1).astype(np.int64)


def _partition(table, acc, exact: bool):
  """Moore partition refinement from (accepting, not) until the number of classes stops growing."""
  cls = acc.astype(np.int64)
  n = len(np.unique(cls))
  while True:
    cls = _refine(cls, table, exact)
    n2 = int(cls.max()) + 1
    if n2 == n:
      return cls
    n = n2


def _minimise(table, start, acc):
  """Moore partition refinement: merges states with the same future (language-preserving).

  Rounds use `_refine`'s row hash, several times cheaper than comparing exact rows on the full SDK
  grammar (benchmarks/RESULTS.md). The result is then checked to be a congruence that keeps
  accepting and other states apart (one exact round splits nothing, each class is all accepting or
  all not); if a hash collision broke that, the exact rounds are run instead. A congruence that
  respects acceptance preserves the language, and Moore's is the coarsest one: the hash only changes
  the cost.
  """
  cls = _partition(table, acc, exact=False)
  n = int(cls.max()) + 1
  if int(_refine(cls, table, exact=True).max()) + 1 != n or len(np.unique(2 * cls + acc)) != n:
    cls = _partition(table, acc, exact=True)
    n = int(cls.max()) + 1
  # One representative per class; transitions map to classes.
  rep = np.zeros(n, np.int64)
  rep[cls[::-1]] = np.arange(len(cls))[::-1]  # first state of each class
  t = np.where(table[rep] >= 0, cls[np.maximum(table[rep], 0)], -1).astype(np.int32)
  return _renumber(t, int(cls[start]), acc[rep], np.ones(n, bool))


@functools.lru_cache(maxsize=32)
def _build(tokenizer: ByteTokenizer, actions: tuple, max_thought_bytes: int, max_content_bytes: int,
           coord_format: str, thought_charset: str | None) -> Grammar:
  regex = reply_regex(actions, max_thought_bytes, max_content_bytes, coord_format, thought_charset)
  table, start, acc = _fsm_table(regex)
  table, start, acc = _product(table, start, acc, _count_automaton(DELIMITER, 1))
  table, start, acc = _prune(table, start, acc)
  table, start, acc = _minimise(table, start, acc)
  s = table.shape[0]
  done = s
  full = np.full((s + 1, tokenizer.vocab_size), -1, np.int32)
  full[:s, :_ASCII] = table
  full[:s, tokenizer.eos_id] = np.where(acc, done, -1)
  full[done, tokenizer.pad_id] = done
  accepting = np.concatenate([acc, [False]])
  full.setflags(write=False)
  accepting.setflags(write=False)
  return Grammar(table=full, start=start, done=done, accepting=accepting, regex=regex)


def build_grammar(tokenizer: ByteTokenizer = ByteTokenizer(), actions=ALL_ACTIONS, max_thought_bytes: int = 32,
                  max_content_bytes: int = 32, coord_format: str = "int",
                  thought_charset: str | None = None) -> Grammar:
  """Compiles the reply language to a dense `[S, V]` automaton (see module docstring). Cached.

  Args:
    tokenizer: byte-level tokenizer (ids 0..255 are bytes; eos_id, pad_id, vocab_size are used).
    actions: the allowed action names, a non-empty subset of ALL_ACTIONS + SDK_ACTIONS.
    max_thought_bytes / max_content_bytes: length caps of the thought and of every quoted argument
      (type/finished content, SDK paths, commands, ...; each mcp_call argument value).
    coord_format: 'int' (0..1000, no leading zeros), 'fixed3' (000..999) or 'tens3' (000, 010, ..
      990), see module docstring.
    thought_charset: the characters a thought may use (a string, printable ASCII); None = all of
      printable ASCII.

  Returns: Grammar with table [S, V] int32, S = the minimal number of states + 1 (done).
  Raises: ValueError for unknown actions or coord_format, negative lengths, a bad charset.
  """
  if isinstance(actions, str):
    actions = (actions,)
  actions = tuple(dict.fromkeys(actions))  # hashable for the cache; duplicates dropped
  return _build(tokenizer, actions, int(max_thought_bytes), int(max_content_bytes), coord_format,
                thought_charset)


def free_text_grammar(vocab_size: int, text_ids, eos_id: int, pad_id: int, regex: str) -> Grammar:
  """Two-state automaton of free text: state 0 allows `text_ids` (-> 0) and EOS (-> done = 1); done
  allows only PAD. Returns: Grammar with table [2, vocab_size] int32 (read-only)."""
  table = np.full((2, vocab_size), -1, np.int32)
  table[0, text_ids] = 0
  table[0, eos_id] = 1
  table[1, pad_id] = 1
  accepting = np.array([True, False])
  table.setflags(write=False)
  accepting.setflags(write=False)
  return Grammar(table=table, start=0, done=1, accepting=accepting, regex=regex)


@functools.lru_cache(maxsize=8)
def free_grammar(tokenizer: ByteTokenizer = ByteTokenizer()) -> Grammar:
  """The unconstrained reply language (`config.grammar.constrained = False`): any byte string, then
  EOS. State 0 allows the 256 byte ids (-> 0) and EOS (-> done); done allows only PAD.

  Why not "no table" at all: a free-running sampler also emits the special ids (many replies of a
  fresh random-init policy hold IMAGE, VISION_START or VISION_END), and an IMAGE id in a reply is
  read as an image placeholder by every later forward of the episode (`Policy` splices image
  features into IMAGE positions in order), shifting the next screenshots onto the wrong tokens and
  making the trainer's log-probs differ from the sampler's. With this table the sampler and the PPO
  loss mask the same tokens, so the log-probs agree.
  Returns: Grammar with table [2, V] int32 (read-only; cached).
  """
  return free_text_grammar(tokenizer.vocab_size, np.arange(256), tokenizer.eos_id, tokenizer.pad_id,
                           "[\\x00-\\xff]*")  # every byte id


def walk(grammar: Grammar, ids) -> np.ndarray:
  """States before each token of `ids`: [len(ids)] int32; -1 after the first disallowed token.

  The state before a disallowed token is still reported (it is where the token was rejected).
  """
  out, s = np.full((len(ids),), -1, np.int32), grammar.start
  for i, t in enumerate(ids):
    if s < 0:
      break
    out[i] = s
    t = int(t)
    s = int(grammar.table[s, t]) if 0 <= t < grammar.table.shape[1] else -1
  return out


def allowed_mask(grammar: Grammar, states) -> np.ndarray:
  """[..., V] bool allowed tokens for an int array of states [...] (negative states allow nothing)."""
  states = np.asarray(states)
  return np.where((states >= 0)[..., None], grammar.table[np.maximum(states, 0)] >= 0, False)


def accepts(grammar: Grammar, text: str, tokenizer: ByteTokenizer = ByteTokenizer()) -> bool:
  """True if `text` (UTF-8 bytes) followed by EOS is a complete reply of the language."""
  s = grammar.start
  for t in tokenizer.encode(text) + [tokenizer.eos_id]:
    s = int(grammar.table[s, t])
    if s < 0:
      return False
  return s == grammar.done
