#!/usr/bin/env bash
# Session 3, H200 call 3: the FP8 training path natively (Mosaic fprop/dgrad, BF16-dequantized
# wgrad) against its reference, the train-step benchmark again, then the FP8 rollout modes of the
# Qwen3-8B shape (call 2 ran out of memory in the KV calibration at a 70 GiB pool; here 50 GiB and
# the async CUDA allocator, with device memory logged).
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
s() { echo "$1 rc=$2" >> "$OUT/summary.txt"; }
timeout 60 python -m pytest -q tests/test_fp8_training.py -k pallas_path -p no:cacheprovider > "$OUT/fp8_training_gpu_test.txt" 2>&1; s fp8_train_test $?
timeout 150 python experiments/bench_train.py --preset qwen3_8b --layers 4 --batch 8 --seq-len 2048 \
  --out "$OUT/train_step_h200.json" > "$OUT/train_step.log" 2>&1; s bench_train $?
TF_GPU_ALLOCATOR=cuda_malloc_async timeout 330 python experiments/bench_rollout.py --preset qwen3_8b --workload W1 \
  --modes all kv --kv-gib 50 --max-slots 256 --steps-per-call 16 --prefill-batch 4 \
  --out "$OUT/rollout_qwen3_8b_W1_fp8.json" > "$OUT/rollout.log" 2>&1; s rollout $?
cat "$OUT/summary.txt"; tail -3 "$OUT/fp8_training_gpu_test.txt"; tail -3 "$OUT/train_step.log"
grep -v "^W1130\|^I1130\|^  " "$OUT/rollout.log" | tail -12
