# Second pointing-probe sweep (issue #25): spatial_merge_size=1 with higher lr / DeepStack / batch 32.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.15
run() { name=$1; shift; python3 -m benchmarks.probes.pointing_probe --screens ${SCREENS:-.probe/ct2.npz,.probe/ct.npz} \
  --config experiments/configs/miniwob_pipeline.py --steps 1500 --eval_at 250,500,750,1000,1500 \
  --max_seconds 110 --label $name --json $OUT/sweep2.jsonl --set spatial_merge_size=1 "$@" > /tmp/$name.log 2>&1; grep -E "\[probe\]|Error|error" /tmp/$name.log | tail -12 >> $OUT/log2.txt; }
run merge1_lr2e-3 --lr 2e-3 &
run merge1_lr3e-3 --lr 3e-3 &
run merge1_deepstack01 --set "deepstack_visual_indexes=(0,1)" &
run merge1_batch32 --batch 32 &
wait
cat $OUT/log2.txt
