#!/usr/bin/env bash
# Session 30, call 2 of 2 on the machine of session30_5.sh (carry [".vllm-h200"]): vLLM 0.26 fp8_kv8 on W1 again, its
# caches warm, then our BF16 (none; swap preemption, 24 GiB pinned in warm-up, as session 28) on W1 on the same machine.
source experiments/device/env.sh
{ vllm_bench 240 --est-s 150 --configs fp8_kv8 --num-prompts 256 --prompt-len 1024 --max-tokens 2048
  echo "== 8B W1 none"; timeout $(left 480) python experiments/bench_rollout.py --preset qwen3_8b \
    --max-slots 256 --steps-per-call 16 --prefill-batch 4 --workload W1 --stall-dump-s 90 \
    --kv-gib-like-vllm 101.74 107.52 --modes none --swap-space-gib 24 --out "$OUT/rollout_8b_W1_none.json"
  echo "rc=$?"
} 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -30
