#!/usr/bin/env bash
# Set up, then run the default (fast) test suite. Pass `-m slow` for the slow tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
exec .venv/bin/python -m pytest "${@:--q}"
