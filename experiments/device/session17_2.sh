#!/usr/bin/env bash
# Session 17, call 2 (one H200): Qwen3-8B W1 in all four modes in one process on the current code (the BF16 GEMMs
# write BF16 themselves since session 16, EngineConfig.fused_cast). Session 16: none 7471, w8a8 8792, kv 10090,
# all 11927 on a machine where W1 kv ran 10015-10145. First, test_cublaslt's reference test, whose largest case ran out
# of the 0.113 memory fraction gpu_tests.sh gave each of call 1's 8 workers (12 GiB for the reference at 4096 x 12288):
# alone, with the whole GPU.
source experiments/device/env.sh
timeout 60 python -m pytest -q -m gpu "tests/test_cublaslt.py::TestGpu::test_matches_reference" -p no:cacheprovider -rfE \
  2>&1 | grep -v "^$" | tail -4 | tee $OUT/cublaslt_rerun.log
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  echo "== 8B W1 none w8a8 kv all"; timeout $(left 590) python $R --workload W1 --modes none w8a8 kv all \
    --out "$OUT/rollout_8b_W1_4modes.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -60
