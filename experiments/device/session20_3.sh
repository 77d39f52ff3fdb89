#!/usr/bin/env bash
# Session 20, call 3 (one H200): SwiGLU fused into the down projection's FP8 input quantization
# (`pallas_kernels.act_quant.silu_mul_quant`, through `W8A8Policy.swiglu_dot`):
#   1. its GPU tests and test_cublaslt's (the handler gained the candidate attribute), on 4 workers;
#   2. its GPU time against the XLA fusions it replaces, at decode's 256 rows and prefill's 4096;
#   3. call 1's mode-all decode profile (equal 2048, engine pages: 15.92 ms/step in call 1, 16.30 in call 2);
#   4. Qwen3-8B W1 none / kv / all in one process.
source experiments/device/env.sh
P="experiments/profile_decode.py --preset qwen3_8b --batch 256 --context 2048 --lengths equal --pages engine"
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
{ GPU_WORKERS=4 SUITE_S=170 bash experiments/device/gpu_tests.sh tests/test_act_quant.py tests/test_cublaslt.py
  echo "== act_quant timing"; timeout $(left 210) python -m pallas_kernels.act_quant --m 256 4096 --out "$OUT/act_quant.json"
  echo "rc=$?"
  echo "== profile all"; timeout $(left 270) python $P --modes all --out "$OUT/profile_all_swiglu.json"; echo "rc=$?"
  echo "== 8B W1 none kv all"; timeout $(left 590) python $R --workload W1 --modes none kv all \
    --out "$OUT/rollout_8b_W1.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -50
