r"""Vertical agents to merge (UI-TARS-2 report section 2.6; issue #26): one shared SFT checkpoint on the
demonstrations of three task sets, then one PPO run per vertical from it, then parameter interpolation
(`experiments/merge.py`) and the merge evaluation (`experiments/merge_eval.py`). `scripts/verticals.sh`
runs it all under `runs/<name>/`:

  python -m experiments.demos --config experiments/configs/verticals.py:sft --out R/demos
  python -m experiments.sft --config experiments/configs/verticals.py:sft --workdir R/sft \
      --config.policy.init=runs/main/sft --config.sft.data="('R/demos',)"
  python -m experiments.train --config experiments/configs/verticals.py:browsing --workdir R/browsing \
      --config.policy.init=R/sft                 # likewise :general -> R/general, :game -> R/game
  python -m experiments.merge_eval --config experiments/configs/verticals.py:all --workdir R

The task sets (`VERTICALS`):
  browsing  GUI-Browsing at this scale: `browse/find-page`, open a module's page from the chapter page of
            the Python docs that lists it (2-5 turns in a 240 x 320 viewport); the list's order drawn from
            the seed and data mode, held-out orders at evaluation (`env.eval_data_mode = 'test'`). The
            information-seeking families (`browse/multi-condition`, `browse/multi-hop`: answers read off
            640 x 480 pages, ~14 turns) scored 0.00 for this ~1.5M-parameter policy (RESULTS.md, "Vertical
            agents"); set `BROWSING` to them for a larger model
  general   GUI-General: the main job's 10 MiniWoB++ tasks, the 5 GUI-only desktop tasks and the 5 hybrid
            GUI + SDK tasks (report section 2.2: terminal, file and MCP calls beside clicks and typing on the
            same session's files; an Xvfb desktop server is launched beside the browser server; episodes go
            to the server of their task)
  game      Game: the 13 games of the game suite (normalised score as reward, experiments/configs/games.py)

Every vertical shares the model, grammar (the union of the sets' actions, the hybrid tasks' SDK functions
among them), system prompt and image
size of the main job's model (experiments/configs/miniwob_pipeline.py): merging needs one parameter
structure, and each vertical is evaluated on the other verticals' tasks. Every task has an expert whose
successful episodes are the SFT data: the MiniWoB++ tasks and the desktop and hybrid tasks (scripted experts
reading the page's DOM / the desktop's window tree: tars_jax/data/sources/experts.py, desktop_experts.py), the
games (reference players) and GUI-Browsing (the DOM-reading expert).

Args: "sft" (the shared SFT stage: demonstrations and evaluation over all three sets), "browsing",
"general", "game" (PPO of that vertical), "all" (evaluation over all three sets: the merge table);
"+smoke" appended = tiny model and budgets (tests).
"""

import ml_collections as mlc

from experiments.configs import miniwob_pipeline

BROWSING = ("browse/find-page",)
DESKTOP = ("desktop/terminal-write-file", "desktop/terminal-mkdir", "desktop/terminal-rename",
           "desktop/editor-type-save", "desktop/dialog-choose")
HYBRID = ("hybrid/dialog-sum-file", "hybrid/dialog-count-errors", "hybrid/dialog-code-to-file",
          "hybrid/docs-lookup-editor", "hybrid/browser-download-total")
GENERAL = (*miniwob_pipeline.DEMO_TASKS, *DESKTOP, *HYBRID)
GAMES = ("2048", "snake", "maze", "same-game", "merge", "shapes", "sokoban", "infinity-loop", "laser-maze",
         "lights-out", "emoji-sort", "free-the-key", "yarn-untangle")
GAME = tuple("games/" + g for g in GAMES)
VERTICALS = {"browsing": BROWSING, "general": GENERAL, "game": GAME}
ALL_TASKS = (*BROWSING, *GENERAL, *GAME)
# Smoke: one task of each set, the cheapest to play (a desktop task would start Xvfb sessions in tests
# that do not need them; tests/test_verticals.py launches the desktop server itself).
SMOKE_VERTICALS = {"browsing": ("browse/find-page",), "general": ("miniwob/click-test",),
                   "game": ("games/lights-out",)}
STAGES = ("sft", *VERTICALS, "all")
ARGS = (*STAGES, *(s + "+smoke" for s in STAGES))
# Steps per episode: the expert opens a find-page module in 3.4 turns on average (scrolls, the click,
# finished; RESULTS.md "find-page"), the multi-step MiniWoB++ tasks take up to 7, a game episode is cut at 8
# (games.py).
MAX_TURNS = {"browsing": 8, "general": 8, "game": 8}


