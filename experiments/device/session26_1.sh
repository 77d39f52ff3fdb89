#!/usr/bin/env bash
# Session 26, call 1 (one H200): cuBLASLt's algorithm choice at the decode GEMMs. Session 25's W2 all profile (128
# rows) spent 3.05 ms a step in the FP8 GEMMs for 6.95 GB of weights (53% of the HBM roofline): cuBLASLt's heuristic
# ran q/k/v and o_proj as 32-48 tiles of 128 x 128 on 132 SMs. (1) the cuBLASLt tests on the GPU (the handler's new
# algo / split_k attributes, its declarations against cublasLt.h); (2) the sweep of the heuristic's algorithms x
# pinned K splits at M = 64, 128, 256, writing the table the policy reads; (3) the decode step of mode all at W2's
# and W1's shapes with the heuristic's choice against the table's, one machine.
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  echo "== cuBLASLt tests on the GPU"; timeout $(left 120) python -m pytest -q -x tests/test_cublaslt.py \
    -p no:cacheprovider 2>&1 | tail -5
  # (as run in session 26 the sweep's --out had the table's file name, and the cp below overwrote it: its rows
  # survive in the log only; the sweep then ranked by replay_ms, since replaced by GPU time)
  echo "== sweep"; timeout $(left 330) python experiments/tune_cublaslt_algos.py --preset qwen3_8b --m 64 128 256 \
    --out "$OUT/cublaslt_sweep.json" --table-out fp8rl_jax/quant/cublaslt_algos.json; echo "rc=$?"
  cp fp8rl_jax/quant/cublaslt_algos.json "$OUT/" 2>/dev/null
  for shape in "128 4096" "256 2048"; do set -- $shape
    for algo in heuristic table; do
      echo "== decode step all, $1 x $2, FP8RL_CUBLASLT_ALGO=$algo"
      FP8RL_CUBLASLT_ALGO=$algo timeout $(left 580) python experiments/profile_decode.py --preset qwen3_8b \
        --batch $1 --context $2 --lengths equal --modes all --out "$OUT/profile_all_$1_${algo}.json"; echo "rc=$?"
    done
  done
} 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | cut -c1-250 | tail -120
