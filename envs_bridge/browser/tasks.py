"""Task registry: what the sandbox needs to run a task page, for MiniWoB++ tasks and the games.

`get(task)` -> TaskSpec (url, viewport, start/state/instruction/clean scripts, extra info fields);
sessions.py goes through it instead of talking to `miniwob_tasks` directly, so 'miniwob/<name>' and
'games/<name>' (envs_bridge/games) are served by the same session code.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from envs_bridge import protocol as P
from envs_bridge.browser import miniwob_tasks as mw
from envs_bridge.games import catalog

GAME_INFO_KEYS = P.GAME_INFO_KEYS  # optional Observation.info fields of game tasks


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """How to run one task page.

  url: file:// URL; width, height: viewport px; css: style added after load (None: nothing);
  clean_script / state_script / utterance_script: JS functions for page.evaluate; the state script
  returns at least {done, reward, raw_reward, reason}; info_keys: state fields copied into
  Observation.info (score/level/lives for games); snapshot_script () -> str and restore_script
  (str) -> void save/load the page's episode state (games; None for MiniWoB, whose tasks keep
  state in the DOM and closures).
  """

  name: str
  kind: str  # "miniwob" | "game"
  url: str
  width: int
  height: int
  css: str | None
  clean_script: str
  state_script: str
  utterance_script: str
  _start: Callable[[int, str], str]
  info_keys: tuple[str, ...] = ()
  snapshot_script: str | None = None
  restore_script: str | None = None

  def start_script(self, seed: int, data_mode: str = "train") -> str:
    """JS that (re)starts an episode with `seed`. Raises ValueError for an unknown data_mode."""
    if data_mode not in mw.DATA_MODES:
      raise ValueError(f"data_mode {data_mode!r} not in {mw.DATA_MODES}")
    return self._start(seed, data_mode)

  def info(self, state: dict) -> dict:
    """Extra Observation.info fields from a state-script result."""
    return {k: state[k] for k in self.info_keys}


@functools.lru_cache(maxsize=1)
def task_names() -> tuple[str, ...]:
  """Every task the sandbox serves (MiniWoB++ tasks and games), sorted."""
  return tuple(sorted(mw.task_names() + catalog.task_names()))


@functools.lru_cache(maxsize=None)
def _spec(task: str) -> TaskSpec:
  if task.startswith(catalog.PREFIX):
    g = catalog.game_name(task)
    return TaskSpec(task, "game", catalog.page_url(g), catalog.WIDTH, catalog.HEIGHT, None, catalog.CLEAN_SCRIPT,
                    catalog.state_script(g), catalog.INSTRUCTION_SCRIPT,
                    lambda seed, data_mode: catalog.start_script(seed), GAME_INFO_KEYS,
                    catalog.SNAPSHOT_SCRIPT, catalog.RESTORE_SCRIPT)
  return TaskSpec(task, "miniwob", mw.task_url(task), mw.WIDTH, mw.HEIGHT, mw.LOCK_VIEWPORT_CSS, mw.CLEAN_SCRIPT,
                  mw.STATE_SCRIPT, mw.UTTERANCE_SCRIPT, mw.start_script)


def get(task: str) -> TaskSpec:
  """TaskSpec of `task`. Raises: UnknownTask (with the task list) for names not served; TaskError
  if a published game's npm package is missing (scripts/setup.sh installs it)."""
  if task not in task_names():
    raise P.UnknownTask(f"unknown task {task!r}", tasks=list(task_names()))
  try:
    return _spec(task)
  except catalog.GameNotInstalled as e:
    raise P.TaskError(str(e)) from e
