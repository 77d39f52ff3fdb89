#!/usr/bin/env bash
# Session 13, call 2 (one H200). Call 1: 30B W1 all 7897 tokens/s with the grouped GEMM on wgmma and its tuning
# table (session 9: 6614; its none 4842, not rerun since). The grouped sweep's wall clock put every config at
# 0.15-0.24 ms per call (~1.3 TB/s of expert weights), which would be ~21 of the 29.1 ms step.
#   1. 30B W1 none in this session (the 1.6x target is all over none);
#   2. the 30B decode step by kernel (mode all): how much of it the grouped GEMM really is;
#   3. the grouped kernel's own GPU time per config (replay_gpu_ms), apart from the launch gaps of the wall clock.
source experiments/device/env.sh
{ echo "== 30B-A3B W1 none"; timeout 300 python experiments/bench_rollout.py --preset qwen3_30b_a3b \
    --max-slots 256 --steps-per-call 16 --prefill-batch 4 --workload W1 --stall-dump-s 120 --kv-gib-like-vllm 60 87 \
    --modes none --out "$OUT/rollout_30b_W1_none.json"; echo "rc=$?"
  echo "== profile 30B all"; timeout $(left 470) python experiments/profile_decode.py --preset qwen3_30b_a3b \
    --batch 256 --context 2048 --modes all --out "$OUT/profile_30b_all.json"; echo "rc=$?"
  echo "== grouped GEMM GPU time"; timeout $(left 585) python experiments/device/gg_gpu_time.py \
    --budget-s 90 --out "$OUT/gg_gpu_time.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"' | cut -c1-300 | tail -40
