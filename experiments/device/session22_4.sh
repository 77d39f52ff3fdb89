#!/usr/bin/env bash
# Session 22, call 4 (one H200, call 3's machine, still held; carry [".vllm-h200"]): vLLM 0.26 FP8 W8A8 (128 x 128
# blocks, DeepGEMM) + FP8 KV on W1, the peer of our mode all. Run as this command line with the deadline at 490 s
# (the session had 528 s of device time left): 11010.5 tokens/s, engine init 346 s.
source experiments/device/env.sh
{ bash .vllm-h200/install.sh >/dev/null && export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
  echo "== vLLM W1 fp8_kv8"; timeout 500 python3 .vllm-h200/bench.py --configs fp8_kv8 \
    --num-prompts 256 --prompt-len 1024 --max-tokens 2048 --deadline-s 490
  echo "rc=$?"
} 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -30
