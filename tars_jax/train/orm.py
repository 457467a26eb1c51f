"""Generative outcome reward model (ORM): the policy model asked whether an episode succeeded.

UI-TARS-2 report section 2.5.2 ("Non-verifiable tasks"): where no verifier exists, UI-TARS-2 itself
is a generative ORM that "takes as input the full text history together with the last five
screenshots (to fit within the context window) and outputs a score indicating task success"; section
3.3 measures it on 300 annotated traces (F1 83.8, "a relatively high false positive rate") and finds
such an imperfect ORM still good enough for RL. Here the ORM is a model of the policy's own family
and token format (`agent/prompts.py`), trained by cross-entropy on the answer of verifier-labelled
trajectories (`experiments/orm.py`), scored by P("yes").

Prompt (token ids of the policy's chat template; `*...*` = the answer, the only trained tokens):

  BOS <system>\\n <instruction>\\n                                                   prefix
  TURN_START [<obs text>\\n] *<reply>* EOS                        older turn: text only (thought, action)
  TURN_END TURN_START [<obs text>\\n] VISION_START IMAGE*n VISION_END <reply> EOS   last k turns
  TURN_END TURN_START <question>\\n                                                 the question
  *yes* *EOS*   or   *no* *EOS*                                                     the answer

- The last `screenshots` = k turns (UI-TARS keeps 5) keep their screenshot, the screenshot each
  reply was conditioned on (`Turn.image`; records hold no screenshot after the last action); older
  turns keep their observation text and reply with the vision block removed (`memory.strip_vision`),
  exactly as the policy's working memory shows them.
- Budget `max_tokens` (prompt + the longest answer; 0 = none): over it, the builder leaves out, one
  at a time, the oldest text-only turn; else the oldest screenshot (its turn becomes text-only); else
  the end of the instruction. It never fails on a long episode: what was left out is recorded in the
  `OrmPrompt` (`trajectory.Context`: image / text / dropped turns, and the instruction characters cut).
  Only a budget that cannot hold the system prompt, the question and an answer is an error
  (`OrmBudgetError`, a configuration error).
- Score: P(yes) = the next-token distribution at the answer position renormalised over the two
  answers' first tokens (`yes_id`, `no_id`; 'y' and 'n' for the byte tokenizer):
  sigmoid(logit[yes_id] - logit[no_id]), temperature 1.

PPO with ORM rewards (`config.rl.orm_run`, `experiments/train.py`): `apply_orm_rewards` replaces the
outcome term of each episode's shaped reward (the verifier's `outcome_weight * env_reward`) by
`outcome_weight * (lo + P(yes) * (hi - lo))` on its last turn, (lo, hi) = `config.rl.orm_reward_range`
(MiniWoB's verifier: -1 failure, +1 success): the verifier reward the ORM expects. The other shaping
terms (format, truncation, step) stay; `Turn.env_reward` keeps the verifier's, logged as
`rollout/verifier_success` beside the ORM's agreement with it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tars_jax.agent import prompts
from tars_jax.agent.memory import shrink_oldest, strip_vision, turns_length
from tars_jax.agent.trajectory import Context, Episode, pad_rows
from tars_jax.rl import rewards as reward_lib
from tars_jax.rl.rewards import RewardConfig
from tars_jax.train import step as step_lib
from tars_jax.train.step import ModelInputs
from tars_jax.train.sft import reply_text

QUESTION = "Did the agent complete the task? Answer yes or no."
ANSWERS = ("yes", "no")  # (positive, negative)


class MissingScreenshots(ValueError):
  """An episode the ORM was asked to judge lacks a screenshot it must show (or has no turn at all)."""


class OrmBudgetError(ValueError):
  """`max_tokens` cannot hold the parts never left out: BOS, system prompt, question, longest answer."""


@dataclasses.dataclass(frozen=True)
class OrmSettings:
  """What the ORM is shown and asked (config section `orm`; `settings_from_config`).

  screenshots: k, the last turns whose screenshot is shown (report: 5); older turns as text. >= 0.
  max_tokens: bound on prompt + longest answer tokens; 0 = none.
  question: the question text after the history.
  answers: (positive, negative) answer texts; trained as their ids + EOS.
  answer_token_ids: (yes_id, no_id) whose next-token probabilities are compared; None = the first
    token of each answer's encoding.
  thoughts: the replies as recorded (True) or with their thought emptied (`Thought: \\nAction: ...`;
    False), e.g. when successes come from demonstrations with templated thoughts and failures from a
    policy that writes none (the ORM would learn the style, not the outcome).
  Raises: ValueError for a negative k or budget, or two equal answers.
  """

  screenshots: int = 5
  max_tokens: int = 0
  question: str = QUESTION
  answers: tuple[str, str] = ANSWERS
  answer_token_ids: tuple[int, int] | None = None
  thoughts: bool = True

  def __post_init__(self):
    if self.screenshots < 0 or self.max_tokens < 0:
      raise ValueError(f"orm screenshots ({self.screenshots}) and max_tokens ({self.max_tokens}) must be >= 0")
    if len(self.answers) != 2 or self.answers[0] == self.answers[1]:
      raise ValueError(f"orm answers must be two different texts, got {self.answers!r}")


def settings_from_config(o) -> OrmSettings:
  """`OrmSettings` from the config section `orm` (every field must be set: AttributeError names it)."""
  return OrmSettings(screenshots=o.screenshots, max_tokens=o.max_tokens, question=o.question,
                     answers=tuple(o.answers), thoughts=o.thoughts)


def answer_ids(tok, settings: OrmSettings) -> tuple[list[int], list[int]]:
  """The ids of the (positive, negative) answers: text ids + EOS (what the ORM is trained to write)."""
  return tuple(tok.encode(a) + [tok.eos_id] for a in settings.answers)  # type: ignore[return-value]


def answer_token_ids(tok, settings: OrmSettings) -> tuple[int, int]:
  """(yes_id, no_id): `settings.answer_token_ids`, or the first token of each answer.
  Raises: ValueError when they coincide (the score would be 0.5 whatever the model says)."""
  ids = settings.answer_token_ids or tuple(a[0] for a in answer_ids(tok, settings))
  if ids[0] == ids[1]:
    raise ValueError(f"the answers {settings.answers!r} start with the same token {ids[0]}; "
                     "set OrmSettings.answer_token_ids")
  return int(ids[0]), int(ids[1])


def verifier_label(ep: Episode, provenance: dict | None = None) -> bool:
  """The training label of a recorded episode: its provenance's `extra["success"]` when recorded,
  else the verifier's outcome `Episode.success` (done with a positive environment return)."""
  extra = (provenance or {}).get("extra") or {}
  if "success" in extra:
    return bool(extra["success"])
  return ep.success


