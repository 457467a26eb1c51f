"""Every sandbox task as a `gymnasium.Env`, so other RL libraries can use our sandboxes.

  import gymnasium, envs_bridge.gym                          # importing registers the ids
  env = gymnasium.make("tars/miniwob.click-test")           # task 'miniwob/click-test'
  obs, info = env.reset(seed=0)        # obs = {'screenshot': uint8 [H, W, 3], 'text': str}
  obs, reward, terminated, truncated, info = env.step("click(start_box='(500,600)')")

Ids: `tars/<task>` with the task's '/' written '.' and a '@gui' suffix written '-gui' (gymnasium ids
allow one '/' only): 'desktop/terminal-mkdir' -> 'tars/desktop.terminal-mkdir',
'hybrid/dialog-sum-file@gui' -> 'tars/hybrid.dialog-sum-file-gui'. `env_id(task)` / `task_of(id)`.

Observations: `screenshot` is the sandbox's PNG decoded to RGB (MiniWoB 210 x 160, desktop 480 x 640);
`text` is the instruction, then after a step the SDK tool output and/or the error
("invalid action: ..."), printable ASCII only (others become '?'), at most `MAX_TEXT` characters.
Actions are strings of our grammar (`tars_jax.agent.actions`), replies 'Thought: ...\\nAction: ...'
included; a string that does not parse is an observation with an error, reward 0, never an exception.
`terminated` = the sandbox says done; `truncated` = `max_episode_steps` reached (gymnasium's
TimeLimit, 15 by default). `info` = the sandbox's info without wall-clock fields (deterministic).

Servers: a task talks to the server given as `server_url`, else to $TARS_BROWSER_URL /
$TARS_DESKTOP_URL, else to one server per kind that this process launches on first use
(`envs_bridge.launch.launch_server`; stopped at exit).
"""

from __future__ import annotations

import os
import string

import gymnasium
import httpx
import numpy as np
from gymnasium import spaces

from envs_bridge import protocol as P
from envs_bridge.client import auth_headers, response_json
from envs_bridge.desktop import tasks as desktop_tasks

MAX_TEXT = 8192
CHARSET = frozenset(string.printable)
_VOLATILE = ("elapsed_ms",)  # wall-clock on the desktop: would break determinism checks
_SERVERS: dict[str, object] = {}  # module -> ServerHandle launched by this process

BROWSER = ("envs_bridge.browser.server", "TARS_BROWSER_URL")
DESKTOP = ("envs_bridge.desktop.server", "TARS_DESKTOP_URL")


def env_id(task: str) -> str:
  """'miniwob/click-test' -> 'tars/miniwob.click-test' (see the module docstring)."""
  return "tars/" + task.replace("/", ".").replace(desktop_tasks.GUI_SUFFIX, "-gui")


def task_of(gym_id: str) -> str:
  """Inverse of `env_id`."""
  name = gym_id.split("/", 1)[1] if gym_id.startswith("tars/") else gym_id
  if name.endswith("-gui"):
    name = name[:-4] + desktop_tasks.GUI_SUFFIX
  return name.replace(".", "/", 1)


def sandbox_of(task: str) -> tuple[str, str]:
  """(server module, URL env var) of the sandbox that runs `task`."""
  return DESKTOP if task.split("/", 1)[0] in ("desktop", "hybrid") else BROWSER


def screen_hw(task: str) -> tuple[int, int]:
  """(height, width) of the task's screenshots at the servers' default sizes."""
  if sandbox_of(task) == DESKTOP:
    return desktop_tasks.HEIGHT, desktop_tasks.WIDTH
  from envs_bridge.browser import tasks as browser_tasks
  ts = browser_tasks.get(task)
  return ts.height, ts.width


def _server_url(task: str) -> str:
  module, var = sandbox_of(task)
  if os.environ.get(var):
    return os.environ[var]
  h = _SERVERS.get(module)
  if h is None or not h.alive():
    from envs_bridge.launch import launch_server
    h = _SERVERS[module] = launch_server(module, step_ms=1000 if module == BROWSER[0] else 300, wait_s=60.0)
  return h.url


def clean_text(text: str) -> str:
  """Printable ASCII only ('?' for the rest), at most MAX_TEXT characters."""
  return "".join(c if c in CHARSET else "?" for c in text[:MAX_TEXT])


