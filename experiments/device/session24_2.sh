#!/usr/bin/env bash
# Session 24, call 2 (one H200): Qwen3-8B W2 (128 x 1024 -> 6144, temperature 1, EOS ignored) in modes none and all in
# one process on the current code: not run since session 7 (none 3758, all 5594). vLLM 0.26 on W2 (2026-11-30): BF16
# 4715, FP8 W8A8 + FP8 KV 6731; issue 4 asks ours all >= 1.3x the latter (8.75k). KV pools as vLLM's 0.85 leaves.
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  timeout 120 python experiments/device/session24_hlo_probe.py "$OUT/decode_hlo" 2>&1 | tail -3
  echo "== 8B W2 none all"; timeout $(left 585) python experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 \
    --steps-per-call 16 --prefill-batch 4 --workload W2 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52 \
    --modes all none --out "$OUT/rollout_8b_W2.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -40
