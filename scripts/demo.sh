#!/usr/bin/env bash
# Main job: the report's recipe on MiniWoB++ click-test / click-test-2, every stage a resumable run under
# runs/<name>/ (experiments/configs/miniwob_pipeline.py):
#   grounding data -> grounding (CT) stage -> expert demonstrations -> SFT -> value pretraining -> PPO
#   -> held-out evaluation of the SFT and the RL policy -> plots.
#   bash scripts/demo.sh                          # runs/main
#   RUN=runs/try2 bash scripts/demo.sh            # another run dir
#   ARG=grpo bash scripts/demo.sh                 # the RL stage with GRPO instead of critic PPO
#   ARG=thoughts bash scripts/demo.sh             # templated thoughts kept (think length logged)
#   SEED=1 RUN=runs/main_seed1 bash scripts/demo.sh  # another training seed (config.seed of every trained stage)
# Re-running continues where it stopped: finished stages are skipped, a killed one resumes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
RUN=${RUN:-runs/main}
# One compilation cache for all stages: the sampler, SFT and PPO programs of one model are compiled
# once per run, and a re-run compiles nothing (the cache only skips compiles, results are the same).
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$(realpath -m "$RUN")/jax_cache}
ARG=${ARG:-}  # config arg of the data, SFT, value-pretraining and RL stages ("", grpo, thoughts)
SEED=${SEED:-0}  # config.seed of the trained stages (init, data order, sampling); the data stages do not depend on it
MOD=${MOD:-}  # "smoke": tiny model and budgets (tests/test_pipeline.py)
CFG=experiments/configs/miniwob_pipeline.py
cfg() { echo "$CFG:$1${MOD:++$MOD}"; }
PY=.venv/bin/python
T0=$(date +%s)
mkdir -p "$RUN"
stage() { echo "[demo] $(( ($(date +%s) - T0) / 60 )) min: $*"; }
# one "finished" test for every stage (tars_jax/train/run.py): a trainer's done.json, or mark_done's
finished() { $PY -m tars_jax.train.run --is_done "$1"; }

stage "grounding data"
finished "$RUN/grounding/data" || { $PY -m experiments.grounding --config "$(cfg "$ARG")" --out "$RUN/grounding/data" \
  && $PY -m tars_jax.train.run --mark_done "$RUN/grounding/data"; }
stage "grounding stage (SFT on grounding examples)"
finished "$RUN/grounding" || $PY -m experiments.sft --config "$(cfg grounding)" --workdir "$RUN/grounding" --config.seed="$SEED" \
  --config.sft.data="('$RUN/grounding/data/train',)" --config.sft.heldout="('$RUN/grounding/data/heldout',)"
stage "expert demonstrations"
finished "$RUN/demos" || { $PY -m experiments.demos --config "$(cfg "$ARG")" --out "$RUN/demos" \
  && $PY -m tars_jax.train.run --mark_done "$RUN/demos"; }
stage "SFT on demonstrations"
finished "$RUN/sft" || $PY -m experiments.sft --config "$(cfg "$ARG")" --workdir "$RUN/sft" --config.seed="$SEED" \
  --config.policy.init="$RUN/grounding" --config.sft.data="('$RUN/demos',)" --config.sft.heldout="('$RUN/grounding/data/heldout',)"
stage "value pretraining under the SFT policy"
finished "$RUN/vpt" || $PY -m experiments.value_pretrain --config "$(cfg "$ARG")" --workdir "$RUN/vpt" --config.seed="$SEED" \
  --config.vpt.policy_run="$RUN/sft"
stage "RL from the SFT policy"
CRITIC=()
[[ ${ARG} == grpo ]] || CRITIC=(--config.critic.init="$RUN/vpt/critic")
finished "$RUN/ppo" || $PY -m experiments.train --config "$(cfg "$ARG")" --workdir "$RUN/ppo" --config.seed="$SEED" \
  --config.policy.init="$RUN/sft" "${CRITIC[@]}"
stage "held-out evaluation (200 seeds per task) of the SFT and the RL policy"
for s in sft ppo; do
  $PY -m experiments.eval --run "$RUN/$s" --tasks miniwob/click-test,miniwob/click-test-2 --episodes "${EVAL_EPISODES:-200}" \
    --json "$RUN/eval_$s.json"
done
cp "$RUN/eval_ppo.json" "$RUN/eval.json"
$PY -m experiments.plot --pipeline "$RUN"
stage "done: $RUN (eval_sft.json, eval_ppo.json, pipeline.png)"
