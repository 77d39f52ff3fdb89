#!/usr/bin/env bash
# Planned for session 21, call 1 (one H200; written in session 19 as session20_3.sh, which session 20 used for
# other work): the workloads issue 4 lists that no session has rerun since session 15/9
# (`h200_session15_2026-12-02.md`, `h200_session9_...`), on the current code:
#   1. Qwen3-30B-A3B W1, none and all in one process (target all >= 1.6x none; session 15: 1.71x), KV pools as
#      vLLM's 0.85 leaves (60 / 87 GiB);
#   2. if time is left, the RL-shaped workload on Qwen3-8B (256 x 512 -> max_tokens uniform up to 8192), all only
#      (session 9: none 5009, all 7009).
# Every run records its clocks and power (gpu_during_run) and its decode calls.
source experiments/device/env.sh
{ echo "== 30B-A3B W1 none all"; timeout $(left 420) python experiments/bench_rollout.py --preset qwen3_30b_a3b \
    --max-slots 256 --steps-per-call 16 --prefill-batch 4 --workload W1 --stall-dump-s 120 --kv-gib-like-vllm 60 87 \
    --modes none all --out "$OUT/rollout_30b_W1.json"; echo "rc=$?"
  echo "== 8B RL all"; timeout $(left 590) python experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 \
    --steps-per-call 16 --prefill-batch 4 --workload RL --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52 \
    --modes all --out "$OUT/rollout_8b_RL_all.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -40
