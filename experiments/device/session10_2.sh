#!/usr/bin/env bash
# Session 10, call 2 (nvidia-h200-x2): cuBLASLt again after call 1's fix (call 1: every heuristic query answered
# CUBLAS_STATUS_INVALID_VALUE, since the scale pointers of a block scale mode must be on the descriptor before the
# query; the stand-in cuBLASLt of the CPU tests now refuses the same).
#   GPU 0: the cuBLASLt test file, then issue 3's GEMM table (M 64/256/2048/8192 x the Qwen3-8B and 30B-A3B expert
#          shapes; Mosaic, cuBLASLt, torch's cuBLAS block FP8, XLA FP8 tensorwise, XLA BF16) and the backend table.
#   GPU 1: a 256x4096x4096 cuBLASLt GEMM against the reference (if it fails, the rollouts use Mosaic), then W1 in
#          modes all, w8a8 and none on one warm process (session 8, Mosaic: 11216 / 8502 / 7626 tokens/s).
source experiments/device/env.sh
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
(
  export CUDA_VISIBLE_DEVICES=0
  { echo "== cuBLASLt tests"
    timeout 150 python -m pytest -q tests/test_cublaslt.py -p no:cacheprovider -rs 2>&1 | tail -25; echo "rc=${PIPESTATUS[0]}"
    echo "== bench_gemm"; mkdir -p /tmp/g; timeout $((550 - SECONDS)) python experiments/bench_gemm.py --no-triton \
      --skip-sync --out /tmp/g/gemm_bench.json --backend-table-out "$OUT/fp8_gemm_backends.json"
    echo "rc=$?"; cp /tmp/g/gemm_bench.json /tmp/g/gemm_bench.md "$OUT/" 2>/dev/null
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && (
  export CUDA_VISIBLE_DEVICES=1
  G=mosaic
  timeout 150 python experiments/device/cublaslt_probe.py && G=cublaslt
  { echo "== W1 all w8a8 none ($G)"; timeout $((550 - SECONDS)) python $R --workload W1 --modes all w8a8 none \
      --fp8-gemm $G --out "$OUT/rollout_W1_$G.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT"/gpu*.log | grep -v '"partial"\|^{"M"' | cut -c1-300 | tail -70