# --------------------------------------------------------------------------------------------- the prompt

@dataclasses.dataclass
class OrmPrompt:
  """The ORM's prompt for one episode.

  ids: prompt ids, ending where the answer starts (the last id's next-token distribution is scored).
  images: the kept screenshots, [H, W, 3] uint8 each, in IMAGE-block order.
  context: `trajectory.Context` of what was kept: `image_turns` (turns shown with their screenshot),
    `text_turns` (as text only: older than the last k, or moved there by the budget),
    `dropped_turns` (left out entirely by the budget); `ids` as above.
  instruction_cut: characters cut from the end of the instruction by the budget (0 normally).
  """

  ids: list[int]
  images: list[np.ndarray]
  context: Context
  instruction_cut: int = 0

  @property
  def dropped(self) -> dict[str, int]:
    """What the ORM did not see: {"screenshots": turns without their screenshot (older than the last
    k, or cut by the budget), "turns": turns left out entirely, "instruction_chars": characters cut}."""
    n = len(self.context.image_turns) + len(self.context.text_turns) + len(self.context.dropped_turns)
    return {"screenshots": n - len(self.context.image_turns), "turns": len(self.context.dropped_turns),
            "instruction_chars": self.instruction_cut}


def reply_ids(turn, tok, thoughts: bool) -> list[int]:
  """A turn's reply as the ORM sees it: the ids the policy wrote (`Turn.reply_ids`, else its text +
  EOS); with thoughts=False and a `Thought: ...\\nAction: ...` reply, the thought emptied."""
  if not thoughts:
    try:
      return tok.encode(reply_text(turn.text or "", thoughts=False)) + [tok.eos_id]
    except ValueError:  # not `Thought: ...\nAction: ...` (e.g. free text): as written
      pass
  return [int(i) for i in turn.reply_ids] if len(turn.reply_ids) else tok.encode(turn.text) + [tok.eos_id]


