"""The launcher never leaves a sandbox server behind: not after stop(), not after its parent is
killed with SIGKILL (PR_SET_PDEATHSIG)."""

import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.browser

_PARENT = """
import sys, time
from envs_bridge.launch import launch_server
h = launch_server(step_ms=1000, lease_s=60.0)
print(h.proc.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  # a zombie (exited, not yet reaped by init) counts as gone
  with open(f"/proc/{pid}/stat") as f:
    return f.read().split(")")[-1].split()[0] != "Z"


def _wait_gone(pid: int, limit_s: float = 60.0) -> bool:
  deadline = time.monotonic() + limit_s
  while time.monotonic() < deadline:
    if not _alive(pid):
      return True
    time.sleep(0.2)
  return False


def test_server_dies_with_a_killed_parent():
  parent = subprocess.Popen([sys.executable, "-c", _PARENT], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))
  server_pid = None
  try:
    server_pid = int(parent.stdout.readline())
    assert _alive(server_pid)
    parent.kill()  # SIGKILL: no atexit, no finally in the parent
    parent.wait()
    assert _wait_gone(server_pid), f"server {server_pid} outlived its parent"
  finally:
    parent.kill()
    if server_pid is not None and _alive(server_pid):  # clean up after a failure
      os.killpg(server_pid, signal.SIGKILL)


def test_config_spare_pages_reaches_the_server():
  """`env.spare_pages` and `env.browsers` of a training config go through `env_fleet` to the server:
  a page opened makes the standby build one for its task, and the server runs that many Chromiums
  (read back from /health)."""
  import httpx

  from envs_bridge.launch import env_fleet
  from experiments.configs import miniwob_ppo
  config = miniwob_ppo.get_config("smoke")
  config.env.spare_pages = 2
  with env_fleet(config.env) as (loop, clients):
    c = clients[0]
    sid = loop.run_until_complete(c.open("miniwob/click-test", seed=1))[0]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the standby builds its pages in the background
      h = httpx.get(c.base_url + "/health", timeout=5).json()
      if h["spare"] and h["spare"]["pages"] >= 1:
        break
      time.sleep(0.2)
    assert h["spare_pages"] == 2 and h["spare"]["up"] and h["spare"]["pages"] == 1, h
    assert config.env.browsers == 2 and h["n_browsers"] == 2 and all(b["up"] for b in h["browsers"]), h
    loop.run_until_complete(c.close(sid))


def test_step_latency_is_a_seeded_log_normal():
  """StepLatency draws median_s * exp(sigma * z): the sample median is median_s, log-delays have
  standard deviation sigma, the same seed gives the same delays; bad settings are refused."""
  import numpy as np

  from envs_bridge.app import StepLatency
  draw = StepLatency(1.5, sigma=0.8, seed=3).sampler()
  x = np.array([draw() for _ in range(20000)])
  assert np.median(x) == pytest.approx(1.5, rel=0.03) and np.log(x).std() == pytest.approx(0.8, rel=0.03)
  again = StepLatency(1.5, sigma=0.8, seed=3).sampler()
  assert [again() for _ in range(5)] == list(x[:5])
  with pytest.raises(ValueError, match="median_s > 0"):
    StepLatency(0.0)


def test_config_step_latency_delays_steps_but_not_the_page():
  """`env.step_latency_median_s` reaches the launched server: every step answers after that many
  wall-clock seconds (sigma 0: exactly), and the page, whose clock is virtual, shows and rewards the
  same as on a server without latency."""
  import httpx

  from envs_bridge.launch import env_fleet
  from experiments.configs import miniwob_ppo

  def play(latency_s):
    config = miniwob_ppo.get_config("smoke")
    config.env.step_latency_median_s, config.env.step_latency_sigma = latency_s, 0.0
    with env_fleet(config.env) as (loop, clients):
      c = clients[0]
      health = httpx.get(c.base_url + "/health", timeout=5).json()
      sid, _ = loop.run_until_complete(c.open("miniwob/click-test", seed=4))
      t0 = time.monotonic()
      obs = loop.run_until_complete(c.step(sid, "Action: click(start_box='(500,500)')"))
      waited = time.monotonic() - t0
      loop.run_until_complete(c.close(sid))
    return health, obs, waited

  health, slow, waited = play(0.8)
  assert health["step_latency"] == {"median_s": 0.8, "sigma": 0.0, "seed": 0} and waited >= 0.8
  health0, fast, _ = play(0.0)
  assert health0["step_latency"] is None
  assert slow.reward == fast.reward and slow.done == fast.done
  assert slow.screenshot_png_b64 == fast.screenshot_png_b64


def _tcmalloc() -> str | None:
  out = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True).stdout
  libs = [line.split("=>")[-1].strip() for line in out.splitlines() if "libtcmalloc_minimal.so.4 " in line]
  return libs[0] if libs else None


def test_without_tcmalloc_keeps_other_preloads():
  from envs_bridge.launch import without_tcmalloc
  env = without_tcmalloc({"LD_PRELOAD": "/x/libtcmalloc_minimal.so.4:/y/libfoo.so", "A": "1"})
  assert env == {"LD_PRELOAD": "/y/libfoo.so", "A": "1"}
  assert without_tcmalloc({"LD_PRELOAD": "/x/libtcmalloc_minimal.so.4", "A": "1"}) == {"A": "1"}
  assert without_tcmalloc({"A": "1"}) == {"A": "1"}


def test_sandbox_server_runs_with_the_system_malloc():
  """A trainer under `scripts/env.sh` (tcmalloc preloaded) starts its sandbox server, and so its
  Chromium, without tcmalloc: read from the processes' memory maps."""
  lib = _tcmalloc()
  assert lib is not None, "libtcmalloc_minimal.so.4 not installed: run scripts/setup.sh, which installs it"
  parent = subprocess.Popen([sys.executable, "-c", _PARENT], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT, LD_PRELOAD=lib))
  server_pid = None
  try:
    server_pid = int(parent.stdout.readline())
    with open(f"/proc/{parent.pid}/maps") as f:
      assert "libtcmalloc" in f.read()  # the preload took in the parent: the check below can fail
    with open(f"/proc/{server_pid}/maps") as f:
      assert "libtcmalloc" not in f.read()
  finally:
    parent.kill()
    parent.wait()
    if server_pid is not None:
      _wait_gone(server_pid)


