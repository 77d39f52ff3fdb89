#!/usr/bin/env bash
# Session 26, call 2 (one H200; carry [".vllm-h200"]): vLLM 0.26 FP8 W8A8 (128 x 128
# blocks) + FP8 KV on W2, the peer of our mode all there (last measured 2026-11-30: 6731).
source experiments/device/env.sh
{ bash .vllm-h200/install.sh >/dev/null && export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
  echo "== vLLM W2 fp8_kv8"; timeout 590 python3 .vllm-h200/bench.py --configs fp8_kv8 \
    --num-prompts 128 --prompt-len 1024 --max-tokens 6144 --deadline-s 580
  echo "rc=$?"
} 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -30
