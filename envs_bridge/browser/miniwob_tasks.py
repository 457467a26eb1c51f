"""MiniWoB++ tasks from the `miniwob` wheel: discovery, seeding, instruction and reward globals.

Episode start follows miniwob's `selenium_instance.py` (`force_stop` + `begin_task`):
`core.endEpisode(0)` (a no-op unless an episode is running), `Math.seedrandom(seed)`,
`core.setDataMode(mode)`, `core.startEpisodeReal()`. The instruction is `core.getUtterance()`;
reward and done are the page's `WOB_REWARD_GLOBAL` (time-discounted for some tasks),
`WOB_RAW_REWARD_GLOBAL`, `WOB_DONE_GLOBAL`, `WOB_REWARD_REASON` (`get_metadata`).
"""

from __future__ import annotations

import functools
import os

import miniwob

HTML_DIR = os.path.join(os.path.dirname(miniwob.__file__), "html")
PREFIX = "miniwob/"
WIDTH, HEIGHT = 160, 210  # MiniWoB's #wrap at (0, 0): 50 px instruction bar over a 160 x 160 task area
DATA_MODES = ("train", "test")  # miniwob's default is "train"
EPISODE_MAX_MS = 10_000  # core.EPISODE_MAX_TIME: an untouched episode ends with reward -1 after this


@functools.lru_cache(maxsize=1)
def task_names() -> tuple[str, ...]:
  """All MiniWoB++ tasks shipped in the wheel, as 'miniwob/<name>', sorted."""
  d = os.path.join(HTML_DIR, "miniwob")
  return tuple(sorted(PREFIX + f[:-5] for f in os.listdir(d) if f.endswith(".html")))


def task_url(task: str) -> str:
  """file:// URL of a task page (its relative links resolve to the wheel's core/ and common/)."""
  return "file://" + os.path.join(HTML_DIR, "miniwob", task[len(PREFIX):] + ".html")


def start_script(seed: int, data_mode: str = "train") -> str:
  """JS that (re)starts an episode exactly as miniwob's `force_stop` + `begin_task` do."""
  if data_mode not in DATA_MODES:
    raise ValueError(f"data_mode {data_mode!r} not in {DATA_MODES}")
  # repr(int) as in miniwob's `set_seed` (a number seeds differently from the string "42").
  return (f"core.endEpisode(0); Math.seedrandom({int(seed)!r}); core.setDataMode({data_mode!r}); "
          "core.startEpisodeReal();")


# The page is wider than #wrap (MiniWoB's reward/timer panel sits to its right). The viewport shows
# #wrap only; locking the root's scrolling keeps wheel/keys from panning that panel (which shows
# rewards and episode counts) into the screenshot. Inner scrollable elements still scroll.
LOCK_VIEWPORT_CSS = "html { overflow: hidden !important; }"

# Leftovers of a previous episode on a reused page that the task's own reset does not clear.
CLEAN_SCRIPT = """() => {
  if (document.activeElement && document.activeElement !== document.body) document.activeElement.blur();
  window.scrollTo(0, 0);
}"""

STATE_SCRIPT = """() => ({done: WOB_DONE_GLOBAL, reward: WOB_REWARD_GLOBAL, raw_reward: WOB_RAW_REWARD_GLOBAL,
  reason: WOB_REWARD_REASON === null || WOB_REWARD_REASON === undefined ? null : String(WOB_REWARD_REASON)})"""
UTTERANCE_SCRIPT = "() => core.getUtterance()"
