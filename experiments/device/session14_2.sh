#!/usr/bin/env bash
# Session 14, call 2 (one H200): the grouped FP8 GEMM's tuning table by GPU time (the sweep's default since
# session 13: its wall clock held ~75 us of launch gaps around a ~75 us kernel), with the scales preloaded and
# the 32-row swap_ab tile; then 30B W1 all with that table (compare call 1's all).
source experiments/device/env.sh
{ echo "== grouped GEMM sweep (GPU time)"; timeout 240 python -m pallas_kernels.fp8_grouped_gemm --tokens 256 64 2048 \
    --shapes gate_up_fused down gate_up --budget-s 200 --out "$OUT/grouped_gemm.json" --tuning-out "$OUT/gg_tuning.json"
  echo "rc=$?"
  [ -f "$OUT/gg_tuning.json" ] && cp "$OUT/gg_tuning.json" pallas_kernels/fp8_grouped_gemm_tuning.json
  echo "== 30B-A3B W1 all"; timeout $(left 585) python experiments/bench_rollout.py --preset qwen3_30b_a3b \
    --max-slots 256 --steps-per-call 16 --prefill-batch 4 --workload W1 --stall-dump-s 120 --kv-gib-like-vllm 60 87 \
    --modes all --out "$OUT/rollout_30b_W1_all.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"' | cut -c1-300 | tail -40
