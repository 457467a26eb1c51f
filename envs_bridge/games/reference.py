"""Scripted reference players: one policy per game, acting only through the action grammar.

A policy maps the game's privileged state (GAME.debugState(), a JSON dict) to ONE action string
(`click(start_box='(x,y)')`, `drag(start_box=..., end_box=...)`, `hotkey(key='up')`) on the 0-1000
grid of the 160 x 210 page. Policies are stateless (recomputed from the state every step), so they
also play from restored snapshots. The reference score of a game is its player's mean score over
seeds 0..4 (`python -m envs_bridge.games.reference --write` -> reference_scores.json); an agent's
normalised score is 100 x score / reference score (report section 2.2 normalises to human play).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import time
from typing import Callable

from envs_bridge.games import catalog

W, H, BAR = catalog.WIDTH, catalog.HEIGHT, catalog.BAR
REFERENCE_SEEDS = (0, 1, 2, 3, 4)
KEYS = {(-1, 0): "up", (1, 0): "down", (0, -1): "left", (0, 1): "right"}


# -- action text --------------------------------------------------------------------------------
def _g(x: float, y: float) -> str:
  """Page point -> "'(gx,gy)'" on the 0-1000 grid, aimed at the centre of pixel (floor x, floor y):
  Chromium hands pages integer (truncated) mouse coordinates, and one grid unit is 0.16 / 0.21 px."""
  return f"'({round((int(x) + 0.5) / W * 1000)},{round((int(y) + 0.5) / H * 1000)})'"


def click(x: float, y: float) -> str:
  """Click at canvas point (x, y) (y measured from the top of the 160 x 160 area)."""
  return f"click(start_box={_g(x, y + BAR)})"


def drag(x0: float, y0: float, x1: float, y1: float) -> str:
  """Drag between canvas points."""
  return f"drag(start_box={_g(x0, y0 + BAR)}, end_box={_g(x1, y1 + BAR)})"


def key(k: str) -> str:
  return f"hotkey(key='{k}')"


def centre(n: int, r: int, c: int) -> tuple[float, float]:
  """Canvas point at the centre of cell (r, c) of an n x n board."""
  s = 160 / n
  return c * s + s / 2, r * s + s / 2


def click_cell(n: int, r: int, c: int) -> str:
  return click(*centre(n, r, c))


def _bfs(start, neighbours, is_goal):
  """Shortest path start -> goal as the list of move labels; None if unreachable."""
  prev = {start: None}
  q = collections.deque([start])
  while q:
    s = q.popleft()
    if is_goal(s):
      path = []
      while prev[s] is not None:
        s, m = prev[s]
        path.append(m)
      return path[::-1]
    for m, t in neighbours(s):
      if t not in prev:
        prev[t] = (s, m)
        q.append(t)
  return None


# -- 2048 ----------------------------------------------------------------------------------------
def slide_row(row: list[int]) -> tuple[list[int], int]:
  """2048 rule for one row moved towards index 0: tiles slide, equal neighbours merge once.
  Returns (new row, points). Independent of the page's code (tests compare against it)."""
  vals = [v for v in row if v]
  out, pts, i = [], 0, 0
  while i < len(vals):
    if i + 1 < len(vals) and vals[i] == vals[i + 1]:
      out.append(2 * vals[i]); pts += 2 * vals[i]; i += 2
    else:
      out.append(vals[i]); i += 1
  return out + [0] * (len(row) - len(out)), pts


def board_2048(st: dict) -> list[list[int]]:
  """The page's grid (cells[x][y], x = column) as rows [r][c] of values (0 = empty)."""
  cells = st["game"]["grid"]["cells"]
  return [[(cells[c][r] or {}).get("value", 0) for c in range(4)] for r in range(4)]


def move_2048(b: list[list[int]], direction: str) -> tuple[list[list[int]], int]:
  """Board after sliding in `direction` ('up'/'down'/'left'/'right') before the new tile; points."""
  t = lambda m: [list(r) for r in zip(*m)]
  m = {"left": b, "right": [r[::-1] for r in b], "up": t(b), "down": [r[::-1] for r in t(b)]}[direction]
  rows, pts = zip(*(slide_row(r) for r in m))
  rows = [list(r) for r in rows]
  back = {"left": rows, "right": [r[::-1] for r in rows], "up": t(rows), "down": t([r[::-1] for r in rows])}
  return back[direction], sum(pts)


def policy_2048(st):
  b = board_2048(st)
  for d in ("down", "left", "right", "up"):  # corner strategy: keep big tiles bottom-left
    if move_2048(b, d)[0] != b:
      return key(d)
  return key("down")


# -- snake ---------------------------------------------------------------------------------------
def policy_snake(st):
  body = [tuple(p) for p in st["body"]]
  head, blocked = body[0], set(body[:-1])
  ok = lambda p: 0 <= p[0] < 10 and 0 <= p[1] < 10 and p not in blocked
  nb = lambda p: [((dr, dc), (p[0] + dr, p[1] + dc)) for dr, dc in KEYS if ok((p[0] + dr, p[1] + dc))]
  path = _bfs(head, nb, lambda p: p == tuple(st["food"]))
  if path:
    return key(KEYS[path[0]])
  safe = [d for d, _ in nb(head)]
  return key(KEYS[safe[0]]) if safe else "wait()"


