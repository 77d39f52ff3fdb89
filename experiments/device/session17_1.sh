#!/usr/bin/env bash
# Planned for session 17, call 1 (one H200; written in session 16, not run yet):
#   1. EngineConfig.fused_cast A/B (session 16, untimed): the decode step by kernel at 256 rows x context 2048 in
#      modes none and kv with the BF16 GEMMs writing BF16 themselves (on) and writing float32 + a convert (off:
#      the code before). Session 15's kv profile: the casts ~0.4 ms of 17.6.
#   2. Qwen3-8B W1 in all four modes in one process on the current code (session 16: none 7471, w8a8 8792, kv 10090,
#      all 11927 on a machine where W1 kv ran 10015-10145).
#   3. the two small GPU-test files.
source experiments/device/env.sh
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
{ nvidia-smi --query-gpu=name,driver_version --format=csv
  for fc in off on; do
    echo "== profile none kv, fused_cast $fc"; timeout 110 python experiments/profile_decode.py --preset qwen3_8b \
      --batch 256 --context 2048 --modes none kv --fused-cast $fc --out "$OUT/profile_fused_cast_$fc.json"
    echo "rc=$?"
  done
  echo "== 8B W1 none w8a8 kv all"; timeout $(left 500) python $R --workload W1 --modes none w8a8 kv all \
    --out "$OUT/rollout_8b_W1_4modes.json"; echo "rc=$?"
  PER_FILE_S=$(left 580) bash experiments/device/gpu_tests.sh tests/test_kv_write.py tests/test_grouped_gemm_dense.py
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -60
