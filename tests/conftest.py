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


# The slow step's longest files (`--durations` of `.ci/run` at 242b41d, benchmarks/RESULTS.md): collected
# first: with `--no-loadscope-reorder` (.ci/run's slow step) `--dist loadfile` hands files to the xdist
# workers in collection order, and a step that starts them last ends on one of them running alone
# (longest-processing-time-first scheduling). xdist's default order is the most tests per file first.
_LONGEST_FIRST = ("tests/test_notebooks.py", "tests/test_verticals.py", "tests/test_streaming_processes.py",
                  "tests/test_pipeline.py", "tests/test_sharding.py")


def pytest_collection_modifyitems(config, items):
  rank = {f: i for i, f in enumerate(_LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order