def build_prompt(ep: Episode, *, tok, system: str, settings: OrmSettings) -> OrmPrompt:
  """The ORM prompt of `ep` (module docstring): prefix, turns (the last `settings.screenshots` with
  their screenshot), question; within `settings.max_tokens` (prompt + longest answer).

  ep: a finished (or truncated) episode; its turns' `obs_ids` (observation text, IMAGE slots),
  `reply_ids` / `text` and `image` are used, its recorded `prefix_ids` are not (the prefix is rebuilt
  from `instruction` and `system`, so episodes recorded with other prompts get one prefix).
  Returns: OrmPrompt. Never fails on a long episode (see `OrmPrompt.dropped`).
  Raises: OrmBudgetError when the budget cannot hold BOS + system + question + the longest answer;
    MissingScreenshots when the episode has no turn, or one of its last `screenshots` turns no `image`
    (an episode stored without its screenshots: the ORM judges from them, it does not guess without).
  """
  n = len(ep.turns)
  missing = [j for j in range(max(0, n - settings.screenshots), n) if ep.turns[j].image is None]
  if n == 0 or missing:
    raise MissingScreenshots(f"the ORM cannot judge episode {ep.task} seed {ep.seed}: "
                             + (f"turns {missing} of {n} have no screenshot" if n else "it has no turn")
                             + " (judge episodes as recorded, with their screenshots)")
  k = settings.screenshots
  mode = ["full" if j >= n - k else "text" for j in range(n)]  # "full" | "text" | "dropped"
  replies = [reply_ids(t, tok, settings.thoughts) for t in ep.turns]
  full_len = [len(t.obs_ids) + len(r) for t, r in zip(ep.turns, replies)]
  text_len = [len(strip_vision(t.obs_ids, tok)) + len(r) for t, r in zip(ep.turns, replies)]
  question = [tok.turn_end_id, tok.turn_start_id] + tok.encode(settings.question + "\n")
  reserve = max(len(a) for a in answer_ids(tok, settings))
  instruction = ep.instruction

  def length() -> int:
    return (len(prompts.encode_episode_prefix(tok, instruction, system)) + turns_length(mode, full_len, text_len)
            + len(question) + reserve)

  budget = settings.max_tokens or None
  while budget is not None and length() > budget:
    if shrink_oldest(mode):
      continue
    if instruction:  # at least one character per pass; one pass for the byte tokenizer
      instruction = instruction[: max(0, len(instruction) - max(1, length() - budget))]
    else:
      raise OrmBudgetError(f"orm max_tokens={budget} cannot hold the system prompt, the question and an answer "
                           f"({length()} tokens with an empty instruction and no turn)")
  ids = prompts.encode_episode_prefix(tok, instruction, system)
  images, image_turns = [], []
  for j, (t, m) in enumerate(zip(ep.turns, mode)):
    if m == "full":
      ids += list(t.obs_ids) + replies[j]
      images.append(t.image)
      image_turns.append(j)
    elif m == "text":
      ids += strip_vision(t.obs_ids, tok) + replies[j]
  ids += question
  ctx = Context(ids=np.asarray(ids, np.int32), image_turns=tuple(image_turns),
                text_turns=tuple(j for j, m in enumerate(mode) if m == "text"),
                dropped_turns=tuple(j for j, m in enumerate(mode) if m == "dropped"))
  return OrmPrompt(ids=[int(i) for i in ids], images=images, context=ctx,
                   instruction_cut=len(ep.instruction) - len(instruction))


