#!/usr/bin/env bash
# Session 16, call 2 (one H200): issue 3's remaining evidence on the current code.
#   1. every GPU-marked test (kernels' GPU twins: quantization, dense/grouped FP8 GEMMs, cuBLASLt, paged and prefill
#      attention, KV write, FP8 training, engine decode through the kernels; the vLLM ones skip without the bundle);
#   2. the GEMM table's Qwen3-30B-A3B expert rows (dense GEMMs of (N, K) = (768, 2048), (2048, 768) at M 64..8192:
#      session 11's run was cut before them), ours vs XLA BF16, XLA FP8 tensorwise and torch's cuBLAS blockwise,
#      and the weight-sync quantization of all Qwen3-8B linear weights.
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version --format=csv
  echo "== GPU tests"; timeout 330 python -m pytest -q -m gpu tests -p no:cacheprovider -rfE --durations=15 \
    --junitxml="$OUT/gpu_tests.xml" 2>&1 | grep -v "^SKIPPED"; echo "rc=${PIPESTATUS[0]}"
  echo "== bench_gemm: 30B-A3B expert shapes + weight sync"; mkdir -p /tmp/g
  timeout $(left 580) python experiments/bench_gemm.py --no-triton --m 64 256 2048 8192 --nk 768 2048 2048 768 \
    --out /tmp/g/gemm_bench.json; echo "rc=$?"; cp /tmp/g/gemm_bench.json /tmp/g/gemm_bench.md "$OUT/" 2>/dev/null
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '^{"M"' | cut -c1-300 | tail -60
