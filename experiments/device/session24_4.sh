#!/usr/bin/env bash
# Session 24, call 4 (one H200, call 3's machine, still held; carry [".vllm-h200"]; run as a command line): vLLM 0.26
# BF16 on W2, which call 3 skipped at its deadline, beside call 3's W2 run of ours in mode none.
source experiments/device/env.sh
bash .vllm-h200/install.sh >/dev/null && export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
timeout 465 python3 .vllm-h200/bench.py --configs bf16 --num-prompts 128 --prompt-len 1024 --max-tokens 6144 \
  --deadline-s 455 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | tail -8
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv
