#!/usr/bin/env bash
# Session 9, call 1 (nvidia-h200-x2): the two rollout benchmarks issue 4 asks for that were never run.
#   GPU 0: the Qwen3-30B-A3B shape (random weights, 61 GB in BF16), W1 none then all, each with the KV pool
#          vLLM's gpu_memory_utilization 0.85 would leave beside weights of its precision (~60 / ~87 GiB).
#   GPU 1: the RL-shaped workload (256 x 512 -> max_tokens uniform up to 8192), Qwen3-8B shape, none then all.
source experiments/device/env.sh
R="experiments/bench_rollout.py --max-slots 256 --steps-per-call 16 --prefill-batch 4"
(
  export CUDA_VISIBLE_DEVICES=0
  { echo "== 30B-A3B W1 none all"; timeout 575 python $R --preset qwen3_30b_a3b --workload W1 --stall-dump-s 120 \
      --kv-gib-like-vllm 60 87 --modes none all --out "$OUT/rollout_30b_W1.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && (
  export CUDA_VISIBLE_DEVICES=1
  { echo "== RL none all"; timeout 575 python $R --preset qwen3_8b --workload RL --stall-dump-s 90 \
      --kv-gib-like-vllm 101.74 107.52 --modes none all --out "$OUT/rollout_RL.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT"/gpu*.log | grep -v '"partial"' | cut -c1-300 | tail -60
