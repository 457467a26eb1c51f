"""Byte-level tokenizer for models trained from scratch.

Ids 0..255 are raw UTF-8 bytes, so any text round-trips and the action grammar can be written as a
byte automaton (`agent/grammar.py`). A handful of special ids follow; `IMAGE` is repeated once per
merged vision token so the decoder can splice image features in place (Qwen2-VL convention of an
`<|image_pad|>` token per merged patch).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

PAD = 256
BOS = 257
EOS = 258
IMAGE = 259
VISION_START = 260
VISION_END = 261
TURN_START = 262
TURN_END = 263
VOCAB_SIZE = 264

SPECIAL_NAMES = {
    PAD: "<pad>", BOS: "<bos>", EOS: "<eos>", IMAGE: "<image>", VISION_START: "<vision_start>",
    VISION_END: "<vision_end>", TURN_START: "<turn>", TURN_END: "</turn>",
}


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  """UTF-8 bytes plus the special ids above; `vocab_size` = 264."""

  name: ClassVar[str] = "byte"  # how trajectory records name it (tars_jax/data/records.py DatasetMeta)
  pad_id: int = PAD
  bos_id: int = BOS
  eos_id: int = EOS
  image_id: int = IMAGE
  vision_start_id: int = VISION_START
  vision_end_id: int = VISION_END
  turn_start_id: int = TURN_START
  turn_end_id: int = TURN_END
  vocab_size: int = VOCAB_SIZE

  def encode(self, text: str) -> list[int]:
    """Text -> list of byte ids (0..255)."""
    return list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    """Ids -> text; special ids are dropped, invalid UTF-8 is replaced (never raises)."""
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

  def render(self, ids) -> str:
    """Ids -> text with special ids shown by name (for logs and trajectory dumps)."""
    out, buf = [], []
    for i in ids:
      i = int(i)
      if i < 256:
        buf.append(i)
        continue
      if buf:
        out.append(bytes(buf).decode("utf-8", errors="replace"))
        buf = []
      out.append(SPECIAL_NAMES.get(i, f"<{i}>"))
    if buf:
      out.append(bytes(buf).decode("utf-8", errors="replace"))
    return "".join(out)
