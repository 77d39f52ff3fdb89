#!/usr/bin/env bash
# Session 20, call 1 (one H200):
#   1. the decode step's GEMMs one by one at 64/128/256 rows, BF16 and FP8, with split-K variants
#      (`bench_decode_gemms.py`): at 256 rows an N = 4096 GEMM (o_proj, down_proj) has 64 output tiles of 128x128
#      for 132 SMs; session 19's kv profile had one cuBLAS kernel at 1.98 ms per step whose shapes are not named;
#   2. profile all, every row at context 2048, pages as the engine hands them out (3 calls, traced);
#   3. the same state for kv held 100 calls (--hold: ~30 s of decode) with the GPU's clocks recorded: does a
#      long run lose clocks that a 1 s profile keeps (W1's kv step was ~1 ms over the profile in session 19)?
#   4. one prefill call of W1 (4 x 1024, mode all) per kernel class (prefill was 4.56 s of W1 all's 40.5 s).
source experiments/device/env.sh
P="experiments/profile_decode.py --preset qwen3_8b --batch 256 --context 2048 --lengths equal --pages engine"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  echo "== decode GEMMs"; timeout $(left 200) python experiments/bench_decode_gemms.py --m 64 128 256 \
    --out "$OUT/decode_gemms.json"; echo "rc=$?"
  echo "== profile all, short"; timeout $(left 280) python $P --modes all --out "$OUT/profile_all_short.json"; echo "rc=$?"
  echo "== profile kv, held 100 calls"; timeout $(left 380) python $P --modes kv --hold --repeats 100 --no-trace \
      --out "$OUT/profile_kv_held.json"; echo "rc=$?"
  echo "== profile prefill, all, 4 x 1024 (W1's prefill calls)"; timeout $(left 470) python experiments/profile_decode.py \
    --preset qwen3_8b --prefill 4 --prompt-len 1024 --modes all --out "$OUT/profile_prefill_all.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -60
