"""Interactive annotation (report section 2.4.2): a person supervises the policy on-policy in a live
sandbox. At each turn the run's policy proposes k candidate replies; the annotator accepts one or
overrides it (a typed thought, an action composed on the screenshot); the reply runs in the sandbox
and the episode goes on. The person is one more `episode.Agent` (`HumanAgent`): the episode is played
by the one turn loop every rollout path uses (`rollout/episode.play`), so an annotated episode is the
same kind of trajectory record the SFT stage reads (`data/records.py`, source "annotation").

Layers (the report's four): the page (`annotation_app.py`), this service (sessions, proposals,
interventions, the task queue), the sandbox platform (`envs_bridge`, through `RecoveringClient`: a
crashed browser is re-opened and the episode's actions replayed, the episode marked `recovered`), and
storage (`write_episode`: complete episodes in the annotation directory, those closed half-way in its
`incomplete/` subdirectory, which no stage reads unless given it).

Per turn the record's provenance (`extra["turns"]`) says whether the reply was accepted (which
candidate) or overridden, with every candidate's text and log-probability; the annotator's name and
the policy version are in the provenance too. Only the final reply is the training target.
"""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import json
import logging
import os
import time
import uuid
from typing import Sequence

import numpy as np

from envs_bridge import protocol
from envs_bridge.client import client_for
from tars_jax.agent import actions as A
from tars_jax.agent.grammar import Grammar, accepts, walk
from tars_jax.agent.tokenizer import ByteTokenizer
from tars_jax.agent.trajectory import Episode
from tars_jax.data import records
from tars_jax.data.sources import experts as E
from tars_jax.rollout import episode as episode_lib
from tars_jax.rollout.episode import Reply, StopEpisode, TurnView

SOURCE = "annotation"
RECOVERY_ATTEMPTS = 4  # re-opens of a lost annotation session before its episode is given up (failed)
SEED_OFFSET = 8_000_000  # annotation seeds: apart from training (0+), demonstrations (2e6), grounding
# (3e6, 4e6), value pretraining (5e6), the flywheel (6e6) and held-out evaluation (1e7) seeds


class BadOverride(ValueError):
  """An override the grammar does not accept (or a click outside the screenshot): nothing ran."""


class TurnMovedOn(RuntimeError):
  """A decision for a turn that is not the one waiting (a double click, a second tab)."""


# ---- the task queue ---------------------------------------------------------------------------------

def latest_eval(run: str) -> dict[str, float]:
  """{task: held-out success} of the newest evaluation JSON of `run` (`eval*.json` in the run dir, as
  `experiments/eval.py --json` and the replication suite write them), or {} without one."""
  paths = sorted(glob.glob(os.path.join(run, "eval*.json")), key=os.path.getmtime)
  if not paths:
    return {}
  with open(paths[-1]) as f:
    d = json.load(f)
  res = d.get("results", d)
  return {t: float(r["success"]) for t, r in res.items() if isinstance(r, dict) and "success" in r}


class TaskQueue:
  """Which (task, seed) an annotator gets next: the tasks ordered by the run's latest held-out
  success, lowest first (a task without an evaluation counts as 0: nothing shows the policy does it),
  each with its own seeds `SEED_OFFSET + task index * 100_000 + k`, k counting on from the episodes of
  that task already in the annotation directories (so a restarted server does not repeat a seed)."""

  def __init__(self, tasks: Sequence[str], run: str, out_dirs: Sequence[str]):
    self.tasks = list(tasks)
    self.success = latest_eval(run)
    self.order = sorted(self.tasks, key=lambda t: (self.success.get(t, 0.0), self.tasks.index(t)))
    self._next = {t: _done_count(out_dirs, t) for t in self.tasks}
    self._turn = 0

  def next(self, task: str | None = None) -> tuple[str, int]:
    """(task, seed): `task`'s next seed, or the next task in order (round robin over the order).
    Raises ValueError for a task outside the queue's tasks."""
    if task is None:
      task = self.order[self._turn % len(self.order)]
      self._turn += 1
    elif task not in self._next:
      raise ValueError(f"task {task!r} is not one of this annotation server's tasks {self.tasks}")
    k = self._next[task]
    self._next[task] += 1
    return task, SEED_OFFSET + self.tasks.index(task) * 100_000 + k


