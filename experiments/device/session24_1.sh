#!/usr/bin/env bash
# Session 24, call 1 (one H200): the GPU test that the engine's decode program has no XLA split-K GEMM (session 23's
# change; XLA's heuristic keeps them), then Qwen3-30B-A3B W1 in modes none and all in one process on the current code
# (session 21: none 5487, all 9575, 1.75x), KV pools as vLLM's 0.85 leaves (60 / 87 GiB).
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  echo "== GPU test: decode program without split-K"; timeout $(left 120) python -m pytest -q -m gpu -p no:cacheprovider \
    -rfE tests/test_engine.py -k split_k 2>&1 | grep -v "^SKIPPED\|^$" | tail -15
  echo "== 30B-A3B W1 none all"; timeout $(left 560) python experiments/bench_rollout.py --preset qwen3_30b_a3b \
    --max-slots 256 --steps-per-call 16 --prefill-batch 4 --workload W1 --stall-dump-s 120 --kv-gib-like-vllm 60 87 \
    --modes none all --out "$OUT/rollout_30b_W1.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -40
