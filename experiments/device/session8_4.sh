#!/usr/bin/env bash
# Session 8, call 4 (nvidia-h200; carry [".vllm-h200"]): the live vLLM backend GPU test alone (call 3's
# timed out compiling one FP8 forward per sequence length; it now pads to one shape).
source experiments/device/env.sh
bash .vllm-h200/install.sh > /dev/null 2>&1; echo "install rc=$?"
export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_DEEP_GEMM_WARMUP=skip
timeout ${LIVE_TIMEOUT:-200} python -m pytest -q -s -m gpu tests/test_vllm_backend.py -p no:cacheprovider \
  --basetemp="$OUT/pt" 2>&1 | filt "INFO\|Loading safetensors\|RotaryEmbedding: Failed" | cut -c1-3000 | tail -40
echo "rc=${PIPESTATUS[0]}"
rm -f "$OUT"/pt/*current
