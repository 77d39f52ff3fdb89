#!/usr/bin/env bash
# Session 11, call 3 (one H200):
#   1. Qwen3-8B W1 in modes none, all and w8a8 in one process (same machine, same session), the FP8 GEMMs on
#      cuBLASLt with the activation scales written in cuBLASLt's order. Session 10: none 7382, all 11840 (one run
#      each); call 1 of this session: w8a8 8758.
#   2. the rows of issue 3's GEMM table call 2 did not reach (4096 x 12288 at M >= 256, the 30B-A3B expert shapes),
#      the cuBLASLt column now with the scales laid out outside the timed calls as torch's are.
source experiments/device/env.sh
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
{ echo "== W1 none all w8a8"; timeout 420 python $R --workload W1 --modes none all w8a8 --fp8-gemm cublaslt \
    --out "$OUT/rollout_W1.json"; echo "rc=$?"
  echo "== bench_gemm rest"; mkdir -p /tmp/g; timeout $(left 540) python experiments/bench_gemm.py --no-triton --skip-sync \
    --m 256 2048 8192 --nk 4096 12288 768 2048 2048 768 --out /tmp/g/gemm_bench_rest.json; echo "rc=$?"
  cp /tmp/g/gemm_bench_rest.json "$OUT/" 2>/dev/null
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"\|^{"M"' | cut -c1-400 | tail -40
