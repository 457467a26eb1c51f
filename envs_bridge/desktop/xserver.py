"""One Xvfb display and the X programs running on it (one per desktop session).

Xvfb picks the first display number it can bind and reports it, once ready, on `-displayfd`; it
listens only on its Unix socket
(`-nolisten tcp`), and runs in its own process group, as does every program started on it, so
`close()` can kill each group whole. Screenshots are Pillow's `ImageGrab.grab(xdisplay=...)`.
Without a window manager, X gives keyboard focus to the window under the pointer (PointerRoot),
so an agent clicks into a window before typing, as on a desktop with focus-follows-mouse.
"""

from __future__ import annotations

import io
import os
import select
import shutil
import signal
import subprocess
import time

from PIL import ImageGrab

# Xvfb dies with the thread that started it (a server killed by SIGKILL cannot clean up; its X
# programs then lose their display and exit too). setpriv is util-linux; skipped where missing.
_PDEATHSIG = ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []
# python-xlib (used by PyAutoGUI) insists on an Xauthority file; Xvfb runs without access control
# on its local socket, so an empty file is enough.
XAUTH = os.path.join(os.environ.get("TMPDIR", "/tmp"), "tars-desktop-empty.Xauthority")


def _read_line(fd: int, deadline: float) -> str | None:
  """What a process writes to the pipe `fd` up to its first newline (stripped); "" if the writer
  closes it first (it exited); None if `deadline` (time.monotonic seconds) passes first."""
  buf = b""
  while not buf.endswith(b"\n"):
    left = deadline - time.monotonic()
    if left <= 0:
      return None
    if not select.select([fd], [], [], left)[0]:
      continue
    chunk = os.read(fd, 64)
    if not chunk:
      return ""
    buf += chunk
  return buf.decode(errors="replace").strip()


class XServerError(RuntimeError):
  """Xvfb did not start, or a program could not be launched on it."""


class ProgramMissing(XServerError):
  """An executable (Xvfb or a task's program) is not installed: no retry on any session fixes it."""


def ensure_xauthority() -> str:
  """Creates the empty Xauthority file and points XAUTHORITY at it (this process and children)."""
  if not os.path.exists(XAUTH):
    open(XAUTH, "a").close()
  os.environ.setdefault("XAUTHORITY", XAUTH)
  return os.environ["XAUTHORITY"]


