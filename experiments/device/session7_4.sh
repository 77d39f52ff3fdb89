#!/usr/bin/env bash
# Session 7, call 4 (nvidia-h200-x2): W2 (128 x 1024 -> 6144) BF16 under vLLM's KV capacity on GPU 0 and
# FP8 all on GPU 1, with the table's new 2-warp word-gather FP8 attention entry (held at W1 scale in call 3).
source experiments/device/env.sh
W2="experiments/bench_rollout.py --preset qwen3_8b --workload W2 --kv-fraction 0.8 --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90"
(
  export CUDA_VISIBLE_DEVICES=0
  { echo "== W2 none"; timeout 380 python $W2 --modes none --kv-tokens 740896 --out "$OUT/rollout_W2_none.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && (
  export CUDA_VISIBLE_DEVICES=1
  { echo "== W2 all"; timeout 380 python $W2 --modes all --out "$OUT/rollout_W2_all.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT"/gpu*.log | grep -v '"partial"' | cut -c1-300 | tail -40
