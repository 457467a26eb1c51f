"""System prompt and chat template of the byte-level agent.

Token layout of an episode (model-written tokens marked *, everything else is observation and has
loss mask 0):

  BOS <system>\n<instruction>\n
  TURN_START [<obs text>\n] VISION_START IMAGE*n VISION_END  *reply bytes*  *EOS*
  TURN_END TURN_START ... (next turn)

`TURN_END` of a reply is written by the environment side at the start of the next observation.
"""

from __future__ import annotations

from tars_jax.agent.grammar import ALL_ACTIONS
from tars_jax.agent.tokenizer import ByteTokenizer

SYSTEM_PROMPT = (
    "You are a GUI agent. You are given a task and a screenshot. Reply with\n"
    "Thought: <reasoning>\nAction: <one action>\n"
    "Actions: {actions}. Coordinates are integers on a 0-1000 grid relative to the screenshot.")


def system_prompt(actions=None, compact: bool = False) -> str:
  """The system prompt naming the allowed actions; `compact` = a few bytes for tiny CPU models."""
  actions = tuple(actions or ALL_ACTIONS)
  if compact:
    return "GUI agent. Actions: " + ",".join(actions) + "."
  return SYSTEM_PROMPT.format(actions=", ".join(actions))


def encode_episode_prefix(tok: ByteTokenizer, instruction: str, system: str) -> list[int]:
  """BOS + system + instruction bytes (observation tokens)."""
  return [tok.bos_id] + tok.encode(f"{system}\n{instruction}\n" if system else f"{instruction}\n")


def encode_observation(tok: ByteTokenizer, n_img_tokens: int, text: str | None = None) -> list[int]:
  """TURN_START [text\\n] VISION_START IMAGE*n VISION_END: one observation before a reply."""
  ids = [tok.turn_start_id]
  if text:
    ids += tok.encode(text + "\n")
  return ids + [tok.vision_start_id] + [tok.image_id] * n_img_tokens + [tok.vision_end_id]
