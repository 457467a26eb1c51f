#!/usr/bin/env bash
# The replication suite (experiments/configs/replication.py; README "Replication suite"; issue #37):
# demonstrations -> SFT per training seed -> value pretraining -> RL variants -> held-out evaluation
# -> benchmarks-style rows, rliable intervals, curves. Resumable: re-running skips finished stages.
#   bash scripts/replicate.sh                                # runs/replication, seeds 0,1,2, every variant
#   SEEDS=0,1,2,3,4 VARIANTS=ppo,grpo bash scripts/replicate.sh
#   MOD=smoke RUN=/tmp/rep bash scripts/replicate.sh         # tiny model and budgets
#   RUN=runs/rl_seeds VARIANTS=ppo_thoughts bash scripts/replicate.sh --sft_seed 0   # every RL seed from seed 0's SFT
#   CONFIG=experiments/configs/replication_multiturn.py RUN=runs/multiturn bash scripts/replicate.sh  # 3 multi-turn tasks
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
RUN=${RUN:-runs/replication}
SEEDS=${SEEDS:-0,1,2}
VARIANTS=${VARIANTS:-ppo,grpo,ppo_novpt,ppo_coupled,ppo_lenadapt,ppo_kl,ppo_thoughts}
MOD=${MOD:-}
CONFIG=${CONFIG:-experiments/configs/replication.py}
mkdir -p "$RUN"
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$(realpath -m "$RUN")/jax_cache}
exec .venv/bin/python -m experiments.replicate --config "$CONFIG" --workdir "$RUN" \
  --seeds "$SEEDS" --variants "$VARIANTS" ${MOD:+--suffix "+$MOD"} "$@"
