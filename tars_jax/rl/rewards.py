"""Reward shaping: outcome reward plus format, overlong-thought and step-budget terms.

UI-TARS-2 report section 2.5.4 ("Reward Shaping": outcome-based reward, format rewards and length
penalties) and section 4 (interaction scaling: "incorporating step budgets into the reward design").
Each term is returned separately so the trainer can log it; the per-turn reward credited to the
reply's EOS token is their sum. Plain Python on host values (rollout side), no JAX.
"""

from __future__ import annotations

import dataclasses
import math

from tars_jax.agent.grammar import DELIMITER

TERMS = ("outcome", "format", "overlong", "step", "truncation")
OUTCOMES = ("raw", "success")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """Weights of the shaping terms (the defaults reproduce outcome + format + truncation only).

  outcome: "raw" = the environment's reward (MiniWoB: raw page reward, -1..1, time-discounted;
    a wrong click or a time-out scores -1, below an episode the agent ends itself with `finished`,
    0); "success" = 1 on a step whose reward is positive, else 0 (MiniWoB rewards only the last
    step, so the episode scores 1 exactly when `Episode.success`, and giving up scores as any
    other failure). Either is multiplied by outcome_weight.
  outcome_weight: multiplies the outcome.
  format_penalty: added (typically negative) when a reply does not parse as an action.
  truncation_reward: added on the last turn of an episode cut by the step budget (max_turns),
    -1 mirrors MiniWoB's own time-out reward.
  step_penalty: added on every turn (typically a small negative cost per step, so that of two
    successful episodes the shorter one scores higher).
  overlong_weight, overlong_max_tokens, overlong_buffer: DAPO's soft overlong punishment on the
    thought of each reply (`overlong_penalty`), times `overlong_weight`; off while the weight or
    `overlong_max_tokens` is 0.
  Raises: ValueError for a buffer outside [0, overlong_max_tokens] or a non-finite weight.
  """

  outcome: str = "raw"
  outcome_weight: float = 1.0
  format_penalty: float = -0.1
  truncation_reward: float = -1.0
  step_penalty: float = 0.0
  overlong_weight: float = 0.0
  overlong_max_tokens: int = 0
  overlong_buffer: int = 0

  def __post_init__(self):
    if self.outcome not in OUTCOMES:
      raise ValueError(f"RewardConfig.outcome {self.outcome!r}; expected one of {OUTCOMES}")
    for f in dataclasses.fields(self):
      if f.name == "outcome":
        continue
      v = getattr(self, f.name)
      if not math.isfinite(float(v)):
        raise ValueError(f"RewardConfig.{f.name} must be finite, got {v}")
    if self.overlong_max_tokens < 0 or not 0 <= self.overlong_buffer <= self.overlong_max_tokens:
      raise ValueError(f"need 0 <= overlong_buffer ({self.overlong_buffer}) <= overlong_max_tokens "
                       f"({self.overlong_max_tokens})")


def overlong_penalty(length: int, max_tokens: int, buffer: int) -> float:
  """DAPO soft overlong punishment (arXiv 2503.14476, eq. 13) in [-1, 0].

  With L_max = max_tokens and L_cache = buffer:
    0                                  if length <= L_max - L_cache
    ((L_max - L_cache) - length) / L_cache   if L_max - L_cache < length <= L_max (linear ramp)
    -1                                 if length > L_max
  max_tokens = 0 disables it (returns 0). buffer = 0 is a hard cut at L_max.
  """
  if max_tokens <= 0:
    return 0.0
  free = max_tokens - buffer
  if length <= free:
    return 0.0
  if length > max_tokens:
    return -1.0
  return (free - length) / buffer


def thought_of(reply: str) -> str:
  """The thought of a `Thought: … \\nAction: …` reply: text before the `Action:` delimiter with the
  `Thought:` prefix and surrounding whitespace removed (the whole reply if there is no delimiter)."""
  head = reply.split(DELIMITER, 1)[0]
  head = head.strip()
  return head[len("Thought:"):].strip() if head.startswith("Thought:") else head


def outcome_term(env_reward: float, cfg: RewardConfig) -> float:
  """The outcome term of a step with environment reward `env_reward` (`RewardConfig.outcome`)."""
  return cfg.outcome_weight * (float(env_reward) if cfg.outcome == "raw" else float(env_reward > 0))


def turn_reward_terms(env_reward: float, invalid: bool, truncated: bool, cfg: RewardConfig,
                      thought_tokens: int = 0) -> dict[str, float]:
  """Shaping terms of one turn, in reward units.

  Args:
    env_reward: reward the sandbox reported for this step (0 unless the episode ended).
    invalid: the reply failed to parse (`ActionParseError`).
    truncated: this is the last turn of an episode cut by the step budget.
    thought_tokens: tokens of the reply's thought (`thought_of`), for the overlong term.
  Returns:
    {"outcome", "format", "overlong", "step", "truncation", "total"} floats.
  Raises: ValueError for a non-finite env_reward (a broken verifier must not train silently).
  """
  if not math.isfinite(float(env_reward)):
    raise ValueError(f"environment reward is not finite: {env_reward}")
  terms = {
      "outcome": outcome_term(env_reward, cfg),
      "format": cfg.format_penalty if invalid else 0.0,
      "overlong": cfg.overlong_weight * overlong_penalty(thought_tokens, cfg.overlong_max_tokens,
                                                         cfg.overlong_buffer),
      "step": cfg.step_penalty,
      "truncation": cfg.truncation_reward if truncated else 0.0,
  }
  terms["total"] = sum(terms.values())
  return terms
