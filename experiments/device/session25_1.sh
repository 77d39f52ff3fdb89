#!/usr/bin/env bash
# Session 25, call 1 (one H200; carry [".vllm-h200"]): where vLLM's 11% on W2 BF16 comes from (session 24: ours 4243
# against vLLM 4761.9 on one machine). Kernel for kernel at W2's decode shapes (lockstep rows, 104-128 rows at 5-7k
# keys, W1's 256 x 2048 as the anchor): our Pallas paged attention (the table's config, at four split sizes) against
# vLLM's FA3 paged decode; then the engine's decode step at W2's shapes, per kernel class.
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  echo "== ours: paged attention at W2 shapes"; timeout $(left 150) python -m pallas_kernels.paged_attention \
    --table-only --equal --batch 104 128 256 --context 2048 5120 7168 --pages-per-split 32 64 128 256 \
    --out "$OUT/pa_ours.json"; echo "rc=$?"
  echo "== vLLM FA3 at the same shapes"
  ( bash .vllm-h200/install.sh >/dev/null && export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
    timeout $(left 260) python3 experiments/fa3_decode_compare.py --equal --batch 104 128 256 \
      --context 2048 5120 7168 --out "$OUT/pa_fa3.json" ); echo "rc=$?"
  echo "== decode step, W2 none shape (104 rows at 5120)"; timeout $(left 430) python experiments/profile_decode.py \
    --preset qwen3_8b --batch 104 --context 5120 --lengths equal --modes none --out "$OUT/profile_w2_none.json"
  echo "rc=$?"
  echo "== decode step, W2 all shape (128 rows at 4096)"; timeout $(left 585) python experiments/profile_decode.py \
    --preset qwen3_8b --batch 128 --context 4096 --lengths equal --modes all --out "$OUT/profile_w2_all.json"
  echo "rc=$?"
} 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | cut -c1-300 | tail -60
