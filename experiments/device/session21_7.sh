#!/usr/bin/env bash
# Session 21, call 5 (one H200): act_quant's GPU tests after call 3's one failure (a 3 x 384 case over the
# mismatch bound, now 0.5% or 16 codes), and the mode-all decode profile with the final norm tiling (1 row, 8 warps).
source experiments/device/env.sh
P="experiments/profile_decode.py --preset qwen3_8b --batch 256 --context 2048 --lengths equal --pages engine"
{ GPU_WORKERS=4 SUITE_S=100 bash experiments/device/gpu_tests.sh tests/test_act_quant.py
  echo "== profile all"; timeout $(left 230) python $P --modes all --out "$OUT/profile_all.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -12
