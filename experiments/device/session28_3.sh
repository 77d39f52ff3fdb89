#!/usr/bin/env bash
# Prepared in session 27 for the next device session (one H200), after session28_1.sh and only if its table
# (committed as fp8rl_jax/quant/fp8_gemm_triton.json) has Triton winning some decode shape: the mode-all decode step
# with every dense FP8 GEMM on cuBLASLt against AUTO (the table's Triton shapes on Triton), at W2's and W1's shapes,
# one machine.
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  for shape in "128 4096" "256 2048"; do set -- $shape
    for gemm in cublaslt auto; do
      echo "== decode step all, $1 x $2, --fp8-gemm $gemm"
      timeout $(left 580) python experiments/profile_decode.py --preset qwen3_8b --batch $1 --context $2 \
        --lengths equal --modes all --fp8-gemm $gemm --out "$OUT/profile_all_$1_$gemm.json"; echo "rc=$?"
    done
  done
} 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | cut -c1-250 | tail -40