def image_slots(prompts_: Sequence[OrmPrompt], k: int) -> int:
  """Image slots of a batch: its most screenshots rounded up to a power of two, at most k (>= 1):
  few jit shapes, and the vision tower does not run on k slots for short episodes."""
  most = max([len(p.images) for p in prompts_] + [1])
  return max(1, min(max(k, 1), 1 << (most - 1).bit_length()))


def collate(prompts_: Sequence[OrmPrompt], answers: Sequence[Sequence[int]] | None = None, *, pad_id: int,
            max_images: int, image_hw: tuple[int, int], length_multiple: int = 64,
            batch_size: int | None = None) -> tuple[dict[str, np.ndarray], np.ndarray]:
  """ORM prompts (+ answers for training) -> (a `trajectory.Batch`-layout dict, answer_pos).

  Returns: dict with tokens [B, T] int32 (prompt then answer, PAD after), attn_mask [B, T] bool,
    loss_mask [B, T-1] float32 (target alignment: 1 where the target token j+1 is an answer token),
    states [B, T-1] int32 (0: the answer is not under the action grammar), pixel_values
    [B, M, H, W, 3] float32 in [0, 1], image_mask [B, M] bool; and answer_pos [B] int32, the index
    whose next-token distribution gives the answer's first token (prompt length - 1; 0 on padding
    rows). B = batch_size (rows beyond the prompts are padding), T a multiple of length_multiple.
  Raises: ValueError for no prompts, more prompts than batch_size, or more screenshots than max_images.
  """
  if not prompts_:
    raise ValueError("orm collate got no prompts")
  b = batch_size or len(prompts_)
  if len(prompts_) > b:
    raise ValueError(f"{len(prompts_)} prompts > batch_size={b}")
  answers = list(answers) if answers is not None else [[] for _ in prompts_]
  rows, pos = [], np.zeros((b,), np.int32)
  for i, (p, ans) in enumerate(zip(prompts_, answers)):
    if len(p.images) > max_images:
      raise ValueError(f"an ORM prompt has {len(p.images)} screenshots > max_images={max_images}")
    n = len(p.ids)
    rows.append(({"tokens": list(p.ids) + [int(a) for a in ans],
                  "loss": np.r_[np.zeros(n, np.float32), np.ones(len(ans), np.float32)]}, p.images))
    pos[i] = n - 1
  padded = pad_rows(rows, {"loss": np.float32}, pad_id=pad_id, batch_size=b, max_images=max_images,
                    image_hw=image_hw, length_multiple=length_multiple)
  t = padded["tokens"].shape[1]
  # target alignment, as `trajectory.collate`: loss_mask[j] = 1 where token j+1 is an answer token
  return dict(tokens=padded["tokens"], attn_mask=padded["attn_mask"], loss_mask=padded["loss"][:, 1:],
              states=np.zeros((b, t - 1), np.int32), pixel_values=padded["pixel_values"],
              image_mask=padded["image_mask"]), pos


# -------------------------------------------------------------------------------------------------- scoring

@functools.partial(jax.jit, static_argnames=("graphdef", "inputs"))
def answer_logits(params, batch: dict, answer_pos, *, graphdef, inputs: ModelInputs):
  """[B, V] float32: the logits at `answer_pos` ([B] int32) of each row of a `collate` batch."""
  out = step_lib.forward(graphdef, params, batch, inputs)
  logits = jnp.take_along_axis(out.logits, answer_pos[:, None, None], axis=1)[:, 0]
  return logits.astype(jnp.float32)


def p_yes_of_logits(logits, yes_id: int, no_id: int):
  """P(yes) renormalised over the two answer tokens: softmax([l_yes, l_no])[0] = sigmoid(l_yes - l_no).
  logits: [..., V]; returns [...] in the array's float type."""
  return jax.nn.sigmoid(logits[..., yes_id] - logits[..., no_id])


