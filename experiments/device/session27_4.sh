#!/usr/bin/env bash
# Session 27, call 3 (one H200): call 2 found swap preemption slower than recompute on W2 none (4512 against 4811
# tokens/s): each growth of XLA's pinned-host allocator (doubling regions) stalled the run 0.4 -> 3.9 s. The engine
# now pins the swap space once in warm-up (JaxEngine.reserve_swap_space). W2 none with 24 GiB of swap (the 25
# preempted sequences hold ~21 GB); vLLM BF16 on the same machine next (session27_5.sh).
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  echo "== 8B W2 none, swap space 24 GiB pinned in warm-up"; timeout $(left 590) \
    python experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 \
    --workload W2 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52 --modes none --swap-space-gib 24 \
    --out "$OUT/rollout_8b_W2_none_swap24.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"' | cut -c1-300 | tail -30
