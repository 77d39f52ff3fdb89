#!/usr/bin/env bash
# Session 22, call 1 (one H200): the fused q/k/v epilogue + KV write (`pallas_kernels.kv_write.qkv_rope_write`):
# its GPU tests and the engine's GPU tests that decode through it, its GPU time against the ops it replaces
# (`python -m pallas_kernels.kv_write`), and the Qwen3-8B decode profile (256 rows at 2048, modes all and kv) with
# it and without it (FP8RL_FUSED_QKV=0) on the same machine.
source experiments/device/env.sh
P="experiments/profile_decode.py --preset qwen3_8b --batch 256 --context 2048 --lengths equal --pages engine"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  GPU_WORKERS=4 SUITE_S=120 bash experiments/device/gpu_tests.sh tests/test_kv_write.py
  echo "== engine GPU tests"; timeout $(left 280) python -m pytest -q -m gpu tests/test_paged_attention.py \
    tests/test_prefill_attention.py -k engine -p no:cacheprovider -rfE 2>&1 | grep -v "^SKIPPED\|^$" | tail -8
  echo "== kv_write bench"; timeout $(left 350) python -m pallas_kernels.kv_write --out "$OUT/kv_write_qkv.json"
  echo "== profile fused"; timeout $(left 450) python $P --modes all kv --hlo --out "$OUT/profile_fused.json"; echo "rc=$?"
  echo "== profile separate"; FP8RL_FUSED_QKV=0 timeout $(left 560) python $P --modes all kv \
    --out "$OUT/profile_separate.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -45
