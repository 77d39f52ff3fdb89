#!/usr/bin/env bash
# Session 9, call 3 (nvidia-h200-x2; carry [".vllm-h200"]): same-session vLLM peers and our W2.
#   GPU 0: our W2 none then all (fused) under vLLM's KV budget (session 7's W2 ran with separate projections).
#   GPU 1: vLLM 0.26 W1 BF16 (last measured in session 6), then W2 FP8 + FP8 KV (session 1) if time is left.
source experiments/device/env.sh
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
(
  export CUDA_VISIBLE_DEVICES=0
  { echo "== W2 none all"; timeout 575 python $R --workload W2 --modes none all --out "$OUT/rollout_W2_none_all.json"
    echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && (
  export CUDA_VISIBLE_DEVICES=1
  { bash .vllm-h200/install.sh >/dev/null && export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
    echo "== vLLM W1 bf16"; timeout 250 python3 .vllm-h200/bench.py --configs bf16 --num-prompts 256 \
      --prompt-len 1024 --max-tokens 2048; echo "rc=$?"
    echo "== vLLM W2 fp8_kv8"; timeout $((575 - SECONDS)) python3 .vllm-h200/bench.py --configs fp8_kv8 \
      --num-prompts 128 --prompt-len 1024 --max-tokens 6144; echo "rc=$?"
  } 2>&1 | filt "Capturing CUDA graphs" > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT"/gpu*.log | grep -v '"partial"' | cut -c1-300 | tail -60