class OrmScorer:
  """Batched, jitted P(yes) of episodes under an ORM's parameters (module docstring).

  `p_yes(episodes) -> np.ndarray [N] float32`; `from_run(run_dir)` loads an `experiments/orm.py`
  run. `dropped` sums, over the episodes of the last `p_yes` call, what their prompts left out
  (`OrmPrompt.dropped` plus "episodes_cut": episodes that lost a turn or instruction characters to
  the budget); a call that had to cut logs one warning.
  """

  def __init__(self, graphdef, params, *, tokenizer, inputs: ModelInputs, settings: OrmSettings, system: str,
               image_hw: tuple[int, int], n_img_tokens: int, batch_size: int = 8, length_multiple: int = 64):
    self.graphdef, self.params, self.tokenizer, self.inputs = graphdef, params, tokenizer, inputs
    self.settings, self.system, self.image_hw, self.n_img_tokens = settings, system, tuple(image_hw), n_img_tokens
    self.batch_size, self.length_multiple = batch_size, length_multiple
    self.yes_id, self.no_id = answer_token_ids(tokenizer, settings)
    self.dropped: dict[str, int] = {}

  @classmethod
  def from_parts(cls, parts, params, settings: OrmSettings, batch_size: int = 8) -> "OrmScorer":
    """A scorer of `params` with the model, tokenizer, system prompt and image size of `parts`
    (`train.state.build` of the ORM's config)."""
    return cls(parts.policy_gd, params, tokenizer=parts.tokenizer, inputs=parts.inputs, settings=settings,
               system=parts.loop_cfg.system, image_hw=parts.image_hw, n_img_tokens=parts.loop_cfg.n_img_tokens,
               batch_size=batch_size, length_multiple=parts.config.length_multiple)

  @classmethod
  def from_run(cls, run_dir: str, config=None, *, batch_size: int | None = None) -> "OrmScorer":
    """The ORM of an `experiments/orm.py` run: its latest checkpoint (or `<run>/checkpoints/<step>`)
    under the model of `config` (None: the run's own config.json), settings from `config.orm`,
    batch size `batch_size` (None: `config.orm.batch_size`).

    Raises: FileNotFoundError (no run dir / config.json / checkpoint); ValueError (from Orbax) when
      the checkpoint is of another model; AttributeError naming a missing config field.
    """
    import ml_collections as mlc
    from tars_jax.train import state as state_lib
    run, _ = state_lib.checkpoint_location(run_dir)
    if config is None:
      path = os.path.join(run, "config.json")
      if not os.path.exists(path):
        raise FileNotFoundError(f"ORM run {run_dir!r}: no config.json (is it an experiments/orm.py run dir?)")
      with open(path) as f:
        config = mlc.ConfigDict(json.load(f))
    parts = state_lib.build(config)
    # restored into the train state's shapes (eval_shape): no random init of policy, critic, optimisers
    abstract = jax.eval_shape(lambda: parts.init_state(config.seed))
    policy, _, _ = state_lib.restore_policy(abstract, run_dir)
    return cls.from_parts(parts, policy, settings_from_config(config.orm),
                          batch_size=batch_size or config.orm.batch_size)

  def check_fits(self, image_hw: tuple[int, int], n_img_tokens: int, tokenizer) -> None:
    """Checks that episodes of a policy with this screenshot size, IMAGE slots per screenshot and
    tokenizer can be scored. Raises: ValueError naming the field and both values."""
    for name, mine, theirs in (("image_hw", self.image_hw, tuple(image_hw)),
                               ("n_img_tokens", self.n_img_tokens, n_img_tokens),
                               ("tokenizer", (self.tokenizer.name, self.tokenizer.vocab_size),
                                (tokenizer.name, tokenizer.vocab_size))):
      if mine != theirs:
        raise ValueError(f"the ORM has {name}={mine!r} but the episodes' policy has {name}={theirs!r}")

  def prompts(self, episodes: Sequence[Episode]) -> list[OrmPrompt]:
    return [build_prompt(e, tok=self.tokenizer, system=self.system, settings=self.settings) for e in episodes]

  def logits(self, prompts_: Sequence[OrmPrompt]) -> np.ndarray:
    """[N, V] float32 next-token logits at the answer position of each prompt."""
    out = []
    for i in range(0, len(prompts_), self.batch_size):
      chunk = prompts_[i:i + self.batch_size]
      batch, pos = collate(chunk, pad_id=self.tokenizer.pad_id,
                           max_images=image_slots(chunk, self.settings.screenshots), image_hw=self.image_hw,
                           length_multiple=self.length_multiple, batch_size=self.batch_size)
      out.append(np.asarray(answer_logits(self.params, batch, pos, graphdef=self.graphdef,
                                          inputs=self.inputs))[:len(chunk)])
    return np.concatenate(out) if out else np.zeros((0, 0), np.float32)

  def p_yes(self, episodes: Sequence[Episode]) -> np.ndarray:
    """[N] float32 P(yes) of each episode (module docstring); [] for no episodes."""
    if not episodes:
      self.dropped = {}
      return np.zeros((0,), np.float32)
    ps = self.prompts(episodes)
    tot = {"episodes_cut": 0, "screenshots": 0, "turns": 0, "instruction_chars": 0}
    for p in ps:
      d = p.dropped
      for key, v in d.items():
        tot[key] += v
      tot["episodes_cut"] += bool(d["turns"] or d["instruction_chars"])
    self.dropped = tot
    if tot["episodes_cut"]:
      logging.warning("ORM budget of %d tokens: %d of %d episodes cut (%d turns, %d instruction characters "
                      "left out)", self.settings.max_tokens, tot["episodes_cut"], len(ps), tot["turns"],
                      tot["instruction_chars"])
    return np.asarray(p_yes_of_logits(self.logits(ps), self.yes_id, self.no_id), np.float32)


