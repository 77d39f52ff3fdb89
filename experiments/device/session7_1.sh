#!/usr/bin/env bash
# Session 7, call 1 (nvidia-h200-x2; GPU 1 runs the BF16 and all W1 alongside).
#   1. The paged-attention stall hunt: the two one-warp configs that were in the table when every W1
#      run of sessions 5-6 using them stopped advancing, the table's 4-warp entries that replaced them,
#      and faster 2/4-warp FP8 candidates; each in its own process, 20 s of back-to-back calls at
#      B = 256, context <= 3072 (W1's), killed and reported when it stops progressing.
#   2. W1 kv (GPU 0) and none + all (GPU 1) with the 4-warp table, a stall dump after 60 s without progress;
#      each run gets what is left of the call's 585 s.
# Copy stall_hunt.json back; if a faster config survived, put it in the table before the next call.
source experiments/device/env.sh
W1="experiments/bench_rollout.py --preset qwen3_8b --workload W1 --kv-fraction 0.8 --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 60"
(
  export CUDA_VISIBLE_DEVICES=0
  {
    echo "== stall hunt"; timeout 230 python experiments/paged_attention_stall_hunt.py --seconds 20 --stall-s 12 \
      --only 6 --out "$OUT/stall_hunt.json"; echo "rc=$?"
    echo "== W1 kv"; timeout $((585 - SECONDS)) python $W1 --modes kv --out "$OUT/rollout_W1_kv.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && (
  export CUDA_VISIBLE_DEVICES=1
  {
    # BF16 under vLLM's KV capacity at gpu_memory_utilization 0.85 (740,896 tokens, session 6)
    echo "== W1 none"; timeout 260 python $W1 --modes none --kv-tokens 740896 --out "$OUT/rollout_W1_none.json"; echo "rc=$?"
    echo "== W1 all"; timeout $((585 - SECONDS)) python $W1 --modes all --out "$OUT/rollout_W1_all.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT"/gpu*.log | cut -c1-400 | tail -60
