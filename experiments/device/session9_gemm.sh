#!/usr/bin/env bash
# Next session, call 1 (nvidia-h200-x2).
#   GPU 0: the decode GEMM sweep with the clustered (TMA multicast) configs at every decode shape (fused and
#          separate projections), merged into the table (returned), then W1 all with it (session 8: 11216).
#   GPU 1: the BF16 decode step by kernel at W2's shape (104 rows x 4k context: our W2 BF16 step measured
#          25.7 ms at 72% of the roofline, vLLM's W2 BF16 is 1.25x ours), BF16 with fused projections
#          (--fuse-projections on) against session 8's unfused 7626, then the RL-shaped workload in mode all.
source experiments/device/env.sh
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
(
  export CUDA_VISIBLE_DEVICES=0
  { echo "== GEMM decode sweep (clusters)"; timeout 240 python -m pallas_kernels.fp8_gemm_mgpu --m 256 --decode-sweep \
      --no-triton --nk 6144 4096 24576 4096 4096 4096 4096 12288 --out "$OUT/gemm_decode_clusters.json" \
      --tuning-out "$OUT/fp8_gemm_mgpu_tuning.json"; echo "rc=$?"
    [ -s "$OUT/fp8_gemm_mgpu_tuning.json" ] && cp "$OUT/fp8_gemm_mgpu_tuning.json" pallas_kernels/fp8_gemm_mgpu_tuning.json
    echo "== W1 all"; timeout $((575 - SECONDS)) python $R --workload W1 --modes all --out "$OUT/rollout_W1_all.json"
    echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && (
  export CUDA_VISIBLE_DEVICES=1
  { echo "== decode profile W2 shape"; timeout 100 python experiments/profile_decode.py --preset qwen3_8b --batch 104 \
      --context 4096 --modes none --out "$OUT/decode_profile_w2.json"; echo "rc=$?"
    echo "== W1 none fused"; timeout 250 python $R --workload W1 --modes none --fuse-projections on \
      --out "$OUT/rollout_W1_none_fused.json"; echo "rc=$?"
    echo "== RL all"; timeout $((575 - SECONDS)) python $R --workload RL --modes all --out "$OUT/rollout_RL_all.json"
    echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT"/gpu*.log | grep -v '"partial"' | cut -c1-300 | tail -60
