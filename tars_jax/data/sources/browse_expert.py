r"""Scripted expert of the GUI-Browsing tasks ('browse/<family>', envs_bridge/browser/browse_tasks.py).

Like the experts of `experts.py` it reads privileged state that the agent never sees and acts only
through the agent's actions: it knows the question's solution plan (`browsing.Question.plan`, the
links from the start page to the answer page, as the games' reference players know the game state),
reads the visible elements of the page through the sandbox's debug `elements` call, and every turn
either clicks the next link of the plan (found by its text among the visible links), scrolls
(`hotkey(key='pagedown')`; `hotkey(key='down')` when the link is cut by the bottom edge;
`hotkey(key='home')` on a page entered below its top, e.g. through a #fragment link), or, on the
answer page, reads the answer off the page (the "Source code:" line, the first h2, or the h1 after the
dash; for find-page the module named by the h1) and answers `finished(content='<answer>')`. The answer is
read from the rendered DOM, never from the question record, so a success checks the generator's
parse of the page against what the browser shows. Which page it is on comes from `info['page']`.

  python -m tars_jax.data.sources.browse_expert --split test          # held-out questions, prints success
  python -m tars_jax.data.sources.browse_expert --split train --limit 20 --servers http://127.0.0.1:8765
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
import time
from typing import Sequence

import numpy as np

from envs_bridge.browser import browse_tasks as bt
from envs_bridge.browser import browsing
from envs_bridge.client import client_for
from tars_jax.agent import actions as A
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.data.sources import experts as E
from tars_jax.rollout import episode as episode_lib
from tars_jax.rollout.episode import LoopConfig, Reply, StopEpisode, TurnView

NAV_BAR_PX = 40  # the narrow Sphinx layout's fixed top bar: elements under it cannot be clicked
LINE_PX = 24  # taller link boxes wrap over several lines
PAGE_DOWN = A.Hotkey(("pagedown",))
# 40 px: for a link cut by the bottom edge, which a page down (87.5 % of the viewport) would put under the top
# bar when the viewport is short (find-page's 320 px)
ARROW_DOWN = A.Hotkey(("down",))
HOME = A.Hotkey(("home",))


def _text(s: str) -> str:
  return " ".join((s or "").split())


@dataclasses.dataclass
class BrowseExpert:
  """Follows `question`'s plan and answers from the answer page (see the module docstring).
  Stateful per episode: which pages it has seen from their top."""

  question: browsing.Question
  coord_format: str = "int"
  width: int | None = None  # px; None: the viewport of the question's task (browse_tasks.viewport)
  height: int | None = None
  seen_top: set = dataclasses.field(default_factory=set)

  def __post_init__(self):
    w, h = bt.viewport(bt.PREFIX + self.question.family)
    self.width = w if self.width is None else self.width
    self.height = h if self.height is None else self.height

  def _hop(self, page: str) -> browsing.Hop | None:
    """The plan's link to follow on `page`; None on the answer page. Raises ExpertError off the plan."""
    if page == self.question.answer_page:
      return None
    for h in self.question.plan:
      if h.page == page:
        return h
    raise E.ExpertError(f"page {page!r} is not on the plan of {self.question.id}")

  @staticmethod
  def _showing(elements: Sequence[dict], text: str):
    """(index, element) of the visible links showing `text`."""
    want = _text(text)
    return ((i, e) for i, e in enumerate(elements) if e["tag"] == "a" and _text(e["text"]) == want)

  def _link(self, elements: Sequence[dict], text: str) -> E.ClickAt | None:
    """A click on the visible link showing `text`, fully below the top bar; None if none is."""
    for i, e in self._showing(elements, text):
      if e["y"] < NAV_BAR_PX or e["y"] + e["height"] > self.height - 1:
        continue  # under the bar or cut by the bottom edge: scroll first
      if e["height"] <= LINE_PX:
        return E.ClickAt(e)
      # wrapped over lines: the union box's centre may be off the text; its last line starts at the
      # box's left edge, so aim there, or at a leaf inside the link
      inner = [d for d in elements[i + 1:] if d["leaf"] and E._overlap(d, e) and d["height"] <= LINE_PX
               and d["y"] >= NAV_BAR_PX]
      if inner:
        return E.ClickAt(inner[0])
      return E.ClickAt({"x": e["x"], "y": e["y"] + e["height"] - LINE_PX / 2 - 6, "width": min(24.0, e["width"]),
                        "height": 12.0})
    return None

  def _cut_at_bottom(self, elements: Sequence[dict], text: str) -> bool:
    """Whether the link showing `text` is in view below the top bar but cut by the bottom edge."""
    return any(e["y"] >= NAV_BAR_PX and e["y"] + e["height"] > self.height - 1
               for _, e in self._showing(elements, text))

  def _answer(self, elements: Sequence[dict]) -> str | None:
    """The answer read off the visible part of the answer page, None until it is in view."""
    kind = self.question.answer_kind
    for e in elements:
      t = _text(e["text"])
      if kind == "source" and e["tag"] == "p" and t.startswith("Source code:"):
        return t[len("Source code:"):].strip()
      if kind == "first_section" and e["tag"] == "h2":
        return t
      if kind == "title" and e["tag"] == "h1" and " — " in t:
        return t.split(" — ", 1)[1].strip()
      if kind == "page" and e["tag"] == "h1":  # find-page: on the page, it names the module it opened
        return t.split(" — ", 1)[0].strip()
    return None

  def decide(self, elements: Sequence[dict], page: str) -> tuple[str, A.Action | E.ClickAt]:
    """(thought, action) on `page` (info['page']) showing `elements`. Raises ExpertError."""
    if any(e["tag"] == "h1" for e in elements):
      self.seen_top.add(page)
    if page not in self.seen_top:
      return "back to the top of this page", HOME
    hop = self._hop(page)
    if hop is not None:
      click = self._link(elements, hop.text)
      if click is not None:
        return f"the link {hop.text}", click
      if self._cut_at_bottom(elements, hop.text):
        return f"scroll down a little to the link {hop.text}", ARROW_DOWN
      return f"scroll down to the link {hop.text}", PAGE_DOWN
    answer = self._answer(elements)
    if answer is not None:
      return f"the answer is {answer}", A.Finished(answer)
    return "scroll down to find the answer", PAGE_DOWN

  def reply(self, elements: Sequence[dict], page: str) -> str:
    """The next reply, `Thought: ...\\nAction: ...`, in the task's coordinates."""
    thought, action = self.decide(elements, page)
    text = E.render(action, self.coord_format, self.width, self.height)
    return E.reply_text(E.clean_thought(thought), text)


