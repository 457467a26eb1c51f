"""Episodes as turns, and their token view for training.

An episode is a list of turns (observation -> model reply -> environment feedback). Its token view
is ONE sequence per episode, the same bytes the policy saw while acting:

  BOS system instruction | TURN_START [obs text] VISION_START IMAGE*n VISION_END | reply... EOS | TURN_END | ...

`loss_mask` is 1 only on model-written tokens (reply bytes and their EOS); rewards sit on the EOS of
the turn that earned them, so token-level GAE (`rl/advantages.py`) skips observation tokens and
carries values across them (verl/tunix multi-turn semantics; UI-TARS-2 report section 2.5.4).

Arrays are in *target* alignment: index j describes token j+1 predicted from the prefix ending at j,
so `logits[:, :-1]` of a forward pass lines up with every field of `Batch`.

With memory (`agent/memory.py`: working memory keeps the last K screenshots, older turns as text, a
token budget drops more), a turn's prompt is rebuilt and no longer extends the previous turn's
prompt + reply. Each such turn then records its prompt (`Turn.context`), and `episode_rows` cuts the
episode into *rows*: a row starts at a turn's recorded prompt and keeps extending while the next
turn's prompt starts with the row so far (same ids, same screenshots); a turn whose prompt was
rebuilt starts a new row. Every reply is thus trained on exactly the ids and screenshots it was
sampled from. Rows of one episode are chained (`Batch.next_row`), so token-level GAE carries the
value and advantage of the next row's first model token into the previous row's last one
(`rl.advantages.gae(..., next_row=...)`), exactly as it would inside one row. Without memory no turn
records a context and everything is one row per episode, as before.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np


@dataclasses.dataclass
class Context:
  """The prompt one reply was sampled from, exactly as given to the act function (`agent/memory.py`
  builds it; recorded only when memory is on).

  ids: [L] int32, the prompt token ids (episode prefix with its episodic summaries, the past turns
    kept — with or without their screenshot — and this turn's observation ids at the end).
  image_turns: turn index of each screenshot in the prompt, in the order of its IMAGE blocks (the
    last one is the turn itself: its own `Turn.image`).
  text_turns: past turns shown as text only (their screenshot left out: working memory / budget).
  dropped_turns: past turns left out entirely (token budget).
  dropped_memory: episodic summaries left out of the prefix (token budget), oldest first.
  """

  ids: np.ndarray
  image_turns: tuple[int, ...]
  text_turns: tuple[int, ...] = ()
  dropped_turns: tuple[int, ...] = ()
  dropped_memory: int = 0


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
  # The prompt of this reply when memory rebuilt it; None = the full history (prefix + every earlier
  # turn with its screenshot + obs_ids), the layout without memory.
  context: Context | None = None
  # Streaming rollouts (rollout/pool.py): versions [n] int32, the policy version that produced each
  # reply token; loss_mask [n] float32, 0 on tokens kept out of the loss (too stale); None = all 1.
  versions: np.ndarray | None = None
  loss_mask: np.ndarray | None = None

  def reply_loss(self) -> list[float]:
    """[n] loss weights of the reply tokens: 1 each, or `loss_mask`."""
    return [1.0] * len(self.reply_ids) if self.loss_mask is None else [float(x) for x in self.loss_mask]


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
  # episodic summaries of earlier episodes of the task that `prefix_ids` holds, oldest first
  # (`agent/memory.py`); the context builder may leave the oldest out under its token budget
  memory: list[str] = dataclasses.field(default_factory=list)

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
  row_episode: [B] int32 or None. Only for batches with recorded contexts (memory on; see the module
               docstring): the index (in the `episodes` given to `collate`) of the episode whose
               row this is, -1 on padding rows. None: one row per episode, row i = episode i.
  next_row:    [B] int32 or None (with row_episode): the row holding the same episode's next model
               tokens, -1 for an episode's last row and padding.
  """

  tokens: np.ndarray
  attn_mask: np.ndarray
  loss_mask: np.ndarray
  rewards: np.ndarray
  old_logp: np.ndarray
  states: np.ndarray
  pixel_values: np.ndarray
  image_mask: np.ndarray
  row_episode: np.ndarray | None = None
  next_row: np.ndarray | None = None

  def as_dict(self) -> dict[str, np.ndarray]:
    """The fields as a dict; the chain fields only when set (a batch without memory is unchanged)."""
    return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def bucket(n: int, multiple: int) -> int:
  """Round n up to a multiple (limits the number of distinct jit shapes)."""
  return int(-(-n // multiple) * multiple)


def pow2_bucket(n: int, floor: int, cap: int) -> int:
  """The smallest `floor * 2**k` >= n, at most `cap` (a handful of jit shapes for a size that varies
  from call to call: rows still playing, screenshots per row, sequence length). Raises ValueError if
  n > cap."""
  if n > cap:
    raise ValueError(f"size {n} exceeds its cap {cap}")
  b = max(1, floor)
  while b < n:
    b *= 2
  return min(b, cap)


def half_octave_bucket(n: int, floor: int, cap: int) -> int:
  """The smallest of floor * {1, 3/2, 2, 3, 4, 6, 8, ...} (powers of two and 3 x powers of two) >= n,
  at most `cap`: twice the shapes of `pow2_bucket` over a range, with at most 1.5x padding instead of
  2x (the PPO minibatch's sequence length: a 158-token row cut to 192, not 256, beside 257-token rows
  in one batch). `floor` must be even. Raises ValueError if n > cap."""
  if n > cap:
    raise ValueError(f"size {n} exceeds its cap {cap}")
  b = max(2, floor)
  while b < n:
    if b + b // 2 >= n:
      return min(b + b // 2, cap)
    b *= 2
  return min(b, cap)


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
    loss += [0.0] * n_obs + t.reply_loss()
    r = [0.0] * n_rep
    if n_rep:
      r[-1] = t.reward
    reward += [0.0] * n_obs + r
    logp += [0.0] * n_obs + [float(x) for x in t.logprobs]
    state += [0] * n_obs + [max(int(s), 0) for s in t.states]
  return dict(tokens=np.asarray(tokens, np.int32), loss=np.asarray(loss, np.float32),
              reward=np.asarray(reward, np.float32), logp=np.asarray(logp, np.float32),
              state=np.asarray(state, np.int32))


def episode_rows(ep: Episode) -> list[dict]:
  """The training rows of one episode: the prompts its replies were sampled from (module docstring).

  Without recorded contexts (memory off) this is `[episode_arrays(ep)]` with every turn's screenshot.
  Otherwise a row starts at a turn's `Context.ids` and takes the next turn in as long as that turn's
  prompt starts with the row's ids and screenshots so far (the new ids are its observation tokens,
  loss 0); a rebuilt prompt starts a new row. A turn without a context in such an episode stands for
  the full history (prefix + earlier turns + its obs_ids, every screenshot).

  Returns: rows in turn order, each a dict of [L] arrays as `episode_arrays` (tokens int32, loss,
    reward, logp float32, state int32) plus `image_turns` (list of the turn index of each screenshot
    of the row, in IMAGE-block order) and `turns` (the turns whose replies the row trains).
  Raises: ValueError if a context does not end with its turn's obs_ids (a prompt that was not the
    one this turn's reply followed).
  """
  if all(t.context is None for t in ep.turns):
    a = episode_arrays(ep)
    a["image_turns"], a["turns"] = list(range(len(ep.turns))), list(range(len(ep.turns)))
    return [a]
  rows: list[dict] = []
  cur = None
  history = list(ep.prefix_ids)  # the full-history prompt, for turns without a context
  for k, t in enumerate(ep.turns):
    if t.context is not None:
      ctx, imgs = [int(x) for x in t.context.ids], list(t.context.image_turns)
    else:
      ctx, imgs = history + list(t.obs_ids), list(range(k + 1))
    if t.obs_ids and ctx[-len(t.obs_ids):] != list(t.obs_ids):
      raise ValueError(f"turn {k}: its context does not end with its observation ids")
    n = len(cur["tokens"]) if cur else 0
    if cur is not None and ctx[:n] == cur["tokens"] and imgs[:len(cur["image_turns"])] == cur["image_turns"]:
      new_ids, cur["image_turns"] = ctx[n:], imgs  # this prompt extends the row: only its new tokens
    else:
      cur = dict(tokens=[], loss=[], reward=[], logp=[], state=[], image_turns=imgs, turns=[])
      rows.append(cur)
      new_ids = ctx
    n_rep = len(t.reply_ids)
    r = [0.0] * n_rep
    if n_rep:
      r[-1] = t.reward
    cur["tokens"] += new_ids + list(t.reply_ids)
    cur["loss"] += [0.0] * len(new_ids) + t.reply_loss()
    cur["reward"] += [0.0] * len(new_ids) + r
    cur["logp"] += [0.0] * len(new_ids) + [float(x) for x in t.logprobs]
    cur["state"] += [0] * len(new_ids) + [max(int(s), 0) for s in t.states]
    cur["turns"].append(k)
    history += list(t.obs_ids) + list(t.reply_ids)
  dtypes = dict(tokens=np.int32, loss=np.float32, reward=np.float32, logp=np.float32, state=np.int32)
  return [{k: (np.asarray(v, dtypes[k]) if k in dtypes else v) for k, v in row.items()} for row in rows]


def real_rows(batch: dict, n: int) -> dict:
  """The first `n` rows of a collated batch dict (the rows after them are padding up to a fixed
  batch size); scalars and shorter arrays are kept as they are."""
  return {k: v[:n] if getattr(v, "ndim", 0) and v.shape[0] >= n else v for k, v in batch.items()}


def collate(episodes: list[Episode], *, pad_id: int, max_images: int, image_hw: tuple[int, int],
            length_multiple: int = 64, batch_size: int | None = None) -> Batch:
  """Episodes -> right-padded `Batch` (see class docstring for shapes).

  Images are resized by the caller (`Turn.image` must already be `image_hw`). Rows beyond the real
  ones (up to `batch_size`) are all-padding with zero masks, so jit sees fixed shapes.

  Without recorded contexts (memory off): one row per episode, row i = episodes[i]. With them, the
  rows of `episode_rows` (several per episode when memory rebuilt a prompt), in episode order, with
  `row_episode` / `next_row` set; when there are more rows than `batch_size`, the batch grows to the
  next multiple of `batch_size` (a handful of jit shapes).

  Raises:
    ValueError: no episodes (an iteration whose episodes were all lost is skipped by the caller,
      `rollout.agent_loop.trainable`), or a row has more screenshots than `max_images`.
  """
  if not episodes:
    raise ValueError("collate got no episodes (were they all lost? skip the update instead)")
  chained = any(t.context is not None for e in episodes for t in e.turns)
  if chained:
    rows, owner = [], []
    for e_idx, ep in enumerate(episodes):
      for row in episode_rows(ep):
        rows.append((row, [ep.turns[j].image for j in row["image_turns"]]))
        owner.append(e_idx)
    for row, imgs in rows:
      if len(imgs) > max_images:
        raise ValueError(f"a row has {len(imgs)} screenshots > max_images={max_images}")
  else:
    rows = [(episode_arrays(ep), [t.image for t in ep.turns]) for ep in episodes]
    for ep in episodes:
      if len(ep.turns) > max_images:
        raise ValueError(f"episode has {len(ep.turns)} turns > max_images={max_images}")
  b = batch_size or len(rows)
  if len(rows) > b:
    b = bucket(len(rows), b)
  p = pad_rows(rows, {"loss": np.float32, "reward": np.float32, "logp": np.float32, "state": np.int32},
               pad_id=pad_id, batch_size=b, max_images=max_images, image_hw=image_hw, length_multiple=length_multiple)
  chain = {}
  if chained:
    row_episode = np.full((b,), -1, np.int32)
    row_episode[:len(owner)] = owner
    next_row = np.full((b,), -1, np.int32)
    for i in range(len(owner) - 1):
      if owner[i + 1] == owner[i]:
        next_row[i] = i + 1
    chain = dict(row_episode=row_episode, next_row=next_row)
  # Shift to target alignment: field[j] describes token j+1.
  return Batch(tokens=p["tokens"], attn_mask=p["attn_mask"], loss_mask=p["loss"][:, 1:], rewards=p["reward"][:, 1:],
               old_logp=p["logp"][:, 1:], states=p["state"][:, 1:], pixel_values=p["pixel_values"],
               image_mask=p["image_mask"], **chain)


def pad_rows(rows: Sequence[tuple[dict, Sequence]], fields: dict[str, Any], *, pad_id: int, batch_size: int,
             max_images: int, image_hw: tuple[int, int], length_multiple: int) -> dict[str, np.ndarray]:
  """Right-pads token rows and their screenshots into fixed-shape arrays (the padding under `collate`
  and the ORM's `collate`).

  rows: (arrays, screenshots) per row: arrays["tokens"] [n] int plus one [n] array per name of
    `fields`, token-aligned; screenshots uint8 [H, W, 3] (already `image_hw`), at most max_images.
  fields: {name: dtype} of the per-token arrays besides tokens (zero on padding).
  Returns: tokens [B, T] int32 (pad_id on padding), attn_mask [B, T] bool, each field [B, T],
    pixel_values [B, max_images, H, W, 3] float32 in [0, 1], image_mask [B, max_images] bool; B =
    batch_size (rows past the given ones are all padding), T = the longest row rounded up to a
    multiple of `length_multiple` (`bucket`).
  """
  t = bucket(max(len(a["tokens"]) for a, _ in rows), length_multiple)
  h, w = image_hw
  out = {"tokens": np.full((batch_size, t), pad_id, np.int32), "attn_mask": np.zeros((batch_size, t), bool),
         **{k: np.zeros((batch_size, t), dt) for k, dt in fields.items()},
         "pixel_values": np.zeros((batch_size, max_images, h, w, 3), np.float32),
         "image_mask": np.zeros((batch_size, max_images), bool)}
  for i, (a, imgs) in enumerate(rows):
    n = len(a["tokens"])
    out["tokens"][i, :n], out["attn_mask"][i, :n] = a["tokens"], True
    for k in fields:
      out[k][i, :n] = a[k]
    for m, image in enumerate(imgs):
      out["pixel_values"][i, m] = np.asarray(image, np.float32) / 255.0
      out["image_mask"][i, m] = True
  return out
