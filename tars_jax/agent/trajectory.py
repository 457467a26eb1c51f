"""Episodes as turns, and their token view for training.

An episode is a list of turns (observation -> model reply -> environment feedback). Its token view
is ONE sequence per episode, the same bytes the policy saw while acting:

  BOS system instruction | TURN_START [obs text] VISION_START IMAGE*n VISION_END | reply... EOS | TURN_END | ...

`loss_mask` is 1 only on model-written tokens (reply bytes and their EOS); rewards sit on the EOS of
the turn that earned them, so token-level GAE (`rl/advantages.py`) skips observation tokens and
carries values across them (verl/tunix multi-turn semantics; UI-TARS-2 report section 2.5.4).

Arrays are in *target* alignment: index j describes token j+1 predicted from the prefix ending at j,
so `logits[:, :-1]` of a forward pass lines up with every field of `Batch`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass
class Turn:
  """One observation -> action exchange.

  obs_ids: token ids the environment contributed before the reply (turn header, image slots).
  reply_ids: model-written ids, ending with EOS (PADs stripped).
  logprobs: [len(reply_ids)] float32, behaviour-policy log-probs of the constrained distribution.
  states: [len(reply_ids)] int32, grammar state before each reply token (-1 = unconstrained).
  """

  image: np.ndarray  # [H, W, 3] uint8 screenshot the reply was conditioned on
  obs_ids: list[int]
  reply_ids: list[int]
  logprobs: np.ndarray
  states: np.ndarray
  text: str = ""  # decoded reply
  reward: float = 0.0  # shaped reward credited to this turn (outcome + format terms)
  env_reward: float = 0.0
  done: bool = False
  error: str | None = None  # "invalid action: ..." when the reply did not parse
  info: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Episode:
  """A finished (or truncated / lost) episode of one task and seed."""

  task: str
  seed: int
  instruction: str
  prefix_ids: list[int]
  turns: list[Turn] = dataclasses.field(default_factory=list)
  truncated: bool = False
  lost: bool = False  # the sandbox session died mid-episode; never trained on
  policy_version: int = 0

  @property
  def env_return(self) -> float:
    return float(sum(t.env_reward for t in self.turns))

  @property
  def shaped_return(self) -> float:
    return float(sum(t.reward for t in self.turns))

  @property
  def success(self) -> bool:
    # MiniWoB++ convention: an episode succeeds when its raw reward is positive.
    return any(t.done for t in self.turns) and self.env_return > 0

  @property
  def num_invalid(self) -> int:
    return sum(t.error is not None for t in self.turns)

  def token_ids(self) -> list[int]:
    ids = list(self.prefix_ids)
    for t in self.turns:
      ids += t.obs_ids + t.reply_ids
    return ids


@dataclasses.dataclass
class Batch:
  """Right-padded training batch in target alignment (see module docstring).

  tokens:      [B, T] int32 input ids (PAD after the end).
  attn_mask:   [B, T] bool, True on real tokens.
  loss_mask:   [B, T-1] float32, 1 where target token j+1 is model-written.
  rewards:     [B, T-1] float32, per-token shaped reward (on reply EOS tokens).
  old_logp:    [B, T-1] float32, behaviour log-probs of target tokens (0 elsewhere).
  states:      [B, T-1] int32, grammar state before target token (0 where unused).
  pixel_values:[B, M, H, W, 3] float32 in [0, 1]; image_mask [B, M] bool.
  """

  tokens: np.ndarray
  attn_mask: np.ndarray
  loss_mask: np.ndarray
  rewards: np.ndarray
  old_logp: np.ndarray
  states: np.ndarray
  pixel_values: np.ndarray
  image_mask: np.ndarray

  def as_dict(self) -> dict[str, np.ndarray]:
    return dataclasses.asdict(self)


def bucket(n: int, multiple: int) -> int:
  """Round n up to a multiple (limits the number of distinct jit shapes)."""
  return int(-(-n // multiple) * multiple)


def episode_arrays(ep: Episode) -> dict[str, np.ndarray]:
  """Token view of one episode, unpadded, in *input* alignment ([L] arrays).

  Returns tokens, loss (1 on reply tokens), reward, logp, state — each [L].
  """
  tokens, loss, reward, logp, state = list(ep.prefix_ids), [], [], [], []
  loss += [0.0] * len(ep.prefix_ids)
  reward += [0.0] * len(ep.prefix_ids)
  logp += [0.0] * len(ep.prefix_ids)
  state += [0] * len(ep.prefix_ids)
  for t in ep.turns:
    n_obs, n_rep = len(t.obs_ids), len(t.reply_ids)
    tokens += t.obs_ids + t.reply_ids
    loss += [0.0] * n_obs + [1.0] * n_rep
    r = [0.0] * n_rep
    if n_rep:
      r[-1] = t.reward
    reward += [0.0] * n_obs + r
    logp += [0.0] * n_obs + [float(x) for x in t.logprobs]
    state += [0] * n_obs + [max(int(s), 0) for s in t.states]
  return dict(tokens=np.asarray(tokens, np.int32), loss=np.asarray(loss, np.float32),
              reward=np.asarray(reward, np.float32), logp=np.asarray(logp, np.float32),
              state=np.asarray(state, np.int32))


def real_rows(batch: dict, n: int) -> dict:
  """The first `n` rows of a collated batch dict (the rows after them are padding up to a fixed
  batch size); scalars and shorter arrays are kept as they are."""
  return {k: v[:n] if getattr(v, "ndim", 0) and v.shape[0] >= n else v for k, v in batch.items()}


def collate(episodes: list[Episode], *, pad_id: int, max_images: int, image_hw: tuple[int, int],
            length_multiple: int = 64, batch_size: int | None = None) -> Batch:
  """Episodes -> right-padded `Batch` (see class docstring for shapes).

  Images are resized by the caller (`Turn.image` must already be `image_hw`). Rows beyond
  len(episodes) (up to `batch_size`) are all-padding with zero masks, so jit sees fixed shapes.

  Raises:
    ValueError: no episodes (an iteration whose episodes were all lost is skipped by the caller,
      `rollout.agent_loop.trainable`), or an episode has more turns than `max_images`.
  """
  if not episodes:
    raise ValueError("collate got no episodes (were they all lost? skip the update instead)")
  arrs = [episode_arrays(e) for e in episodes]
  b = batch_size or len(episodes)
  t = bucket(max(len(a["tokens"]) for a in arrs), length_multiple)
  h, w = image_hw
  tokens = np.full((b, t), pad_id, np.int32)
  attn = np.zeros((b, t), bool)
  loss = np.zeros((b, t), np.float32)
  rew = np.zeros((b, t), np.float32)
  logp = np.zeros((b, t), np.float32)
  st = np.zeros((b, t), np.int32)
  pix = np.zeros((b, max_images, h, w, 3), np.float32)
  img_mask = np.zeros((b, max_images), bool)
  for i, (ep, a) in enumerate(zip(episodes, arrs)):
    n = len(a["tokens"])
    tokens[i, :n], attn[i, :n] = a["tokens"], True
    loss[i, :n], rew[i, :n], logp[i, :n], st[i, :n] = a["loss"], a["reward"], a["logp"], a["state"]
    if len(ep.turns) > max_images:
      raise ValueError(f"episode has {len(ep.turns)} turns > max_images={max_images}")
    for m, turn in enumerate(ep.turns):
      pix[i, m] = turn.image.astype(np.float32) / 255.0
      img_mask[i, m] = True
  # Shift to target alignment: field[j] describes token j+1.
  return Batch(tokens=tokens, attn_mask=attn, loss_mask=loss[:, 1:], rewards=rew[:, 1:],
               old_logp=logp[:, 1:], states=st[:, 1:], pixel_values=pix, image_mask=img_mask)
