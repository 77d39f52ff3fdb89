#!/usr/bin/env bash
# Session 26, call 3 (one H200, call 2's machine): Qwen3-8B W2 in mode all beside call 2's vLLM FP8 run, then the
# RL-shaped workload (256 x 512 -> up to 8192, spread lengths) in mode all: decode row buckets and slot compaction
# (session 25) untimed there yet.
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  echo "== 8B W2 all"; timeout $(left 300) python experiments/bench_rollout.py --preset qwen3_8b \
    --max-slots 256 --steps-per-call 16 --prefill-batch 4 --workload W2 --stall-dump-s 90 \
    --kv-gib-like-vllm 101.74 107.52 --modes all --out "$OUT/rollout_8b_W2_all.json"; echo "rc=$?"
  echo "== 8B RL all"; timeout $(left 590) python experiments/bench_rollout.py --preset qwen3_8b \
    --max-slots 256 --steps-per-call 16 --prefill-batch 4 --workload RL --stall-dump-s 90 \
    --kv-gib-like-vllm 101.74 107.52 --modes all --out "$OUT/rollout_8b_RL_all.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"' | cut -c1-300 | tail -30
