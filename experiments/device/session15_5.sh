#!/usr/bin/env bash
# Session 15, call 5 (one H200, ~390 s of budget left): does the fused q/k/v + gate/up layout help BF16 weights?
# Call 3's kv profile (BF16 weights, unfused by default): XLA merged the three q/k/v dots into one Triton
# gemm_fusion that concatenates the weights on the fly, 1.45 ms per step (~320 TFLOP/s), where cuBLAS ran the
# other GEMMs at ~600. A/B in one process each: kv and none with --fuse-projections on, then kv off again.
source experiments/device/env.sh
P="experiments/profile_decode.py --preset qwen3_8b --batch 256 --context 2048"
{ echo "== profile 8B kv none fused"; timeout 110 python $P --modes kv none --fuse-projections on \
    --out "$OUT/profile_8b_fused_on.json"; echo "rc=$?"
  echo "== profile 8B kv unfused"; timeout $(left 190) python $P --modes kv --fuse-projections off --no-trace \
    --out "$OUT/profile_8b_fused_off.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"' | cut -c1-400 | tail -20
