#!/usr/bin/env bash
# Next session, call 3 (nvidia-h200-x2), with what is left of the budget.
#   GPU 0: Qwen3-30B-A3B shape (random weights, 61 GB in BF16), W1 none then all (issue 4: all >= 1.6x none).
#   GPU 1: the Mosaic FP8 GEMM at decode size with split-K (never timed: MgpuGemmConfig.k_splits), table out.
source experiments/device/env.sh
(
  export CUDA_VISIBLE_DEVICES=0
  { echo "== 30B-A3B W1 none all"; timeout 570 python experiments/bench_rollout.py --preset qwen3_30b_a3b --workload W1 \
      --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 120 --kv-fraction 0.8 --modes none all \
      --out "$OUT/rollout_30b_W1.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && (
  export CUDA_VISIBLE_DEVICES=1
  { echo "== GEMM decode sweep"; timeout 500 python -m pallas_kernels.fp8_gemm_mgpu --m 256 --decode-sweep --no-triton \
      --nk 4096 4096 1024 4096 12288 4096 4096 12288 --out "$OUT/gemm_decode.json" \
      --tuning-out "$OUT/fp8_gemm_mgpu_tuning.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT"/gpu*.log | grep -v '"partial"' | cut -c1-300 | tail -60
