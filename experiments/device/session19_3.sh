#!/usr/bin/env bash
# Session 19, call 3 (one H200; carry [".vllm-h200"]): Qwen3-8B W1 none / kv / all with each call's top-k/top-p
# truncation decided on the host (no lax.cond in the decode program: on XLA:GPU its predicate copy held the
# host's dispatch of each chunk until the chunk before it had run; call 2's decode_calls show dispatches returning
# ~one chunk late) and the inverse-CDF draw as the default; then vLLM 0.26 BF16 on W1 on the same machine (the
# issue's peer rerun). Every decode call's step time and host time go into the JSON (decode_calls).
source experiments/device/env.sh
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  echo "== 8B W1 none kv all"; timeout $(left 330) python $R --workload W1 --modes none kv all \
    --out "$OUT/rollout_8b_W1.json"; echo "rc=$?"
  bash .vllm-h200/install.sh >/dev/null && export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
  echo "== vLLM W1 bf16"; timeout $(left 590) python3 .vllm-h200/bench.py --configs bf16 \
    --num-prompts 256 --prompt-len 1024 --max-tokens 2048 --deadline-s $(left 580)
  echo "rc=$?"
} 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -40
