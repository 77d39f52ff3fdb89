#!/usr/bin/env bash
# Session 17, call 3 (one H200; carry [".vllm-h200"]): vLLM 0.26 on W1 in the session that reports our W1 (the issue
# asks for the peer rerun then): BF16 and FP8 W8A8 + FP8 KV (../shared/vllm-h200/bench.py: 256 x 1024 -> 2048,
# temperature 1, ignore_eos, gpu_memory_utilization 0.85). Sessions 6/7: 8015 / 10960 tokens/s. bench.py stops
# itself before its deadline.
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  bash .vllm-h200/install.sh >/dev/null && export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
  echo "== vLLM W1 bf16 fp8_kv8"; timeout $(left 590) python3 .vllm-h200/bench.py --configs bf16,fp8_kv8 \
    --num-prompts 256 --prompt-len 1024 --max-tokens 2048 --deadline-s $(left 560)
  echo "rc=$?"
} 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"' | cut -c1-300 | tail -40