def _done_count(out_dirs: Sequence[str], task: str) -> int:
  n = 0
  for d in out_dirs:
    if os.path.exists(os.path.join(d, records.INDEX_FILE)):
      n += records.read_index(d)["counts"].get(SOURCE, {}).get(task, 0)
  return n


# ---- the sandbox, recovered after a crash -------------------------------------------------------------

class RecoveringClient:
  """A `SandboxClient` whose sessions survive a crashed browser: a step lost to a retryable sandbox
  error (`protocol.is_retryable`) re-opens the episode's task and seed and replays its actions so far
  (the sandbox is deterministic given seed and actions: virtual clock), then runs the step; the
  observation's `info["recovered"]` is set and `recovered` counts it. A session id stays the one
  `open` returned. Other errors propagate."""

  def __init__(self, client):
    self.client, self.serves, self.recovered = client, getattr(client, "serves", None), 0
    self._real: dict[str, str] = {}
    self._episode: dict[str, tuple[str, int, dict]] = {}
    self._actions: dict[str, list[str]] = {}

  async def open(self, task: str, seed: int = 0, **kw):
    sid, obs = await self.client.open(task, seed, **kw)
    self._real[sid], self._episode[sid], self._actions[sid] = sid, (task, seed, kw), []
    return sid, obs

  async def step(self, sid: str, action: str):
    try:
      obs = await self.client.step(self._real[sid], action)
    except Exception as e:  # noqa: BLE001 -- only sandbox losses are recovered; the rest re-raised
      if not protocol.is_retryable(e):
        raise
      logging.warning("annotation session %s lost (%s: %s); re-opening and replaying %d actions", sid,
                      type(e).__name__, getattr(e, "reason", e), len(self._actions[sid]))
      task, seed, kw = self._episode[sid]
      for attempt in range(RECOVERY_ATTEMPTS):  # a relaunching browser may refuse the first tries
        try:
          new, _ = await self.client.open(task, seed, **kw)
          for a in self._actions[sid]:
            await self.client.step(new, a)
          break
        except Exception as e2:  # noqa: BLE001
          if not protocol.is_retryable(e2) or attempt == RECOVERY_ATTEMPTS - 1:
            raise
          await asyncio.sleep(1.0 + attempt)
      self._real[sid] = new
      self.recovered += 1
      obs = await self.client.step(new, action)
      obs.info["recovered"] = True
    self._actions[sid].append(action)
    return obs

  async def observe(self, sid: str):
    return await self.client.observe(self._real[sid])

  async def close(self, sid: str) -> None:
    real = self._real.pop(sid, sid)
    self._episode.pop(sid, None)
    self._actions.pop(sid, None)
    await self.client.close(real)

  def real_session(self, sid: str) -> str:
    """The sandbox server's id of the session now behind `sid` (debugging, tests)."""
    return self._real.get(sid, sid)


# ---- candidates and decisions ------------------------------------------------------------------------

@dataclasses.dataclass
class Candidate:
  """One proposal: the reply as the policy sampled it, its log-probability (nats, sum over tokens), and
  its click in [0, 1] units of the screenshot (None for other actions or a reply that does not parse)."""
  reply: Reply
  thought: str
  action: str
  logp: float
  click: tuple[float, float] | None

  def to_json(self) -> dict:
    return {"text": self.reply.text, "thought": self.thought, "action": self.action, "logp": self.logp,
            "click": None if self.click is None else list(self.click)}


def candidate(reply: Reply, coords: A.CoordSpec) -> Candidate:
  """The `Candidate` of a sampled reply (its text parsed once, for the page)."""
  try:
    thought, act = A.parse_response(reply.text, coords)
    action = reply.text.split("Action:", 1)[1].strip()
    click = (act.x, act.y) if isinstance(act, (A.Click, A.LeftDouble, A.RightSingle)) else None
  except (A.ActionParseError, IndexError):
    thought, action, click = "", reply.text, None
  return Candidate(reply, thought, action, float(np.sum(reply.logprobs)), click)


