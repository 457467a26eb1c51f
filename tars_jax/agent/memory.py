"""Hierarchical memory of the agent: working memory (recent turns in full) and episodic memory
(short summaries of earlier episodes of the same task), and the context builder that fits a turn's
prompt into a token budget. UI-TARS-2 report section 2.1 ("working memory ... recent steps in full;
episodic memory ... compressed summaries of past episodes"); UI-TARS keeps the last 5 screenshots
(`bytedance/UI-TARS`, `history_n = 5`).

Layout of one turn's prompt (token ids of `agent/prompts.py`; `*…*` = model-written):

  BOS <system>\\n [Memory:\\n- <summary>\\n ...] <instruction>\\n          prefix (episodic summaries)
  [TURN_END] TURN_START [<obs text>\\n] *<reply>* *EOS*                 older turn: text only
  TURN_END TURN_START [<obs text>\\n] VISION_START IMAGE*n VISION_END *<reply>* *EOS*   recent turn
  TURN_END TURN_START [<obs text>\\n] VISION_START IMAGE*n VISION_END    this turn's observation

- Working memory: the prompt holds `working_turns` = K screenshots, this turn's included (the last
  K-1 past turns keep theirs); older turns keep their observation text and reply (thought and
  action) with the `VISION_START IMAGE*n VISION_END` block removed. K = 0: every screenshot.
- Budget: the prompt never exceeds `max_context_tokens - reserve_tokens` tokens (0 = no budget). Over
  it, the builder leaves out, one at a time until it fits: the oldest text-only turn; else the
  screenshot of the oldest past turn that still has one (it becomes text-only); else the oldest
  episodic summary. The turn's own screenshot and observation and the base prefix are never left
  out: if they alone exceed the budget, `ContextBudgetError` names the lengths. What was left out is
  recorded in the turn's `trajectory.Context`.
- Episodic memory: `EpisodicMemory` keeps, per task, the summaries of its latest finished episodes
  (a template: task, actions, outcome; or written by the policy from a summary prompt through the
  act function), at most `episodic_episodes` and `episodic_max_tokens` tokens of them; an episode
  opened later gets them in its prefix.
- Off (the default `MemoryConfig()`): the prompt is the full history, `ep.token_ids() + obs_ids`
  with every screenshot, and nothing is recorded: exactly the layout without this module.

Training on exactly these prompts: see `agent/trajectory.py` (`Turn.context`, `episode_rows`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Sequence

import numpy as np

from tars_jax.agent import prompts
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.agent.trajectory import Context, Episode
from tars_jax.agent.grammar import DELIMITER
from tars_jax.rl.rewards import thought_of

EPISODIC_MODES = ("off", "template", "policy")
SUMMARY_PROMPT = "Summarize this episode in one line: what you did and whether it worked."


class ContextBudgetError(ValueError):
  """The parts of a prompt that are never left out (base prefix, this turn's observation and
  screenshot) do not fit `max_context_tokens - reserve_tokens`."""

  def __init__(self, needed: int, budget: int):
    self.needed, self.budget = needed, budget
    super().__init__(f"the prefix and this turn's observation need {needed} tokens, more than the context "
                     f"budget of {budget} (max_context_tokens - reserve_tokens)")


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
  """Memory settings (config section `memory`, built by `train.state.build`). Defaults: all off.

  working_turns: K, screenshots kept in a prompt, this turn's included (UI-TARS: 5); 0 = all.
  max_context_tokens: bound on prompt tokens + `reserve_tokens`; 0 = no bound.
  reserve_tokens: tokens kept free for the reply inside `max_context_tokens` (e.g. the grammar's
    longest reply), so a training row (prompt + reply) stays within `max_context_tokens` too.
  episodic: "off" | "template" (summary from the episode's record) | "policy" (written by the policy
    from `SUMMARY_PROMPT`, the template when its reply has no text).
  episodic_episodes: summaries kept per task (the latest ones).
  episodic_max_tokens: bound on the summaries fed into one prefix (the latest that fit).
  summary_max_tokens: bound on one summary (cut at a UTF-8 character boundary).
  Raises: ValueError for negative sizes or an unknown episodic mode.
  """

  working_turns: int = 0
  max_context_tokens: int = 0
  reserve_tokens: int = 0
  episodic: str = "off"
  episodic_episodes: int = 3
  episodic_max_tokens: int = 128
  summary_max_tokens: int = 48

  def __post_init__(self):
    if self.episodic not in EPISODIC_MODES:
      raise ValueError(f"unknown memory.episodic {self.episodic!r}; expected one of {EPISODIC_MODES}")
    for name in ("working_turns", "max_context_tokens", "reserve_tokens", "episodic_episodes",
                 "episodic_max_tokens", "summary_max_tokens"):
      if getattr(self, name) < 0:
        raise ValueError(f"memory.{name} must be >= 0, got {getattr(self, name)}")
    if self.max_context_tokens and self.reserve_tokens >= self.max_context_tokens:
      raise ValueError(f"memory.reserve_tokens ({self.reserve_tokens}) must be < max_context_tokens "
                       f"({self.max_context_tokens})")

  @property
  def enabled(self) -> bool:
    """True when prompts may differ from the full history (then each turn records its Context)."""
    return self.working_turns > 0 or self.max_context_tokens > 0 or self.episodic != "off"


def strip_vision(ids: Sequence[int], tok: ByteTokenizer) -> list[int]:
  """`ids` without their `VISION_START ... VISION_END` blocks (the text-only form of an observation)."""
  out, inside = [], False
  for i in ids:
    if i == tok.vision_start_id:
      inside = True
    elif i == tok.vision_end_id and inside:
      inside = False
    elif not inside:
      out.append(int(i))
  return out


def turns_length(mode: list[str], full_len: list[int], text_len: list[int]) -> int:
  """Tokens of the turns in a context: turn j costs full_len[j] shown "full", text_len[j] as "text",
  nothing "dropped"."""
  return sum(full_len[j] if m == "full" else text_len[j] if m == "text" else 0 for j, m in enumerate(mode))


def shrink_oldest(mode: list[str]) -> bool:
  """One step of leaving history out of a context, in place: the oldest text-only turn is dropped, else
  the oldest turn with a screenshot becomes text-only. Returns False when every turn is dropped already
  (the caller then cuts something else or gives up). mode: per turn, "full" | "text" | "dropped"."""
  for old, new in (("text", "dropped"), ("full", "text")):
    if old in mode:
      mode[mode.index(old)] = new
      return True
  return False


def build_context(ep: Episode, obs_ids: Sequence[int], image: np.ndarray, *, cfg: MemoryConfig,
                  tok: ByteTokenizer, system: str) -> tuple[list[int], list[np.ndarray], Context]:
  """The prompt of the next reply of `ep` (module docstring): (ids, screenshots in IMAGE-block order,
  the `Context` that records it).

  ep: the episode so far (its turns, `prefix_ids`, `instruction`, `memory`); obs_ids: this turn's
  observation ids (`rollout.episode.observation_ids`); image: this turn's screenshot [H, W, 3]
  uint8; system: the system prompt the prefix was built with. With `cfg.enabled` False the result is
  `ep.token_ids() + obs_ids` and every screenshot.
  Raises: ContextBudgetError when the parts never left out exceed the budget.
  """
  n = len(ep.turns)
  if not cfg.enabled:  # the full history, as without memory
    ids = ep.token_ids() + list(obs_ids)
    return ids, [t.image for t in ep.turns] + [image], Context(ids=np.asarray(ids, np.int32),
                                                               image_turns=tuple(range(n + 1)))
  k = cfg.working_turns
  first_full = 0 if k == 0 else max(0, n - (k - 1))
  mode = ["text" if j < first_full else "full" for j in range(n)]  # "full" | "text" | "dropped"
  full_len = [len(t.obs_ids) + len(t.reply_ids) for t in ep.turns]
  text_len = [len(strip_vision(t.obs_ids, tok)) + len(t.reply_ids) for t in ep.turns]
  n_mem = len(ep.memory)
  mem_drop = 0

  def prefix_ids() -> list[int]:
    return prompts.encode_episode_prefix(tok, ep.instruction, system, memory=ep.memory[mem_drop:])

  def length() -> int:
    return len(prefix_ids()) + turns_length(mode, full_len, text_len) + len(obs_ids)

  budget = cfg.max_context_tokens - cfg.reserve_tokens if cfg.max_context_tokens else None
  while budget is not None and length() > budget:
    if shrink_oldest(mode):
      continue
    if mem_drop < n_mem:
      mem_drop += 1
    else:
      raise ContextBudgetError(length(), budget)
  ids = prefix_ids()
  images, image_turns = [], []
  for j, (t, m) in enumerate(zip(ep.turns, mode)):
    if m == "full":
      ids += list(t.obs_ids) + list(t.reply_ids)
      images.append(t.image)
      image_turns.append(j)
    elif m == "text":
      ids += strip_vision(t.obs_ids, tok) + list(t.reply_ids)
  ids += list(obs_ids)
  images.append(image)
  image_turns.append(n)
  ctx = Context(ids=np.asarray(ids, np.int32), image_turns=tuple(image_turns),
                text_turns=tuple(j for j, m in enumerate(mode) if m == "text"),
                dropped_turns=tuple(j for j, m in enumerate(mode) if m == "dropped"), dropped_memory=mem_drop)
  return ids, images, ctx


# --- Episodic memory -----------------------------------------------------------------------------


def clip_tokens(text: str, max_tokens: int, tok: ByteTokenizer) -> str:
  """`text` cut to at most `max_tokens` byte tokens at a UTF-8 character boundary, one line."""
  text = " ".join(text.split())
  data = text.encode("utf-8")[:max_tokens]
  return data.decode("utf-8", errors="ignore")


def _action_of(reply: str) -> str:
  return reply.split(DELIMITER, 1)[1].strip() if DELIMITER in reply else reply.strip()


def template_summary(ep: Episode, max_tokens: int, tok: ByteTokenizer) -> str:
  """`<instruction> | <action>; <action>; ... | success|failure, return <r>` of a finished episode
  (an invalid action is shown as `invalid`), cut to `max_tokens` tokens (`clip_tokens`)."""
  acts = "; ".join("invalid" if t.error else _action_of(t.text) for t in ep.turns) or "none"
  outcome = "success" if ep.success else ("truncated" if ep.truncated else "failure")
  return clip_tokens(f"{ep.instruction} | {acts} | {outcome}, return {ep.env_return:.2f}", max_tokens, tok)


def summary_prompt(ep: Episode, tok: ByteTokenizer, system: str) -> list[int]:
  """Prompt ids asking the policy to summarise `ep`: its prefix (without episodic summaries), every
  turn as text only, then `TURN_END TURN_START <SUMMARY_PROMPT>\\n` (no screenshot)."""
  ids = prompts.encode_episode_prefix(tok, ep.instruction, system)
  for t in ep.turns:
    ids += strip_vision(t.obs_ids, tok) + list(t.reply_ids)
  return ids + [tok.turn_end_id, tok.turn_start_id] + tok.encode(SUMMARY_PROMPT + "\n")


class EpisodicMemory:
  """Per-task store of short summaries of earlier episodes (report section 2.1, episodic memory).

  `summaries(task)` gives the latest summaries of `task` that fit `cfg.episodic_max_tokens`, oldest
  first (what `episode_prefix` puts in a new episode's prefix); `add(task, summary)` keeps the last
  `cfg.episodic_episodes`. Keyed by task name (episodes of other seeds of the task included).
  """

  def __init__(self, cfg: MemoryConfig, tok: ByteTokenizer):
    self.cfg, self.tok = cfg, tok
    self._store: dict[str, collections.deque] = {}

  def add(self, task: str, summary: str) -> None:
    summary = clip_tokens(summary, self.cfg.summary_max_tokens, self.tok)
    if summary and self.cfg.episodic_episodes:
      self._store.setdefault(task, collections.deque(maxlen=self.cfg.episodic_episodes)).append(summary)

  def summaries(self, task: str) -> list[str]:
    kept, used = [], 0
    for s in reversed(self._store.get(task, ())):
      cost = len(prompts.memory_line(s))
      if used + cost > self.cfg.episodic_max_tokens:
        break
      kept.append(s)
      used += cost
    return kept[::-1]

  def to_json(self) -> dict[str, list[str]]:
    return {k: list(v) for k, v in self._store.items()}


# act(prompts, images) -> [(reply ids incl. EOS, logprobs, states)]: `rollout.agent_loop.ActFn`.
ActFn = Callable[[list[list[int]], list[list[np.ndarray]]], list[tuple[list[int], np.ndarray, np.ndarray]]]


def remember(store: EpisodicMemory, episodes: Sequence[Episode], *, tok: ByteTokenizer, system: str,
             act: ActFn | None = None) -> list[str]:
  """Writes one summary per episode of `episodes` that was not lost into `store` (in order) and
  returns them: the template (`template_summary`) or, with `store.cfg.episodic == "policy"`, the
  thought (else the whole text) of the policy's reply to `summary_prompt`, one batched `act` call
  (its log-probs are not trained on); an empty reply falls back to the template.
  Raises: ValueError for the "policy" mode without `act`.
  """
  eps = [e for e in episodes if not e.lost]
  cfg = store.cfg
  if cfg.episodic == "off" or not eps:
    return []
  texts = [template_summary(e, cfg.summary_max_tokens, tok) for e in eps]
  if cfg.episodic == "policy":
    if act is None:
      raise ValueError("memory.episodic='policy' needs the act function")
    replies = act([summary_prompt(e, tok, system) for e in eps], [[] for _ in eps])
    for i, (ids, _, _) in enumerate(replies):
      text = tok.decode(ids)
      text = clip_tokens(thought_of(text) or text, cfg.summary_max_tokens, tok)
      texts[i] = text or texts[i]
  for e, s in zip(eps, texts):
    store.add(e.task, s)
  return texts
