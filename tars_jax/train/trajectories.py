"""Saving sampled episodes (screenshots + replies) so a person can look at what the agent did."""

from __future__ import annotations

import json
import os

from PIL import Image

from tars_jax.agent.trajectory import Episode


def save_episodes(directory: str, episodes: list[Episode]) -> None:
  """Writes `<dir>/ep_<k>/turn_<t>.png` (the screenshot the policy saw) and `episode.json`."""
  for k, ep in enumerate(episodes):
    d = os.path.join(directory, f"ep_{k}")
    os.makedirs(d, exist_ok=True)
    turns = []
    for t, turn in enumerate(ep.turns):
      png = f"turn_{t}.png"
      Image.fromarray(turn.image).save(os.path.join(d, png))
      turns.append({"screenshot": png, "reply": turn.text, "reward": turn.reward,
                    "env_reward": turn.env_reward, "done": turn.done, "error": turn.error,
                    "sum_logprob": float(turn.logprobs.sum()), "info": turn.info})
    with open(os.path.join(d, "episode.json"), "w") as f:
      json.dump({"task": ep.task, "seed": ep.seed, "instruction": ep.instruction,
                 "success": ep.success, "return": ep.env_return, "truncated": ep.truncated,
                 "policy_version": ep.policy_version, "turns": turns}, f, indent=2, default=str)