# -------------------------------------------------------------------------------------------------- metrics

def classification_metrics(p_yes, labels, threshold: float = 0.5) -> dict[str, float | int | None]:
  """Binary classification of episodes by an ORM: predicted success = p_yes > threshold.

  p_yes: [N] scores; labels: [N] bool (verifier success). Returns counts tp, fp, tn, fn, n and
  positives (int), and precision = tp / (tp + fp), recall = tp / (tp + fn), f1 (their harmonic mean),
  false_positive_rate = fp / (fp + tn), accuracy, base_rate (positives / n): 0.0 where the
  denominator is 0; auroc: the probability that a random success scores above a random failure (ties
  count half; Mann-Whitney), None without both classes.
  """
  p = np.asarray(p_yes, np.float64).reshape(-1)
  y = np.asarray(labels, bool).reshape(-1)
  if p.shape != y.shape:
    raise ValueError(f"{p.shape[0]} scores but {y.shape[0]} labels")
  pred = p > threshold
  tp, fp = int(np.sum(pred & y)), int(np.sum(pred & ~y))
  tn, fn = int(np.sum(~pred & ~y)), int(np.sum(~pred & y))

  def div(a, b):
    return float(a / b) if b else 0.0

  precision, recall = div(tp, tp + fp), div(tp, tp + fn)
  auroc = None
  if y.any() and (~y).any():
    from scipy.stats import rankdata
    ranks = rankdata(p)  # average ranks of ties
    npos, nneg = int(y.sum()), int((~y).sum())
    auroc = float((ranks[y].sum() - npos * (npos + 1) / 2) / (npos * nneg))
  return {"n": int(y.size), "positives": int(y.sum()), "tp": tp, "fp": fp, "tn": tn, "fn": fn,
          "precision": precision, "recall": recall, "f1": div(2 * precision * recall, precision + recall),
          "false_positive_rate": div(fp, fp + tn), "accuracy": div(tp + tn, y.size), "base_rate": div(y.sum(), y.size),
          "auroc": auroc}


BALANCE = ("none", "length")  # `orm.balance`: how the training and held-out episodes are subsampled


def balance_by_length(items: Sequence[dict], seed: int) -> list[dict]:
  """The episodes of `items` subsampled so that, within each (task, number of turns) stratum, successes
  and failures are equally many: the larger side of a stratum is cut to the smaller side's count by a
  draw without replacement from `np.random.default_rng(seed)` (strata in sorted order), so a stratum
  with one class only is dropped. The label is then independent of (task, episode length): a classifier
  of the turn count alone has AUROC 0.5 on the result.

  items: dicts with "task" (str), "turns" (int) and "label" (bool), other keys kept. Returns the kept
  dicts themselves, in their order in `items` (nothing added, nothing copied).
  """
  strata: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
  for i, x in enumerate(items):
    pos, neg = strata.setdefault((x["task"], int(x["turns"])), ([], []))
    (pos if x["label"] else neg).append(i)
  rng = np.random.default_rng(seed)
  keep: list[int] = []
  for key in sorted(strata):
    pos, neg = strata[key]
    n = min(len(pos), len(neg))
    for side in (pos, neg):
      keep.extend(side if len(side) == n else (side[j] for j in rng.choice(len(side), n, replace=False)))
  return [items[i] for i in sorted(keep)]


