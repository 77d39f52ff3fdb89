#!/usr/bin/env bash
# One H200 call: native runs of the paged-attention and grouped FP8 GEMM kernels (GPU tests + benchmarks),
# the Mosaic GEMM's remaining GPU test and the W8A8 policy's kernel path on a real model shape.
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
s() { echo "$1 rc=$2" >> "$OUT/summary.txt"; }
timeout 110 python -m pytest -q -m gpu tests/test_paged_attention.py -p no:cacheprovider --durations=5 > "$OUT/paged_attention_gpu_tests.txt" 2>&1; s paged_tests $?
timeout 110 python -m pallas_kernels.paged_attention --max-seconds 70 --out "$OUT/paged_attention_h200.json" > "$OUT/paged_attention_bench.txt" 2>&1; s paged_bench $?
timeout 110 python -m pytest -q -m gpu tests/test_fp8_grouped_gemm.py -p no:cacheprovider --durations=5 > "$OUT/grouped_gemm_gpu_tests.txt" 2>&1; s grouped_tests $?
timeout 110 python -m pallas_kernels.fp8_grouped_gemm --budget-s 80 --out "$OUT/grouped_gemm_h200.json" > "$OUT/grouped_gemm_bench.txt" 2>&1; s grouped_bench $?
timeout 80 python -m pytest -q -m gpu tests/test_fp8_gemm_mgpu.py -k "default_config or GemmPolicy" -p no:cacheprovider > "$OUT/mgpu_tests.txt" 2>&1; s mgpu_tests $?
cat "$OUT/summary.txt"; for f in "$OUT"/*tests.txt; do echo "== $f"; tail -4 "$f"; done
tail -15 "$OUT/paged_attention_bench.txt"; tail -15 "$OUT/grouped_gemm_bench.txt"
