#!/usr/bin/env bash
# The GPU-marked tests of the given files (default: every file that has them, the live-vLLM one aside).
#
# GPU_WORKERS=N (N > 1): one pytest over all the files on N pytest-xdist workers sharing the GPU. The suite's
# time is the tests' compiles (Triton, Mosaic, XLA: CPU-bound, one core each) far more than their GPU work, so
# workers on the machine's 16 cores run it several times faster than one process (session 16: one pytest ran
# out 300 s after 35 of 153 tests; session 17: 8 workers ran the 152 in 180 s). Nothing is preallocated, so a
# worker holds only what its tests have used; each may grow to min(0.9, 3.6/N) of the GPU's memory
# (XLA_PYTHON_CLIENT_MEM_FRACTION): at 0.9/N (0.113 for 8) the reference of test_cublaslt's 4096 x 12288 case
# (12 GiB) ran out in session 17, and passed alone. Every test has its own timeout (PER_TEST_S, default 240 s)
# where pytest-timeout is installed (the H200 image has it).
# Otherwise: one pytest per file under its own timeout (PER_FILE_S, default 240), so a slow file cannot
# hide the others' results.
# Sourced env.sh's $OUT gets the junit XML; each run's summary line is printed.
#   GPU_WORKERS=8 bash experiments/device/gpu_tests.sh
#   bash experiments/device/gpu_tests.sh tests/test_kv_write.py tests/test_paged_attention.py
source experiments/device/env.sh
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
  files=(tests/test_cublaslt.py tests/test_fp8_gemm_mgpu.py tests/test_fp8_grouped_gemm.py
         tests/test_grouped_gemm_dense.py tests/test_kv_write.py tests/test_paged_attention.py
         tests/test_pallas_kernels.py tests/test_prefill_attention.py tests/test_act_quant.py tests/test_engine.py)
fi
if [ "${GPU_WORKERS:-1}" -gt 1 ]; then
  frac=$(python -c "print(round(min(0.9, 3.6 / ${GPU_WORKERS}), 3))")
  tmo=(); python -c "import pytest_timeout" 2>/dev/null && tmo=(--timeout "${PER_TEST_S:-240}")
  echo "== GPU tests: ${#files[@]} files on $GPU_WORKERS workers (memory fraction $frac each)"
  XLA_PYTHON_CLIENT_MEM_FRACTION=$frac timeout "${SUITE_S:-540}" python -m pytest -q -m gpu "${files[@]}" \
    -n "$GPU_WORKERS" --dist load -p no:cacheprovider -rfE --durations=15 "${tmo[@]}" \
    --junitxml="$OUT/gpu_tests.xml" 2>&1 | grep -v "^SKIPPED\|^$" | tail -60
  echo "rc(gpu_tests)=${PIPESTATUS[0]} at ${SECONDS}s"
  exit 0
fi
for f in "${files[@]}"; do
  name=$(basename "$f" .py)
  echo "== GPU tests: $f"
  timeout "${PER_FILE_S:-240}" python -m pytest -q -m gpu "$f" -p no:cacheprovider -rfE --durations=5 \
    --junitxml="$OUT/gpu_$name.xml" 2>&1 | grep -v "^SKIPPED\|^$" | tail -25
  echo "rc($name)=${PIPESTATUS[0]} at ${SECONDS}s"
done
