#!/usr/bin/env bash
# Session 23, call 2 (one H200): call 1's HLO showed XLA's split-K rewrite (xla_gpu_experimental_enable_split_k_rewrite)
# splitting the BF16 decode GEMMs with N = 4096 / 6144 (o_proj, down_proj, fused q/k/v) into 2 batched cuBLAS GEMMs
# plus a float32 reduction (196 + 127 us per step in mode kv). The decode profile in modes kv and none with the
# rewrite on (the default) and off, same machine.
source experiments/device/env.sh
P="experiments/profile_decode.py --preset qwen3_8b --batch 256 --context 2048 --lengths equal --pages engine"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  echo "== split-K rewrite on (default)"; timeout $(left 200) python $P --modes kv none --out "$OUT/profile_splitk_on.json"
  echo "== split-K rewrite off"; XLA_FLAGS="--xla_gpu_experimental_enable_split_k_rewrite=false" timeout $(left 400) \
    python $P --modes kv none --out "$OUT/profile_splitk_off.json"
  echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-200 | tail -40
