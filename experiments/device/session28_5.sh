#!/usr/bin/env bash
# Session 28 (one H200), after session28_1.sh measured the Triton FP8 GEMM faster than cuBLASLt at one decode shape
# (o_proj, 4096 x 4096, M bucket 64: 13.25 against 15.53 us; the table is fp8rl_jax/quant/fp8_gemm_triton.json): the
# mode-all decode step with every FP8 GEMM on cuBLASLt against AUTO (that shape on Triton) at 64 and 16 rows, where
# the table's M bucket 64 applies, one machine.
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  i=0
  for run in 64:cublaslt 64:auto 16:cublaslt 16:auto 64:cublaslt 64:auto; do rows=${run%:*} gemm=${run#*:} i=$((i + 1))
    echo "== decode step all, $rows x 4096, --fp8-gemm $gemm"
    timeout $(left 440) python experiments/profile_decode.py --preset qwen3_8b --batch $rows --context 4096 \
      --lengths equal --modes all --fp8-gemm $gemm --out "$OUT/profile_all_${rows}_${gemm}_$i.json"; echo "rc=$?"
  done
} 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | cut -c1-250 | tail -60
