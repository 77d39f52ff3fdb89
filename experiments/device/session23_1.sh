#!/usr/bin/env bash
# Session 23, call 1 (one H200): the Qwen3-8B decode profile (256 rows at 2048, engine pages) in modes kv and all with
# the optimized HLO of each program, to attribute session 22's unexplained XLA kernels in mode kv
# (loop_reduce_fusion_106, 197 us per step; loop_reduce_fusion_35, 127; loop_multiply_fusion_1, 222), and the
# GPU tests of the engine's decode through the kernels.
source experiments/device/env.sh
P="experiments/profile_decode.py --preset qwen3_8b --batch 256 --context 2048 --lengths equal --pages engine"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  echo "== profile"; timeout $(left 300) python $P --modes kv all --hlo --hlo-out "$OUT/hlo" --out "$OUT/profile.json"
  echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -40
