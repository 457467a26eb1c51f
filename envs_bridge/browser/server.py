r"""Browser sandbox server: FastAPI app over Chromium processes with many sessions (docs/ARCHITECTURE.md protocol).

  python -m envs_bridge.browser.server --port 8765 [--host 127.0.0.1] [--step-ms 1000] \
      [--lease-s 300] [--max-sessions 64] [--browsers 1] [--page-timeout-s 60] [--gc-interval-s 30] \
      [--token T | env TARS_SANDBOX_TOKEN] [--max-body-bytes 4194304] [--spare-pages 0]

Without a token the server binds loopback only (another --host is refused); with one, every route
but /health needs `Authorization: Bearer <token>` (401 otherwise). Prefer the env var to --token:
command lines are visible to every user of the machine (`ps`).

OpenAPI schema at /openapi.json; `envs_bridge/protocol.py` documents the calls, the observation and
the error bodies. `envs_bridge.launch.launch_server` starts this as a subprocess.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

import uvicorn
from fastapi import FastAPI
from fastapi import Query
from fastapi.responses import JSONResponse, Response

from envs_bridge import protocol as P
from envs_bridge.app import (SERVER_KEEPALIVE_S, StepLatency, access_from_args, add_access_args, add_latency_args,
                             latency_from_args, protocol_app)
from envs_bridge.browser import tasks as task_registry
from envs_bridge.browser import telemetry
from envs_bridge.browser.sessions import DEFAULT_CHROMIUM, BrowserSandbox
from envs_bridge.launch import die_with_parent

log = logging.getLogger("envs_bridge.browser")


def create_app(step_ms: int = 1000, lease_s: float = 300.0, max_sessions: int = 64, n_browsers: int = 1,
               page_timeout_s: float = 60.0, gc_interval_s: float = 30.0, token: str | None = None,
               max_body_bytes: int = P.MAX_BODY_BYTES, spare_pages: int = 0,
               chromium: str = DEFAULT_CHROMIUM, step_latency: StepLatency | None = None) -> FastAPI:
  """The FastAPI app; the sandbox (Chromium) starts and stops with the app's lifespan.
  Arguments: see `BrowserSandbox`; token, max_body_bytes, step_latency: see `envs_bridge.app.protocol_app`."""
  sandbox = BrowserSandbox(step_ms=step_ms, lease_s=lease_s, max_sessions=max_sessions, n_browsers=n_browsers,
                           page_timeout_s=page_timeout_s, gc_interval_s=gc_interval_s, spare_pages=spare_pages,
                           executable=chromium)

  app = protocol_app("tars_jax browser sandbox", sandbox, task_registry.task_names, log, token=token,
                     max_body_bytes=max_body_bytes, step_latency=step_latency)

  @app.get("/health")
  async def health():
    """Liveness and counters; HTTP 503 when no Chromium is connected (a relaunch is under way)."""
    h = dict(sandbox.health(), step_latency=step_latency and dataclasses.asdict(step_latency))
    return JSONResponse(status_code=200 if h["ok"] else 503, content=h)

  @app.get("/metrics")
  async def metrics():
    """Prometheus text format (prometheus-client): sandbox_sessions, sandbox_steps_total,
    sandbox_steps_per_second, crash/recovery counters, sandbox_op_seconds latency histograms."""
    return Response(content=sandbox.metrics_text(), media_type=telemetry.CONTENT_TYPE)

  @app.get("/events")
  async def events(since: int = Query(0, ge=0), limit: int = Query(1000, ge=1, le=10_000)):
    """Browser/page/session events with seq > `since`, oldest first."""
    evs = sandbox.events.since(since, limit)
    return {"events": evs, "last": evs[-1]["seq"] if evs else since}

  @app.post("/sessions/{sid}/snapshot", response_model=P.Snapshot)
  async def snapshot(sid: str):
    return P.Snapshot(**await sandbox.snapshot(sid))

  @app.post("/sessions/{sid}/restore", response_model=P.Observation)
  async def restore(sid: str, snap: P.Snapshot):
    return await sandbox.restore(sid, snap.model_dump())

  @app.get("/debug/sessions/{sid}/elements", tags=["debug"])
  async def elements(sid: str):
    """DEBUG / EXPERTS / DATA ONLY: every visible element of the task area with its text and pixel
    box (`BrowserSandbox.elements`). Scripted experts and grounding data read it; agents never do."""
    return {"elements": await sandbox.elements(sid)}

  @app.get("/debug/sessions/{sid}/game_state", tags=["debug"])
  async def game_state(sid: str):
    """DEBUG / EXPERTS ONLY: a game session's privileged state (`BrowserSandbox.game_state`), what the
    games' reference players read; agents never do."""
    return {"state": await sandbox.game_state(sid)}

  @app.get("/debug/sessions/{sid}/element_box", tags=["debug"])
  async def element_box(sid: str, selector: str):
    """DEBUG / TESTS ONLY: pixel bounding box of a DOM element (CSS selector), or null. Lets tests
    find the right button of a task; agents never use it (they see only screenshots)."""
    return {"box": await sandbox.element_box(sid, selector)}

  return app


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  add_access_args(ap)
  add_latency_args(ap)
  ap.add_argument("--port", type=int, default=8765)
  ap.add_argument("--step-ms", type=int, default=1000, help="virtual ms advanced per step")
  ap.add_argument("--lease-s", type=float, default=300.0, help="idle seconds before a session is reclaimed")
  ap.add_argument("--max-sessions", type=int, default=64, help="concurrent sessions (ServerBusy beyond)")
  ap.add_argument("--browsers", type=int, default=1, help="Chromium processes (sessions spread over them)")
  ap.add_argument("--page-timeout-s", type=float, default=60.0, help="a page silent this long counts as hung")
  ap.add_argument("--gc-interval-s", type=float, default=30.0, help="seconds between leaked-page GC passes")
  ap.add_argument("--spare-pages", type=int, default=0,
                  help="0: no standby browser; N: a standby Chromium with up to N pre-made pages, promoted "
                       "when a browser dies (fast crash recovery; costs its memory, see /health spare.pss_mb)")
  ap.add_argument("--chromium", default=DEFAULT_CHROMIUM, help="Chromium executable")
  ap.add_argument("--log-level", default="warning")
  a = ap.parse_args(argv)
  if not os.access(a.chromium, os.X_OK):
    ap.error(f"--chromium {a.chromium}: not an executable file")
  token = access_from_args(ap, a)  # exit code 2 before any Chromium starts
  die_with_parent()  # started by launch_server: never outlive the trainer
  logging.basicConfig(level=a.log_level.upper())
  uvicorn.run(create_app(a.step_ms, a.lease_s, a.max_sessions, a.browsers, a.page_timeout_s, a.gc_interval_s,
                         token=token, max_body_bytes=a.max_body_bytes, spare_pages=a.spare_pages,
                         chromium=a.chromium, step_latency=latency_from_args(a)),
              host=a.host, port=a.port, timeout_keep_alive=SERVER_KEEPALIVE_S,
              log_level=a.log_level)


if __name__ == "__main__":
  main()
