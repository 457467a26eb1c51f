"""Gymnasium wrapper: every task registered as tars/<task>, gymnasium's env checker on a MiniWoB task
(browser server, real Chromium) and on a desktop task (Xvfb), and one solved episode each."""

import gymnasium
import httpx
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from envs_bridge import gym as tgym
from envs_bridge.browser import miniwob_tasks as mw
from envs_bridge.browser import tasks as browser_tasks
from envs_bridge.desktop import tasks as dtasks
from envs_bridge.launch import launch_server


def test_every_task_is_registered_and_ids_round_trip():
  ids = [i for i in gymnasium.registry if i.startswith("tars/")]
  tasks = list(browser_tasks.task_names()) + list(dtasks.task_names())
  assert sorted(ids) == sorted(tgym.env_id(t) for t in tasks) and len(ids) == len(tasks)
  for t in ("miniwob/click-test", "games/2048", "desktop/terminal-mkdir", "hybrid/dialog-sum-file@gui"):
    assert tgym.task_of(tgym.env_id(t)) == t
  assert tgym.env_id("hybrid/dialog-sum-file@gui") == "tars/hybrid.dialog-sum-file-gui"


def test_text_is_cleaned_to_the_charset():
  assert tgym.clean_text("naïve\tok") == "na?ve\tok"
  assert len(tgym.clean_text("x" * (tgym.MAX_TEXT + 5))) == tgym.MAX_TEXT


@pytest.mark.browser
def test_env_checker_and_an_episode_on_miniwob(server):
  env = gymnasium.make("tars/miniwob.click-test", server_url=server.url, render_mode="rgb_array")
  check_env(env.unwrapped)
  obs, info = env.reset(seed=3)
  assert obs["screenshot"].shape == (mw.HEIGHT, mw.WIDTH, 3) and obs["screenshot"].dtype == np.uint8
  assert obs["text"] == info["instruction"] == "Click the button."
  box = httpx.get(f"{server.url}/debug/sessions/{env.unwrapped.session_id}/element_box",
                  params={"selector": "#subbtn"}).json()["box"]
  x, y = (box["x"] + box["width"] / 2) / mw.WIDTH * 1000, (box["y"] + box["height"] / 2) / mw.HEIGHT * 1000
  obs, reward, terminated, truncated, info = env.step(f"Thought: the button\nAction: click(start_box='({x:.0f},{y:.0f})')")
  assert terminated and not truncated and reward > 0 and info["raw_reward"] == 1.0
  assert np.array_equal(env.render(), obs["screenshot"])
  env.close()


@pytest.mark.slow  # ~17 s: the checker resets the env many times, each a fresh Xvfb + xterm
def test_env_checker_and_an_episode_on_the_desktop():
  with launch_server("envs_bridge.desktop.server", step_ms=250, lease_s=120.0) as h:
    env = gymnasium.make("tars/desktop.terminal-mkdir", server_url=h.url)
    check_env(env.unwrapped, skip_render_check=True)
    obs, info = env.reset(seed=1)
    assert obs["screenshot"].shape == (dtasks.HEIGHT, dtasks.WIDTH, 3)
    word = info["instruction"].split("named ")[1].rstrip(".")
    obs, reward, terminated, truncated, info = env.step("run_command(command='ls')")
    assert obs["text"] == f"{info['instruction']}\n[exit code 0]"  # empty directory: no output
    obs, reward, terminated, truncated, info = env.step(f"type(content='mkdir {word}\\n')")
    for _ in range(20):
      if terminated:
        break
      obs, reward, terminated, truncated, info = env.step("wait()")
    assert terminated and reward == 1.0
    env.close()
