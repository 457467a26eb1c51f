"""Typed GUI actions -> PyAutoGUI calls on one Xvfb display (the OSWorld way of acting on a desktop).

PyAutoGUI's X11 backend talks to a single module-level Xlib connection (`_pyautogui_x11._display`,
opened from $DISPLAY at import). A server drives many displays, so each call runs under one lock
with that connection swapped for the session's own (`Xlib.display.Display(":N")`); the key table
PyAutoGUI builds at import stays valid because every Xvfb starts with the same default keymap.
Calls block (XTest + XSync), so sessions run them in a worker thread.

Key names follow UI-TARS / PyAutoGUI (`hotkey(key='ctrl shift a')`); a name PyAutoGUI does not
know raises `InvalidKey` before anything is pressed.
"""

from __future__ import annotations

import os
import threading

from tars_jax.agent import actions as A

_LOCK = threading.Lock()
_SCROLL_CLICKS = 3  # wheel clicks of one scroll action
_ALIASES = {"control": "ctrl", "return": "enter", "escape": "esc", "cmd": "win", "command": "win",
            "super": "win", "meta": "win", "option": "alt", "arrowup": "up", "arrowdown": "down",
            "arrowleft": "left", "arrowright": "right", "del": "delete"}
_pg = None


class InvalidKey(ValueError):
  """A hotkey names a key PyAutoGUI does not know."""


def _pyautogui(display_name: str):
  """Imports PyAutoGUI once (it needs a reachable $DISPLAY at import time)."""
  global _pg
  if _pg is None:
    from envs_bridge.desktop.xserver import ensure_xauthority
    ensure_xauthority()
    old = os.environ.get("DISPLAY")
    os.environ["DISPLAY"] = display_name
    try:
      import pyautogui
    finally:
      if old is None:
        os.environ.pop("DISPLAY", None)
      else:
        os.environ["DISPLAY"] = old
    pyautogui.FAILSAFE = False  # (0, 0) is a legitimate target, not an emergency stop
    pyautogui.PAUSE = 0.0  # sessions wait after the whole action instead
    _pg = pyautogui
  return _pg


def key_name(k: str, pg) -> str:
  """UI-TARS key name -> PyAutoGUI key name. Raises: InvalidKey."""
  low = _ALIASES.get(k.lower(), k.lower())
  if len(k) == 1:
    low = k  # keep the case of single characters ('A' is shift+a)
  if not pg.isValidKey(low):
    raise InvalidKey(f"unknown key {k!r}")
  return low


class Actor:
  """PyAutoGUI bound to one display; `run(action)` performs one GUI action (blocking).

  Args: display_name: ':N'; width, height: screen pixels (actions are fractions of these).
  """

  def __init__(self, display_name: str, width: int, height: int):
    from Xlib import display as xdisplay
    self.pg = _pyautogui(display_name)
    self.width, self.height = width, height
    self.conn = xdisplay.Display(display_name)

  def run(self, action) -> bool:
    """Performs a GUI action. Returns True for finished()/call_user() (end of episode).

    Raises: InvalidKey (nothing pressed); Xlib errors if the display died.
    """
    if isinstance(action, (A.Finished, A.CallUser)):
      return True
    if isinstance(action, A.Wait):
      return False
    p = {k: int(min(v, (self.width if k.startswith("x") else self.height) - 1))
         for k, v in A.to_pixels(action, self.width, self.height).items()}
    pg = self.pg
    keys = [key_name(k, pg) for k in action.keys] if isinstance(action, A.Hotkey) else None
    from pyautogui import _pyautogui_x11 as backend
    with _LOCK:
      saved = backend._display
      backend._display = self.conn
      try:
        if isinstance(action, A.Click):
          pg.click(p["x"], p["y"])
        elif isinstance(action, A.LeftDouble):
          pg.doubleClick(p["x"], p["y"])
        elif isinstance(action, A.RightSingle):
          pg.rightClick(p["x"], p["y"])
        elif isinstance(action, A.Drag):
          pg.moveTo(p["x1"], p["y1"])
          pg.dragTo(p["x2"], p["y2"], duration=0.0, button="left")
        elif isinstance(action, A.Hotkey):
          pg.hotkey(*keys)
        elif isinstance(action, A.Type):
          pg.write(action.content)
        elif isinstance(action, A.Scroll):
          pg.moveTo(p["x"], p["y"])
          if action.direction in ("up", "down"):
            pg.scroll(_SCROLL_CLICKS if action.direction == "up" else -_SCROLL_CLICKS)
          else:
            pg.hscroll(_SCROLL_CLICKS if action.direction == "right" else -_SCROLL_CLICKS)
        else:
          raise TypeError(f"not a GUI action: {action!r}")
        self.conn.sync()
      finally:
        backend._display = saved
    return False

  def close(self) -> None:
    try:
      self.conn.close()
    except Exception:  # the display may already be gone
      pass
