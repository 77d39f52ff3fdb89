#!/usr/bin/env bash
# Next session, call 3 (nvidia-h200-x2; carry [".vllm-h200"]).
#   GPU 0: the Qwen3-30B-A3B shape (random weights, 61 GB in BF16), W1 none then all (issue 4: all >= 1.6x none).
#   GPU 1: the vLLM backend in BF16 (mode none) on W1 and W2 with DIRECT weight updates, for the one table.
source experiments/device/env.sh
(
  export CUDA_VISIBLE_DEVICES=0
  { echo "== 30B-A3B W1 none all"; timeout 570 python experiments/bench_rollout.py --preset qwen3_30b_a3b --workload W1 \
      --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 120 --kv-fraction 0.8 --modes none all \
      --out "$OUT/rollout_30b_W1.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && (
  export CUDA_VISIBLE_DEVICES=1
  { bash .vllm-h200/install.sh >/dev/null && export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
    echo "== backend vllm none W1 W2"; timeout 570 python experiments/bench_rollout.py --backend vllm --preset qwen3_8b \
      --workload W1 --also-workloads W2 --modes none --sync-repeats 3 --out "$OUT/rollout_vllm_backend_none.json"
    echo "rc=$?"
  } 2>&1 | filt "Capturing CUDA graphs" > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT"/gpu*.log | grep -v '"partial"\|INFO\|WARNING' | cut -c1-300 | tail -60
