#!/usr/bin/env bash
# Session 30 (one H200; carry [".vllm-h200"]), call 1 of 2 on one machine: Qwen3-8B W1 (256 x 1024 -> 2048) mode all
# (AUTO's FP8 GEMMs, now with the Triton GEMM reading transposed activation scales), then vLLM 0.26 fp8_kv8 on W1:
# its first start on the machine (DeepGEMM JIT and compile caches cold; session 29: 21% below its warm run). Call 2
# (session30_6.sh) reruns vLLM warm: the number issue 4's "FP8 all >= 1.3x vLLM FP8" is read against.
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  echo "== 8B W1 all"; timeout $(left 200) python experiments/bench_rollout.py --preset qwen3_8b \
    --max-slots 256 --steps-per-call 16 --prefill-batch 4 --workload W1 --stall-dump-s 90 \
    --kv-gib-like-vllm 101.74 107.52 --modes all --out "$OUT/rollout_8b_W1_all.json"
  echo "rc=$?"
  vllm_bench 590 --configs fp8_kv8 --num-prompts 256 --prompt-len 1024 --max-tokens 2048
} 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -30
