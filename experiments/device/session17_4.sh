#!/usr/bin/env bash
# Session 17, call 4 (one H200, the machine of call 3 still warm; carry [".vllm-h200"]): vLLM's FP8 W8A8 + FP8 KV on W1
# again, alone. In call 3 its first start on the machine took 275 s (DeepGEMM JIT-compiled its kernels during graph
# capture, 141 s) and bench.py killed the run at its deadline; this call reused the checkpoint and the compile
# caches that start left (engine start 37 s).
source experiments/device/env.sh
bash .vllm-h200/install.sh >/dev/null && export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
ls /tmp/qwen3_8b_random | head -3
timeout 370 python3 .vllm-h200/bench.py --configs fp8_kv8 --num-prompts 256 --prompt-len 1024 --max-tokens 2048 \
  --deadline-s 360 --timeout 350 2>&1 | filt "Capturing CUDA graphs" | grep -v "^  \|^$" | tail -12
