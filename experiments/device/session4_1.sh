#!/usr/bin/env bash
# Session 4, call 1 (nvidia-h200-x2): the scale-out measurement of the scale-out issue, both GPUs.
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus.txt" 2>&1
timeout 560 python experiments/bench_scaling.py --preset qwen3_8b --train-layers 8 --max-new 512 --repeats 2 \
  --out "$OUT/scaling_qwen3_8b_h200x2.json" > "$OUT/scaling.log" 2>&1
echo "bench_scaling rc=$?" | tee "$OUT/summary.txt"
grep -v "^W1130\|^I1130\|^  " "$OUT/scaling.log" | tail -15