@dataclasses.dataclass
class Result:
  """One expert episode: reward from the sandbox, turns taken, the answer given (or None), and why it
  stopped early (ExpertError text) or None."""

  task: str
  seed: int
  data_mode: str
  reward: float
  turns: int
  answer: str | None
  stopped: str | None = None


class _Solver:
  """The expert as an agent of `episode.play` (its replies in the tasks' own "int" coordinates)."""

  prompt = False

  def __init__(self, q: browsing.Question):
    self.q, self.ex, self.page, self.tok = q, BrowseExpert(q), q.start, ByteTokenizer()

  async def reply(self, view: TurnView) -> Reply:
    if view.turn == 0 and view.ep.instruction != self.q.question:
      raise E.ExpertError(f"{view.ep.task} seed {view.ep.seed}: the server asks {view.ep.instruction!r}, this "
                          f"process generated {self.q.question!r} (different corpus?)")
    self.page = view.info.get("page") or self.page
    try:
      text = self.ex.reply(await view.client.elements(view.sid), self.page)
    except E.ExpertError as e:
      raise StopEpisode(str(e)) from e
    ids = self.tok.encode(text) + [self.tok.eos_id]
    return Reply(text, ids, np.zeros(len(ids), np.float32), np.zeros(len(ids), np.int32))

  def close(self) -> None:
    pass


