"""Async client of the sandbox protocol (httpx); raises the typed errors of `envs_bridge.protocol`.

  async with SandboxClient(url) as c:
    sid, obs = await c.open("miniwob/click-test", seed=0)
    obs = await c.step(sid, "Thought: …\\nAction: click(start_box='(500,600)')")
    img = obs.image()            # [210, 160, 3] uint8

`SessionPool(urls)` spreads sessions over several servers (round-robin) for rollouts;
`SessionPool.run_episode(task, seed, policy)` plays one episode and, when its session is lost
(`protocol.is_retryable`: SessionLost, LeaseExpired, ServerBusy, an unreachable server), replays it
from its seed on the next server,
counting `episodes_lost` / `episodes_retried` (`.stats`, and Prometheus text via `.metrics_text()`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Awaitable, Callable, Sequence

import httpx
import prometheus_client as prom

from envs_bridge import protocol as P


# Idle keep-alive connections are dropped here before the server drops them (SERVER_KEEPALIVE_S in
# envs_bridge/app.py): with equal timeouts, a request sent on a connection the server was closing at
# that moment fails with httpx.ReadError (a race that long soaks, benchmarks/soak.py, run into).
KEEPALIVE_S = 10.0


def response_json(r: httpx.Response):
  """The JSON body of a sandbox response. Raises: the typed `protocol.SandboxError` of an HTTP error
  (`protocol.error_from_body`; a non-JSON error body is passed on as text)."""
  if r.status_code >= 400:
    try:
      body = r.json()
    except ValueError:
      body = r.text
    raise P.error_from_body(r.status_code, body)
  return r.json()


def auth_headers(token: str | None = None) -> dict[str, str] | None:
  """`Authorization: Bearer` headers for a sandbox server's `token`; None: the env var
  `protocol.TOKEN_ENV` if set; no headers (None) when neither is set."""
  token = P.resolve_token(token)
  return {"Authorization": f"Bearer {token}"} if token else None


class SandboxClient:
  """One sandbox server. All calls are coroutines; many sessions may be driven concurrently.

  Args:
    base_url: e.g. 'http://127.0.0.1:8765'.
    timeout_s: per-request timeout in seconds.
    max_connections: httpx connection pool size (>= concurrent sessions you drive).
    token: the server's bearer token (sent as `Authorization: Bearer`); None: the env var
      `protocol.TOKEN_ENV` if set, else none.
    serves: the task names the server serves (its `GET /tasks`), for routing episodes over servers of
      different kinds (`client_for`; `launch.sandbox_fleet` fills it in); None: not known, any task.

  Every call raises the typed `protocol.SandboxError` subclass of an error response (UnknownTask,
  UnknownSession, LeaseExpired, SessionLost, TaskError, ServerBusy, InvalidAction, Unauthorized (401:
  missing or wrong token), PayloadTooLarge (413); a plain
  SandboxError with `.status` for others, e.g. 422 validation errors), and httpx.TransportError
  when the server cannot be reached.
  """

  def __init__(self, base_url: str, timeout_s: float = 60.0, max_connections: int = 256,
               token: str | None = None, serves: frozenset[str] | None = None):
    self.base_url = base_url.rstrip("/")
    self.serves = serves
    self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, headers=auth_headers(token),
                                   limits=httpx.Limits(max_connections=max_connections,
                                                       max_keepalive_connections=max_connections,
                                                       keepalive_expiry=KEEPALIVE_S))

  async def _call(self, method: str, path: str, **kw):
    return response_json(await self._http.request(method, path, **kw))

  async def open(self, task: str, seed: int = 0, coords: str = "relative1000",
                 data_mode: str = "train") -> tuple[str, P.Observation]:
    """Starts an episode of `task` with `seed`; returns (session_id, first observation).

    coords: how the session's actions write coordinates ('relative1000' or 'absolute' pixels).
    """
    out = P.OpenResponse(**await self._call("POST", "/sessions", json={
        "task": task, "seed": seed, "coords": coords, "data_mode": data_mode}))
    return out.session_id, out.observation

  async def step(self, session_id: str, action: str) -> P.Observation:
    """Executes an action string (a 'Thought: …\\nAction: …' reply or a bare action)."""
    return P.Observation(**await self._call("POST", f"/sessions/{session_id}/step", json={"action": action}))

  async def observe(self, session_id: str) -> P.Observation:
    """The current observation, without acting (reward 0)."""
    return P.Observation(**await self._call("GET", f"/sessions/{session_id}/observe"))

  async def close(self, session_id: str) -> None:
    """Ends the session (idempotent for sessions that already ended)."""
    await self._call("DELETE", f"/sessions/{session_id}")

  async def tasks(self) -> list[str]:
    return (await self._call("GET", "/tasks"))["tasks"]

  async def health(self) -> dict:
    """{'ok': bool, 'sessions': n, 'browsers': [...], ...server counters}; also while the server
    answers 503 (no Chromium connected: a relaunch is under way)."""
    r = await self._http.get("/health")
    if r.status_code not in (200, 503):
      raise P.error_from_body(r.status_code, r.text)
    return r.json()

  async def snapshot(self, session_id: str) -> P.Snapshot:
    """A deterministic-replay snapshot of the session (seed + actions so far + screenshot hash)."""
    return P.Snapshot(**await self._call("POST", f"/sessions/{session_id}/snapshot"))

  async def restore(self, session_id: str, snap: P.Snapshot) -> P.Observation:
    """Replays `snap` on the session (same task); returns the restored observation.
    Raises: InvalidAction (other task / step_ms), TaskError (replay diverged), session errors."""
    return P.Observation(**await self._call("POST", f"/sessions/{session_id}/restore", json=snap.model_dump()))

  async def metrics(self) -> str:
    """The server's Prometheus text exposition."""
    r = await self._http.get("/metrics")
    if r.status_code >= 400:
      response_json(r)  # raises the typed error
    return r.text

  async def events(self, since: int = 0, limit: int = 1000) -> list[dict]:
    """Server events (browser/page/session) with seq > since, oldest first."""
    return (await self._call("GET", "/events", params={"since": since, "limit": limit}))["events"]

  async def elements(self, session_id: str) -> list[dict]:
    """DEBUG / EXPERTS / DATA ONLY: the visible elements of the task area, in document order, each
    {tag, id, classes, type, text, value, checked, focused, leaf, x, y, width, height} (box in
    screenshot pixels). Raises the typed session errors."""
    return (await self._call("GET", f"/debug/sessions/{session_id}/elements"))["elements"]

  async def game_state(self, session_id: str) -> dict:
    """DEBUG / EXPERTS ONLY: the privileged state of a game session (`GAME.debugState()`, read by the
    reference players of envs_bridge/games/reference.py). Raises: InvalidAction (not a game), the
    typed session errors."""
    return (await self._call("GET", f"/debug/sessions/{session_id}/game_state"))["state"]

  async def desktop_state(self, session_id: str) -> dict:
    """DEBUG / EXPERTS ONLY: the privileged state of a desktop / hybrid session (`DesktopSandbox.debug_state`:
    work, display, outputs, windows [{id, name, class, x, y, width, height, depth}] in screen pixels,
    width, height, programs {label: argv}, evaluator, entries). Raises the typed session errors."""
    return await self._call("GET", f"/debug/sessions/{session_id}/state")

  async def element_box(self, session_id: str, selector: str) -> dict | None:
    """DEBUG / TESTS ONLY: {x, y, width, height} px of the first element matching `selector`."""
    return (await self._call("GET", f"/debug/sessions/{session_id}/element_box",
                             params={"selector": selector}))["box"]

  async def aclose(self) -> None:
    await self._http.aclose()

  async def __aenter__(self):
    return self

  async def __aexit__(self, *exc):
    await self.aclose()


