"""System prompt and chat template of the byte-level agent (token ids of `agent/tokenizer.py`).

Token layout of an episode (docs/ARCHITECTURE.md: trajectory = turns -> token sequences with loss masks and
image slots). `*…*` marks model-written tokens (loss mask 1); everything else is observation
(loss mask 0):

  BOS <system>\\n<instruction>\\n                                           episode prefix
  TURN_START [<obs text>\\n] VISION_START IMAGE*n VISION_END <assistant prefix>   observation 1
  *<reply bytes>* *EOS*                                                    reply 1
  TURN_END TURN_START [<obs text>\\n] VISION_START IMAGE*n VISION_END ...  observation 2, ...

- `<system>\\n` is left out when the system prompt is empty. With episodic memory
  (`agent/memory.py`) a block `Memory:\\n- <summary>\\n ...` sits between it and the instruction.
- `<obs text>` is optional environment text shown before the screenshot, e.g. the error
  "invalid action: …" after a reply that did not parse (the format signal of docs/ARCHITECTURE.md).
- `IMAGE` is repeated once per merged vision token; the model splices the screenshot's features in
  place of those ids, in order (one screenshot per turn).
- `<assistant prefix>` (empty by default) are observation bytes that open the reply slot. The reply
  itself starts with the forced `Thought: ` of the grammar (`agent/grammar.py`), which already marks
  the assistant's turn; under constrained decoding forced tokens have log-prob 0, so they cost
  nothing in PPO.
- The reply ends with `EOS` (model-written). `TURN_END` closing a reply is written by the
  environment side: it opens the NEXT observation (so the final reply of an episode has none), as
  `rollout/agent_loop.py` and `agent/trajectory.py` do.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tars_jax.agent.grammar import ALL_ACTIONS, SDK_ACTIONS
from tars_jax.agent.tokenizer import ByteTokenizer

# How the prompt shows each action (the UI-TARS spellings of `agent/grammar.py`).
ACTION_SIGNATURES = {
    "click": "click(start_box='(x,y)')",
    "left_double": "left_double(start_box='(x,y)')",
    "right_single": "right_single(start_box='(x,y)')",
    "drag": "drag(start_box='(x1,y1)', end_box='(x2,y2)')",
    "hotkey": "hotkey(key='ctrl c')",
    "type": "type(content='text')",
    "scroll": "scroll(start_box='(x,y)', direction='down')",
    "wait": "wait()",
    "finished": "finished(content='answer')",
    "call_user": "call_user()",
    # GUI-SDK functions (report sections 2.1-2.2), offered only where the sandbox has an SDK
    "run_command": "run_command(command='ls -l')",
    "read_file": "read_file(path='notes.txt')",
    "write_file": "write_file(path='out.txt', content='text')",
    "list_files": "list_files(path='.')",
    "search_files": "search_files(pattern='text', path='.')",
    "mcp_list_tools": "mcp_list_tools(server='docs')",
    "mcp_call": "mcp_call(server='docs', tool='search_docs', arguments='{\"query\": \"text\"}')",
}
_SDK_LINE = "SDK functions act on the session's files, terminal and tools, not on the screen."
_COORDS = {
    "int": "x,y: integers 0-1000 relative to the screenshot, (0,0) top-left.",
    "fixed3": "x,y: three digits 000-999 relative to the screenshot, (000,000) top-left.",
    "tens3": "x,y: three digits 000-990 ending in 0, relative to the screenshot, (000,000) top-left.",
}


def system_prompt(actions: Sequence[str] | None = None, compact: bool = False,
                  coord_format: str = "int") -> str:
  """The system prompt for the allowed `actions` (None = all of ALL_ACTIONS, the GUI actions; SDK
  functions of SDK_ACTIONS are listed only when named, with one line on what they act on).

  compact=True gives a few bytes for tiny CPU models (they pay per byte); the full prompt states
  the reply format, one line per action and the coordinate convention (446 bytes for all actions).
  Raises: ValueError for unknown actions or coord_format.
  """
  actions = tuple(actions) if actions else ALL_ACTIONS
  unknown = sorted(set(actions) - set(ACTION_SIGNATURES))
  if unknown:
    raise ValueError(f"unknown actions {unknown}; expected a subset of {ALL_ACTIONS + SDK_ACTIONS}")
  if coord_format not in _COORDS:
    raise ValueError(f"unknown coord_format {coord_format!r}; expected one of {sorted(_COORDS)}")
  if compact:
    return "GUI agent. Actions: " + ",".join(actions) + "."
  lines = ["You are a GUI agent. Given a task and a screenshot, reply exactly:",
           "Thought: <one line>", "Action: <one action>", "Actions:"]
  lines += [ACTION_SIGNATURES[a] for a in actions]
  if any("(x" in ACTION_SIGNATURES[a] for a in actions):
    lines.append(_COORDS[coord_format])
  if any(a in SDK_ACTIONS for a in actions):
    lines.append(_SDK_LINE)
  return "\n".join(lines)


SYSTEM_PROMPT = system_prompt()


MEMORY_HEADER = "Memory:\n"


def memory_line(summary: str) -> bytes:
  """One episodic summary as it appears in the prefix: `- <summary>\\n` (UTF-8 bytes = byte tokens)."""
  return f"- {summary}\n".encode("utf-8")


def encode_episode_prefix(tokenizer: ByteTokenizer, instruction: str, system: str,
                          memory: Sequence[str] = ()) -> list[int]:
  """`BOS <system>\\n[Memory:\\n- <summary>\\n ...]<instruction>\\n` as ids (observation;
  `<system>\\n` dropped when empty; the memory block only with episodic summaries, oldest first,
  `agent/memory.py`). Without `memory` the ids are those of the layout before episodic memory."""
  if hasattr(tokenizer, "episode_prefix"):  # a checkpoint's tokenizer: its chat template (agent/hf_tokenizer.py)
    return tokenizer.episode_prefix(instruction, system, memory)
  mem = (MEMORY_HEADER + "".join(memory_line(m).decode("utf-8") for m in memory)) if memory else ""
  text = f"{system}\n{mem}{instruction}\n" if system else f"{mem}{instruction}\n"
  return [tokenizer.bos_id] + tokenizer.encode(text)


def encode_observation(tokenizer: ByteTokenizer, n_img_tokens: int, text: str | None = None,
                       assistant_prefix: str = "", after_reply: bool = False) -> list[int]:
  """One observation before a reply (all observation tokens, loss mask 0):

  `[TURN_END] TURN_START [<text>\\n] VISION_START IMAGE*n_img_tokens VISION_END <assistant_prefix>`.
  after_reply=True prepends the TURN_END that closes the previous reply.
  Raises: ValueError if n_img_tokens < 0.
  """
  if hasattr(tokenizer, "observation"):  # a checkpoint's tokenizer: its chat template (agent/hf_tokenizer.py)
    return tokenizer.observation(n_img_tokens, text, assistant_prefix, after_reply)
  if n_img_tokens < 0:
    raise ValueError(f"n_img_tokens must be >= 0, got {n_img_tokens}")
  ids = [tokenizer.turn_end_id] if after_reply else []
  ids.append(tokenizer.turn_start_id)
  if text:
    ids += tokenizer.encode(text + "\n")
  ids += [tokenizer.vision_start_id] + [tokenizer.image_id] * n_img_tokens + [tokenizer.vision_end_id]
  return ids + tokenizer.encode(assistant_prefix)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """The layout of the module docstring, bundled with its settings.

  Model-written tokens (loss mask 1): the reply bytes and the reply's EOS — exactly what the sampler
  emits up to and including EOS. Everything else — BOS, system and instruction bytes, TURN_START,
  observation text, VISION_START, IMAGE slots, VISION_END, the assistant prefix and TURN_END — is
  observation (loss mask 0).
  """

  tokenizer: ByteTokenizer = ByteTokenizer()
  system: str = ""
  n_img_tokens: int = 1  # IMAGE ids per screenshot (merged vision tokens)
  assistant_prefix: str = ""

  @classmethod
  def for_actions(cls, actions=None, n_img_tokens: int = 1, compact: bool = False,
                  coord_format: str = "int", tokenizer: ByteTokenizer = ByteTokenizer()) -> "ChatTemplate":
    return cls(tokenizer, system_prompt(actions, compact, coord_format), n_img_tokens)

  def prefix(self, instruction: str) -> list[int]:
    """Episode prefix ids (observation)."""
    return encode_episode_prefix(self.tokenizer, instruction, self.system)

  def observation(self, text: str | None = None, after_reply: bool = False) -> list[int]:
    """Observation ids before a reply; after_reply=True for every turn but the first."""
    return encode_observation(self.tokenizer, self.n_img_tokens, text, self.assistant_prefix, after_reply)

  def reply(self, reply) -> list[int]:
    """Model-written ids of a reply: text -> bytes + EOS; ids must already end with EOS.

    Raises: ValueError for ids that do not end with EOS or contain another special id.
    """
    tok = self.tokenizer
    if isinstance(reply, str):
      return tok.encode(reply) + [tok.eos_id]
    ids = [int(i) for i in reply]
    if not ids or ids[-1] != tok.eos_id or any(i > 255 for i in ids[:-1]):
      raise ValueError(f"reply ids must be bytes followed by one EOS, got {tok.render(ids)!r}")
    return ids

  def episode(self, instruction: str, turns: Sequence[tuple[str | None, object]]
              ) -> tuple[list[int], list[int]]:
    """Token ids and loss mask ([L] each, mask 1 on model-written ids) of a whole episode.

    turns: (observation text or None, reply text or reply ids ending with EOS) per turn.
    """
    ids = self.prefix(instruction)
    mask = [0] * len(ids)
    for k, (obs_text, reply) in enumerate(turns):
      obs, rep = self.observation(obs_text, after_reply=k > 0), self.reply(reply)
      ids += obs + rep
      mask += [0] * len(obs) + [1] * len(rep)
    return ids, mask
