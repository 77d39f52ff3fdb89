#!/usr/bin/env bash
# Prepared in session 28 for the next device session (one H200): the RL-shaped workload (256 x 512 -> up to 8192,
# spread lengths) in mode all with every FP8 GEMM on cuBLASLt, then with AUTO (the committed Triton table: q/k/v,
# o_proj and gate/up at up to 64 rows on Triton), one machine. Its decode calls run at 16-64 rows in the tail
# (session 26: 127 of 513 calls), where the table applies.
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  for spec in "cublaslt 295" "auto 590"; do set -- $spec
    echo "== 8B RL all, --fp8-gemm $1"; timeout $(left $2) python experiments/bench_rollout.py --preset qwen3_8b \
      --max-slots 256 --steps-per-call 16 --prefill-batch 4 --workload RL --stall-dump-s 90 \
      --kv-gib-like-vllm 101.74 107.52 --modes all --fp8-gemm $1 --out "$OUT/rollout_8b_RL_all_$1.json"
    echo "rc=$?"
  done
} 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '^{"mode"' | cut -c1-300 | tail -30