def override_reply(grammar: Grammar, tok: ByteTokenizer, coord_format: str, thought: str, action: str,
                   x: float | None = None, y: float | None = None, content: str = "",
                   screen_wh: tuple[int, int] = (E.WIDTH, E.HEIGHT)) -> Reply:
  """The annotator's own reply: `action` is an action name of the grammar ("click" with x, y in [0, 1]
  of the screenshot, converted once to the grammar's 0-1000 grid; "type" with `content`; "finished",
  ...) or a whole action string (`click(start_box='(500,500)')`). Zero log-probs, the grammar's states.
  Raises BadOverride naming what is wrong (a click outside the screenshot, an action or thought the
  grammar does not accept); nothing is executed then."""
  name = action.strip()
  if name in ("click", "left_double", "right_single"):
    if x is None or y is None or not (0.0 <= x <= 1.0 and 0.0 <= y <= 1.0):
      raise BadOverride(f"a {name} needs a point on the screenshot (x, y in [0, 1]), got ({x}, {y})")
    text_action = E.render(A.Click(x, y), coord_format, *screen_wh).replace("click(", f"{name}(", 1)
  elif name == "type":
    text_action = A.format_action(A.Type(content))
  elif name == "finished":
    text_action = A.format_action(A.Finished(content))
  elif name in ("wait", "call_user"):
    text_action = f"{name}()"
  else:
    try:
      A.parse_action(name)
    except A.ActionParseError as e:
      raise BadOverride(f"the action {name!r} does not parse: {e.reason}") from None
    text_action = name
  text = E.reply_text(" ".join(thought.split()), text_action)
  if not accepts(grammar, text, tok):
    raise BadOverride(f"the run's grammar does not accept {text!r}: check its actions, thought length and "
                      "coordinate format (config.grammar.actions, max_thought_bytes, coord_format)")
  ids = tok.encode(text) + [tok.eos_id]
  return Reply(text, ids, np.zeros(len(ids), np.float32), walk(grammar, ids))


# ---- one annotator's episode -------------------------------------------------------------------------

class HumanAgent:
  """The annotator as an `episode.Agent`: each turn the session proposes the policy's candidates and
  waits for the person's decision (`AnnotationSession.decide`); closing the session stops the episode
  where it is (StopEpisode)."""

  prompt = True

  def __init__(self, session: "AnnotationSession"):
    self.s = session

  async def reply(self, view: TurnView) -> Reply:
    return await self.s.propose_and_wait(view)

  def close(self) -> None:
    pass


