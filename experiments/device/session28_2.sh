#!/usr/bin/env bash
# Prepared in session 27 for the next device session (one H200; carry [".vllm-h200"]): Qwen3-8B W1 (256 x 1024 ->
# 2048) in BF16 with swap preemption (its BF16 pool preempts ~15 sequences; session 27 took W2 BF16 from 4811 to
# 4992 tokens/s with the swap space pinned in warm-up), then vLLM 0.26 BF16 on W1 on the same machine, for issue 4's
# "our BF16 >= vLLM BF16" (session 23: 1.004x with recompute).
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  echo "== 8B W1 none, swap space 24 GiB"; timeout $(left 260) python experiments/bench_rollout.py --preset qwen3_8b \
    --max-slots 256 --steps-per-call 16 --prefill-batch 4 --workload W1 --stall-dump-s 90 \
    --kv-gib-like-vllm 101.74 107.52 --modes none --swap-space-gib 24 --out "$OUT/rollout_8b_W1_none_swap24.json"
  echo "rc=$?"
  vllm_bench 590 --configs bf16 --num-prompts 256 --prompt-len 1024 --max-tokens 2048
} 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -30
