#!/usr/bin/env bash
# Session 9, call 2 (nvidia-h200-x2). Call 1 finished both `none` rows but its limit cut both `all` runs in
# their warm-up (compiles: 106-124 s per mode), so each `all` runs alone first here.
#   GPU 0: Qwen3-30B-A3B W1 all (call 1's none: 4842 tokens/s), then the FP8 GEMM decode sweep (M = 256, the fused
#          generator's shapes) with the overlapped-promotion and cluster configs, merged into the table (returned).
#   GPU 1: the RL-shaped workload, Qwen3-8B shape, all (call 1's none: 5009 tokens/s), then the GEMM's GPU tests
#          (native numerics of every sweep config, overlapped promotion included).
source experiments/device/env.sh
R="experiments/bench_rollout.py --max-slots 256 --steps-per-call 16 --prefill-batch 4"
(
  export CUDA_VISIBLE_DEVICES=0
  { echo "== 30B-A3B W1 all"; timeout 330 python $R --preset qwen3_30b_a3b --workload W1 --stall-dump-s 120 \
      --kv-gib-like-vllm 60 87 --modes all --out "$OUT/rollout_30b_W1_all.json"; echo "rc=$?"
    echo "== GEMM decode sweep"; timeout $((540 - SECONDS)) python -m pallas_kernels.fp8_gemm_mgpu --m 256 --decode-sweep \
      --no-triton --nk 6144 4096 24576 4096 4096 4096 4096 12288 --out "$OUT/gemm_decode.json" \
      --tuning-out "$OUT/tuning_decode.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && (
  export CUDA_VISIBLE_DEVICES=1
  { echo "== RL all"; timeout 420 python $R --preset qwen3_8b --workload RL --stall-dump-s 90 \
      --kv-gib-like-vllm 101.74 107.52 --modes all --out "$OUT/rollout_RL_all.json"; echo "rc=$?"
    echo "== GPU tests of the GEMM"; timeout $((540 - SECONDS)) python -m pytest -q -m gpu tests/test_fp8_gemm_mgpu.py \
      -p no:cacheprovider 2>&1 | tail -6
  } 2>&1 | filt > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT"/gpu*.log | grep -v '"partial"' | cut -c1-300 | tail -60
