#!/usr/bin/env bash
# Session 25, call 2 (one H200; carry [".vllm-h200"]): call 1 found our decode at W2's shape at 93.5% of the HBM
# roofline and our BF16 paged attention within 3-7% of vLLM's FA3, yet W2's run showed ~5 ms per step over the
# roofline at every row count: the engine decoded all 256 slots while W2 holds 128 prompts (and 25 after the
# preemptions), its GEMMs at M = 256. Decode row buckets (EngineConfig.decode_buckets) run the occupied rows only.
# Ours W2 none with them, then vLLM 0.26 BF16 on W2, on one machine.
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  echo "== 8B W2 none, decode row buckets"; timeout $(left 300) python experiments/bench_rollout.py --preset qwen3_8b \
    --max-slots 256 --steps-per-call 16 --prefill-batch 4 --workload W2 --stall-dump-s 90 \
    --kv-gib-like-vllm 101.74 107.52 --modes none --out "$OUT/rollout_8b_W2_none.json"; echo "rc=$?"
  bash .vllm-h200/install.sh >/dev/null && export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
  echo "== vLLM W2 bf16"; timeout $(left 590) python3 .vllm-h200/bench.py --configs bf16 \
    --num-prompts 128 --prompt-len 1024 --max-tokens 6144 --deadline-s $(left 585)
  echo "rc=$?"
} 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -40