# -- maze ----------------------------------------------------------------------------------------
def policy_maze(st):
  walls = st["walls"]
  bits = {(-1, 0): 1, (0, 1): 2, (1, 0): 4, (0, -1): 8}
  nb = lambda p: [(d, (p[0] + d[0], p[1] + d[1])) for d, b in bits.items() if not walls[p[0]][p[1]] & b]
  path = _bfs(tuple(st["pos"]), nb, lambda p: p == tuple(st["exit"]))
  return key(KEYS[path[0]])


# -- same-game -----------------------------------------------------------------------------------
def groups(grid: list[list[int]]) -> list[list[tuple[int, int]]]:
  """Connected same-colour groups (4-neighbour) of non-empty cells, in row-major order of first cell."""
  n, seen, out = len(grid), set(), []
  for r, c in itertools.product(range(n), range(n)):
    if grid[r][c] < 0 or (r, c) in seen:
      continue
    g, todo = [], [(r, c)]
    seen.add((r, c))
    while todo:
      a, b = todo.pop()
      g.append((a, b))
      for x, y in ((a + 1, b), (a - 1, b), (a, b + 1), (a, b - 1)):
        if 0 <= x < n and 0 <= y < n and (x, y) not in seen and grid[x][y] == grid[r][c]:
          seen.add((x, y)); todo.append((x, y))
    out.append(g)
  return out


def policy_same_game(st):
  best = max((g for g in groups(st["grid"]) if len(g) >= 2), key=len)
  return click_cell(8, *best[0])


# -- merge ---------------------------------------------------------------------------------------
def policy_merge(st):
  cells = [(v, r, c) for r, row in enumerate(st["grid"]) for c, v in enumerate(row) if v]
  for v, r, c in sorted(cells):
    other = [(r2, c2) for v2, r2, c2 in cells if v2 == v and (r2, c2) != (r, c)]
    if other:
      return drag(*centre(4, r, c), *centre(4, *other[0]))
  return "wait()"


# -- shapes --------------------------------------------------------------------------------------
def policy_shapes(st):
  t = st["target"]
  s = next(s for s in st["shapes"] if not s["gone"] and s["color"] == t["color"] and s["kind"] == t["kind"])
  return click_cell(4, s["r"], s["c"])


# -- sokoban -------------------------------------------------------------------------------------
def policy_sokoban(st):
  walls, goals = {tuple(w) for w in st["walls"]}, frozenset(tuple(g) for g in st["goals"])

  def nb(s):
    (pr, pc), boxes = s
    for d in KEYS:
      n = (pr + d[0], pc + d[1])
      if n in walls:
        continue
      if n in boxes:
        n2 = (n[0] + d[0], n[1] + d[1])
        if n2 in walls or n2 in boxes:
          continue
        yield d, (n, boxes - {n} | {n2})
      else:
        yield d, (n, boxes)

  path = _bfs((tuple(st["player"]), frozenset(tuple(b) for b in st["boxes"])), nb, lambda s: s[1] == goals)
  return key(KEYS[path[0]])