def client_for(clients: Sequence[SandboxClient], task: str, k: int) -> SandboxClient:
  """The `k`-th (round robin) of the `clients` that serve `task`: a fleet of browser and desktop servers
  sends each episode to a server that has its task. Clients whose `serves` is None take any task.

  Raises: P.UnknownTask (naming the tasks the fleet serves) when no client serves `task`.
  """
  able = [c for c in clients if c.serves is None or task in c.serves]
  if not able:
    known = sorted(set().union(*(c.serves for c in clients if c.serves is not None)))
    raise P.UnknownTask(f"no sandbox server of the fleet serves task {task!r}", tasks=known)
  return able[k % len(able)]


@dataclasses.dataclass
class RemoteSession:
  """An open session on one server: `await s.step(action)`, `await s.close()`."""

  client: SandboxClient
  id: str
  observation: P.Observation  # the latest one

  async def step(self, action: str) -> P.Observation:
    self.observation = await self.client.step(self.id, action)
    return self.observation

  async def observe(self) -> P.Observation:
    self.observation = await self.client.observe(self.id)
    return self.observation

  async def close(self) -> None:
    await self.client.close(self.id)


# policy(session) -> the next action text, or None to stop; session.observation is the latest one.
Policy = Callable[[RemoteSession], Awaitable[str | None]]
@dataclasses.dataclass
class PoolStats:
  episodes: int = 0  # episodes finished (not lost)
  episodes_lost: int = 0  # attempts that lost their session
  episodes_retried: int = 0  # replays from the seed after a loss
  episodes_failed: int = 0  # lost on every attempt (returned with lost=True)