class XDisplay:
  """A running Xvfb of `width` x `height` x 24 bit and the programs started on it.

  Args: width, height: screen size in pixels. start_timeout_s: seconds to wait for Xvfb.
  Raises: XServerError if Xvfb is missing or does not report a display in time.
  """

  def __init__(self, width: int = 640, height: int = 480, start_timeout_s: float = 10.0):
    ensure_xauthority()
    self.width, self.height = width, height
    self.programs: list[subprocess.Popen] = []
    # Xvfb picks the display itself (-displayfd): the first number whose socket it can bind, an
    # atomic choice across threads and processes, written to the pipe once it accepts connections.
    # (Choosing the number here and waiting for its socket file raced: a server of another process
    # starting on the same number made the file while ours failed, and sessions met "Connection refused".)
    r, w = os.pipe()
    try:
      self.proc = subprocess.Popen(
          [*_PDEATHSIG, "Xvfb", "-displayfd", str(w), "-screen", "0", f"{width}x{height}x24", "-nolisten", "tcp",
           "-noreset", "-nocursor"],
          start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
          pass_fds=(w,))
    except FileNotFoundError as e:
      raise ProgramMissing("Xvfb is not installed (Debian package xvfb; scripts/setup.sh)") from e
    finally:
      os.close(w)
    try:
      n = _read_line(r, time.monotonic() + start_timeout_s)
    finally:
      os.close(r)
    if not (n or "").isdigit():
      self._kill(self.proc)
      raise XServerError(f"Xvfb did not report a display within {start_timeout_s:g} s" if n is None else
                         f"Xvfb exited before reporting a display (exit status {self.proc.poll()})")
    self.name = f":{n}"

  def env(self, **extra) -> dict:
    """Environment for programs on this display."""
    return {**os.environ, "DISPLAY": self.name, "XAUTHORITY": ensure_xauthority(), **extra}

  def launch(self, argv: list[str], cwd: str, env: dict | None = None, stdout=subprocess.DEVNULL) -> subprocess.Popen:
    """Starts an X program on this display in its own process group.

    Raises: ProgramMissing if the executable is missing.
    """
    try:
      p = subprocess.Popen(argv, cwd=cwd, env=self.env(**(env or {})), stdin=subprocess.DEVNULL, stdout=stdout,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    except FileNotFoundError as e:
      raise ProgramMissing(f"program not installed: {argv[0]}") from e
    self.programs.append(p)
    return p

  def alive(self) -> bool:
    return self.proc.poll() is None

  def screenshot_png(self) -> bytes:
    """The whole screen as PNG bytes ([height, width] RGB). Raises OSError if Xvfb is gone."""
    img = ImageGrab.grab(xdisplay=self.name)
    buf = io.BytesIO()
    img.convert("RGB").save(buf, format="PNG", compress_level=1)  # fast: screenshots are per step
    return buf.getvalue()

  def wait_for_windows(self, n: int, timeout_s: float = 10.0) -> bool:
    """Waits until at least `n` top-level windows are mapped (programs have drawn); True if so. False
    after `timeout_s` seconds, or at once when a program launched here has exited (it never will)."""
    from Xlib import X, display as xdisplay  # local: only sessions need python-xlib
    d = xdisplay.Display(self.name)
    try:
      deadline = time.monotonic() + timeout_s
      while time.monotonic() < deadline:
        if self._viewable(d.screen().root.query_tree().children, X) >= n:
          return True
        if any(p.poll() is not None for p in self.programs):
          return False
        time.sleep(0.05)
      return False
    finally:
      d.close()

  @staticmethod
  def _viewable(kids, X) -> int:
    n = 0
    for k in kids:
      try:
        n += k.get_attributes().map_state == X.IsViewable
      except Exception:  # BadWindow: a window that vanished between the query and now (Chromium's)
        pass
    return n

  def windows(self) -> list[dict]:
    """Mapped top-level windows and their mapped children, depth first, with absolute geometry:
    [{'id', 'name', 'class', 'x', 'y', 'width', 'height', 'depth'}] (tests and debugging only)."""
    from Xlib import X, display as xdisplay
    d = xdisplay.Display(self.name)
    out = []
    try:
      def walk(w, ox, oy, depth):
        for c in w.query_tree().children:
          try:
            if c.get_attributes().map_state != X.IsViewable:
              continue
            g = c.get_geometry()
            cls = c.get_wm_class()
            out.append({"id": c.id, "name": c.get_wm_name() or "", "class": cls[1] if cls else "",
                        "x": ox + g.x, "y": oy + g.y, "width": g.width, "height": g.height, "depth": depth})
            walk(c, ox + g.x + g.border_width, oy + g.y + g.border_width, depth + 1)
          except Exception:  # a window that vanished mid-walk
            continue
      walk(d.screen().root, 0, 0, 0)
    finally:
      d.close()
    return out

  def close(self) -> None:
    """Kills every program's process group, then Xvfb."""
    for p in self.programs:
      self._kill(p)
    self.programs.clear()
    self.proc.terminate()  # SIGTERM first: Xvfb removes its socket and lock file
    try:
      self.proc.wait(2)
    except subprocess.TimeoutExpired:
      pass
    self._kill(self.proc)

  @staticmethod
  def _kill(p: subprocess.Popen) -> None:
    try:
      os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
    try:
      p.wait(5)
    except subprocess.TimeoutExpired:
      pass