# -- lights-out ----------------------------------------------------------------------------------
def lights_out_press(grid, r, c):
  """Grid after pressing (r, c): the cell and its 4 neighbours toggle."""
  g = [row[:] for row in grid]
  for a, b in ((r, c), (r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
    if 0 <= a < 5 and 0 <= b < 5:
      g[a][b] ^= 1
  return g


def lights_out_solution(grid) -> list[tuple[int, int]]:
  """Fewest presses that clear `grid` (light chasing over the 32 first-row patterns)."""
  best = None
  for first in range(32):
    g, presses = grid, [(0, c) for c in range(5) if first >> c & 1]
    for r, c in presses:
      g = lights_out_press(g, r, c)
    for r in range(1, 5):
      for c in range(5):
        if g[r - 1][c]:
          g = lights_out_press(g, r, c); presses.append((r, c))
    if not any(map(any, g)) and (best is None or len(presses) < len(best)):
      best = presses
  return best


def policy_lights_out(st):
  return click_cell(5, *sorted(lights_out_solution(st["grid"]))[0])


# -- infinity-loop -------------------------------------------------------------------------------
def rot(m: int) -> int:
  """Quarter turn clockwise of a pipe mask (1 up, 2 right, 4 down, 8 left)."""
  return ((m << 1) | (m >> 3)) & 15


def policy_infinity_loop(st):
  for r, c in itertools.product(range(4), range(4)):
    if st["grid"][r][c] != st["solution"][r][c]:
      return click_cell(4, r, c)
  return "wait()"


# -- laser-maze ----------------------------------------------------------------------------------
def policy_laser_maze(st):
  for q, m in zip(st["mirrors"], st["solution"]):
    if q["m"] != m:
      return click_cell(5, q["r"], q["c"])
  return "wait()"


# -- emoji-sort ----------------------------------------------------------------------------------
def _tube_moves(tubes):
  for a, b in itertools.permutations(range(len(tubes)), 2):
    s, d = tubes[a], tubes[b]
    if s and len(d) < 3 and (not d or d[-1] == s[-1]):
      n = list(tubes)
      n[a], n[b] = s[:-1], d + (s[-1],)
      yield (a, b), tuple(n)


def policy_emoji_sort(st):
  tubes = tuple(tuple(t) for t in st["tubes"])
  done = lambda ts: sum(len(t) == 3 and len(set(t)) == 1 for t in ts) == 3
  a, b = _bfs(tubes, _tube_moves, done)[0]
  tube = lambda i: click(i * 32 + 16, 85)
  if st["selected"] < 0:
    return tube(a)
  return tube(b) if st["selected"] == a else tube(st["selected"])  # clicking the selected tube deselects


# -- free-the-key --------------------------------------------------------------------------------
def _block_cells(b):
  return [(b[0], b[1] + i) if b[3] else (b[0] + i, b[1]) for i in range(b[2])]


def policy_free_the_key(st):
  ids = [b["id"] for b in st["blocks"]]
  start = tuple((b["r"], b["c"], b["len"], b["h"]) for b in st["blocks"])
  k = ids.index("K")

  def nb(s):
    for i, b in enumerate(s):
      occ = {p for j, o in enumerate(s) if j != i for p in _block_cells(o)}
      for step in (-1, 1):
        n, d = b, 0
        while True:
          n = (n[0] + (0 if n[3] else step), n[1] + (step if n[3] else 0), n[2], n[3])
          if any(not (0 <= r < 6 and 0 <= c < 6) or (r, c) in occ for r, c in _block_cells(n)):
            break
          d += step
          yield (i, d), s[:i] + (n,) + s[i + 1:]

  i, d = _bfs(start, nb, lambda s: s[k][1] + s[k][2] == 6)[0]
  r, c, _, h = start[i]
  x, y = centre(6, r, c)
  s = 160 / 6
  return drag(x, y, x + d * s, y) if h else drag(x, y, x, y + d * s)


# -- yarn-untangle -------------------------------------------------------------------------------
def policy_yarn_untangle(st):
  for p, q in zip(st["pos"], st["solution"]):
    if p != q:
      return drag(*p, *q)
  return "wait()"


POLICIES: dict[str, Callable[[dict], str]] = {
    "2048": policy_2048, "snake": policy_snake, "maze": policy_maze, "same-game": policy_same_game,
    "merge": policy_merge, "shapes": policy_shapes, "sokoban": policy_sokoban, "infinity-loop": policy_infinity_loop,
    "laser-maze": policy_laser_maze, "lights-out": policy_lights_out, "emoji-sort": policy_emoji_sort,
    "free-the-key": policy_free_the_key, "yarn-untangle": policy_yarn_untangle,
}


# -- runner --------------------------------------------------------------------------------------
async def play(sandbox, game: str, seed: int, max_steps: int = 1000) -> tuple[dict, list[str]]:
  """Plays one episode of `game` with its reference policy in a BrowserSandbox (in-process).

  Returns (final debug state of the page, actions taken). The policy reads the privileged state;
  every action goes through `sandbox.step` (parser, executor, virtual clock) like an agent's.
  """
  policy = POLICIES[game]
  sid, obs = await sandbox.open(catalog.PREFIX + game, seed)
  page = sandbox.sessions[sid].page
  actions = []
  try:
    while not obs.done and len(actions) < max_steps:
      a = policy(await page.evaluate(catalog.DEBUG_STATE_SCRIPT))
      actions.append(a)
      obs = await sandbox.step(sid, a)
      if obs.info.get("error"):
        raise RuntimeError(f"{game}: reference action {a!r} rejected: {obs.info['error']}")
    return await page.evaluate(catalog.DEBUG_STATE_SCRIPT), actions
  finally:
    await sandbox.close(sid)


async def _measure(games, seeds):
  from envs_bridge.browser.sessions import BrowserSandbox
  sb = BrowserSandbox(step_ms=1000)
  await sb.start()
  try:
    out = {}
    for g in games:
      t = time.perf_counter()
      scores = [(await play(sb, g, s))[0]["score"] for s in seeds]
      out[g] = sum(scores) / len(scores)
      print(f"{g:14s} scores {scores} mean {out[g]:.2f}  ({time.perf_counter() - t:.1f} s)", flush=True)
    return out
  finally:
    await sb.stop()


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--games", nargs="*", default=list(catalog.GAMES))
  ap.add_argument("--write", action="store_true", help=f"write {catalog.REFERENCE_SCORES}")
  a = ap.parse_args(argv)
  scores = asyncio.run(_measure(a.games, REFERENCE_SEEDS))
  if a.write:
    with open(catalog.REFERENCE_SCORES, "w") as f:
      json.dump({"seeds": list(REFERENCE_SEEDS), "step_ms": 1000, "scores": scores}, f, indent=1)
      f.write("\n")


if __name__ == "__main__":
  main()
