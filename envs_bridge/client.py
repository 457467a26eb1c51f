"""Async client of the sandbox protocol (httpx); raises the typed errors of `envs_bridge.protocol`.

  async with SandboxClient(url) as c:
    sid, obs = await c.open("miniwob/click-test", seed=0)
    obs = await c.step(sid, "Thought: …\\nAction: click(start_box='(500,600)')")
    img = obs.image()            # [210, 160, 3] uint8

`SessionPool(urls)` spreads sessions over several servers (round-robin) for rollouts.
"""

from __future__ import annotations

import dataclasses
import itertools

import httpx

from envs_bridge import protocol as P


class SandboxClient:
  """One sandbox server. All calls are coroutines; many sessions may be driven concurrently.

  Args:
    base_url: e.g. 'http://127.0.0.1:8765'.
    timeout_s: per-request timeout in seconds.
    max_connections: httpx connection pool size (>= concurrent sessions you drive).

  Every call raises the typed `protocol.SandboxError` subclass of an error response (UnknownTask,
  UnknownSession, LeaseExpired, SessionLost, TaskError, ServerBusy, InvalidAction; a plain
  SandboxError with `.status` for others, e.g. 422 validation errors), and httpx.TransportError
  when the server cannot be reached.
  """

  def __init__(self, base_url: str, timeout_s: float = 60.0, max_connections: int = 256):
    self.base_url = base_url.rstrip("/")
    self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s,
                                   limits=httpx.Limits(max_connections=max_connections,
                                                       max_keepalive_connections=max_connections))

  async def _call(self, method: str, path: str, **kw):
    r = await self._http.request(method, path, **kw)
    if r.status_code >= 400:
      try:
        body = r.json()
      except ValueError:
        body = r.text
      raise P.error_from_body(r.status_code, body)
    return r.json()

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
    """{'ok': True, 'sessions': n, ...server counters}."""
    return await self._call("GET", "/health")

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


class SessionPool:
  """Sessions spread round-robin over several sandbox servers.

  Args:
    urls: server base URLs; one `SandboxClient` each (`.clients`).
    **client_kw: passed to every SandboxClient.
  """

  def __init__(self, urls, **client_kw):
    if not urls:
      raise ValueError("SessionPool needs at least one server URL")
    self.clients = [SandboxClient(u, **client_kw) for u in urls]
    self._next = itertools.cycle(range(len(self.clients)))

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
