"""Typed actions -> Playwright mouse/keyboard calls on a page (pixel coordinates of the viewport)."""

from __future__ import annotations

from tars_jax.agent import actions as A

# UI-TARS key names -> Playwright key names.
_KEYS = {"ctrl": "Control", "control": "Control", "shift": "Shift", "alt": "Alt", "cmd": "Meta",
         "meta": "Meta", "enter": "Enter", "return": "Enter", "tab": "Tab", "backspace": "Backspace",
         "escape": "Escape", "esc": "Escape", "space": "Space", "up": "ArrowUp", "down": "ArrowDown",
         "left": "ArrowLeft", "right": "ArrowRight", "delete": "Delete", "home": "Home", "end": "End",
         "pageup": "PageUp", "pagedown": "PageDown", "arrowup": "ArrowUp", "arrowdown": "ArrowDown",
         "arrowleft": "ArrowLeft", "arrowright": "ArrowRight"}
_SCROLL_PX = 100  # wheel delta of one scroll action, pixels


def key_name(k: str) -> str:
  """UI-TARS key -> Playwright key ('ctrl' -> 'Control', 'f5' -> 'F5', 'a' -> 'a')."""
  k = k.lower()
  if k in _KEYS:
    return _KEYS[k]
  if len(k) > 1 and k[0] == "f" and k[1:].isdigit():
    return k.upper()
  return k


async def execute(page, action: A.Action, width: int, height: int) -> bool:
  """Performs `action` on `page`. Returns True if the action asks to end the episode.

  Raises: playwright errors if the page is gone (the session layer maps them to SessionLost).
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
    await m.move(p["x2"], p["y2"], steps=5)
    await m.up()
  elif isinstance(action, A.Hotkey):
    await kb.press("+".join(key_name(k) for k in action.keys))
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
