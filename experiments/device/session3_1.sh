#!/usr/bin/env bash
# Session 3, H200 call 1: train-step time BF16 vs end-to-end FP8 (RL-core issue), an end-to-end RL
# run on a random Qwen3-1.7B with FP8 rollout and its stage times (RL-loop issue), then the prefill
# attention kernel's GPU tests and benchmark (rollout issue).
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
s() { echo "$1 rc=$2" >> "$OUT/summary.txt"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
timeout 140 python experiments/bench_train.py --preset qwen3_8b --layers 4 --batch 8 --seq-len 2048 \
  --out "$OUT/train_step_h200.json" > "$OUT/train_step.log" 2>&1; s bench_train $?
timeout 230 python experiments/bench_rl_step.py --preset qwen3_1_7b --arms all:bf16 --steps 3 \
  --out "$OUT/rl_step_h200.json" > "$OUT/rl_step.log" 2>&1; s bench_rl_step $?
timeout 80 python -m pytest -q -m gpu tests/test_prefill_attention.py -p no:cacheprovider --durations=5 \
  > "$OUT/prefill_gpu_tests.txt" 2>&1; s prefill_tests $?
timeout 60 python -m pallas_kernels.prefill_attention --max-seconds 35 --out "$OUT/prefill_attention_h200.json" \
  > "$OUT/prefill_bench.txt" 2>&1; s prefill_bench $?
cat "$OUT/gpu.txt" "$OUT/summary.txt"; tail -4 "$OUT/train_step.log"; tail -9 "$OUT/rl_step.log"
tail -4 "$OUT/prefill_gpu_tests.txt"; tail -12 "$OUT/prefill_bench.txt"
