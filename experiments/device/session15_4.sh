#!/usr/bin/env bash
# Session 15, call 4 (one H200): Qwen3-8B W1 in all four modes in one process (the per-mode targets are
# ratios to that process's BF16: w8a8 >= 1.2x, kv >= 1.4x, all >= 1.6x). Session 11: none 7314, w8a8 8758
# (1.197x), all 11750 in one process; call 2 of this session: none 7583, kv 10412 (1.37x).
source experiments/device/env.sh
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
{ echo "== 8B W1 none w8a8 kv all"; timeout 585 python $R --workload W1 --modes none w8a8 kv all \
    --out "$OUT/rollout_8b_W1_4modes.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"' | cut -c1-300 | tail -40
