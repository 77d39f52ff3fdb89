#!/usr/bin/env bash
# Session 11, call 2 (one H200): after call 1 showed our cuBLASLt kernels as fast as torch's on the GPU (the gap was
# the host's ~30 us launch of each call) and the 8B decode step GPU-bound (busy 15.5 of 15.7 ms):
#   1. the 8B decode step by kernel in mode all with the activation quantization writing cuBLASLt's scale order
#      (quantize_activations_t: do the scale transposes, 264 us/step in call 1, go?), with each top kernel's HLO op;
#   2. the cuBLASLt GPU tests call 1's 240 s cut off (the jitted loop, the policy, 1x128 x 1x128);
#   3. issue 3's GEMM table with GPU time beside wall time (bench_gemm, replay_gpu_ms), and the backend table.
source experiments/device/env.sh
{ echo "== profile 8B all"; timeout 170 python experiments/profile_decode.py --preset qwen3_8b --batch 256 \
    --context 2048 --modes all --out "$OUT/profile_8b_all.json"; echo "rc=$?"
  echo "== cuBLASLt GPU tests (rest)"; timeout 100 python -m pytest -q -x tests/test_cublaslt.py -p no:cacheprovider \
    -k "jitted or 1d_matches" 2>&1 | tail -6
  echo "== bench_gemm"; mkdir -p /tmp/g; timeout $(left 470) python experiments/bench_gemm.py --no-triton --skip-sync \
    --out /tmp/g/gemm_bench.json --backend-table-out "$OUT/fp8_gemm_backends.json"
  echo "rc=$?"; cp /tmp/g/gemm_bench.json /tmp/g/gemm_bench.md "$OUT/" 2>/dev/null
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"\|^{"M"' | cut -c1-300 | tail -60
