import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def server():
  """A real sandbox server subprocess (real Chromium) on a free loopback port."""
  from envs_bridge.launch import launch_server
  with launch_server(step_ms=1000, lease_s=60.0) as h:
    yield h
