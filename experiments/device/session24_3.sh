#!/usr/bin/env bash
# Session 24, call 3 (one H200; carry [".vllm-h200"]): call 2 ran Qwen3-8B W2 at none 4211 tokens/s against vLLM
# BF16's 4715 of 2026-11-30 (another machine). Both on one machine: the GPU test of the decode program without split-K
# (its HLO check fixed: XLA calls cuBLASLt, `__cublas$lt$matmul`), our W2 in mode none, then vLLM 0.26 BF16 on W2.
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  echo "== GPU test: decode program without split-K"; timeout $(left 60) python -m pytest -q -m gpu -p no:cacheprovider \
    -rfE tests/test_engine.py -k split_k 2>&1 | grep -v "^SKIPPED\|^$" | tail -5
  echo "== 8B W2 none"; timeout $(left 300) python experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 \
    --steps-per-call 16 --prefill-batch 4 --workload W2 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52 \
    --modes none --out "$OUT/rollout_8b_W2_none.json"; echo "rc=$?"
  bash .vllm-h200/install.sh >/dev/null && export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
  echo "== vLLM W2 bf16"; timeout $(left 590) python3 .vllm-h200/bench.py --configs bf16 \
    --num-prompts 128 --prompt-len 1024 --max-tokens 6144 --deadline-s $(left 585)
  echo "rc=$?"
} 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -40
