"""MiniWoB++ tasks from the `miniwob` wheel: discovery, seeding, instruction and reward globals.

Seeding follows miniwob's `selenium_instance.py`: `Math.seedrandom(seed)` then
`core.startEpisodeReal()`. The instruction is `core.getUtterance()`; reward and done are the page's
`WOB_REWARD_GLOBAL` (time-discounted), `WOB_RAW_REWARD_GLOBAL`, `WOB_DONE_GLOBAL`, `WOB_REWARD_REASON`.
"""

from __future__ import annotations

import functools
import os

import miniwob

HTML_DIR = os.path.join(os.path.dirname(miniwob.__file__), "html")
PREFIX = "miniwob/"
WIDTH, HEIGHT = 160, 210  # MiniWoB's #wrap: 50 px instruction bar over a 160 x 160 task area


@functools.lru_cache(maxsize=1)
def task_names() -> tuple[str, ...]:
  """All MiniWoB++ tasks shipped in the wheel, as 'miniwob/<name>'."""
  d = os.path.join(HTML_DIR, "miniwob")
  return tuple(sorted(PREFIX + f[:-5] for f in os.listdir(d) if f.endswith(".html")))


def task_url(task: str) -> str:
  return "file://" + os.path.join(HTML_DIR, "miniwob", task[len(PREFIX):] + ".html")


def start_script(seed: int) -> str:
  # repr(int) as in miniwob's `set_seed` (a number seeds differently from the string "42").
  return f"Math.seedrandom({int(seed)!r}); core.startEpisodeReal();"


STATE_SCRIPT = """() => ({done: WOB_DONE_GLOBAL, reward: WOB_REWARD_GLOBAL, raw_reward: WOB_RAW_REWARD_GLOBAL,
  reason: WOB_REWARD_REASON === null ? null : String(WOB_REWARD_REASON)})"""
UTTERANCE_SCRIPT = "() => core.getUtterance()"
