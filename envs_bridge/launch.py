"""Start a sandbox server as a subprocess on a free loopback port, wait for /health, stop it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class ServerHandle:
  """A running server subprocess. `.url`; `.stop()` (also as a context manager)."""

  def __init__(self, proc: subprocess.Popen, url: str, log_path: str | None):
    self.proc, self.url, self.log_path = proc, url, log_path

  def stop(self, timeout: float = 10.0) -> None:
    if self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(timeout)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.stop()


def launch_server(module: str = "envs_bridge.browser.server", port: int | None = None,
                  step_ms: int = 1000, lease_s: float = 300.0, max_sessions: int = 64,
                  wait_s: float = 60.0, log_path: str | None = None) -> ServerHandle:
  """Launches `python -m <module> --port N ...` and waits until GET /health answers.

  Raises: RuntimeError if the server exits or does not answer within `wait_s` seconds.
  """
  port = port or free_port()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = open(log_path, "ab") if log_path else subprocess.DEVNULL
  cmd = [sys.executable, "-m", module, "--port", str(port), "--step-ms", str(int(step_ms)),
         "--lease-s", str(lease_s), "--max-sessions", str(max_sessions)]
  proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if log_path else subprocess.DEVNULL)
  url = f"http://127.0.0.1:{port}"
  deadline = time.monotonic() + wait_s
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      raise RuntimeError(f"sandbox server exited with code {proc.returncode} ({' '.join(cmd)})")
    try:
      if httpx.get(url + "/health", timeout=1.0).status_code == 200:
        return ServerHandle(proc, url, log_path)
    except httpx.HTTPError:
      pass
    time.sleep(0.1)
  proc.kill()
  raise RuntimeError(f"sandbox server did not answer /health within {wait_s} s")
