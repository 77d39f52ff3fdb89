#!/usr/bin/env bash
# Session 26, call 4 (one H200, the session's last ~280 s): call 1's sweep ranked cuBLASLt's pinned K splits by wall
# clock, which counts each kernel launch (~25 us) and so penalizes split-K's extra reduction kernel; inside the
# engine's CUDA graphs launches cost ~nothing. This reruns it by GPU busy time (tune_cublaslt_algos now times with
# replay_gpu_ms) on the shapes with < 1 wave (q/k/v, o_proj, down_proj) at 128 and 256 rows.
source experiments/device/env.sh
{ timeout $(left 250) python experiments/tune_cublaslt_algos.py --preset qwen3_8b --m 128 256 \
    --shapes qkv o_proj down_proj --splits 2 4 --sets 4 --out "$OUT/cublaslt_sweep.json" \
    --table-out "$OUT/cublaslt_algos_table.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | cut -c1-230 | tail -40
