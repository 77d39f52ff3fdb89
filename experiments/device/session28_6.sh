#!/usr/bin/env bash
# Session 28 (one H200): more Triton FP8 GEMM configs near session28_1's one winner (o_proj at M bucket 64: 64 x 64
# tiles, 4 warps, 4 stages, 2 K splits, swap_ab, scales prefetched): stages, K splits and 128-row weight tiles, at 64
# rows (the M bucket 64 the table keys), against cuBLASLt, merged into a copy of the committed table.
source experiments/device/env.sh
cp fp8rl_jax/quant/fp8_gemm_triton.json "$OUT/fp8_gemm_triton.json"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  timeout $(left 230) python experiments/bench_decode_gemms.py --preset qwen3_8b --m 64 \
    --shapes o_proj qkv down_proj gate_up --splits 2 --triton --out "$OUT/decode_gemms_m64.json" \
    --triton-table-out "$OUT/fp8_gemm_triton.json" --triton-configs 64,64,4,4,2,swap,prefetch \
    64,64,4,3,2,swap,prefetch 64,64,4,6,2,swap,prefetch 64,64,4,4,1,swap,prefetch 64,64,4,4,4,swap,prefetch \
    64,64,4,4,8,swap,prefetch 64,128,4,4,2,swap,prefetch 64,128,8,4,2,swap,prefetch 64,128,4,4,4,swap,prefetch
  echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep "fp8_cublaslt\|fp8_triton\|rc=\|^M<=" | cut -c1-140 | tail -60
