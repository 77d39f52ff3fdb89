#!/usr/bin/env bash
# Session 10, call 3 (nvidia-h200; the x2 kind was not lent after call 1), after call 2 ran cuBLASLt's GEMM but
# found every call that needed a workspace failing ("no workspace memory" from XLA's scratch allocator) and the
# others at half of torch's cuBLAS speed (each call launched from the host). Now the workspace is a second result of
# the call and the handler may be captured into XLA's command buffers.
#   1. the probe: numerics and a jitted loop of 64 GEMMs through each registration (graph-capturable, eager);
#   2. W1 in modes all and none with the FP8 GEMMs on cuBLASLt (session 8, Mosaic: all 11216, none 7626 tokens/s);
#   3. the cuBLASLt GPU tests; 4. the decode-shape GEMM rows again.
source experiments/device/env.sh
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
{
  G=mosaic
  timeout 150 python experiments/device/cublaslt_probe.py; rc=$?
  [ $rc = 0 ] && G=cublaslt
  [ $rc = 3 ] && G=cublaslt && export FP8RL_CUBLASLT_GRAPHS=0
  echo "== probe rc=$rc -> $G (FP8RL_CUBLASLT_GRAPHS=${FP8RL_CUBLASLT_GRAPHS:-1})"
  echo "== W1 all none ($G)"; timeout 310 python $R --workload W1 --modes all none --fp8-gemm $G \
    --out "$OUT/rollout_W1_$G.json"; echo "rc=$?"
  echo "== cuBLASLt GPU tests"; timeout 100 python -m pytest -q tests/test_cublaslt.py -p no:cacheprovider \
    -k "Gpu or declarations or entry_point" 2>&1 | tail -12
  echo "== bench_gemm decode rows"; mkdir -p /tmp/g; timeout $((545 - SECONDS)) python experiments/bench_gemm.py \
    --no-triton --skip-sync --m 256 64 --nk 4096 4096 12288 4096 4096 12288 1024 4096 --out /tmp/g/gemm_bench.json \
    --backend-table-out "$OUT/fp8_gemm_backends.json"
  echo "rc=$?"; cp /tmp/g/gemm_bench.json /tmp/g/gemm_bench.md "$OUT/" 2>/dev/null
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT"/run.log | grep -v '"partial"\|^{"M"' | cut -c1-300 | tail -70
