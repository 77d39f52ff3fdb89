#!/usr/bin/env bash
# Session 21, call 4 (one H200): Qwen3-30B-A3B W1, none and all in one process, on the code of call 3 (the
# one-pass add + RMSNorm + quantization before q/k/v, the plain one before o_proj; the MoE experts keep theirs).
# Target all >= 1.6x none (session 15: 1.71x). KV pools as vLLM's 0.85 leaves (60 / 87 GiB).
source experiments/device/env.sh
{ echo "== 30B-A3B W1 none all"; timeout $(left 470) python experiments/bench_rollout.py --preset qwen3_30b_a3b \
    --max-slots 256 --steps-per-call 16 --prefill-batch 4 --workload W1 --stall-dump-s 120 --kv-gib-like-vllm 60 87 \
    --modes none all --out "$OUT/rollout_30b_W1.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -20
