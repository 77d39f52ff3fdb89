#!/usr/bin/env bash
# Prepared in session 27 for the next device session (one H200): the Triton FP8 GEMM's decode configs with the
# scales preloaded before the K loop or prefetched a step ahead, and with swap_ab (weight rows on the wgmma's M
# side), against cuBLASLt by GPU time at Qwen3-8B's decode GEMMs. Session 27 found the per-step scale loads' configs
# 1.02-2.86x cuBLASLt; offline codegen shows the new ones' K loops free of those global loads. GPU tests first.
# The per-shape winners go to $OUT/fp8_gemm_triton.json: commit it as fp8rl_jax/quant/fp8_gemm_triton.json where
# Triton won a shape, then session28_3.sh.
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  echo "== Triton GEMM GPU tests"; timeout $(left 240) python -m pytest -q -x -m gpu tests/test_pallas_kernels.py \
    -k "Gemm and not Grouped" -p no:cacheprovider 2>&1 | tail -4
  echo "== decode GEMMs"; timeout $(left 590) python experiments/bench_decode_gemms.py --preset qwen3_8b \
    --m 64 128 256 --shapes qkv o_proj gate_up down_proj --splits 2 --triton --out "$OUT/decode_gemms.json" \
    --triton-table-out "$OUT/fp8_gemm_triton.json"
  echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep "fp8_cublaslt\|fp8_triton\|passed\|failed\|rc=\|^M<=" | cut -c1-160 | tail -200
