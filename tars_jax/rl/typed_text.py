"""Which reply tokens are the text a `type(...)` action types: the copied characters.

For the ablation `rl.skip_typed_text` (variant `ppo_notext` of experiments/configs/replication.py): the
policy gradient leaves these tokens out, so RL cannot move the copied text directly. What it showed is in
benchmarks/RESULTS.md, "The multi-turn suite's SFT start as one 1400-update run".
"""

from __future__ import annotations

import re

import numpy as np

# `actions.format_action`: type(content='...') with \\, \' and \n escaped (`actions._q`).
_TYPED = re.compile(rb"type\(content='((?:[^'\\]|\\.)*)'\)", re.DOTALL)


def typed_text_targets(tokens: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
  """[B, T-1] bool: target position j (the token tokens[:, j + 1]) is a byte of the quoted content of a
  `type(content='...')` action (escape backslashes included, the quotes not) in a reply (loss_mask 1).

  tokens: [B, T] int ids of the byte tokenizer (`agent.tokenizer.ByteTokenizer`: ids 0..255 are the
  UTF-8 bytes, larger ids special); loss_mask: [B, T-1] (nonzero = a reply token the policy emitted).
  An action cut off before its closing `')` marks nothing.
  Raises: ValueError if the shapes do not line up.
  """
  tokens, loss_mask = np.asarray(tokens), np.asarray(loss_mask)
  if tokens.ndim != 2 or loss_mask.shape != (tokens.shape[0], tokens.shape[1] - 1):
    raise ValueError(f"typed_text_targets: tokens [B, T] and loss_mask [B, T-1], got {tokens.shape} "
                     f"and {loss_mask.shape}")
  out = np.zeros(loss_mask.shape, bool)
  targets = tokens[:, 1:]
  for b in range(tokens.shape[0]):
    # Non-reply tokens and special ids become NUL, so a match lies inside one reply's bytes.
    row = np.where((loss_mask[b] != 0) & (targets[b] >= 0) & (targets[b] < 256), targets[b], 0)
    for m in _TYPED.finditer(row.astype(np.uint8).tobytes()):
      out[b, m.start(1):m.end(1)] = True
  return out