INTERVAL_METRICS = ("f1", "precision", "recall", "false_positive_rate", "accuracy", "auroc")


def bootstrap_intervals(p_yes, labels, *, strata=None, groups=None, reps: int = 2000, seed: int = 0,
                        level: float = 0.95, threshold: float = 0.5) -> dict[str, tuple[float, float]]:
  """Percentile bootstrap intervals of `classification_metrics` over episodes.

  Each replicate draws, within each stratum (`strata`: [N] labels, e.g. the task; None = one stratum),
  as many units as the stratum has, with replacement; a unit is an episode, or a group of episodes
  (`groups`: [N] labels, e.g. the (task, seed) screen the episodes share, whose episodes are correlated)
  taken whole. Returns {metric: (lo, hi)} for INTERVAL_METRICS at `level`; a metric undefined in a
  replicate (AUROC without both classes) is left out of that replicate, (nan, nan) if it never is.
  Deterministic in `seed`.
  """
  p = np.asarray(p_yes, np.float64).reshape(-1)
  y = np.asarray(labels, bool).reshape(-1)
  n = p.shape[0]
  strata = np.zeros(n, np.int64) if strata is None else np.unique(np.asarray(strata), return_inverse=True)[1]
  groups = np.arange(n) if groups is None else np.unique(np.asarray(groups), return_inverse=True)[1]
  # units (groups) of each stratum, and the episodes of each unit
  members: dict[int, np.ndarray] = {int(g): np.flatnonzero(groups == g) for g in np.unique(groups)}
  units = [np.unique(groups[strata == s]) for s in np.unique(strata)]
  rng = np.random.default_rng(seed)
  out: dict[str, list[float]] = {k: [] for k in INTERVAL_METRICS}
  for _ in range(reps):
    idx = np.concatenate([members[int(g)] for u in units for g in rng.choice(u, len(u))] or [np.zeros(0, np.int64)])
    m = classification_metrics(p[idx], y[idx], threshold)
    for k in INTERVAL_METRICS:
      if m[k] is not None:
        out[k].append(m[k])
  a = (1 - level) / 2
  return {k: ((float(np.quantile(v, a)), float(np.quantile(v, 1 - a))) if v else (float("nan"), float("nan")))
          for k, v in out.items()}


def format_table(rows: dict[str, dict]) -> str:
  """A text table of `classification_metrics` results, one row per name (e.g. 'all', a task)."""
  head = f"{'episodes':34s} {'n':>5s} {'succ':>5s} {'F1':>6s} {'prec':>6s} {'recall':>6s} {'FPR':>6s} {'acc':>6s} {'AUROC':>6s}"
  lines = [head]
  for name, m in rows.items():
    au = "  -   " if m["auroc"] is None else f"{m['auroc']:6.3f}"
    lines.append(f"{name:34s} {m['n']:5d} {m['positives']:5d} {100 * m['f1']:6.1f} {100 * m['precision']:6.1f} "
                 f"{100 * m['recall']:6.1f} {100 * m['false_positive_rate']:6.1f} {100 * m['accuracy']:6.1f} {au}")
  return "\n".join(lines)


