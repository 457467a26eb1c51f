# Pointing-probe sweep on the GPU machine (issue #25): 8 model / optimiser variants side by side.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.1
nvidia-smi -L; python3 -c "import jax, flax; print(jax.__version__, flax.__version__, jax.devices())"
S=${STEPS:-4000}; MAXS=${MAXS:-420}
run() { name=$1; shift; python3 -m benchmarks.probes.pointing_probe --screens ${SCREENS:-.probe/ct2.npz,.probe/ct.npz} \
  --config experiments/configs/miniwob_pipeline.py --steps $S --eval_at 250,500,1000,1500,2000,3000,4000 \
  --max_seconds $MAXS --label $name --json $OUT/sweep.jsonl "$@" > /tmp/$name.log 2>&1; grep -E "\[probe\]|Error|error" /tmp/$name.log | tail -20 >> $OUT/log.txt; }
run base &
run depth4 --config.model.vision_depth=4 &
run merge1 --set spatial_merge_size=1 &
run deepstack01 --set "deepstack_visual_indexes=(0,1)" &
run wide192 --config.model.vision_hidden=192 --config.model.vision_mlp=384 &
run lr3e-3 --lr 3e-3 &
run batch64 --batch 64 &
run patch7 --config.model.patch_size=7 &
wait
cat $OUT/log.txt
