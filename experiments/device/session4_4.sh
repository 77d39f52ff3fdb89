#!/usr/bin/env bash
# Session 4, call 4 (nvidia-h200): the FP8-training Pallas-path test after the dequantization barrier
# (codes_to_float32), and the decode-step profile with float16 dots reverted and the GEMM tuning table.
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
filt() { grep -v "^W1130\|^I1130\|DeprecationWarning\|return rule"; }
{
  echo "== fp8 training pallas path"; timeout 60 python -m pytest -q tests/test_fp8_training.py -k pallas_path \
    -p no:cacheprovider 2>&1 | tail -3
  echo "== profile"; timeout 130 python experiments/profile_decode.py --preset qwen3_8b --batch 256 --context 2048 \
    --modes all --out "$OUT/decode_profile_qwen3_8b_all.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/log.txt"
cat "$OUT/log.txt"
