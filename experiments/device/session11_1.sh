#!/usr/bin/env bash
# Next session, call 1 (nvidia-h200-x2 if lent, else nvidia-h200: the second half then runs after the first).
#   A: where a decode-size cuBLASLt call's time goes (cublaslt_overhead.py), the cuBLASLt test file whole (session 10's 100 s cut left the jitted-loop and 1D x 1D tests unrun since the
#      workspace fix), then issue 3's GEMM table with the fixed handler (M 64/256/2048/8192 x the 8B and 30B expert
#      shapes; new column: cuBLASLt 1D x 1D with the weight scales per row) and the backend table (returned: merge
#      into fp8rl_jax/quant/fp8_gemm_backends.json, whose H200 default is cuBLASLt).
#   B: the decode step by kernel with cuBLASLt at W1's shape (does XLA capture the custom call into its command
#      buffers? how long are the GEMMs against session 8's 5.86 ms on Mosaic?), then W1 w8a8 and kv on cuBLASLt
#      (session 8, Mosaic: 1.11x and 1.39x of none; session 10 on cuBLASLt: none 7382, all 11840).
source experiments/device/env.sh
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
part_a() {
  { echo "== cuBLASLt call overhead"; timeout 150 python experiments/device/cublaslt_overhead.py \
      --out "$OUT/cublaslt_overhead.json" | cut -c1-400; echo "rc=$?"
    echo "== cuBLASLt tests"; timeout 240 python -m pytest -q tests/test_cublaslt.py -p no:cacheprovider -rs 2>&1 | tail -25
    echo "== bench_gemm"; mkdir -p /tmp/g; timeout $(($1 - SECONDS)) python experiments/bench_gemm.py --no-triton \
      --skip-sync --out /tmp/g/gemm_bench.json --backend-table-out "$OUT/fp8_gemm_backends.json"
    echo "rc=$?"; cp /tmp/g/gemm_bench.json /tmp/g/gemm_bench.md "$OUT/" 2>/dev/null
  } 2>&1 | filt > "$OUT/a.log"
}
part_b() {
  { echo "== profile 8B all (cuBLASLt)"; timeout 200 python experiments/profile_decode.py --preset qwen3_8b --batch 256 \
      --context 2048 --modes all --fp8-gemm cublaslt --out "$OUT/profile_8b_cublaslt.json"; echo "rc=$?"
    echo "== W1 w8a8 kv (cuBLASLt)"; timeout $(($1 - SECONDS)) python $R --workload W1 --modes w8a8 kv \
      --fp8-gemm cublaslt --out "$OUT/rollout_W1_w8a8_kv_cublaslt.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/b.log"
}
two_gpus_or 545 "part_b 300; part_a 545"
grep -v "^  \|^$" "$OUT"/*.log | grep -v '"partial"\|^{"M"' | cut -c1-300 | tail -70
