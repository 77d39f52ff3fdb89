#!/usr/bin/env bash
# Session 21, call 1 (one H200): the FP8 linears' other input quantizations in one pass each
# (`pallas_kernels.act_quant.add_rms_norm_quant` before q/k/v and gate/up, with the residual add deferred into it;
# `quantize_1x128` before o_proj), through `W8A8Policy.norm_dot` / `dot`:
#   1. act_quant's GPU tests (the kernels against XLA:GPU's composition and float64);
#   2. GPU time of the new kernels against the XLA fusions they replace at decode's 256 rows and prefill's 4096,
#      with their tilings swept;
#   3. the mode-all decode profile of session 20 (equal 2048, engine pages: 15.83 ms/step in its call 3);
#   4. Qwen3-8B W1 all (session 20: 12846 / 12480 tok/s, 17.13 / 17.49 ms/step).
source experiments/device/env.sh
P="experiments/profile_decode.py --preset qwen3_8b --batch 256 --context 2048 --lengths equal --pages engine"
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
{ GPU_WORKERS=4 SUITE_S=150 bash experiments/device/gpu_tests.sh tests/test_act_quant.py
  echo "== act_quant timing"; timeout $(left 300) python -m pallas_kernels.act_quant --m 256 4096 --kernels norm plain \
    --sweep --out "$OUT/act_quant_norm.json"; echo "rc=$?"
  echo "== profile all"; timeout $(left 370) python $P --modes all --out "$OUT/profile_all_norm.json"; echo "rc=$?"
  echo "== 8B W1 all"; timeout $(left 590) python $R --workload W1 --modes all --out "$OUT/rollout_8b_W1_all.json"
  echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -60
