r"""Desktop sandbox server: FastAPI app over Xvfb sessions (the browser sandbox's protocol).

  python -m envs_bridge.desktop.server --port 8766 [--host 127.0.0.1] [--step-ms 300] \
      [--lease-s 300] [--max-sessions 8] [--width 640 --height 480] [--gui-only] [--cmd-timeout-s 10] \
      [--mcp-config servers.json] [--token T | env TARS_SANDBOX_TOKEN] [--max-body-bytes N]

Without a token the server binds loopback only (another --host is refused: SDK actions run shell
commands); with one, every route but /health needs `Authorization: Bearer <token>`.

Same calls, observation and typed errors as `envs_bridge/protocol.py` (so `SandboxClient`, the
trainer and the evaluator use it unchanged, e.g. `launch_server("envs_bridge.desktop.server")`).
Additions: `info.tool_output` / `info.tool_error` after SDK actions, `info.gui_only`,
`info.mcp_servers`; `GET /debug/sessions/{id}/state` (tests and experts only: session directory, window
tree, screen size, the task's programs and check; `SandboxClient.desktop_state`).
`--step-ms` is real time here: the wait after each action before the check and the screenshot.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

import uvicorn
from fastapi import FastAPI

from envs_bridge import protocol as P
from envs_bridge.app import (SERVER_KEEPALIVE_S, StepLatency, access_from_args, add_access_args, add_latency_args,
                             latency_from_args, protocol_app)
from envs_bridge.desktop import tasks
from envs_bridge.desktop.sessions import DesktopSandbox
from envs_bridge.launch import die_with_parent
from envs_bridge.sdk.terminal import Limits

log = logging.getLogger("envs_bridge.desktop")


def create_app(step_ms: int = 300, lease_s: float = 300.0, max_sessions: int = 8, width: int = tasks.WIDTH,
               height: int = tasks.HEIGHT, gui_only: bool = False, limits: Limits = Limits(),
               mcp_servers: dict | None = None, token: str | None = None,
               max_body_bytes: int = P.MAX_BODY_BYTES, step_latency: StepLatency | None = None) -> FastAPI:
  """The FastAPI app; sessions are torn down with the app's lifespan. `mcp_servers`: see DesktopSandbox;
  token, max_body_bytes, step_latency: see `envs_bridge.app.protocol_app`."""
  sandbox = DesktopSandbox(step_ms=step_ms, lease_s=lease_s, max_sessions=max_sessions, width=width,
                           height=height, gui_only=gui_only, limits=limits, mcp_servers=mcp_servers)

  app = protocol_app("tars_jax desktop sandbox", sandbox, tasks.task_names, log, token=token,
                     max_body_bytes=max_body_bytes, step_latency=step_latency)

  @app.get("/health")
  async def health():
    return {"ok": True, "sessions": len(sandbox.sessions), "step_ms": sandbox.step_ms, "lease_s": sandbox.lease_s,
            "max_sessions": sandbox.max_sessions, "gui_only": sandbox.gui_only, **sandbox.counters,
            "step_latency": step_latency and dataclasses.asdict(step_latency)}

  @app.get("/debug/sessions/{sid}/state", tags=["debug"])
  async def debug_state(sid: str):
    """DEBUG / TESTS / EXPERTS ONLY: session directory, captured program outputs, window tree with
    geometry, screen size, the task's programs and evaluator, the directory's entries."""
    return await sandbox.debug_state(sid)

  return app


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  add_access_args(ap)
  add_latency_args(ap)
  ap.add_argument("--port", type=int, default=8766)
  ap.add_argument("--step-ms", type=int, default=300, help="real ms waited after each action")
  ap.add_argument("--lease-s", type=float, default=300.0, help="idle seconds before a session is reclaimed")
  ap.add_argument("--max-sessions", type=int, default=8, help="concurrent sessions (ServerBusy beyond)")
  ap.add_argument("--width", type=int, default=tasks.WIDTH)
  ap.add_argument("--height", type=int, default=tasks.HEIGHT)
  ap.add_argument("--gui-only", action="store_true", help="disable SDK actions (GUI-only action space)")
  ap.add_argument("--cmd-timeout-s", type=float, default=Limits.timeout_s, help="terminal command time-out")
  ap.add_argument("--mcp-config", default=None,
                  help="JSON file {name: {command, args, env}}: stdio MCP servers every session may call")
  ap.add_argument("--log-level", default="warning")
  a = ap.parse_args(argv)
  token = access_from_args(ap, a)  # SDK actions run commands: never reachable off-host without a token
  die_with_parent()
  logging.basicConfig(level=a.log_level.upper())
  mcp = None
  if a.mcp_config:
    with open(a.mcp_config) as f:
      mcp = json.load(f)
  uvicorn.run(create_app(a.step_ms, a.lease_s, a.max_sessions, a.width, a.height, a.gui_only,
                         Limits(timeout_s=a.cmd_timeout_s), mcp, token=token, max_body_bytes=a.max_body_bytes,
                         step_latency=latency_from_args(a)),
              host=a.host, port=a.port, timeout_keep_alive=SERVER_KEEPALIVE_S, log_level=a.log_level)


if __name__ == "__main__":
  main()
