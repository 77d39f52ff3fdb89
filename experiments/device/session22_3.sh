#!/usr/bin/env bash
# Session 22, call 3 (one H200; carry [".vllm-h200"], built by `bash ../shared/vllm-h200/build_bundle.sh .vllm-h200`):
# the split combine's reworked kernel (contiguous per-split loads; call 2's took 234 us per step against XLA's 244)
# on the GPU, Qwen3-8B W1 with this session's kernels in modes none, kv and all (one process), then vLLM 0.26 BF16 on
# W1 on the same machine. vLLM FP8 W8A8 + FP8 KV follows in call 4 (its first start on a machine took ~250 s).
# As run: our W1 took 312 s (compiles 43 + 28 + 30 s), so bench.py skipped vLLM BF16 at its deadline.
source experiments/device/env.sh
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  echo "== combine GPU test"; timeout 60 python -m pytest -q -m gpu tests/test_paged_attention.py -k combine \
    -p no:cacheprovider -rfE 2>&1 | tail -2
  echo "== 8B W1 none kv all"; timeout $(left 320) python $R --workload W1 --modes none kv all \
    --out "$OUT/rollout_8b_W1.json"; echo "rc=$?"
  bash .vllm-h200/install.sh >/dev/null && export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
  echo "== vLLM W1 bf16"; timeout $(left 590) python3 .vllm-h200/bench.py --configs bf16 \
    --num-prompts 256 --prompt-len 1024 --max-tokens 2048 --deadline-s $(left 580)
  echo "rc=$?"
} 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -40
