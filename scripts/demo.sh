#!/usr/bin/env bash
# Main job: set up, train the small VLM agent with PPO on MiniWoB++ click tasks, then evaluate it.
#   bash scripts/demo.sh                # full run (experiments/configs/miniwob_ppo.py)
#   bash scripts/demo.sh --config.rl.lr=1e-4   # extra flags go to experiments/train.py
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
RUN=${RUN:-runs/miniwob_ppo}
.venv/bin/python -m experiments.train --config experiments/configs/miniwob_ppo.py --workdir "$RUN" "$@"
.venv/bin/python -m experiments.eval --run "$RUN" --tasks miniwob/click-test,miniwob/click-test-2 \
  --episodes 200 --json "$RUN/eval.json"
.venv/bin/python -m experiments.plot --run "$RUN"
