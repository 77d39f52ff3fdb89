#!/usr/bin/env bash
# Next session, call 2 (nvidia-h200-x2; carry [".vllm-h200"]), right after session6_1.sh (whose tuned
# paged_attention_tuning.json must first be copied into pallas_kernels/ on this machine: the device
# gets this checkout's files, not what an earlier call wrote there):
#   GPU 0: our W1 BF16 and w8a8, then W2 BF16 (128 x 1024 -> 6144).
#   GPU 1: the decode GEMM sweep with the split-K configs (merged into the GEMM tuning table), the
#          live vLLM backend test (greedy agreement, update takes effect, KV scales), then our W2 FP8 all.
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
filt() { grep -v "^W1130\|^I1130\|^W12\|^I12\|DeprecationWarning\|return rule"; }
R="experiments/bench_rollout.py --preset qwen3_8b --kv-fraction 0.8 --max-slots 256 --steps-per-call 16 --prefill-batch 4"
(
  export CUDA_VISIBLE_DEVICES=0
  {
    for m in none w8a8; do
      echo "== W1 $m"; timeout 170 python $R --workload W1 --modes $m --out "$OUT/rollout_W1_$m.json"; echo "rc=$?"
    done
    echo "== W2 none"; timeout 230 python $R --workload W2 --modes none --out "$OUT/rollout_W2_none.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  {
    echo "== gemm decode sweep (split-K)"; timeout 170 python -m pallas_kernels.fp8_gemm_mgpu --m 256 --decode-sweep \
      --no-triton --nk 4096 4096 1024 4096 12288 4096 4096 12288 --tuning-out "$OUT/gemm_tuning.json" \
      --out "$OUT/gemm_decode.json"; echo "rc=$?"
    cp "$OUT/gemm_tuning.json" pallas_kernels/fp8_gemm_mgpu_tuning.json  # the W2 run below uses it
    (bash .vllm-h200/install.sh >/dev/null && PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 \
      timeout 300 python -m pytest -q -m gpu tests/test_vllm_backend.py -p no:cacheprovider 2>&1 | tail -15)
    echo "== W2 all"; timeout 260 python $R --workload W2 --modes all --out "$OUT/rollout_W2_all.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT/gpu0.log" | tail -30; echo; grep -v "^  \|^$" "$OUT/gpu1.log" | tail -30
