#!/usr/bin/env bash
# Session 4, call 2 (nvidia-h200-x2, one job per GPU at once):
#   GPU 0: the FP8-training Pallas-path test natively (after the K >= 512 guard), then the
#          train-step benchmark at 8 and 16 layers (FP8 vs BF16 step-time ratio, training issue);
#   GPU 1: where a Qwen3-8B decode step's time goes (profile_decode.py, BF16 and FP8 all), then
#          the paged-attention kernel over pool layouts (NHD vs HND) and a wide config sweep.
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 60 python -m pytest -q tests/test_fp8_training.py -k pallas_path -p no:cacheprovider > "$OUT/fp8_training_gpu_test.txt" 2>&1
  echo "fp8_train_test rc=$?" >> "$OUT/summary0.txt"
  timeout 170 python experiments/bench_train.py --preset qwen3_8b --layers 8 --batch 8 --seq-len 2048 \
    --out "$OUT/train_step_8l_h200.json" > "$OUT/train_8l.log" 2>&1
  echo "bench_train_8l rc=$?" >> "$OUT/summary0.txt"
  timeout 200 python experiments/bench_train.py --preset qwen3_8b --layers 16 --batch 8 --seq-len 2048 \
    --out "$OUT/train_step_16l_h200.json" > "$OUT/train_16l.log" 2>&1
  echo "bench_train_16l rc=$?" >> "$OUT/summary0.txt"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 220 python experiments/profile_decode.py --preset qwen3_8b --batch 256 --context 2048 --modes none all \
    --out "$OUT/decode_profile_qwen3_8b.json" --trace-out "$OUT/traces" > "$OUT/profile.log" 2>&1
  echo "profile_decode rc=$?" >> "$OUT/summary1.txt"
  timeout 200 python -m pallas_kernels.paged_attention --batch 256 --context 2048 --layouts nhd hnd --wide \
    --max-seconds 150 --out "$OUT/paged_attention_layouts_h200.json" > "$OUT/paged_sweep.log" 2>&1
  echo "paged_sweep rc=$?" >> "$OUT/summary1.txt"
) &
wait
cat "$OUT"/summary*.txt; tail -3 "$OUT/fp8_training_gpu_test.txt"
grep -i "ratio\|fp8\|bf16" "$OUT/train_8l.log" "$OUT/train_16l.log" | grep -v "^W1130\|^I1130" | tail -8
grep -v "^W1130\|^I1130" "$OUT/profile.log" | tail -30
grep -v "^W1130\|^I1130" "$OUT/paged_sweep.log" | tail -8