class AnnotationSession:
  """One annotator's episode of `task`/`seed`, played by `episode.play` with a `HumanAgent` in an
  asyncio task of the server's loop. `state()` is what the page shows; `decide` and `close` are what
  it sends. Finished (or closed, or failed), the episode is written by `write_episode`."""

  def __init__(self, server: "AnnotationServer", annotator: str, task: str, seed: int, client):
    self.id = uuid.uuid4().hex[:12]
    self.server, self.annotator, self.task, self.seed = server, annotator, task, seed
    self.client = RecoveringClient(client)
    self.status, self.message, self.turn = "starting", "", -1
    self.ep: Episode | None = None
    self.sid: str | None = None
    self.candidates: list[Candidate] = []
    self.decisions: list[dict] = []
    self.screenshot_b64, self.screen_wh = "", (E.WIDTH, E.HEIGHT)
    self.version = server.version
    self.last_active = time.monotonic()
    self.written: str | None = None
    self._decision: asyncio.Future | None = None
    self._changed = asyncio.Event()
    self._lock = asyncio.Lock()
    self._proposed_at = 0.0
    self._closing: str | None = None
    self.task_handle = asyncio.get_running_loop().create_task(self._run())

  # -- the episode (its own asyncio task) --
  async def _run(self) -> None:
    s = self.server
    complete, stopped, error = False, None, None
    try:
      ep, stopped = await episode_lib.play(self.client, self.task, self.seed, HumanAgent(self), cfg=s.loop_cfg,
                                           tok=s.tok, version=self.version)
      self.ep, complete = ep, stopped is None
    except Exception as e:  # noqa: BLE001 -- kept as an incomplete episode, shown on the page
      error = f"{type(e).__name__}: {getattr(e, 'reason', None) or e}"
      logging.exception("annotation session %s failed", self.id)
    self.written = s.write_episode(self, complete, stopped or error)
    self.status = "done" if complete else ("failed" if error else "incomplete")
    self.message = stopped or error or ""
    self._notify()

  async def propose_and_wait(self, view: TurnView) -> Reply:
    s = self.server
    self.ep, self.sid, self.turn = view.ep, view.sid, view.turn
    if self._closing:  # closed while the last decision ran
      raise StopEpisode(self._closing)
    replies = await asyncio.gather(*[s.service.generate(view.prompt_ids, view.images) for _ in range(s.k)])
    self.candidates = [candidate(Reply(s.tok.decode(r.tokens), list(r.tokens), r.logprobs, r.states,
                                       np.asarray(r.versions, np.int32)), s.coords) for r in replies]
    obs = await self.client.observe(view.sid)
    image = obs.image()
    self.screen_wh = (image.shape[1], image.shape[0])
    self.screenshot_b64 = obs.screenshot_png_b64
    if self._closing:
      raise StopEpisode(self._closing)
    self._decision = asyncio.get_running_loop().create_future()
    self.status, self._proposed_at = "deciding", time.monotonic()
    self._notify()
    return await self._decision  # a Reply, or StopEpisode when the session is closed

  # -- what the page sends --
  async def decide(self, turn: int, accept: int | None = None, thought: str = "", action: str = "",
                   x: float | None = None, y: float | None = None, content: str = "") -> dict:
    """Accepts candidate `accept`, or overrides with (thought, action, x, y, content)
    (`override_reply`); waits until the next turn's candidates are ready or the episode ended, and
    returns `state()`. Raises TurnMovedOn (not the waiting turn: nothing done), BadOverride (nothing
    executed), IndexError (no such candidate)."""
    async with self._lock:
      self.last_active = time.monotonic()
      if self.status != "deciding" or turn != self.turn or self._decision is None or self._decision.done():
        raise TurnMovedOn(f"turn {turn} is not waiting for a decision (the episode is at turn {self.turn}, "
                          f"{self.status})")
      if accept is not None:
        if not 0 <= accept < len(self.candidates):
          raise IndexError(f"no candidate {accept} (there are {len(self.candidates)})")
        reply, meta = self.candidates[accept].reply, {"accepted": accept, "overridden": False}
      else:
        reply = override_reply(self.server.grammar, self.server.tok, self.server.coord_format, thought, action, x, y,
                               content, self.screen_wh)
        meta = {"accepted": None, "overridden": True}
      self.decisions.append(dict(meta, turn=turn, candidates=[c.to_json() for c in self.candidates],
                                 decided_s=time.monotonic() - self._proposed_at))
      self.status = "executing"
      self._changed.clear()
      self._decision.set_result(reply)
    await self.wait_while("executing")
    return self.state()

  async def close(self, why: str = "closed by the annotator") -> dict:
    """Ends the episode where it is: written as incomplete (unless it already ended)."""
    self._closing = self._closing or why
    if self._decision is not None and not self._decision.done():
      self._decision.set_exception(StopEpisode(why))
    await asyncio.shield(self.task_handle)
    return self.state()

  def _notify(self) -> None:
    self._changed.set()

  async def wait_while(self, status: str) -> None:
    """Returns once the session's status is no longer `status` (the episode task notifies each change)."""
    while self.status == status:
      await self._changed.wait()
      self._changed.clear()

  def state(self) -> dict:
    """The page's view: status, turn, instruction, screenshot (PNG base64), candidates, history."""
    ep = self.ep
    history = []
    if ep is not None:
      for i, t in enumerate(ep.turns):
        d = self.decisions[i] if i < len(self.decisions) else {}
        history.append({"turn": i, "text": t.text, "reward": t.reward, "env_reward": t.env_reward, "done": t.done,
                        "error": t.error, "accepted": d.get("accepted"), "overridden": d.get("overridden")})
    return {"id": self.id, "annotator": self.annotator, "task": self.task, "seed": self.seed,
            "instruction": ep.instruction if ep is not None else "", "status": self.status,
            "message": self.message, "turn": self.turn, "max_turns": self.server.loop_cfg.max_turns,
            "screenshot_png_b64": self.screenshot_b64, "screen_wh": list(self.screen_wh),
            "candidates": [c.to_json() for c in self.candidates] if self.status == "deciding" else [],
            "history": history, "return": float(sum(t.env_reward for t in ep.turns)) if ep is not None else 0.0,
            "actions": list(self.server.grammar_actions), "policy_version": self.version,
            "recovered": self.client.recovered, "written": self.written,
            "sandbox_session": self.client.real_session(self.sid) if self.sid else None}


# ---- the service: sessions, the policy, the queue, storage -------------------------------------------

