"""Async client of the sandbox protocol (httpx); raises the typed errors of `envs_bridge.protocol`."""

from __future__ import annotations

import httpx

from envs_bridge import protocol as P


class SandboxClient:
  """One sandbox server. All calls are coroutines; many sessions may be driven concurrently.

  Args:
    base_url: e.g. 'http://127.0.0.1:8765'.
    timeout_s: per-request timeout in seconds.
  """

  def __init__(self, base_url: str, timeout_s: float = 60.0, max_connections: int = 256):
    self.base_url = base_url.rstrip("/")
    self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s,
                                   limits=httpx.Limits(max_connections=max_connections))

  async def _call(self, method: str, path: str, **kw):
    r = await self._http.request(method, path, **kw)
    if r.status_code >= 400:
      try:
        body = r.json()
      except ValueError:
        body = r.text
      raise P.error_from_body(r.status_code, body)
    return r.json()

  async def open(self, task: str, seed: int = 0, coords: str = "relative1000") -> tuple[str, P.Observation]:
    """Starts an episode of `task` with `seed`; returns (session_id, first observation)."""
    out = P.OpenResponse(**await self._call("POST", "/sessions",
                                            json={"task": task, "seed": seed, "coords": coords}))
    return out.session_id, out.observation

  async def step(self, session_id: str, action: str) -> P.Observation:
    """Executes an action string (reply or bare action); returns the next observation."""
    return P.Observation(**await self._call("POST", f"/sessions/{session_id}/step", json={"action": action}))

  async def observe(self, session_id: str) -> P.Observation:
    return P.Observation(**await self._call("GET", f"/sessions/{session_id}/observe"))

  async def close(self, session_id: str) -> None:
    await self._call("DELETE", f"/sessions/{session_id}")

  async def tasks(self) -> list[str]:
    return (await self._call("GET", "/tasks"))["tasks"]

  async def health(self) -> dict:
    return await self._call("GET", "/health")

  async def element_box(self, session_id: str, selector: str) -> dict | None:
    return (await self._call("GET", f"/sessions/{session_id}/element_box", params={"selector": selector}))["box"]

  async def aclose(self) -> None:
    await self._http.aclose()

  async def __aenter__(self):
    return self

  async def __aexit__(self, *exc):
    await self.aclose()
