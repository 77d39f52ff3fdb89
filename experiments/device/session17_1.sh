#!/usr/bin/env bash
# Session 17, call 1 (one H200):
#   1. the whole GPU-marked suite on the current code in one pytest on 8 xdist workers sharing the GPU
#      (gpu_tests.sh; session 16's single-process run ran out 300 s after 35 of 153 tests: the time is compiles);
#   2. EngineConfig.fused_cast A/B (session 16, untimed): the decode step by kernel at 256 rows x context <= 2048 in
#      modes none and kv with the BF16 GEMMs writing BF16 themselves (on) and writing float32 + a convert (off: the
#      code before). Session 15's kv profile: the casts ~0.4 ms of 17.6.
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  GPU_WORKERS=8 SUITE_S=$(left 380) bash experiments/device/gpu_tests.sh
  for fc in off on; do
    echo "== profile none kv, fused_cast $fc"; timeout $(left $([ $fc = off ] && echo 470 || echo 590)) \
      python experiments/profile_decode.py --preset qwen3_8b --batch 256 --context 2048 --modes none kv \
      --fused-cast $fc --out "$OUT/profile_fused_cast_$fc.json"
    echo "rc=$?"
  done
} 2>&1 | filt > "$OUT/run.log"
grep -v "^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -70
