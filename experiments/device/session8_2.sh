#!/usr/bin/env bash
# Next session, call 2 (nvidia-h200-x2; carry [".vllm-h200"]).
#   GPU 0: vLLM 0.26 W2 FP8 W8A8 + FP8 KV alone (its FP8 start took 360 s in session 7).
#   GPU 1: our RL-shaped workload (256 x 512 -> lengths uniform up to 8192) none and all, then the live
#          vLLM backend test (issue 8) if time is left.
source experiments/device/env.sh
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
(
  export CUDA_VISIBLE_DEVICES=0
  { bash .vllm-h200/install.sh >/dev/null && export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
    echo "== vLLM W2 fp8_kv8"; timeout 575 python3 .vllm-h200/bench.py --configs fp8_kv8 --num-prompts 128 \
      --prompt-len 1024 --max-tokens 6144; echo "rc=$?"
  } 2>&1 | filt "Capturing CUDA graphs" > "$OUT/gpu0.log"
) &
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && (
  export CUDA_VISIBLE_DEVICES=1
  { echo "== RL none all"; timeout 420 python $R --workload RL --modes none all --out "$OUT/rollout_RL.json"
    echo "rc=$?"
    (bash .vllm-h200/install.sh >/dev/null && PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 \
      timeout $((580 - SECONDS)) python -m pytest -q -m gpu tests/test_vllm_backend.py -p no:cacheprovider 2>&1 | tail -15)
  } 2>&1 | filt "Capturing CUDA graphs" > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT"/gpu*.log | grep -v '"partial"' | cut -c1-300 | tail -60
