#!/usr/bin/env bash
# Prepared in session 26 for the next device session (one H200): swap preemption against recompute on Qwen3-8B W2
# in BF16 (the mode that preempts: 25 sequences in session 25), one machine, one process each; run vLLM BF16 W2 on
# the same machine in the next call (session25_2.sh has the command) for issue 4's "our BF16 >= vLLM BF16".
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  for swap in 48 0; do
    echo "== 8B W2 none, swap space $swap GiB"; timeout $(left $([ $swap = 48 ] && echo 295 || echo 590)) \
      python experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 \
      --workload W2 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52 --modes none --swap-space-gib $swap \
      --out "$OUT/rollout_8b_W2_none_swap$swap.json"; echo "rc=$?"
  done
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"' | cut -c1-300 | tail -30
