"""Typed actions -> Playwright mouse/keyboard calls on a page (pixel coordinates of the viewport).

Key names follow UI-TARS / PyAutoGUI spelling (`hotkey(key='ctrl shift a')`) and are mapped to
Playwright's (`Control+Shift+a`). A key Playwright does not know is the model's mistake, not the
page's: it raises `InvalidKey` (the session turns it into an "invalid action" observation) instead
of the Playwright error that would look like a dead page.
"""

from __future__ import annotations

from tars_jax.agent import actions as A

# UI-TARS / PyAutoGUI key names -> Playwright key names.
_KEYS = {
    "ctrl": "Control", "control": "Control", "shift": "Shift", "alt": "Alt", "option": "Alt",
    "cmd": "Meta", "command": "Meta", "meta": "Meta", "win": "Meta", "super": "Meta",
    "enter": "Enter", "return": "Enter", "tab": "Tab", "backspace": "Backspace", "escape": "Escape",
    "esc": "Escape", "space": "Space", "delete": "Delete", "del": "Delete", "insert": "Insert",
    "home": "Home", "end": "End", "pageup": "PageUp", "pagedown": "PageDown", "capslock": "CapsLock",
    "up": "ArrowUp", "down": "ArrowDown", "left": "ArrowLeft", "right": "ArrowRight",
    "arrowup": "ArrowUp", "arrowdown": "ArrowDown", "arrowleft": "ArrowLeft", "arrowright": "ArrowRight",
    **{f"f{i}": f"F{i}" for i in range(1, 13)},
}
_SCROLL_PX = 100  # wheel delta of one scroll action, pixels
_DRAG_STEPS = 5  # intermediate mousemove events of a drag (pages that track the pointer need some)


class InvalidKey(ValueError):
  """A hotkey names a key that the browser does not have."""


def key_name(k: str) -> str:
  """UI-TARS key -> Playwright key ('ctrl' -> 'Control', 'f5' -> 'F5', 'a' -> 'a').

  Raises: InvalidKey for names that are neither known keys nor one printable ASCII character.
  """
  low = k.lower()
  if low in _KEYS:
    return _KEYS[low]
  if len(k) == 1 and " " < k <= "~":  # printable ASCII: the US layout Playwright uses has them all
    return k
  raise InvalidKey(f"unknown key {k!r}")


async def execute(page, action: A.Action, width: int, height: int) -> bool:
  """Performs `action` on `page` whose viewport is `width` x `height` px.

  Returns: True if the action asks to end the episode (finished / call_user), else False.
  Raises: InvalidKey for an unknown hotkey name (nothing was pressed); Playwright errors if the
  page is gone (the session layer maps them to SessionLost).
  """
  p = A.to_pixels(action, width, height)
  m, kb = page.mouse, page.keyboard
  if isinstance(action, A.Click):
    await m.click(p["x"], p["y"])
  elif isinstance(action, A.LeftDouble):
    await m.dblclick(p["x"], p["y"])
  elif isinstance(action, A.RightSingle):
    await m.click(p["x"], p["y"], button="right")
  elif isinstance(action, A.Drag):
    await m.move(p["x1"], p["y1"])
    await m.down()
    await m.move(p["x2"], p["y2"], steps=_DRAG_STEPS)
    await m.up()
  elif isinstance(action, A.Hotkey):
    combo = "+".join(key_name(k) for k in action.keys)  # validate every key before pressing any
    await kb.press(combo)
  elif isinstance(action, A.Type):
    await kb.type(action.content)
  elif isinstance(action, A.Scroll):
    await m.move(p["x"], p["y"])
    dx = {"left": -_SCROLL_PX, "right": _SCROLL_PX}.get(action.direction, 0)
    dy = {"up": -_SCROLL_PX, "down": _SCROLL_PX}.get(action.direction, 0)
    await m.wheel(dx, dy)
  elif isinstance(action, (A.Finished, A.CallUser)):
    return True
  return False
