#!/usr/bin/env bash
# Executes every notebook in notebooks/ against small runs made here with the project's own smoke
# configs (CI; README "Notebooks"). Fails on the first notebook cell that raises.
#
#   bash scripts/notebooks.sh            # runs under runs/ci_notebooks (removed first), executed copies in it
#   NB_RUNS=/tmp/nb NB_KEEP=1 bash scripts/notebooks.sh   # another dir; keep (and resume) its runs
#
# Runs (one smoke sweep serves four notebooks):
#   $NB_RUNS/ablations/{ppo,grpo,ppo_vpt}/seed_0   experiments/sweep.py, miniwob_ablations.py +smoke (1 iteration)
#   $NB_RUNS/demos                                 experiments/demos.py (the pipeline's smoke grammar), 2 seeds per task
#   $NB_RUNS/replication                           experiments/replicate.py +smoke, variant ppo, seed 0 (demos, SFT,
#                                                  value pretraining, PPO, evaluations)
# Notebooks -> runs: training_dynamics and trajectories read ppo/seed_0 (metrics, rollouts) and the demos;
# ablations the sweep; merging interpolates ppo/seed_0 and ppo_vpt/seed_0 (same model) and evaluates 3 α;
# step_budget evaluates ppo/seed_0 at budgets 1,2,4; replication reads its smoke sweep (one seed: intervals
# refused) and the committed benchmarks/results/replication.json. Every evaluation uses 2 held-out seeds per task.
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

stamp "sweep smoke (ppo, grpo, ppo_vpt; seed 0; 1 iteration)"
"$PY" -m experiments.sweep --config experiments/configs/miniwob_ablations.py --variants ppo,grpo,ppo_vpt \
  --suffix +smoke --seeds 0 --workdir "$RUNS/ablations" \
  || { tail -n 40 "$RUNS"/ablations/*/seed_0.log; exit 1; }
stamp "demonstrations (2 seeds per task)"
[[ -f $RUNS/demos/done ]] || {  # a kept dir's demonstrations are not written twice
  "$PY" -m experiments.demos --config experiments/configs/miniwob_pipeline.py:+smoke --seeds 2 --out "$RUNS/demos"
  touch "$RUNS/demos/done"; }

stamp "replication suite smoke (ppo, seed 0)"
"$PY" -m experiments.replicate --workdir "$RUNS/replication" --seeds 0 --variants ppo --suffix +smoke \
  || { tail -n 40 "$RUNS"/replication/logs/*.log; exit 1; }

PPO=$RUNS/ablations/ppo/seed_0
run_nb() {  # notebook name, then papermill -p NAME VALUE pairs
  local name=$1; shift
  stamp "notebook $name"
  "$PY" -m papermill "notebooks/$name.ipynb" "$RUNS/executed/$name.ipynb" --cwd "$PWD" \
    --kernel python3 --no-progress-bar --log-level WARNING "$@"
}
run_nb training_dynamics -p RUN "$PPO"
run_nb trajectories -p ROLLOUTS "$PPO/rollouts" -p DEMOS "$RUNS/demos" -p N 2
run_nb ablations -p SWEEP "$RUNS/ablations"
run_nb step_budget -p RUN "$PPO" -p BUDGETS 1,2,4 -p EPISODES 2 -p JSON "$RUNS/eval_budgets.json" -p RERUN True
run_nb merging -p CKPT_A "$PPO" -p CKPT_B "$RUNS/ablations/ppo_vpt/seed_0" -y "ALPHAS: [0.0, 0.5, 1.0]" \
  -p EPISODES 2 -p OUT "$RUNS/merge_line"
run_nb replication -p SWEEP "$RUNS/replication" -p REPS 1000
stamp "all notebooks ran; executed copies in $RUNS/executed"
