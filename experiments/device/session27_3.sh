#!/usr/bin/env bash
# Prepared in session 26 for the next device session (one H200): the decode step of mode all with the dense FP8 GEMMs
# on cuBLASLt (the H200 default) against our Triton split-K kernel (EngineConfig.fp8_gemm / --fp8-gemm triton,
# `fp8rl_jax.quant.policy.triton_config`), at W2's and W1's shapes, one machine. Run after session27_2.sh shows
# which Triton configs win per M, and put those in triton_config first.
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  for shape in "128 4096" "256 2048"; do set -- $shape
    for gemm in cublaslt triton; do
      echo "== decode step all, $1 x $2, --fp8-gemm $gemm"
      timeout $(left 580) python experiments/profile_decode.py --preset qwen3_8b --batch $1 --context $2 \
        --lengths equal --modes all --fp8-gemm $gemm --out "$OUT/profile_all_$1_$gemm.json"; echo "rc=$?"
    done
  done
} 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | cut -c1-250 | tail -40