async def solve(client, task: str, seed: int, data_mode: str = "test", max_turns: int = 60) -> Result:
  """Plays one episode of `task` with the expert through `client` (an envs_bridge SandboxClient):
  `episode.play`, the loop every agent plays.

  Raises: ExpertError when the server asks another question than this process generates (another
  corpus); the client's sandbox errors.
  """
  agent = _Solver(bt.question(task, seed, data_mode))
  ep, stopped = await episode_lib.play(client, task, seed, agent, cfg=LoopConfig(max_turns=max_turns, data_mode=data_mode),
                                       tok=agent.tok)
  if stopped is not None:
    return Result(task, seed, data_mode, 0.0, len(ep.turns), None, stopped)
  answers = [A.parse(t.text).content for t in ep.turns if "finished(" in t.text]
  answer = answers[-1] if answers else None
  if ep.turns and ep.turns[-1].done:
    return Result(task, seed, data_mode, float(ep.turns[-1].env_reward), len(ep.turns), answer)
  return Result(task, seed, data_mode, 0.0, max_turns, answer, f"no answer in {max_turns} turns")


async def evaluate(clients: Sequence, tasks: Sequence[str], split: str = "test", limit: int | None = None,
                   concurrency: int = 4, max_turns: int = 60) -> dict[str, list[Result]]:
  """The expert on every question of `split` of each task (first `limit` of each), `concurrency`
  episodes at a time over `clients`; {task: [Result]}."""
  suite = bt.prepare()
  sem = asyncio.Semaphore(concurrency)
  out: dict[str, list[Result]] = {t: [] for t in tasks}

  async def one(k: int, task: str, seed: int):
    async with sem:
      out[task].append(await solve(client_for(clients, task, k), task, seed, split, max_turns))

  jobs = []
  for t in tasks:
    n = len(suite.split(bt.family(t), split))
    jobs += [(t, s) for s in range(n if limit is None else min(n, limit))]
  await asyncio.gather(*[one(k, t, s) for k, (t, s) in enumerate(jobs)])
  for t in tasks:
    out[t].sort(key=lambda r: r.seed)
  return out


def format_results(results: dict[str, list[Result]]) -> str:
  """A table: task, episodes, success rate, mean turns of the successes, expert errors."""
  lines = [f"{'task':24s} {'episodes':>8s} {'success':>8s} {'turns':>6s} {'errors':>6s}"]
  for t, rs in results.items():
    ok = [r for r in rs if r.reward > 0]
    lines.append(f"{t:24s} {len(rs):8d} {len(ok) / max(1, len(rs)):8.3f} "
                 f"{sum(r.turns for r in ok) / max(1, len(ok)):6.1f} {sum(r.stopped is not None for r in rs):6d}")
  return "\n".join(lines)


def main(argv=None) -> int:
  from envs_bridge.client import SandboxClient
  from envs_bridge.launch import launch_server
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--split", choices=browsing.SPLITS, default="test")
  ap.add_argument("--tasks", default=",".join(bt.task_names()))
  ap.add_argument("--limit", type=int, default=None, help="questions per task (default: all of the split)")
  ap.add_argument("--concurrency", type=int, default=2)
  ap.add_argument("--max-turns", type=int, default=60)
  ap.add_argument("--servers", default="", help="sandbox URLs, comma-separated (default: launch one)")
  a = ap.parse_args(argv)
  logging.getLogger("httpx").setLevel(logging.WARNING)
  tasks = [t for t in a.tasks.split(",") if t]

  async def run(urls):
    clients = [SandboxClient(u) for u in urls]
    try:
      return await evaluate(clients, tasks, a.split, a.limit, a.concurrency, a.max_turns)
    finally:
      for c in clients:
        await c.aclose()

  t0 = time.time()
  if a.servers:
    res = asyncio.run(run(a.servers.split(",")))
  else:
    with launch_server(step_ms=1000, lease_s=120.0) as h:
      res = asyncio.run(run([h.url]))
  print(format_results(res))
  for t, rs in res.items():
    for r in rs:
      if r.reward <= 0:
        print(f"  failed {t} seed {r.seed}: answer {r.answer!r}, {r.turns} turns, {r.stopped or 'wrong answer'}")
  print(f"({time.time() - t0:.0f} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