class AnnotationServer:
  """Everything behind the page: the run's policy in an `InferenceService` (k candidates per turn),
  the sandbox clients, the task queue, the sessions of every annotator, and the annotation directory.

  Args: parts (`train.state.Parts` of the run's config), service (its InferenceService), clients
    (SandboxClients on the running loop), tasks, run (run dir: its eval JSONs order the queue), out
    (annotation directory; `incomplete/` under it), k (candidates per turn), idle_s (a session whose
    page has not acted for this long is closed: a closed tab).
  """

  def __init__(self, parts, service, clients, tasks: Sequence[str], run: str, out: str, k: int = 3,
               idle_s: float = 600.0):
    self.parts, self.service, self.clients, self.run, self.out = parts, service, list(clients), run, out
    self.tok, self.grammar, self.loop_cfg = parts.tokenizer, parts.grammar, parts.loop_cfg
    self.coord_format = parts.config.grammar.coord_format
    self.coords = A.CoordSpec()
    self.grammar_actions = tuple(parts.config.grammar.actions)
    self.k, self.idle_s = k, idle_s
    self.incomplete = os.path.join(out, "incomplete")
    self.queue = TaskQueue(tasks, run, [out, self.incomplete])
    self.sessions: dict[str, AnnotationSession] = {}
    self.meta = records.DatasetMeta.for_model(parts.image_hw, parts.loop_cfg.n_img_tokens, parts.tokenizer)
    self._n = 0

  @property
  def version(self) -> int:
    return self.service.version

  async def start_session(self, annotator: str, task: str | None = None) -> AnnotationSession:
    """A new episode for `annotator` from the queue (or of `task`); returns once its first candidates
    are shown (or it ended). Raises ValueError for an unknown task or an empty annotator name."""
    if not annotator.strip():
      raise ValueError("an annotator name is needed (it goes into every record)")
    task, seed = self.queue.next(task)
    s = AnnotationSession(self, annotator.strip(), task, seed, client_for(self.clients, task, self._n))
    self._n += 1
    self.sessions[s.id] = s
    await s.wait_while("starting")
    return s

  def reload(self, run: str | None = None) -> dict:
    """The policy of `run` (default the current run: its newest checkpoint) and its queue order;
    sessions already running keep the candidates shown and get the new weights from their next turn."""
    from tars_jax.train import state as state_lib
    self.run = run or self.run
    params, step, _ = state_lib.restore_policy(self.parts.init_state(self.parts.config.seed), self.run)
    self.service.set_params(params, step)
    self.queue = TaskQueue(self.queue.tasks, self.run, [self.out, self.incomplete])
    return {"run": self.run, "version": step, "order": self.queue.order, "success": self.queue.success}

  async def sweep_idle(self) -> None:
    """Closes sessions whose page has been silent for idle_s (a closed tab); forever, every 5 s."""
    while True:
      await asyncio.sleep(min(5.0, self.idle_s))
      now = time.monotonic()
      for s in list(self.sessions.values()):
        if s.status == "deciding" and now - s.last_active > self.idle_s:
          await s.close(f"idle for {self.idle_s:.0f} s (page closed?)")

  def write_episode(self, s: AnnotationSession, complete: bool, why: str | None) -> str | None:
    """Writes `s`'s episode as one trajectory record (source "annotation"): into `out` when complete,
    into `out/incomplete` otherwise (closed half-way, or its sandbox failed for good); returns the
    directory, or None for an episode without a turn."""
    ep = s.ep
    if ep is None or not ep.turns:
      return None
    directory = self.out if complete else self.incomplete
    extra = {"annotator": s.annotator, "complete": complete, "stopped": why, "recovered": s.client.recovered,
             "policy_run": self.run, "policy_version": s.version, "turns": s.decisions[:len(ep.turns)]}
    prefix = f"ann-{int(time.time() * 1000)}-{s.id}"
    with records.RecordWriter(directory, self.meta, prefix=prefix) as w:
      w.write(ep, source=SOURCE, policy_version=s.version, extra=extra)
    return directory


__all__ = ["SOURCE", "SEED_OFFSET", "BadOverride", "TurnMovedOn", "TaskQueue", "RecoveringClient", "Candidate",
           "candidate", "override_reply", "HumanAgent", "AnnotationSession", "AnnotationServer", "latest_eval"]
