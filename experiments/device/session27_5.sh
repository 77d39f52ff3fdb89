#!/usr/bin/env bash
# Session 27, call 4 (one H200; carry [".vllm-h200"]), right after session27_4.sh on the same machine: vLLM 0.26 BF16
# on W2 (128 x 1024 -> 6144), for issue 4's "our BF16 >= vLLM BF16". (Written out inline when it ran; env.sh's vllm_bench
# since, the same commands.)
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  vllm_bench 590 --configs bf16 --num-prompts 128 --prompt-len 1024 --max-tokens 6144
} 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -30
