#!/usr/bin/env bash
# One RL pilot of the replication suite's `ppo` config from an existing SFT checkpoint (benchmarks/RESULTS.md,
# "Replication suite: the reward RL optimised"): value pretraining under that policy (skipped when done), PPO
# from it with the given overrides, then a held-out evaluation. Resumable: re-running continues.
#   SFT=runs/replication/sft/seed_0 bash scripts/rl_pilot.sh NAME SEED [--config.<field>=<value> ...]
#   env: SFT (required), OUT (default runs/pilot), EPISODES (held-out seeds per task, default 50),
#        VPT (critic run dir; default $OUT/vpt_s$SEED)
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=$1; SEED=$2; shift 2
OUT=${OUT:-runs/pilot}; EPISODES=${EPISODES:-50}; V=${VPT:-$OUT/vpt_s$SEED}; D=$OUT/${NAME}_s$SEED
source scripts/env.sh
mkdir -p "$OUT"
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$(realpath -m "$OUT")/jax_cache}
.venv/bin/python -m tars_jax.train.run --is_done "$V" || .venv/bin/python -m experiments.value_pretrain \
  --config experiments/configs/replication.py:ppo --config.seed="$SEED" --workdir "$V" --config.vpt.policy_run="$SFT"
.venv/bin/python -m experiments.train --config experiments/configs/replication.py:ppo --config.seed="$SEED" \
  --workdir "$D" --config.policy.init="$SFT" --config.critic.init="$V/critic" "$@"
[ -f "$D/eval$EPISODES.json" ] || .venv/bin/python -m experiments.eval --run "$D" --episodes "$EPISODES" \
  --json "$D/eval$EPISODES.json"
