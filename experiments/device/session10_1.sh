#!/usr/bin/env bash
# Next session, call 1 (nvidia-h200-x2): cuBLASLt's block-scaled FP8 GEMM through our FFI handler, first time on the GPU.
#   GPU 0: its GPU tests (build at first use, the declarations against the image's cublasLt.h, numerics against the
#          jnp reference, a jitted scan, the policy), then bench_gemm at decode (M = 256) and engine-prefill
#          (M = 4096) sizes of every generator GEMM shape, Mosaic vs cuBLASLt vs torch's cuBLAS, and the weight sync;
#          the faster of ours per shape goes into the table GemmBackend.AUTO follows (returned: commit it to
#          fp8rl_jax/quant/fp8_gemm_backends.json).
#   GPU 1: W1 all (3 runs on the warm engine, the median reported), then W1 w8a8, with EngineConfig.fp8_gemm =
#          cublaslt (session 8 with the Mosaic kernel, one run each: 11216 and 8502 tokens/s; none 7626).
source experiments/device/env.sh
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
(
  export CUDA_VISIBLE_DEVICES=0
  { echo "== cuBLASLt tests (all of the file: header check and entry points run only where CUDA is installed)"
    timeout 150 python -m pytest -q tests/test_cublaslt.py -p no:cacheprovider -x -rs \
      2>&1 | tail -15; echo "rc=${PIPESTATUS[0]}"
    echo "== bench_gemm"; mkdir -p /tmp/g; timeout $((540 - SECONDS)) python experiments/bench_gemm.py --no-triton \
      --m 256 4096 --nk 6144 4096 24576 4096 4096 4096 4096 12288 1024 4096 12288 4096 --out /tmp/g/gemm_bench.json \
      --backend-table-out "$OUT/fp8_gemm_backends.json"
    echo "rc=$?"; cp /tmp/g/gemm_bench.json /tmp/g/gemm_bench.md "$OUT/" 2>/dev/null
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && (
  export CUDA_VISIBLE_DEVICES=1
  # if the handler does not build or load here, the GPU's time goes to Mosaic repeats instead (the spread of W1 all)
  G=cublaslt; timeout 120 python -c "from fp8rl_jax.quant import cublaslt as c; ok, why = c.available(); print('cublaslt', ok, why); assert ok" || G=mosaic
  { echo "== W1 all ($G), 3 runs"; timeout 330 python $R --workload W1 --modes all --fp8-gemm $G --repeats 3 \
      --out "$OUT/rollout_W1_all_$G.json"; echo "rc=$?"
    echo "== W1 w8a8 ($G)"; timeout $((540 - SECONDS)) python $R --workload W1 --modes w8a8 --fp8-gemm $G \
      --out "$OUT/rollout_W1_w8a8_$G.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT"/gpu*.log | grep -v '"partial"\|^{"M"' | cut -c1-300 | tail -60
