"""Access control and request limits of the sandbox servers (issue #5 "Bad input"): loopback only
without a token; with one, `Authorization: Bearer` on every route but /health (401 `Unauthorized`
otherwise); bodies over `max_body_bytes` refused with 413 `PayloadTooLarge`. Against a real browser
server bound to all interfaces with a token."""

import os
import subprocess
import sys

import httpx
import pytest

from envs_bridge import protocol as P
from envs_bridge.app import check_bind, is_loopback, server_token
from envs_bridge.client import SandboxClient
from envs_bridge.launch import free_port, launch_server
from _shared import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "s3cret-token-for-tests"
LIMIT = 64 * 1024  # small body limit, so the test sends little


@pytest.fixture(scope="module")
def secured():
  # 0.0.0.0 is allowed because there is a token; the handle's URL is loopback.
  with launch_server(host="0.0.0.0", token=TOKEN, extra_args=("--max-body-bytes", str(LIMIT))) as h:
    yield h


def test_bind_rules():
  assert [is_loopback(h) for h in ("127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost")] == [True] * 5
  assert [is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "example.com", "")] == [False] * 5
  check_bind("127.0.0.1", None)
  check_bind("0.0.0.0", "t")
  for host in ("0.0.0.0", "192.168.1.10", "::"):
    with pytest.raises(ValueError, match="without a token"):
      check_bind(host, None)
    with pytest.raises(ValueError, match="without a token"):
      check_bind(host, "")


def test_server_token_from_flag_or_env(monkeypatch):
  monkeypatch.delenv(P.TOKEN_ENV, raising=False)
  assert server_token(None) is None and server_token("") is None and server_token("a") == "a"
  monkeypatch.setenv(P.TOKEN_ENV, "from-env")
  assert server_token(None) == "from-env" and server_token("flag") == "flag"
  monkeypatch.setenv(P.TOKEN_ENV, "")
  assert server_token(None) is None


@pytest.mark.browser
@pytest.mark.parametrize("server", ["envs_bridge.browser.server", "envs_bridge.desktop.server"])
def test_non_loopback_without_token_is_refused_before_start(monkeypatch, server):
  # the desktop server runs shell commands for SDK actions: the same rule matters even more there
  monkeypatch.delenv(P.TOKEN_ENV, raising=False)
  r = subprocess.run([sys.executable, "-m", server, "--host", "0.0.0.0",
                      "--port", str(free_port())], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert r.returncode == 2 and "refusing to bind '0.0.0.0' without a token" in r.stderr


@pytest.mark.browser
def test_token_required_on_every_route_but_health(secured, monkeypatch):
  monkeypatch.delenv(P.TOKEN_ENV, raising=False)
  assert secured.token == TOKEN
  url = secured.url
  assert httpx.get(url + "/health").status_code == 200  # liveness stays open
  routes = [("GET", "/tasks", None), ("GET", "/metrics", None), ("GET", "/events", None),
            ("POST", "/sessions", {"task": "miniwob/click-test"}),
            ("POST", "/sessions/abc/step", {"action": "wait()"}), ("GET", "/sessions/abc/observe", None),
            ("DELETE", "/sessions/abc", None), ("POST", "/sessions/abc/snapshot", None),
            ("GET", "/debug/sessions/abc/element_box?selector=a", None), ("GET", "/openapi.json", None),
            ("GET", "/docs", None)]
  for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic " + TOKEN},
                  {"Authorization": TOKEN}):
    for method, path, body in routes:
      r = httpx.request(method, url + path, json=body, headers=headers)
      assert r.status_code == 401, (method, path, headers, r.status_code, r.text)
      assert r.json()["error"] == "Unauthorized" and r.headers["www-authenticate"] == "Bearer"
  # a malformed body without a token is still 401, not a 422 that tells what the server expects
  r = httpx.post(url + "/sessions", content=b"{not json", headers={"content-type": "application/json"})
  assert r.status_code == 401

  async def go():
    async with SandboxClient(url) as anon, SandboxClient(url, token="wrong") as bad, \
        SandboxClient(url, token=TOKEN) as good:
      for c in (anon, bad):
        with pytest.raises(P.Unauthorized):
          await c.tasks()
        with pytest.raises(P.Unauthorized):
          await c.open("miniwob/click-test", 0)
        with pytest.raises(P.Unauthorized):
          await c.metrics()
      assert (await anon.health())["ok"]
      sid, o0 = await good.open("miniwob/click-test", 0)
      o1 = await good.step(sid, "wait()")
      await good.close(sid)
      return o0, o1, await good.health(), await good.metrics()
  o0, o1, h, metrics = run(go())
  assert o0.info["step"] == 0 and o1.info["step"] == 1 and h["opened"] == 1 and h["closed"] == 1
  assert "sandbox_sessions" in metrics
  assert "/sessions" in httpx.get(url + "/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"}).json()["paths"]