def vertical_sets(sets: dict[str, tuple[str, ...]], max_turns: dict[str, int]) -> mlc.ConfigDict:
  """`config.verticals`: {vertical: {"tasks": its task set, "max_turns": the step budget every model plays
  it with}}. ml_collections keeps the verticals sorted by name: that is experiments/merge_eval.py's order
  (and the α order of its merges)."""
  return mlc.ConfigDict({v: {"tasks": tuple(ts), "max_turns": int(max_turns[v])} for v, ts in sets.items()})


def get_config(arg: str | None = None) -> mlc.ConfigDict:
  """Config of one stage; raises ValueError for an unknown arg."""
  stage, smoke = miniwob_pipeline.stage_arg(arg, STAGES)
  c = miniwob_pipeline.get_config("+smoke" if smoke else "")
  sets = SMOKE_VERTICALS if smoke else VERTICALS
  tasks = sets[stage] if stage in sets else tuple(t for ts in sets.values() for t in ts)
  c.tasks = tasks
  desktop = tuple(t for t in (*DESKTOP, *HYBRID) if t in tasks)  # played on the desktop server
  # The experiment's task sets and each one's step budget (experiments/merge_eval.py reads them)
  c.verticals = vertical_sets(sets, {v: 3 if smoke else MAX_TURNS[v] for v in sets})

  # --- One grammar for every vertical: clicks, typing, keys (scrolling pages, playing games), drags (the
  # games' reference players drag), the SDK functions the hybrid experts call, and answers as long as the
  # longest GUI-Browsing answer (70 bytes) ---
  c.grammar.actions = ("click", "drag", "type", "hotkey", "finished", "run_command", "write_file", "mcp_call")
  c.grammar.max_content_bytes = 72
  budget = MAX_TURNS[stage] if stage in MAX_TURNS else max(MAX_TURNS.values())
  c.env.max_turns = 3 if smoke else budget  # smoke: the policy's episodes only (its experts keep theirs)
  c.env.eval_data_mode = "test"  # held-out browse questions (MiniWoB++'s test mode; games and desktop ignore it)
  c.env.launch = ("browser", "desktop") if desktop else ("browser",)
  c.env.num_sessions = 4 if smoke else 16
  # One desktop session per concurrent episode: a lockstep batch may hold only desktop episodes, and the
  # server refuses those over its limit (ServerBusy): with 8 sessions every 16-episode batch of desktop
  # episodes lost 8 attempts and replayed them as a second round
  c.env.desktop_sessions = c.env.num_sessions
  c.rl.truncation_reward = 0.0  # games pay when they end; a cut episode pays nothing (games.py)
  c.length_multiple = 128

  # --- Demonstrations of every set's experts (the "sft" stage collects them; the desktop ones through
  # the desktop server's debug state, in the same clicks / typing / keys as the policy) ---------------
  c.data.demo_tasks = tasks
  c.data.demo_seeds = 2 if smoke else 16
  c.data.demo_seeds_rl_tasks = 2 if smoke else 16
  # Browsing: 3 list orders a module. Desktop and hybrid: 128 each; with 16 the GUI-General SFT typed the wrong
  # word in held-out desktop episodes (0.01-0.03 success), with 128 it copies it 42-68 % of the time
  # (benchmarks/RESULTS.md, "The GUI-General vertical with 128 demonstrations per desktop task")
  c.data.demo_seeds_by_task = () if smoke else (*((t, 330) for t in BROWSING if t in tasks),
                                                *((t, 128) for t in desktop))
  c.data.demo_max_turns = budget

  # --- The shared SFT stage: continues the main job's SFT policy on all three sets -------------------
  # 2400 updates with the desktop tasks' 640 demonstrations (the measured GUI-General run), 1200 without
  c.sft.steps = 4 if smoke else (2400 if desktop else 1200)
  c.sft.batch_size = 4  # episodes of up to 14 turns (14 screenshots each): 16 of them took 19 GB
  c.sft.decay_steps = 0
  c.sft.max_minutes = 30.0 if smoke else 60.0  # guard only (tars_jax/train/guard.py): the budget is the count above
  c.sft.lr = 1e-3
  c.sft.eval_every = 0  # measured by experiments/merge_eval.py
  c.sft.heldout = ()

  # --- PPO of one vertical from the shared SFT checkpoint --------------------------------------------
  c.iterations = 2 if smoke else 3  # ~1.5 min per iteration of long browsing episodes
  c.max_minutes = 30.0 if smoke else 60.0  # guard only (tars_jax/train/guard.py): the budget is the count above
  c.rl.minibatch_size = 4  # long episodes, as in SFT
  c.eval_every = 0  # measured by experiments/merge_eval.py
  return c