class TarsEnv(gymnasium.Env):
  """One sandbox task as a gymnasium Env (one session at a time, over the HTTP protocol).

  Args:
    task: sandbox task name ('miniwob/click-test', 'desktop/terminal-mkdir', 'hybrid/...@gui').
    server_url: sandbox server; default: see the module docstring.
    coords: 'relative1000' or 'absolute' (how actions write points).
    screen: (height, width) of the server's screenshots if not the default size.
    render_mode: None or 'rgb_array' (render() returns the latest screenshot).
    timeout_s: HTTP timeout per call.
  Raises (reset/step): the typed `protocol.SandboxError`s (UnknownTask, SessionLost, ...).
  """

  metadata = {"render_modes": ["rgb_array"], "render_fps": 1}

  def __init__(self, task: str, server_url: str | None = None, coords: str = "relative1000",
               screen: tuple[int, int] | None = None, render_mode: str | None = None, timeout_s: float = 120.0):
    self.task, self.coords, self.render_mode = task, coords, render_mode
    self._url = server_url
    self._http: httpx.Client | None = None
    self._timeout = timeout_s
    self.session_id: str | None = None
    h, w = screen or screen_hw(task)
    self.observation_space = spaces.Dict({
        "screenshot": spaces.Box(0, 255, (h, w, 3), np.uint8),
        "text": spaces.Text(MAX_TEXT, min_length=0, charset=CHARSET)})
    self.action_space = spaces.Text(P.MAX_ACTION_CHARS, min_length=0, charset=CHARSET)
    self._last: np.ndarray | None = None

  def _call(self, method: str, path: str, **kw):
    if self._http is None:
      self._http = httpx.Client(base_url=self._url or _server_url(self.task), timeout=self._timeout,
                                headers=auth_headers())  # the server's token from TARS_SANDBOX_TOKEN
    return response_json(self._http.request(method, path, **kw))

  def _convert(self, o: P.Observation, text_extra: str = "") -> tuple[dict, dict]:
    img = o.image()
    self._last = img
    info = {k: v for k, v in o.info.items() if k not in _VOLATILE}
    text = o.info.get("instruction", "")
    for part in (o.info.get("tool_output"), o.info.get("error")):
      if part:
        text += "\n" + part
    return {"screenshot": img, "text": clean_text(text)}, info

  def reset(self, *, seed: int | None = None, options: dict | None = None):
    """Closes the previous session and opens a new episode. The task seed is `seed`, or drawn from
    the env's RNG (itself seeded by `seed`), or `options['task_seed']`."""
    super().reset(seed=seed)
    self._close_session()
    task_seed = (options or {}).get("task_seed", seed if seed is not None
                                     else int(self.np_random.integers(0, 2**31 - 1)))
    out = P.OpenResponse(**self._call("POST", "/sessions", json={
        "task": self.task, "seed": int(task_seed), "coords": self.coords}))
    self.session_id = out.session_id
    return self._convert(out.observation)

  def step(self, action: str):
    if self.session_id is None:
      raise RuntimeError("call reset() before step()")
    o = P.Observation(**self._call("POST", f"/sessions/{self.session_id}/step", json={"action": str(action)}))
    obs, info = self._convert(o)
    return obs, float(o.reward), bool(o.done), False, info

  def render(self):
    return None if self.render_mode is None else self._last

  def _close_session(self):
    if self.session_id is not None:
      try:
        self._call("DELETE", f"/sessions/{self.session_id}")
      except (P.SandboxError, httpx.HTTPError):
        pass  # the server reclaims it by lease anyway
      self.session_id = None

  def close(self):
    self._close_session()
    if self._http is not None:
      self._http.close()
      self._http = None


def all_tasks() -> tuple[str, ...]:
  """Every task of every sandbox: MiniWoB++ and games (browser), desktop + hybrid (desktop)."""
  from envs_bridge.browser import tasks as browser_tasks
  return tuple(browser_tasks.task_names()) + tuple(desktop_tasks.task_names())


def register_all(max_episode_steps: int = 15) -> list[str]:
  """Registers `tars/<task>` for every task (idempotent); returns the ids."""
  ids = []
  for t in all_tasks():
    i = env_id(t)
    if i not in gymnasium.registry:
      gymnasium.register(i, entry_point="envs_bridge.gym:TarsEnv", kwargs={"task": t},
                         max_episode_steps=max_episode_steps, disable_env_checker=True)
    ids.append(i)
  return ids


register_all()
