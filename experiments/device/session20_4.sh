#!/usr/bin/env bash
# Session 20, call 4 (one H200): test_act_quant's GPU cases with the GPU check rewritten after call 3 (codes may
# differ from XLA:GPU's by one E4M3 step in at most 0.5% of elements, no less accurate against float64); then
# Qwen3-8B W1 none / w8a8 / all in one process (w8a8 last ran in session 17; all a second time on this code).
source experiments/device/env.sh
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
{ GPU_WORKERS=4 SUITE_S=90 bash experiments/device/gpu_tests.sh tests/test_act_quant.py
  echo "== 8B W1 none w8a8 all"; timeout $(left 440) python $R --workload W1 --modes none w8a8 all \
    --out "$OUT/rollout_8b_W1.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -30
