"""Start a sandbox server as a subprocess on a free loopback port, wait for /health, stop it.

  with launch_server(step_ms=1000) as h:      # h.url == 'http://127.0.0.1:<port>'
    ...SandboxClient(h.url)...

The server runs in its own process group, so `stop()` also takes down Playwright's driver if the server
does not exit cleanly; its Chromium, which Playwright starts in process groups of their own, dies with
the driver (parent-death signal, envs_bridge/browser/launcher.py). Servers still running when the
interpreter exits are stopped.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from envs_bridge.protocol import TOKEN_ENV

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RUNNING: set["ServerHandle"] = set()


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port free on `host` right now (the OS picks it)."""
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


class ServerHandle:
  """A running server subprocess: `.url`, `.proc`, `.log_path`, `.stop()`; a context manager."""

  def __init__(self, proc: subprocess.Popen, url: str, log_path: str, own_log: bool, token: str | None = None):
    self.proc, self.url, self.log_path, self._own_log = proc, url, log_path, own_log
    self.token = token  # what clients must send (None: the server requires none)
    _RUNNING.add(self)

  def alive(self) -> bool:
    return self.proc.poll() is None

  def log_tail(self, n: int = 4000) -> str:
    """The last `n` characters of the server's stdout + stderr."""
    try:
      with open(self.log_path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - n))
        return f.read().decode(errors="replace")
    except OSError:
      return ""

  def stop(self, timeout: float = 10.0) -> None:
    """SIGTERM (graceful: the server closes Chromium), then SIGKILL to the process group (the server and
    Playwright's driver; the driver's Chromium dies with it, `browser/launcher.py`)."""
    _RUNNING.discard(self)
    if self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(timeout)
      except subprocess.TimeoutExpired:
        pass
    try:  # whatever is left of the group (Playwright driver, Chromium)
      os.killpg(self.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
    if self.proc.poll() is None:
      self.proc.wait()
    if self._own_log:
      try:
        os.unlink(self.log_path)
      except OSError:
        pass

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.stop()


@atexit.register
def _stop_all():
  for h in list(_RUNNING):
    h.stop(timeout=3.0)


PARENT_ENV = "TARS_SANDBOX_PARENT_PID"


def die_with_parent() -> None:
  """Called first thing by a server started with `launch_server`: asks Linux to SIGTERM this
  process when the launching process dies, even by kill -9 (`prctl(PR_SET_PDEATHSIG)`), so a
  killed trainer never leaves a server and its Chromium behind; exits at once if the launcher is
  already gone. Done in the child after exec, not in a `preexec_fn` (unsafe to fork a
  multithreaded JAX process into Python code). A no-op without the env var or without prctl."""
  parent = os.environ.get(PARENT_ENV)
  if not parent or not sys.platform.startswith("linux"):
    return
  try:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    return
  if os.getppid() != int(parent):  # the launcher died before prctl took effect
    sys.exit(0)


def without_tcmalloc(env) -> dict:
  """A copy of the environment mapping `env` with tcmalloc taken out of LD_PRELOAD (`scripts/env.sh`
  preloads it for XLA's per-step buffers). Sandbox servers and the Chromium they start run with the
  system malloc: tcmalloc helps XLA's buffers, not the sandbox's throughput (benchmarks/RESULTS.md,
  "Allocator")."""
  env = dict(env)
  keep = [p for p in env.get("LD_PRELOAD", "").split(":") if p and "tcmalloc" not in p]
  if keep:
    env["LD_PRELOAD"] = ":".join(keep)
  else:
    env.pop("LD_PRELOAD", None)
  return env


def launch_server(module: str = "envs_bridge.browser.server", port: int | None = None,
                  host: str = "127.0.0.1", step_ms: int = 1000, lease_s: float = 300.0,
                  max_sessions: int = 64, wait_s: float = 30.0, log_path: str | None = None,
                  extra_args: tuple[str, ...] = (), n_browsers: int = 1, page_timeout_s: float = 60.0,
                  gc_interval_s: float = 30.0, token: str | None = None, spare_pages: int = 0,
                  chromium: str | None = None, step_latency: tuple[float, float] = (0.0, 1.0)) -> ServerHandle:
  """Runs `python -m <module> --host H --port N --step-ms .. --lease-s .. --max-sessions ..` and waits
  until GET /health answers 200.

  Args:
    port: None picks a free port. host: interface to bind (the URL uses it; 0.0.0.0 -> 127.0.0.1).
    wait_s: seconds to wait for /health. log_path: server stdout+stderr (default: a temp file,
      deleted on stop). extra_args: more command-line flags for the module.
    n_browsers, page_timeout_s, gc_interval_s, spare_pages: browser-server flags (`--browsers`, ...,
      `--spare-pages`: a standby Chromium with that many pre-made pages for fast crash recovery),
      passed only when they differ from the defaults (other server modules need not know them).
    step_latency: (median seconds, sigma) of the log-normal wall-clock delay before each step answers
      (`envs_bridge.app.StepLatency`); median 0 = none.
    token: bearer token the server requires (passed in its environment as `protocol.TOKEN_ENV`, never on
      its command line, which every user can read); None: inherit that env var from this process
      ('' there or unset: no token, and then the server binds loopback only). `.token` of the handle.
  Raises: RuntimeError (with the server's log tail) if it exits or does not answer within wait_s.
  """
  port = port or free_port(host)
  own_log = log_path is None
  if own_log:
    fd, log_path = tempfile.mkstemp(prefix="sandbox-server-", suffix=".log")
    os.close(fd)
  env = without_tcmalloc(dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                                **{PARENT_ENV: str(os.getpid())}))
  if token is not None:
    env[TOKEN_ENV] = token
  token = env.get(TOKEN_ENV) or None
  cmd = [sys.executable, "-m", module, "--host", host, "--port", str(port), "--step-ms", str(int(step_ms)),
         "--lease-s", str(lease_s), "--max-sessions", str(max_sessions)]
  for flag, value, default in (("--browsers", n_browsers, 1), ("--page-timeout-s", page_timeout_s, 60.0),
                               ("--gc-interval-s", gc_interval_s, 30.0), ("--spare-pages", spare_pages, 0),
                               ("--chromium", chromium, None)):
    if value != default:
      cmd += [flag, str(value)]
  if step_latency[0] > 0:
    cmd += ["--step-latency-median-s", str(step_latency[0]), "--step-latency-sigma", str(step_latency[1])]
  cmd += list(extra_args)
  with open(log_path, "ab") as out:
    proc = subprocess.Popen(cmd, env=env, cwd=_ROOT, stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
  h = ServerHandle(proc, f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}", log_path, own_log, token)
  deadline = time.monotonic() + wait_s
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      tail = h.log_tail()
      h.stop()
      raise RuntimeError(f"sandbox server exited with code {proc.returncode} ({' '.join(cmd)}):\n{tail}")
    try:
      if httpx.get(h.url + "/health", timeout=1.0).status_code == 200:
        return h
    except httpx.HTTPError:
      pass
    time.sleep(0.1)
  tail = h.log_tail()
  h.stop()
  raise RuntimeError(f"sandbox server did not answer /health within {wait_s} s:\n{tail}")


# The server module of each sandbox kind a fleet can launch (`sandbox_fleet(launch=...)`).
SERVER_MODULES = {"browser": "envs_bridge.browser.server", "desktop": "envs_bridge.desktop.server"}


def env_fleet(env, urls=None):
  """`sandbox_fleet` of a training / eval config's `env` block: its `servers` (or `urls` when given;
  empty = launch the kinds of `env.launch`), `step_ms`, `lease_s`, `spare_pages`, `browsers` and the
  desktop server's `desktop_sessions` / `desktop_step_ms` (defaults when absent: configs saved before
  the fields existed), and the latency model `step_latency_median_s` / `step_latency_sigma` of the
  servers it launches."""
  return sandbox_fleet(env.servers if urls is None else urls, env.step_ms, env.lease_s,
                       spare_pages=env.get("spare_pages", 0), n_browsers=env.get("browsers", 1),
                       launch=tuple(env.get("launch", ("browser",))),
                       desktop_sessions=env.get("desktop_sessions", 8),
                       desktop_step_ms=env.get("desktop_step_ms", 300),
                       step_latency=(env.get("step_latency_median_s", 0.0), env.get("step_latency_sigma", 1.0)))


@contextlib.contextmanager
def sandbox_fleet(urls, step_ms: int = 1000, lease_s: float = 300.0, token: str | None = None,
                  spare_pages: int = 0, n_browsers: int = 1, launch: tuple[str, ...] = ("browser",),
                  desktop_sessions: int = 8, desktop_step_ms: int = 300,
                  step_latency: tuple[float, float] = (0.0, 1.0)):
  """(event loop, [SandboxClient]) over the servers at `urls`, or over servers launched here when
  `urls` is empty: one of each kind in `launch` ("browser": `launch_server(step_ms=, lease_s=,
  spare_pages=, n_browsers=)`, MiniWoB++, games and GUI-Browsing; "desktop": the Xvfb desktop server
  with `desktop_sessions` sessions at most and `desktop_step_ms` of real time per step), each with the
  latency model `step_latency` (`launch_server`). With more than
  one server, each client learns its server's tasks (`GET /tasks`) and episodes go to a server that
  serves their task (`client.client_for`). On exit the clients, the loop and the launched servers are
  closed — also when the body raises (a trainer's SIGTERM unwinds through here).

  token: bearer token of the servers (and of the ones launched here); None: the env var
  `protocol.TOKEN_ENV` (kept out of configs on purpose: configs are logged and checkpointed).
  Raises: ValueError for an unknown kind in `launch`; RuntimeError when a server does not start.
  """
  from envs_bridge.client import SandboxClient  # local: the server side imports this module too
  unknown = sorted(set(launch) - set(SERVER_MODULES))
  if unknown:
    raise ValueError(f"unknown sandbox kinds {unknown} in launch; known: {sorted(SERVER_MODULES)}")
  servers = []
  urls = list(urls or ())
  loop = asyncio.new_event_loop()
  clients = []
  try:
    if not urls:
      for kind in launch:
        if kind == "browser":
          servers.append(launch_server(step_ms=step_ms, lease_s=lease_s, token=token, spare_pages=spare_pages,
                                       n_browsers=n_browsers, step_latency=step_latency))
        else:
          servers.append(launch_server(SERVER_MODULES[kind], step_ms=desktop_step_ms, lease_s=lease_s,
                                       token=token, max_sessions=desktop_sessions, step_latency=step_latency))
      urls = [h.url for h in servers]
    clients = [SandboxClient(u, token=token) for u in urls]
    if len(clients) > 1:
      for c in clients:
        c.serves = frozenset(loop.run_until_complete(c.tasks()))
    yield loop, clients
  finally:
    for c in clients:
      loop.run_until_complete(c.aclose())
    loop.close()
    for h in servers:
      h.stop()
