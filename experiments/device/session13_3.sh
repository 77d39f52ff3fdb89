#!/usr/bin/env bash
# Session 13, call 3 (one H200). Call 2 cut 30B W1 none at 300 s (after its first compile); its profile put the
# grouped GEMM at 11.0 of the 26.4 ms 30B `all` step (75-80 us a call, ~2.6 TB/s). Since then the grouped kernel
# loads each tile's scales before its K loop (they were plain global loads in it, not pipelined).
#   1. 30B W1 none (the baseline of the 1.6x target; call 1 ran all: 7897 tokens/s);
#   2. the grouped GEMM's GPU tests with the preloaded scales;
#   3. its GPU time, scales preloaded vs in the loop;
#   4. 30B W1 all with the preloaded scales, if time is left.
source experiments/device/env.sh
B="experiments/bench_rollout.py --preset qwen3_30b_a3b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --workload W1 --stall-dump-s 120 --kv-gib-like-vllm 60 87"
{ echo "== 30B-A3B W1 none"; timeout 370 python $B --modes none --out "$OUT/rollout_30b_W1_none.json"; echo "rc=$?"
  echo "== GPU tests"; timeout $(left 440) python -m pytest -q -m gpu -x tests/test_fp8_grouped_gemm.py \
    -k "preload or qwen3_30b" 2>&1 | tail -4
  echo "== grouped GEMM GPU time"; timeout $(left 490) python experiments/device/gg_gpu_time.py --tokens 256 \
    --budget-s 40 --out "$OUT/gg_gpu_time.json"; echo "rc=$?"
  echo "== 30B-A3B W1 all"; timeout $(left 590) python $B --modes all --out "$OUT/rollout_30b_W1_all.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"' | cut -c1-300 | tail -40
