"""Reward shaping: outcome reward plus format and step-budget terms (UI-TARS-2 report section 2.5.4).

Each term is returned separately so the trainer can log it; the per-turn reward credited to the
reply's EOS token is their sum.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """Weights of the shaping terms.

  outcome_weight: multiplies the environment's reward (MiniWoB: raw page reward, -1..1).
  format_penalty: added (typically negative) when a reply does not parse as an action.
  truncation_reward: added on the last turn of an episode cut by the step budget (max_turns),
    -1 mirrors MiniWoB's own time-out reward.
  """

  outcome_weight: float = 1.0
  format_penalty: float = -0.1
  truncation_reward: float = -1.0


def turn_reward_terms(env_reward: float, invalid: bool, truncated: bool,
                      cfg: RewardConfig) -> dict[str, float]:
  """Shaping terms of one turn, in reward units.

  Args:
    env_reward: reward the sandbox reported for this step (0 unless the episode ended).
    invalid: the reply failed to parse (`ActionParseError`).
    truncated: this is the last turn of an episode cut by the step budget.
  Returns:
    {"outcome", "format", "truncation", "total"} floats.
  """
  terms = {
      "outcome": cfg.outcome_weight * float(env_reward),
      "format": cfg.format_penalty if invalid else 0.0,
      "truncation": cfg.truncation_reward if truncated else 0.0,
  }
  terms["total"] = sum(terms.values())
  return terms
