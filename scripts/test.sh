#!/usr/bin/env bash
# Set up, then run the default (fast) test suite. Pass `-m slow` for the slow tests CI runs, `-m long` for
# the ones it does not (pytest.ini).
# Tests run in parallel pytest-xdist workers, one test file per worker at a time (module fixtures are
# built once): one pytest process keeps only ~1.1 of the CI machine's 2 cores busy (XLA compiles are
# single-threaded), two finish the fast suite in ~half the time (benchmarks/RESULTS.md).
# `-n 0` (after the script's name) runs everything in this one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
exec .venv/bin/python -m pytest -n auto --maxprocesses=4 --dist loadfile "${@:--q}"
