#!/usr/bin/env bash
# Executes every notebook in notebooks/ against small runs made here with the project's own smoke
# configs (CI; README "Notebooks"). Fails on the first notebook cell that raises.
#
#   bash scripts/notebooks.sh            # runs under runs/ci_notebooks (removed first), executed copies in it
#   NB_RUNS=/tmp/nb NB_KEEP=1 bash scripts/notebooks.sh   # another dir; keep (and resume) its runs
#
# Runs: one smoke replication suite serves every notebook:
#   $NB_RUNS/replication   experiments/replicate.py +smoke, variants ppo and grpo, seed 0: demos (2 seeds per
#                          task), SFT, value pretraining, PPO and GRPO from that SFT checkpoint, evaluations
# Notebooks -> runs: training_dynamics and trajectories read ppo/seed_0 (metrics, rollouts) and the demos;
# merging interpolates ppo/seed_0 and grpo/seed_0 (same model, same SFT start) and evaluates 3 α, then reads the
# committed merge tables (benchmarks/results/merge_eval_vmw_seed*.json);
# step_budget evaluates ppo/seed_0 at budgets 1,2,4; replication reads the suite (one seed: intervals
# refused) and the committed benchmarks/results/replication.json; flywheel reads benchmarks/results/flywheel.json.
# Every evaluation uses 2 held-out seeds per task.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
PY=${PYTHON:-.venv/bin/python}
RUNS=${NB_RUNS:-runs/ci_notebooks}
[[ $RUNS = /* ]] || RUNS=$PWD/$RUNS
if [[ ${NB_KEEP:-0} != 1 ]]; then rm -rf "$RUNS"; fi
mkdir -p "$RUNS/executed"
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$RUNS/jax_cache}  # one model: compile once
t0=$SECONDS
stamp() { echo "[notebooks] $(( SECONDS - t0 )) s: $*"; }

stamp "replication suite smoke (ppo, grpo; seed 0)"
REP=$RUNS/replication
"$PY" -m experiments.replicate --workdir "$REP" --seeds 0 --variants ppo,grpo --suffix +smoke \
  || { tail -n 40 "$REP"/logs/*.log; exit 1; }

PPO=$REP/ppo/seed_0
# bootstrap resamples of the intervals from committed rows: CI checks that the cells run, not the intervals'
# last digit (the notebooks' own default, 10 000, takes minutes per notebook on 2 cores)
REPS=${NB_REPS:-200}
run_nb() {  # notebook name, then papermill -p NAME VALUE pairs
  local name=$1; shift
  stamp "notebook $name"
  "$PY" -m papermill "notebooks/$name.ipynb" "$RUNS/executed/$name.ipynb" --cwd "$PWD" \
    --kernel python3 --no-progress-bar --log-level WARNING "$@"
}
run_nb training_dynamics -p RUN "$PPO"
run_nb trajectories -p ROLLOUTS "$PPO/rollouts" -p DEMOS "$REP/demos" -p N 2
run_nb replication -p SWEEP "$REP" -p REPS $REPS
run_nb step_budget -p RUN "$PPO" -p BUDGETS 1,2,4 -p EPISODES 2 -p JSON "$RUNS/eval_budgets.json" -p RERUN True \
  -p REPS $REPS
run_nb merging -p CKPT_A "$PPO" -p CKPT_B "$REP/grpo/seed_0" -y "ALPHAS: [0.0, 0.5, 1.0]" \
  -p EPISODES 2 -p OUT "$RUNS/merge_line"
# flywheel: no flywheel run in the smoke suite (one takes ~25 min); the committed rows of docs/replication.md row 9
run_nb flywheel -p FLYWHEEL_RUNS "$RUNS/flywheel_seed*" -p CONTROL_RUNS "$RUNS/ppo_continue_seed*" -p REPS $REPS
stamp "all notebooks ran; executed copies in $RUNS/executed"