@pytest.mark.browser
def test_client_takes_the_token_from_the_environment(secured, monkeypatch):
  monkeypatch.setenv(P.TOKEN_ENV, TOKEN)

  async def go():
    async with SandboxClient(secured.url) as c:
      return await c.tasks()
  assert "miniwob/click-test" in run(go())


@pytest.mark.browser
def test_oversized_bodies_get_413(secured):
  auth = {"Authorization": f"Bearer {TOKEN}"}
  big = {"action": "x" * (LIMIT + 1)}
  r = httpx.post(secured.url + "/sessions/abc/step", json=big, headers=auth)
  assert r.status_code == 413
  assert r.json() == {"error": "PayloadTooLarge", "reason": f"request body over {LIMIT} bytes "
                      "(this server's max_body_bytes)", "max_body_bytes": LIMIT}

  def chunks():  # no Content-Length: the limit is counted while the body is read
    for _ in range(LIMIT // 1024 + 2):
      yield b"x" * 1024
  r = httpx.post(secured.url + "/sessions", content=chunks(), headers={**auth, "content-type": "application/json"})
  assert r.status_code == 413 and r.json()["error"] == "PayloadTooLarge"
  # just under the limit is an ordinary request (here: an unknown session)
  r = httpx.post(secured.url + "/sessions/abc/step", json={"action": "x" * (LIMIT - 100)}, headers=auth)
  assert r.status_code == 404 and r.json()["error"] == "UnknownSession"

  async def go():
    async with SandboxClient(secured.url, token=TOKEN) as c:
      with pytest.raises(P.PayloadTooLarge) as e:
        await c.step("abc", "x" * (LIMIT + 1))
      return e.value
  err = run(go())
  assert err.extra["max_body_bytes"] == LIMIT
  assert httpx.get(secured.url + "/health").json()["ok"]  # the server lives on


@pytest.mark.browser
def test_gym_env_sends_the_token_from_the_environment(secured, monkeypatch):
  from envs_bridge.gym import TarsEnv
  monkeypatch.delenv(P.TOKEN_ENV, raising=False)
  env = TarsEnv("miniwob/click-test", server_url=secured.url)
  with pytest.raises(P.Unauthorized):
    env.reset(seed=0)
  env.close()
  monkeypatch.setenv(P.TOKEN_ENV, TOKEN)
  env = TarsEnv("miniwob/click-test", server_url=secured.url)
  obs, info = env.reset(seed=0)
  assert obs["screenshot"].shape == env.observation_space["screenshot"].shape and info["step"] == 0
  env.close()


@pytest.mark.browser
def test_desktop_server_requires_its_token(monkeypatch):
  monkeypatch.delenv(P.TOKEN_ENV, raising=False)
  with launch_server("envs_bridge.desktop.server", host="0.0.0.0", token=TOKEN) as h:
    assert httpx.get(h.url + "/health").status_code == 200
    r = httpx.get(h.url + "/tasks")
    assert r.status_code == 401 and r.json()["error"] == "Unauthorized"
    r = httpx.get(h.url + "/tasks", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and any(t.startswith("desktop/") for t in r.json()["tasks"])
