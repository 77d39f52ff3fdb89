#!/usr/bin/env bash
# Planned for session 21, call 2 (one H200; carry [".vllm-h200"], rebuilt by
# `bash ../shared/vllm-h200/build_bundle.sh .vllm-h200` if absent): the vLLM comparison on one machine with the
# current code. Qwen3-8B W1 none and all (ours), then vLLM 0.26 BF16 on W1. vLLM FP8 W8A8 + FP8 KV needs a call of
# its own (its first start on a machine took ~250 s): `python3 .vllm-h200/bench.py --configs fp8_kv8 ...` as below.
# Session 20 found W1 at the 700 W power cap in every mode; bench_rollout records the clocks (gpu_during_run).
source experiments/device/env.sh
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  echo "== 8B W1 none all"; timeout $(left 260) python $R --workload W1 --modes none all \
    --out "$OUT/rollout_8b_W1.json"; echo "rc=$?"
  bash .vllm-h200/install.sh >/dev/null && export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
  echo "== vLLM W1 bf16"; timeout $(left 590) python3 .vllm-h200/bench.py --configs bf16 \
    --num-prompts 256 --prompt-len 1024 --max-tokens 2048 --deadline-s $(left 580)
  echo "rc=$?"
} 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -40