@dataclasses.dataclass
class EpisodeResult:
  task: str
  seed: int
  observations: list[P.Observation]  # first observation, then one per step (of the last attempt)
  actions: list[str]
  attempts: int  # 1 + retries
  lost: bool = False  # True: every attempt was lost; do not train on it
  lost_reasons: list[str] = dataclasses.field(default_factory=list)

  @property
  def reward(self) -> float:
    return sum(o.reward for o in self.observations)

  @property
  def done(self) -> bool:
    return bool(self.observations) and self.observations[-1].done


class SessionPool:
  """Sessions spread round-robin over several sandbox servers.

  Args:
    urls: server base URLs; one `SandboxClient` each (`.clients`).
    max_retries: replays of a lost episode (run_episode) before it is given up as lost.
    **client_kw: passed to every SandboxClient.
  """

  def __init__(self, urls, max_retries: int = 2, **client_kw):
    if not urls:
      raise ValueError("SessionPool needs at least one server URL")
    if max_retries < 0:
      raise ValueError(f"max_retries must be >= 0, got {max_retries}")
    self.clients = [SandboxClient(u, **client_kw) for u in urls]
    self._next = itertools.cycle(range(len(self.clients)))
    self.max_retries = max_retries
    self.stats = PoolStats()
    self.registry = prom.CollectorRegistry()
    self._m = {k: prom.Counter(f"sandbox_pool_{k}", f"client pool: {k.replace('_', ' ')}", registry=self.registry)
               for k in ("episodes", "episodes_lost", "episodes_retried", "episodes_failed")}

  def _count(self, key: str) -> None:
    setattr(self.stats, key, getattr(self.stats, key) + 1)
    self._m[key].inc()

  def metrics_text(self) -> bytes:
    """Prometheus text of the pool counters (sandbox_pool_episodes_lost_total, ...)."""
    return prom.generate_latest(self.registry)

  async def run_episode(self, task: str, seed: int, policy: Policy, max_steps: int = 50,
                        **open_kw) -> EpisodeResult:
    """Plays `task`/`seed` with `policy` until done, the policy returns None, or `max_steps`.

    A lost session (`protocol.is_retryable`) loses the attempt: it is counted (`episodes_lost`) and the episode
    is replayed from its seed on the next server (`episodes_retried`), at most `max_retries` times;
    after that it is returned with `lost=True` (`episodes_failed`). The policy is called afresh on
    every attempt, so it must depend only on the observations of the attempt it is given.
    Raises: other errors at once (UnknownTask, Unauthorized, TaskError, ...), which no replay would fix.
    """
    reasons: list[str] = []
    for attempt in range(1, self.max_retries + 2):
      sess = None
      actions: list[str] = []
      obs: list[P.Observation] = []
      try:
        sess = await self.open(task, seed, **open_kw)
        obs.append(sess.observation)
        while not sess.observation.done and len(actions) < max_steps:
          a = await policy(sess)
          if a is None:
            break
          actions.append(a)
          obs.append(await sess.step(a))
      except Exception as e:
        if not P.is_retryable(e):
          raise
        reasons.append(f"{type(e).__name__}: {getattr(e, 'reason', None) or e}")
        logging.warning("episode %s/%d lost on attempt %d: %s", task, seed, attempt, reasons[-1])
        self._count("episodes_lost")
        if attempt <= self.max_retries:
          self._count("episodes_retried")
        continue
      finally:
        if sess is not None:
          try:
            await sess.close()
          except (P.SandboxError, httpx.TransportError):
            pass  # best effort: a lost session is already gone, the lease reclaims the rest
      self._count("episodes")
      return EpisodeResult(task, seed, obs, actions, attempt, lost_reasons=reasons)
    self._count("episodes_failed")
    return EpisodeResult(task, seed, [], [], self.max_retries + 1, lost=True, lost_reasons=reasons)

  async def open(self, task: str, seed: int = 0, **kw) -> RemoteSession:
    """Opens a session on the next server. Raises: as SandboxClient.open."""
    c = self.clients[next(self._next)]
    sid, obs = await c.open(task, seed, **kw)
    return RemoteSession(c, sid, obs)

  async def health(self) -> list[dict]:
    return [await c.health() for c in self.clients]

  async def aclose(self) -> None:
    for c in self.clients:
      await c.aclose()

  async def __aenter__(self):
    return self

  async def __aexit__(self, *exc):
    await self.aclose()
