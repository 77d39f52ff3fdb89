#!/usr/bin/env bash
# Session 7, call 2 (nvidia-h200-x2): W1 in every mode on the 4-warp table. Call 1's runs never got
# past the random init (its compile took > 60 s, and --stall-dump-s counted it; now armed after it).
# The stall hunt of call 1 ran the two one-warp configs alone for 20 s each at W1's shapes: no stall.
#   GPU 0: kv, then w8a8.   GPU 1: none under vLLM's KV capacity (740,896 tokens), then all.
source experiments/device/env.sh
W1="experiments/bench_rollout.py --preset qwen3_8b --workload W1 --kv-fraction 0.8 --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90"
(
  export CUDA_VISIBLE_DEVICES=0
  {
    echo "== W1 kv"; timeout 300 python $W1 --modes kv --out "$OUT/rollout_W1_kv.json"; echo "rc=$?"
    echo "== W1 w8a8"; timeout $((585 - SECONDS)) python $W1 --modes w8a8 --out "$OUT/rollout_W1_w8a8.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && (
  export CUDA_VISIBLE_DEVICES=1
  {
    echo "== W1 none"; timeout 300 python $W1 --modes none --kv-tokens 740896 --out "$OUT/rollout_W1_none.json"; echo "rc=$?"
    echo "== W1 all"; timeout $((585 - SECONDS)) python $W1 --modes all --out "$OUT/rollout_W1_all.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT"/gpu*.log | cut -c1-400 | tail -70