def test_chromium_flag_picks_the_servers_browser():
  """`launch_server(chromium=)` reaches the server: with the full Debian browser instead of the default
  headless shell, /health names it and the server's Chromium browser process runs its binary (the
  /usr/bin/chromium wrapper starts /usr/lib/chromium/chromium). A path that is not an executable is
  refused before any Chromium starts, with the reason in the error."""
  import httpx

  from envs_bridge.browser.sessions import DEFAULT_CHROMIUM
  from envs_bridge.launch import launch_server
  assert DEFAULT_CHROMIUM != "/usr/bin/chromium"  # setup.sh installs the headless shell: it is the default
  with launch_server(step_ms=1000, lease_s=60.0, chromium="/usr/bin/chromium") as h:
    health = httpx.get(h.url + "/health", timeout=5).json()
    assert health["chromium"] == "/usr/bin/chromium" and health["ok"], health
    with open(f"/proc/{health['browsers'][0]['pid']}/cmdline", "rb") as f:
      assert f.read().split(b"\0")[0] == b"/usr/lib/chromium/chromium"
  with pytest.raises(RuntimeError, match="not an executable file"):
    launch_server(step_ms=1000, lease_s=60.0, chromium="/nonexistent/chromium")


MARK_ENV = "TARS_TEST_CHROMIUM_MARK"  # set for one server: its Chromium inherits it (/proc/<pid>/environ)
_SLOW_CHROMIUM = """#!/bin/sh
# The real browser; once {flag} exists, a launch first waits 60 s in a process whose command line
# names the browser (so a relaunch can be caught in flight; it counts as a survivor if it lives on).
[ -e {flag} ] || exec {exe} "$@"
exec {python} -c "import os, sys, time; time.sleep(60); os.execv(sys.argv[1], sys.argv[1:])" {exe} "$@"
"""


def _marked(mark: str) -> list[int]:
  """Live (non-zombie) processes started by the server tagged `mark` whose command line names Chromium."""
  pids = []
  for d in os.listdir("/proc"):
    if not d.isdigit():
      continue
    try:
      with open(f"/proc/{d}/environ", "rb") as f:
        if f"{MARK_ENV}={mark}".encode() not in f.read().split(b"\0"):
          continue
      with open(f"/proc/{d}/cmdline", "rb") as f:
        if b"chromium" not in f.read():
          continue
      if _alive(int(d)):
        pids.append(int(d))
    except (OSError, ProcessLookupError):  # gone meanwhile, or not ours
      continue
  return pids


