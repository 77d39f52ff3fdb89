#!/usr/bin/env bash
# Session 20, call 2 (one H200): cuBLASLt's candidate algorithms per FP8 GEMM shape at decode's 256 rows and W1's
# prefill 4096 tokens, Qwen3-8B's linears and Qwen3-30B-A3B's attention projections (`tune_cublaslt.py`; winners
# written into fp8rl_jax/quant/cublaslt_algos.json, copied to $OUT); then, with that table, the decode GEMMs again
# (bench_decode_gemms) and call 1's mode-all decode profile (equal 2048, engine pages: 15.92 ms/step) with the
# optimized HLO of its top kernels (--hlo: what each XLA fusion computes). tune_cublaslt.py and the handler's
# candidate attribute are in commit f5a1fac; d648ea2 removed them after this call (one kernel per shape).
source experiments/device/env.sh
P="experiments/profile_decode.py --preset qwen3_8b --batch 256 --context 2048 --lengths equal --pages engine"
{ echo "== tune cuBLASLt"; timeout $(left 300) python experiments/tune_cublaslt.py --presets qwen3_8b qwen3_30b_a3b \
    --candidates 12 --m 256 4096 --out "$OUT/tune_cublaslt.json" --table-out; echo "rc=$?"
  cp fp8rl_jax/quant/cublaslt_algos.json "$OUT/" 2>/dev/null
  echo "== decode GEMMs, tuned"; timeout $(left 360) python experiments/bench_decode_gemms.py --m 256 128 --splits 2 \
    --shapes qkv o_proj gate_up down_proj --out "$OUT/decode_gemms_tuned.json"; echo "rc=$?"
  echo "== profile all, tuned, hlo"; timeout $(left 470) python $P --modes all --hlo --out "$OUT/profile_all_tuned.json"
  echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-400 | tail -60
