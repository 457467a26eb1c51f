"""Fixtures shared by the test modules. The packages are imported as installed (`scripts/setup.sh`:
`pip install -e .`); `tests/_shared.py` is importable as `_shared` because pytest puts this directory on
the path of the test modules it collects."""

import pytest


@pytest.fixture(scope="session")
def server():
  """A real sandbox server subprocess (real Chromium) on a free loopback port."""
  from envs_bridge.launch import launch_server
  with launch_server(step_ms=1000, lease_s=60.0) as h:
    yield h

