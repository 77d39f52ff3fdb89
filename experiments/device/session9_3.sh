#!/usr/bin/env bash
# Session 9, call 3 (nvidia-h200-x2).
#   GPU 0: W1 all with call 2's decode GEMM table (session 8: 11216 tokens/s with the old one).
#   GPU 1, in its own copy of the tree (its table must not race GPU 0's): the FP8 GEMM prefill sweep (M = 8192,
#          2048 at issue 3's shapes) into a table, then bench_gemm (ours at the table's config against cuBLAS
#          blockwise FP8, XLA FP8 tensorwise and XLA BF16) at every issue-3 shape, and the weight sync.
source experiments/device/env.sh
(
  export CUDA_VISIBLE_DEVICES=0
  { echo "== W1 all"; timeout 400 python experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 \
      --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52 --workload W1 --modes all \
      --out "$OUT/rollout_W1_all.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && (
  export CUDA_VISIBLE_DEVICES=1
  rm -rf /tmp/tree1 && mkdir -p /tmp/tree1 && cp -r pallas_kernels fp8rl_jax experiments configs /tmp/tree1/ && cd /tmp/tree1
  { echo "== GEMM prefill sweep"; timeout 240 python -m pallas_kernels.fp8_gemm_mgpu --m 8192 2048 --no-triton \
      --nk 4096 4096 12288 4096 4096 12288 --out "$OUT/gemm_prefill.json" --tuning-out "$OUT/tuning_prefill.json"
    echo "rc=$?"
    [ -s "$OUT/tuning_prefill.json" ] && cp "$OUT/tuning_prefill.json" pallas_kernels/fp8_gemm_mgpu_tuning.json
    echo "== bench_gemm"; mkdir -p /tmp/g; timeout $((540 - SECONDS)) python experiments/bench_gemm.py --no-triton \
      --out /tmp/g/gemm_bench.json; echo "rc=$?"; cp /tmp/g/gemm_bench.json "$OUT/"
  } 2>&1 | filt > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT"/gpu*.log | grep -v '"partial"\|^{"M"' | cut -c1-300 | tail -60
