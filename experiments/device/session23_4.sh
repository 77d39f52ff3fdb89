#!/usr/bin/env bash
# Session 23, call 4 (one H200, call 3's machine, still held; carry [".vllm-h200"]): vLLM 0.26 on W1 on the machine of
# our W1 run: BF16, the peer of our mode none (FP8 W8A8 + FP8 KV, the peer of mode all, in call 5 if the budget allows).
source experiments/device/env.sh
{ bash .vllm-h200/install.sh >/dev/null && export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
  echo "== vLLM W1 bf16"; timeout 590 python3 .vllm-h200/bench.py --configs bf16 \
    --num-prompts 256 --prompt-len 1024 --max-tokens 2048 --deadline-s 580
  echo "rc=$?"
} 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -30
