#!/usr/bin/env bash
# Session 9, call 3 (nvidia-h200-x2), the session's last (~590 s of budget left).
#   GPU 0: Qwen3-30B-A3B W1 all alone (call 2's limit cut it after 61 s of measurement, at 6515 tokens/s so far).
#   GPU 1: bench_gemm without the Triton kernel (ours at the table's config against cuBLAS blockwise FP8, XLA FP8
#          tensorwise and XLA BF16) at every issue-3 shape, the weight-quantization sync, then the GEMM's GPU tests
#          (call 2's limit cut them after 28 passed).
source experiments/device/env.sh
(
  export CUDA_VISIBLE_DEVICES=0
  { echo "== 30B-A3B W1 all"; timeout 490 python experiments/bench_rollout.py --preset qwen3_30b_a3b --workload W1 \
      --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 120 --kv-gib-like-vllm 60 87 --modes all \
      --sync-repeats 3 --out "$OUT/rollout_30b_W1_all.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && (
  export CUDA_VISIBLE_DEVICES=1
  { echo "== bench_gemm"; mkdir -p /tmp/g; timeout 330 python experiments/bench_gemm.py --no-triton \
      --out /tmp/g/gemm_bench.json; echo "rc=$?"; cp /tmp/g/gemm_bench.json "$OUT/"
    echo "== GPU tests of the GEMM"; timeout $((490 - SECONDS)) python -m pytest -q -m gpu tests/test_fp8_gemm_mgpu.py \
      -p no:cacheprovider -x 2>&1 | tail -8; echo "rc=${PIPESTATUS[0]}"
  } 2>&1 | filt > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT"/gpu*.log | grep -v '"partial"\|^{"M"' | cut -c1-300 | tail -40
