#!/usr/bin/env bash
# Prepared in session 26 for the next device session (one H200): our Triton FP8 GEMM with split-K
# (pallas_kernels.fp8_gemm.DECODE_CONFIGS, CPU-tested in interpret mode) against cuBLASLt at the decode GEMMs of
# Qwen3-8B, by GPU time on the same quantized operands; first its GPU tests (the split-K cases among them).
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  echo "== Triton GEMM GPU tests"; timeout $(left 200) python -m pytest -q -x -m gpu tests/test_pallas_kernels.py \
    -k Gemm -p no:cacheprovider 2>&1 | tail -4
  echo "== decode GEMMs"; timeout $(left 590) python experiments/bench_decode_gemms.py --preset qwen3_8b \
    --m 64 128 256 --shapes qkv o_proj gate_up down_proj --splits 2 --triton --out "$OUT/decode_gemms.json"
  echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | cut -c1-220 | tail -80
