#!/usr/bin/env bash
# Session 14, call 3 (one H200): the decode steps by kernel with each top XLA kernel's HLO (--hlo), to name the
# 30B-A3B step's 7.2 ms of small ops (other fusions 4.6, reductions 1.1, sorts 0.9, MemcpyD2D 0.6; session 13)
# and the 8B step's 2.7 ms (session 11); 30B first.
source experiments/device/env.sh
{ echo "== profile 30B all --hlo"; timeout 280 python experiments/profile_decode.py --preset qwen3_30b_a3b \
    --batch 256 --context 2048 --modes all --hlo --out "$OUT/profile_30b_all_hlo.json"; echo "rc=$?"
  echo "== profile 8B all --hlo"; timeout $(left 585) python experiments/profile_decode.py --preset qwen3_8b \
    --batch 256 --context 2048 --modes all --hlo --out "$OUT/profile_8b_all_hlo.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"' | cut -c1-300 | tail -60
