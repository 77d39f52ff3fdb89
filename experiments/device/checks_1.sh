#!/usr/bin/env bash
# One H200 call: GPU-marked kernel tests, float32 HF parity with the image's transformers, Mosaic GEMM sweep.
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/nvidia-smi.txt" 2>&1
python -c "import jax,jaxlib,flax,torch,transformers;print(jax.__version__,jaxlib.__version__,flax.__version__,torch.__version__,transformers.__version__)" > "$OUT/versions.txt" 2>&1
timeout 170 python -m pytest -q -m gpu tests/test_pallas_kernels.py tests/test_fp8_gemm_mgpu.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc=$?" >> "$OUT/summary.txt"
FP8RL_REF_PYTHON=$(command -v python3) timeout 100 python -m pytest -q tests/test_hf_parity.py -p no:cacheprovider > "$OUT/parity.log" 2>&1; echo "parity rc=$?" >> "$OUT/summary.txt"
timeout 280 python -m pallas_kernels.fp8_gemm_mgpu --m 2048 8192 256 --no-triton --out "$OUT/mgpu_sweep.json" > "$OUT/mgpu_sweep.log" 2>&1; echo "mgpu sweep rc=$?" >> "$OUT/summary.txt"
cat "$OUT/summary.txt"; tail -5 "$OUT/gpu_tests.log" "$OUT/parity.log"; cat "$OUT/mgpu_sweep.log" | grep -v "^  M=" | tail -20
