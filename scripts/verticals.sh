#!/usr/bin/env bash
# Vertical agents and their merge (report section 2.6; experiments/configs/verticals.py): demonstrations
# of the three task sets -> one shared SFT checkpoint (continuing the main job's SFT policy) -> PPO of each
# vertical (GUI-Browsing, GUI-General, Game) from it -> merges (uniform, searched α) -> every model on
# every set (merge_eval.json, merge_eval.png).
#   bash scripts/verticals.sh                             # runs/verticals, from runs/main/sft
#   RUN=runs/v2 INIT=runs/r8/sft bash scripts/verticals.sh
#   EPISODES=60 VAL_EPISODES=20 bash scripts/verticals.sh  # held-out / α-search episodes per task set
#                                                           # (experiments/merge_eval.py: 30 and 10)
#   SFT=runs/mt/sft/seed_1 CRITIC=runs/mt/vpt/seed_1/critic RUN=runs/vmw/seed_1 \
#     CFG=experiments/configs/verticals_miniwob.py bash scripts/verticals.sh  # another config's verticals
#     # (its `verticals`), from an SFT run that exists (linked as $RUN/sft: no demonstrations, no SFT
#     # stage) and a pretrained critic for every vertical's PPO
# Re-running continues where it stopped: finished stages are skipped, a killed one resumes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
RUN=${RUN:-runs/verticals}
INIT=${INIT-runs/main/sft}  # the shared SFT stage starts from this policy (INIT="" = a fresh init)
MOD=${MOD:-}  # "smoke": tiny model and budgets (tests)
SFT=${SFT:-}  # an existing SFT run to start every vertical from (skips the demonstrations and SFT stages)
CRITIC=${CRITIC:-}  # a pretrained critic (value pretraining's <run>/critic) for configs with vpt.enabled
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$(realpath -m "$RUN")/jax_cache}
CFG=${CFG:-experiments/configs/verticals.py}
cfg() { echo "$CFG:$1${MOD:++$MOD}"; }
PY=.venv/bin/python
# the config's verticals (its `verticals`, sorted by name as ml_collections keeps them: merge_eval's order)
VERTICALS=$($PY -c 'import importlib, sys
m = importlib.import_module(sys.argv[1].removesuffix(".py").replace("/", "."))
print(" ".join(m.get_config("all" + sys.argv[2]).verticals))' "$CFG" "${MOD:++$MOD}")
T0=$(date +%s)
mkdir -p "$RUN"
stage() { echo "[verticals] $(( ($(date +%s) - T0) / 60 )) min: $*"; }
# one "finished" test for every stage (tars_jax/train/run.py): a trainer's done.json, or mark_done's
finished() { $PY -m tars_jax.train.run --is_done "$1"; }

if [ -n "$SFT" ]; then
  stage "shared SFT policy: $SFT"
  [ -e "$RUN/sft" ] || ln -s "$(realpath "$SFT")" "$RUN/sft"
else
  stage "demonstrations of the task sets"
  finished "$RUN/demos" || { $PY -m experiments.demos --config "$(cfg sft)" --out "$RUN/demos" \
    && $PY -m tars_jax.train.run --mark_done "$RUN/demos"; }
  stage "shared SFT stage${INIT:+ from $INIT}"
  finished "$RUN/sft" || $PY -m experiments.sft --config "$(cfg sft)" --workdir "$RUN/sft" ${INIT:+--config.policy.init="$INIT"} \
    --config.sft.data="('$RUN/demos',)"
fi
for v in $VERTICALS; do
  stage "PPO of the $v vertical from the shared SFT policy"
  finished "$RUN/$v" || $PY -m experiments.train --config "$(cfg $v)" --workdir "$RUN/$v" --config.policy.init="$RUN/sft" \
    ${CRITIC:+--config.critic.init="$(realpath "$CRITIC")"}
done
stage "merges and their evaluation on every set"
$PY -m experiments.merge_eval --config "$(cfg all)" --workdir "$RUN" ${EPISODES:+--episodes "$EPISODES"} \
  ${VAL_EPISODES:+--val_episodes "$VAL_EPISODES"}
stage "done: $RUN (merge_eval.json, merge_eval.png)"
