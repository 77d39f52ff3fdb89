#!/usr/bin/env bash
# Session 3, H200 call 2: the end-to-end RL step on a random Qwen3-1.7B, FP8 rollout vs BF16 rollout
# (call 1 ran out of memory in the update at 8 sequences per micro-batch: [8, 1536, 152k] float32
# logits copies; here 2 per micro-batch), then the rollout benchmark's FP8 modes on the Qwen3-8B
# shape, workload W1, same engine settings as the BF16 row of session 2.
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
s() { echo "$1 rc=$2" >> "$OUT/summary.txt"; }
timeout 300 python experiments/bench_rl_step.py --preset qwen3_1_7b --arms all:bf16 none:bf16 --steps 3 \
  --micro-batches 64 --out "$OUT/rl_step_h200.json" > "$OUT/rl_step.log" 2>&1; s bench_rl_step $?
timeout 270 python experiments/bench_rollout.py --preset qwen3_8b --workload W1 --modes all kv --kv-gib 70 \
  --max-slots 256 --steps-per-call 16 --prefill-batch 4 --out "$OUT/rollout_qwen3_8b_W1_fp8.json" > "$OUT/rollout.log" 2>&1
s rollout $?
cat "$OUT/summary.txt"; grep -v "^W1130\|^I1130" "$OUT/rl_step.log" | tail -12; tail -8 "$OUT/rollout.log"
