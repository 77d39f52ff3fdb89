#!/usr/bin/env bash
# Session 21, call 3 (one H200): the final defaults of the one-pass activation quantizations (add_rms_norm_quant
# 1 row x 8 warps per program, as call 2 timed fastest at 256 rows): act_quant's GPU tests (the plain kernel's
# check now allows XLA:GPU's non-IEEE division), then Qwen3-8B W1 none, kv and all in one process.
source experiments/device/env.sh
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
{ GPU_WORKERS=4 SUITE_S=100 bash experiments/device/gpu_tests.sh tests/test_act_quant.py
  echo "== 8B W1 none kv all"; timeout $(left 560) python $R --workload W1 --modes none kv all \
    --out "$OUT/rollout_8b_W1.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -30
