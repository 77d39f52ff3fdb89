#!/usr/bin/env bash
# Session 15, call 3 (one H200): decode steps by kernel with each top XLA kernel's HLO (--hlo). 8B first, in the
# modes whose targets are borderline (kv 1.37x in call 2 against >= 1.4x; w8a8 1.197x in session 11 against
# >= 1.2x): where the step's time goes besides attention and the GEMMs. Then 30B-A3B all (session 13: 7.2 ms of
# small ops: other fusions 4.6, reductions 1.1, sorts 0.9, MemcpyD2D 0.6).
source experiments/device/env.sh
{ echo "== profile 8B kv w8a8 --hlo"; timeout 300 python experiments/profile_decode.py --preset qwen3_8b \
    --batch 256 --context 2048 --modes kv w8a8 --hlo --out "$OUT/profile_8b_kv_w8a8_hlo.json"; echo "rc=$?"
  echo "== profile 30B all --hlo"; timeout $(left 585) python experiments/profile_decode.py --preset qwen3_30b_a3b \
    --batch 256 --context 2048 --modes all --hlo --out "$OUT/profile_30b_all_hlo.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"' | cut -c1-300 | tail -80
