#!/usr/bin/env bash
# One H200 call: the rollout benchmark (Qwen3-8B shape, random weights, workload W1) for BF16 and FP8 (all),
# then the paged-attention long-context test that overflowed shared memory in the previous call.
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 240 python experiments/bench_rollout.py --preset qwen3_8b --workload W1 --modes all --kv-gib 70 \
  --max-slots 256 --steps-per-call 16 --prefill-batch 4 --out "$OUT/rollout_qwen3_8b_W1.json" > "$OUT/rollout.log" 2>&1
echo "rollout rc=$?" >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; tail -12 "$OUT/rollout.log"
