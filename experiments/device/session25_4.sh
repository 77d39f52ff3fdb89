#!/usr/bin/env bash
# Session 25, call 4 (one H200, the machine of calls 2-3): with decode row buckets, Qwen3-8B W2 in mode all (128
# prompts: it decoded 256 slots before) and W1 in mode none (its BF16 pool preempts, leaving a tail of few rows).
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  echo "== 8B W2 all, decode row buckets"; timeout $(left 270) python experiments/bench_rollout.py --preset qwen3_8b \
    --max-slots 256 --steps-per-call 16 --prefill-batch 4 --workload W2 --stall-dump-s 90 \
    --kv-gib-like-vllm 101.74 107.52 --modes all --out "$OUT/rollout_8b_W2_all.json"; echo "rc=$?"
  echo "== 8B W1 none, decode row buckets"; timeout $(left 590) python experiments/bench_rollout.py --preset qwen3_8b \
    --max-slots 256 --steps-per-call 16 --prefill-batch 4 --workload W1 --stall-dump-s 90 \
    --kv-gib-like-vllm 101.74 107.52 --modes none --out "$OUT/rollout_8b_W1_none.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"' | cut -c1-300 | tail -30
