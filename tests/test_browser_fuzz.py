"""Property-based fuzzing of the browser server's HTTP API with schemathesis (issue #5 item 6): requests
generated from the server's own OpenAPI schema (/openapi.json) — valid ones and ones that break it
(negative mode) — against a real server with real Chromium on loopback never get a 5xx, and the
server keeps serving. Also with a live session id in every `{sid}` path, so that steps (random action
texts), observes, snapshots, restores (random snapshots) and debug selectors reach a real page."""

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from envs_bridge.client import SandboxClient
from envs_bridge.launch import launch_server
from _shared import run

pytestmark = pytest.mark.browser

TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TASK = "miniwob/click-test"
EXAMPLES = 25  # per generation mode and variant; ~200 requests in all (~20-40 s on 2 busy cores)


@pytest.fixture(scope="module")
def fuzzed():
  with launch_server(token=TOKEN, lease_s=600.0, page_timeout_s=20.0) as h:
    yield h


def _fuzz(h, schema, mode, path_parameters=None, on_ok=None):
  """Runs EXAMPLES generated requests of `mode`; -> the 5xx answers as readable strings."""
  bad = []

  @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
            suppress_health_check=list(HealthCheck), phases=[hypothesis.Phase.generate])
  @given(case=schema.as_strategy(generation_mode=mode, path_parameters=path_parameters))
  def check(case):
    r = case.call(base_url=h.url, headers=AUTH, timeout=120)
    if r.status_code >= 500:
      bad.append(f"{r.status_code} {case.method} {case.formatted_path} body={str(case.body)[:200]!r} "
                 f"query={case.query!r} -> {r.text[:300]}")
    elif on_ok is not None:
      on_ok(case, r)
  check()
  return bad


def test_generated_requests_never_get_5xx(fuzzed):
  schema = schemathesis.openapi.from_url(fuzzed.url + "/openapi.json", headers=AUTH)
  opened = []

  def note_opened(case, r):  # a generated open that named a real task: closed below
    if case.method == "POST" and case.formatted_path == "/sessions" and r.status_code == 200:
      opened.append(r.json()["session_id"])

  bad = []
  for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
    bad += _fuzz(fuzzed, schema, mode, on_ok=note_opened)

  async def live_session():
    async with SandboxClient(fuzzed.url, token=TOKEN) as c:
      return (await c.open(TASK, 0))[0]
  sid = run(live_session())
  # a live session in every {sid} path; DELETE would end it after one example, so it is left out
  live = schema.exclude(method="DELETE")
  for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
    bad += _fuzz(fuzzed, live, mode, path_parameters={"sid": sid}, on_ok=note_opened)
  assert bad == [], "\n".join(bad)

  async def after():
    async with SandboxClient(fuzzed.url, token=TOKEN) as c:
      for s in opened:
        await c.close(s)
      o = await c.step(sid, "wait()")  # the fuzzed session still works (or ended by a fuzzed finished())
      await c.close(sid)
      return o, await c.health()
  o, h = run(after())
  assert o.info["task"] == TASK and h["ok"] and h["sessions"] == 0
  assert h["steps"] > 0  # the live variant really stepped the page
