#!/usr/bin/env bash
# Session 5, call 1 (nvidia-h200-x2, one job per GPU at once; at most 8 files come back):
#   GPU 0: FP8 training step time vs BF16 (8 Qwen3-8B layers) after the dequantization barrier
#          (codes_to_float32); GPU tests of the kernels changed in session 4; the FP8 paged-attention
#          wide sweep (2-D gather).
#   GPU 1: the BF16 paged-attention wide sweep; the Qwen3-8B decode-step profile, none and all.
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
filt() { grep -v "^W1130\|^I1130\|DeprecationWarning\|return rule"; }
(
  export CUDA_VISIBLE_DEVICES=0
  {
    echo "== bench_train 8 layers"; timeout 230 python experiments/bench_train.py --preset qwen3_8b --layers 8 \
      --batch 8 --seq-len 2048 --out "$OUT/train_step_qwen3_8b_8l.json"; echo "rc=$?"
    echo "== gpu tests"; timeout 120 python -m pytest -q -m gpu tests/test_kv_write.py tests/test_paged_attention.py \
      tests/test_grouped_gemm_dense.py tests/test_fp8_training.py -p no:cacheprovider 2>&1 | tail -8; echo "rc=$?"
    echo "== paged attention fp8 wide"; timeout 170 python -m pallas_kernels.paged_attention --wide --batch 256 \
      --context 2048 --dtypes float8_e4m3fn --max-seconds 140 --out "$OUT/pa_fp8.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  {
    echo "== paged attention bf16 wide"; timeout 200 python -m pallas_kernels.paged_attention --wide --batch 256 \
      --context 2048 --dtypes bfloat16 --max-seconds 170 --out "$OUT/pa_bf16.json"; echo "rc=$?"
    echo "== profile 8b"; timeout 200 python experiments/profile_decode.py --preset qwen3_8b --batch 256 --context 2048 \
      --modes none all --out "$OUT/decode_profile_qwen3_8b.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT/gpu0.log" | tail -45; echo; grep -v "^  \|^$" "$OUT/gpu1.log" | tail -45
