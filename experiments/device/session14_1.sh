#!/usr/bin/env bash
# Session 14, call 1 (one H200): Qwen3-30B-A3B W1, none and all in one process (the 1.6x target is all over
# none). Session 13 cut none twice (300 and 370 s limits; 5567 tokens/s so far at 97.6% of the tokens) and all
# once with the preloaded scales (8124 so far at 45 s); its complete all (scales in the loop) was 7897. The setup
# phases before the first compile (~170 s in session 13) are printed ("setup (s)") and kept in the JSON.
source experiments/device/env.sh
{ echo "== 30B-A3B W1 none all"; timeout 585 python experiments/bench_rollout.py --preset qwen3_30b_a3b \
    --max-slots 256 --steps-per-call 16 --prefill-batch 4 --workload W1 --stall-dump-s 120 --kv-gib-like-vllm 60 87 \
    --modes none all --out "$OUT/rollout_30b_W1.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"' | cut -c1-300 | tail -40
