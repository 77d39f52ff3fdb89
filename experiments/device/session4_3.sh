#!/usr/bin/env bash
# Session 4, call 3 (nvidia-h200-x2, one job per GPU at once; at most 8 files come back):
#   GPU 0: the K = 256 FP8-training disagreement isolated stage by stage; GPU tests of the new KV write
#          kernel and the paged-attention changes; the FP8 GEMM decode sweep (M = 256), written as the
#          tuning table the library reads; then the decode-step profile with all of it.
#   GPU 1: the paged-attention kernel at its default config (float16 dots for FP8 pools); then the
#          rollout benchmark W1, BF16 and (once GPU 0 has written the tuning table) FP8 all.
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TABLE=pallas_kernels/fp8_gemm_mgpu_tuning.json
filt() { grep -v "^W1130\|^I1130\|DeprecationWarning\|return rule"; }
(
  export CUDA_VISIBLE_DEVICES=0
  {
    echo "== train_k256_diag"; timeout 60 python experiments/device/train_k256_diag.py; echo "rc=$?"
    echo "== gpu tests"; timeout 100 python -m pytest -q -m gpu tests/test_kv_write.py tests/test_paged_attention.py \
      -k "Gpu and (bitwise or hnd or vs_reference or long_context)" -p no:cacheprovider 2>&1 | tail -5; echo "rc=$?"
    echo "== gemm decode sweep"; timeout 150 python -m pallas_kernels.fp8_gemm_mgpu --m 256 --decode-sweep --no-triton \
      --nk 4096 4096 1024 4096 12288 4096 4096 12288 --tuning-out "$OUT/fp8_gemm_mgpu_tuning.json" \
      --out "$OUT/gemm_decode_h200.json"; echo "rc=$?"
    cp "$OUT/fp8_gemm_mgpu_tuning.json" "$TABLE.tmp" && mv "$TABLE.tmp" "$TABLE"
    echo "== profile"; timeout 200 python experiments/profile_decode.py --preset qwen3_8b --batch 256 --context 2048 \
      --modes none all --out "$OUT/decode_profile_qwen3_8b.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  {
    echo "== paged attention (default config)"; timeout 60 python -m pallas_kernels.paged_attention --quick \
      --batch 256 64 --context 2048 8192 --out "$OUT/paged_attention_f16_h200.json"; echo "rc=$?"
    echo "== rollout W1 none"; TF_GPU_ALLOCATOR=cuda_malloc_async timeout 240 python experiments/bench_rollout.py \
      --preset qwen3_8b --workload W1 --modes none --kv-fraction 0.8 --max-slots 256 --steps-per-call 16 \
      --prefill-batch 4 --out "$OUT/rollout_qwen3_8b_W1_none.json"; echo "rc=$?"
    for i in $(seq 60); do [ -f "$TABLE" ] && break; sleep 2; done; echo "table present: $([ -f $TABLE ] && echo yes)"
    echo "== rollout W1 all"; TF_GPU_ALLOCATOR=cuda_malloc_async timeout 200 python experiments/bench_rollout.py \
      --preset qwen3_8b --workload W1 --modes all --kv-fraction 0.8 --max-slots 256 --steps-per-call 16 \
      --prefill-batch 4 --out "$OUT/rollout_qwen3_8b_W1_all.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT/gpu0.log" | tail -40; echo; grep -v "^  \|^$" "$OUT/gpu1.log" | tail -25
