#!/usr/bin/env bash
# Planned for session 20, call 2 (one H200; after session20_1.sh): Qwen3-8B W1 none / w8a8 / all in one process with
# session 19's code (truncation decided on the host, inverse-CDF draw), each run's clocks and power recorded
# (gpu_during_run). With call 1's kv this gives all four modes of issue 4's table. Then all with 8 prompts
# per prefill call.
source experiments/device/env.sh
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
{ echo "== 8B W1 none w8a8 all"; timeout $(left 470) python $R --workload W1 --modes none w8a8 all \
    --out "$OUT/rollout_8b_W1.json"; echo "rc=$?"
  # prefill was 4.56 of W1 all's 40.5 s in session 19 (64 calls of 4 prompts x 1024: 71 ms a call, about 0.8
  # PFLOP/s counting the linear layers' 13.9 GFLOP per token): 8 prompts per call, a larger M for every GEMM
  echo "== 8B W1 all, prefill batch 8"; timeout $(left 590) python ${R/--prefill-batch 4/--prefill-batch 8} \
    --workload W1 --modes all --out "$OUT/rollout_8b_W1_all_pb8.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -40