def format_interval_table(rows: dict[str, dict], intervals: dict[str, dict]) -> str:
  """`format_table`'s rows with their `bootstrap_intervals` (in %; AUROC as a fraction), one line per
  row that has intervals: 'F1 [lo, hi]' and so on."""
  lines = [f"{'episodes':34s} {'n':>5s} {'succ':>5s}  F1 / precision / recall / FPR / accuracy [95 % CI], AUROC [95 % CI]"]
  for name, m in rows.items():
    ci = intervals.get(name)
    if ci is None:
      continue
    parts = [f"{100 * m[k]:.1f} [{100 * ci[k][0]:.1f}, {100 * ci[k][1]:.1f}]"
             for k in ("f1", "precision", "recall", "false_positive_rate", "accuracy")]
    au = "-" if m["auroc"] is None else f"{m['auroc']:.3f} [{ci['auroc'][0]:.3f}, {ci['auroc'][1]:.3f}]"
    lines.append(f"{name:34s} {m['n']:5d} {m['positives']:5d}  " + " / ".join(parts) + f", {au}")
  return "\n".join(lines)


# ------------------------------------------------------------------------------------ ORM rewards in PPO

def orm_outcome(p_yes: float, reward_range: tuple[float, float]) -> float:
  """The outcome reward the ORM gives: lo + p_yes * (hi - lo) for (lo, hi) = (failure, success)
  verifier rewards (the verifier's reward expected under the ORM's belief)."""
  lo, hi = reward_range
  return float(lo + p_yes * (hi - lo))


def scorer_for_ppo(config, parts) -> OrmScorer | None:
  """The ORM whose rewards replace the verifier's in `experiments/train.py`: `config.rl.orm_run`
  loaded by `OrmScorer.from_run` (its own config.json), checked against the policy's screenshots,
  IMAGE slots and tokenizer; None when `config.rl.orm_run` is "" (the verifier's rewards).
  Raises: as `OrmScorer.from_run` / `check_fits`."""
  if not config.rl.orm_run:
    return None
  scorer = OrmScorer.from_run(config.rl.orm_run)
  scorer.check_fits(parts.image_hw, parts.loop_cfg.n_img_tokens, parts.tokenizer)
  return scorer


def apply_orm_rewards(episodes: Sequence[Episode], scorer: OrmScorer, rewards: RewardConfig,
                      reward_range: tuple[float, float]) -> dict[str, float]:
  """Replaces, in place, the verifier's outcome term of each episode's shaped rewards by the ORM's.

  For every turn, `Turn.reward -= rewards.outcome_term(Turn.env_reward)` (the outcome term
  `rewards.turn_reward_terms` added); then the last turn gets `outcome_weight * orm_outcome(P(yes),
  reward_range)`. Format, truncation, step and overlong terms are kept; `env_reward` (the verifier's)
  is not changed, so success metrics and records still carry the verifier's outcome.
  Returns metrics: orm/p_yes, orm/outcome (mean ORM outcome term), rollout/verifier_success, and the
  ORM against the verifier at 0.5 (orm/accuracy, precision, recall, f1, false_positive_rate), plus
  orm/turns_dropped, orm/screenshots_dropped, orm/episodes_cut (the ORM's context budget), perf/orm_s.
  """
  t0 = time.perf_counter()
  p = scorer.p_yes(episodes)
  outcomes = []
  for ep, pi in zip(episodes, p):
    for t in ep.turns:
      t.reward = float(t.reward - reward_lib.outcome_term(t.env_reward, rewards))
    if ep.turns:
      new = rewards.outcome_weight * orm_outcome(float(pi), reward_range)
      ep.turns[-1].reward = float(ep.turns[-1].reward + new)
      outcomes.append(new)
  labels = np.array([e.success for e in episodes], bool)
  cm = classification_metrics(p, labels)
  m = {"orm/p_yes": float(np.mean(p)) if len(p) else 0.0, "orm/outcome": float(np.mean(outcomes)) if outcomes else 0.0,
       "rollout/verifier_success": float(labels.mean()) if len(labels) else 0.0}
  m.update({f"orm/{k}": float(cm[k]) for k in ("accuracy", "precision", "recall", "f1", "false_positive_rate")})
  d = scorer.dropped
  m.update({"orm/turns_dropped": d.get("turns", 0), "orm/screenshots_dropped": d.get("screenshots", 0),
            "orm/episodes_cut": d.get("episodes_cut", 0), "perf/orm_s": time.perf_counter() - t0})
  return m
