#!/usr/bin/env bash
# Session 29 (one H200; carry [".vllm-h200"]): Qwen3-8B W1 (256 x 1024 -> 2048) in mode all with AUTO's FP8 GEMMs
# (the committed Triton table; W1 decodes at ~256 rows, where every GEMM stays on cuBLASLt), then vLLM 0.26 with FP8
# block-wise W8A8 and FP8 KV (fp8_kv8) on W1 on the same machine, for issue 4's "FP8 all >= 1.3x vLLM FP8" (last
# same-session measurement: session 23, 1.188x).
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  echo "== 8B W1 all"; timeout $(left 200) python experiments/bench_rollout.py --preset qwen3_8b \
    --max-slots 256 --steps-per-call 16 --prefill-batch 4 --workload W1 --stall-dump-s 90 \
    --kv-gib-like-vllm 101.74 107.52 --modes all --out "$OUT/rollout_8b_W1_all.json"
  echo "rc=$?"
  vllm_bench 590 --configs fp8_kv8 --num-prompts 256 --prompt-len 1024 --max-tokens 2048
} 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -30