@pytest.mark.parametrize("how", ["SIGKILL to the group", "SIGTERM", "SIGINT to the group"])
def test_no_chromium_outlives_a_server_stopped_during_a_relaunch(how, tmp_path, monkeypatch):
  """Two browsers; one is killed with kill -9 and its relaunch is held in flight (a slow executable);
  then the server is stopped. Whatever the way, no process of its Chromium survives it: the browser
  that was up, its renderers and zygotes, and the relaunch (Playwright puts each browser in a process
  group of its own, out of reach of the server's group)."""
  import httpx

  from envs_bridge.browser.sessions import DEFAULT_CHROMIUM
  from envs_bridge.launch import launch_server
  mark = f"{os.getpid()}-{time.monotonic_ns()}"
  monkeypatch.setenv(MARK_ENV, mark)
  monkeypatch.setenv("TARS_JAX_CHROMIUM_DIR", str(tmp_path))  # the server's wrapper of this one-off executable
  flag, exe = tmp_path / "slow", tmp_path / "chromium"
  exe.write_text(_SLOW_CHROMIUM.format(flag=flag, exe=DEFAULT_CHROMIUM, python=sys.executable))
  exe.chmod(0o755)
  h = launch_server(step_ms=1000, lease_s=60.0, n_browsers=2, chromium=str(exe))
  try:
    health = httpx.get(h.url + "/health", timeout=10).json()
    pids = [b["pid"] for b in health["browsers"]]
    assert len(set(pids)) == 2 and set(pids) <= set(_marked(mark)), (pids, _marked(mark))
    flag.touch()
    os.kill(pids[0], signal.SIGKILL)
    relaunch = lambda: [p for p in _marked(mark) if b"time.sleep" in open(f"/proc/{p}/cmdline", "rb").read()]
    deadline = time.monotonic() + 60  # only so a broken test cannot hang
    while not relaunch() and time.monotonic() < deadline:
      time.sleep(0.05)
    assert relaunch(), "the relaunch did not start"
    assert _alive(pids[1])  # the other browser is up: it must go with the server too
    if how == "SIGKILL to the group":
      os.killpg(h.proc.pid, signal.SIGKILL)
    elif how == "SIGTERM":
      h.proc.terminate()
    else:
      os.killpg(h.proc.pid, signal.SIGINT)
    h.proc.wait(60)
    deadline = time.monotonic() + 30  # the kernel's parent-death signal takes a moment to land
    while _marked(mark) and time.monotonic() < deadline:
      time.sleep(0.1)
    assert _marked(mark) == []
  finally:
    h.stop()
    for p in _marked(mark):  # never leave Chromium behind, also when the test fails
      os.kill(p, signal.SIGKILL)


def test_pdeathsig_wrapper_passes_arguments_and_dies_with_its_parent(tmp_path, monkeypatch):
  """The wrapper Chromium is started through (browser/launcher.py), on `sleep` and `printf`: arguments
  reach the program unchanged, and the program is killed when the process that started it is."""
  from envs_bridge.browser.launcher import pdeathsig_wrapper
  monkeypatch.setenv("TARS_JAX_CHROMIUM_DIR", str(tmp_path))
  out = subprocess.run([pdeathsig_wrapper("/usr/bin/printf"), "%s|", "a b", "", "c'd"], capture_output=True,
                       text=True, timeout=30)
  assert (out.returncode, out.stdout) == (0, "a b||c'd|")
  parent = subprocess.Popen(["/bin/sh", "-c", f"{pdeathsig_wrapper('/bin/sleep')} 600 & echo $!; wait"],
                            stdout=subprocess.PIPE, text=True)
  pid = int(parent.stdout.readline())
  try:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the wrapper's two passes end in exec of sleep (same pid)
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if f.read().startswith(b"/bin/sleep\0"):
          break
      time.sleep(0.02)
    parent.kill()
    parent.wait()
    assert _wait_gone(pid), "the program outlived the process that started it"
  finally:
    if _alive(pid):
      os.kill(pid, signal.SIGKILL)
