#!/usr/bin/env bash
# Session 8, call 3 (nvidia-h200-x2; carry [".vllm-h200"]).
#   GPU 0: the live vLLM backend test (small random Qwen3: agreement with our FP8 forward, update effect,
#          DIRECT == RELOAD), the Qwen3-8B-shaped sync time of both update paths, then our W1 w8a8 with the
#          fused q/k/v and gate/up GEMMs (compare with call 1's unfused 8320 tokens/s).
#   GPU 1: the Mosaic FP8 GEMM decode sweep (M = 256) on the fused shapes and the others, merged into the
#          table (returned), then W1 all with that table (fused).
source experiments/device/env.sh
(
  export CUDA_VISIBLE_DEVICES=0
  { bash .vllm-h200/install.sh > /dev/null 2>&1; echo "install rc=$?"
  ( export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_DEEP_GEMM_WARMUP=skip
    echo "== live test"; timeout 200 python -m pytest -q -s -m gpu tests/test_vllm_backend.py -p no:cacheprovider \
      --basetemp="$OUT/pt" 2>&1 | grep -v "INFO\|Loading safetensors\|RotaryEmbedding: Failed"; echo "rc=${PIPESTATUS[0]}"
    echo "== live sync8b"; timeout 170 python experiments/vllm_live_check.py --phase sync8b --repeats 5 \
      --out "$OUT/vllm_live_sync8b.json" 2>&1 | grep -v "INFO\|Loading safetensors\|RotaryEmbedding: Failed"
    echo "rc=${PIPESTATUS[0]}"
  ) 2>&1
  echo "== W1 w8a8 (fused)"; timeout $((575 - SECONDS)) python experiments/bench_rollout.py --preset qwen3_8b \
    --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52 \
    --workload W1 --modes w8a8 --out "$OUT/rollout_W1_w8a8_fused.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && (
  export CUDA_VISIBLE_DEVICES=1
  { echo "== GEMM decode sweep"; timeout 200 python -m pallas_kernels.fp8_gemm_mgpu --m 256 --decode-sweep --no-triton \
      --nk 6144 4096 24576 4096 4096 4096 4096 12288 --out "$OUT/gemm_decode_fused.json" \
      --tuning-out "$OUT/fp8_gemm_mgpu_tuning.json"; echo "rc=$?"
    [ -s "$OUT/fp8_gemm_mgpu_tuning.json" ] && cp "$OUT/fp8_gemm_mgpu_tuning.json" pallas_kernels/fp8_gemm_mgpu_tuning.json
    echo "== W1 all (fused, swept table)"; timeout $((575 - SECONDS)) python experiments/bench_rollout.py --preset qwen3_8b \
      --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52 \
      --workload W1 --modes all --out "$OUT/rollout_W1_all_fused_tuned.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT"/gpu*.log | grep -v '"partial"\|WARNING\|warmup:' | cut -c1-400 | tail -70
