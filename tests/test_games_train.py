"""Games as training tasks (issue #5 item 7): experiments/configs/games.py trains end to end with the
real trainer, sandbox server and Chromium, and experiments/eval.py reports per-game normalised scores
that a replay of the evaluated episodes on a fresh page reproduces (score read from the page).
"""

import asyncio
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tars_jax.analysis import game_scores as eval_lib
from experiments.configs import games as games_cfg
from tars_jax.agent.trajectory import Episode, Turn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE_JSON = os.path.join(ROOT, "envs_bridge", "games", "reference_scores.json")


def _reference(game: str) -> float:
  with open(REFERENCE_JSON) as f:  # read here, not through catalog: an independent path to the numbers
    return float(json.load(f)["scores"][game])


def _episode(task, seed, scores, done=False, lost=False):
  turns = [Turn(image=np.zeros((1, 1, 3), np.uint8), obs_ids=[], reply_ids=[], logprobs=np.zeros(0),
                states=np.zeros(0, np.int32), text=f"a{i}", done=done and i == len(scores) - 1,
                info={"score": s}) for i, s in enumerate(scores)]
  return Episode(task=task, seed=seed, instruction="", prefix_ids=[], turns=turns, lost=lost)


def test_game_scores_hand_worked():
  # same-game: final scores 4, 0, 2 (the earlier steps' scores do not count); the lost one is dropped.
  eps = [_episode("games/same-game", 1, [0, 4]), _episode("games/same-game", 2, [0]),
         _episode("games/same-game", 3, [1, 2], done=True), _episode("games/same-game", 4, [9], lost=True),
         _episode("games/shapes", 1, [1]), _episode("miniwob/click-test", 1, [0])]
  out = eval_lib.game_scores(eps)
  assert sorted(out) == ["games/same-game", "games/shapes"]
  ref = _reference("same-game")
  assert out["games/same-game"]["episodes"] == 3 and out["games/same-game"]["mean_score"] == 2.0
  assert out["games/same-game"]["normalized_score"] == pytest.approx(100 * 2.0 / ref)
  assert out["games/shapes"]["normalized_score"] == pytest.approx(100 * 1 / _reference("shapes"))
  recs = eval_lib.game_episode_records(eps)
  assert [(r["seed"], r["score"], r["done"], r["actions"]) for r in recs[:3]] == [
      (1, 4.0, False, ["a0", "a1"]), (2, 0.0, False, ["a0"]), (3, 2.0, True, ["a0", "a1"])]


def test_games_config_args():
  c = games_cfg.get_config()
  assert c.tasks == ("games/2048", "games/same-game", "games/shapes") and c.rl.algo == "ppo"
  assert set(c.grammar.actions) == {"click", "hotkey", "finished"} and c.rl.truncation_reward == 0.0
  s = games_cfg.get_config("smoke")
  assert s.iterations == 1 and s.tasks == ("games/same-game", "games/shapes") and s.model.layers == 2
  assert games_cfg.get_config("snake,maze+smoke").tasks == ("games/snake", "games/maze")
  with pytest.raises(ValueError, match="unknown games"):
    games_cfg.get_config("tetris")
  with pytest.raises(ValueError, match="unknown config arg"):
    games_cfg.get_config("2048+big")


def _run(*args):
  env = dict(os.environ, PYTHONPATH=ROOT)
  return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=1800)  # generous: a loaded 2-core CI box


async def _replay_scores(records, step_ms):
  """Replays each evaluated episode's replies on a fresh in-process sandbox; the page's own score."""
  from envs_bridge.browser.sessions import BrowserSandbox
  sb = BrowserSandbox(step_ms=step_ms, lease_s=600)
  await sb.start()
  try:
    out = []
    for r in records:
      sid, _ = await sb.open(r["task"], r["seed"])
      for a in r["actions"]:
        await sb.step(sid, a)
      out.append((await sb.sessions[sid].page.evaluate("() => window.GAME.record()"))["score"])
      await sb.close(sid)
    return out
  finally:
    await sb.stop()


@pytest.mark.long
@pytest.mark.browser
def test_games_smoke_trains_and_eval_reports_normalised_scores(tmp_path):
  run, out = tmp_path / "run", tmp_path / "eval.json"
  p = _run("experiments.train", "--config", os.path.join(ROOT, "experiments/configs/games.py:smoke"),
           "--workdir", str(run))
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  rows = [json.loads(l) for l in open(run / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1] and "success/games/same-game" in rows[0]
  assert sorted(os.listdir(run / "checkpoints")) == ["1"]

  p = _run("experiments.eval", "--run", str(run), "--episodes", "2", "--json", str(out))
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  res = json.load(open(out))
  assert sorted(res["games"]) == ["games/same-game", "games/shapes"] and "normalized" in p.stdout
  records = res["game_episodes"]
  assert sorted((r["task"], r["seed"]) for r in records) == [
      (t, 10_000_000 + k) for t in ("games/same-game", "games/shapes") for k in range(2)]
  page = asyncio.run(_replay_scores(records, step_ms=1000))
  assert [r["score"] for r in records] == page  # eval's scores are the page's (deterministic replay)
  for task in ("games/same-game", "games/shapes"):
    mine = [s for r, s in zip(records, page) if r["task"] == task]
    expect = 100 * float(np.mean(mine)) / _reference(task.split("/")[1])
    assert res["games"][task]["normalized_score"] == pytest.approx(expect)
    assert res["results"][task]["normalized_score"] == pytest.approx(expect)

  # the untrained baseline: checkpoint 0 (none saved) = the run's random init, same held-out seeds
  base = tmp_path / "eval0.json"
  p = _run("experiments.eval", "--run", str(run), "--episodes", "2", "--checkpoint", "0", "--json", str(base))
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  res0 = json.load(open(base))
  assert res0["checkpoint"] == 0 and "checkpoint 0 of" in p.stdout
  assert sorted((r["task"], r["seed"]) for r in res0["game_episodes"]) == sorted(
      (r["task"], r["seed"]) for r in records)
