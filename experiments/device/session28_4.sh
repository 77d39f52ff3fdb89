#!/usr/bin/env bash
# Session 28 (one H200): Qwen3-8B W1 (256 x 1024 -> 2048) in modes none (swap preemption, 24 GiB pinned in warm-up),
# kv and all, one machine, for issue 4's kv >= 1.4x and all >= 1.6x our BF16 (session 25: 1.353x and 1.566x against
# a recompute none). Each mode its own process with its own deadline, so a cut run keeps the ones before it.
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  for spec in "none 200 --swap-space-gib 24" "kv 395" "all 590"; do set -- $spec; mode=$1 until=$2; shift 2
    echo "== 8B W1 $mode $*"; timeout $(left $until) python experiments/bench_rollout.py --preset qwen3_8b \
      --max-slots 256 --steps-per-call 16 --prefill-batch 4 --workload W1 --stall-dump-s 90 \
      --kv-gib-like-vllm 101.74 107.52 --modes $mode "$@" --out "$OUT/rollout_8b_W1_$mode.json"
    echo "rc=$?"
  done
} 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '^{"mode"' | cut -c1-300 | tail -30
