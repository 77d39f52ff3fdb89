#!/usr/bin/env bash
# Session 21, call 2 (one H200): call 1 (session21_3.sh) found add_rms_norm_quant's loop over the groups of a row
# latency-bound (27.6 us at 256 x 4096 where XLA's kernels took 7.6; the decode step 17.8 ms against 15.8). Now it
# quantizes a row's groups at once. Again: act_quant's GPU tests, the norm kernel's timing and tilings, the mode-all
# decode profile, and Qwen3-8B W1 none and all in one process.
source experiments/device/env.sh
P="experiments/profile_decode.py --preset qwen3_8b --batch 256 --context 2048 --lengths equal --pages engine"
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
{ GPU_WORKERS=4 SUITE_S=120 bash experiments/device/gpu_tests.sh tests/test_act_quant.py
  echo "== act_quant timing"; timeout $(left 220) python -m pallas_kernels.act_quant --m 256 4096 --kernels norm \
    --sweep --out "$OUT/act_quant_norm.json"; echo "rc=$?"
  echo "== profile all"; timeout $(left 290) python $P --modes all --out "$OUT/profile_all_norm.json"; echo "rc=$?"
  echo "== 8B W1 none all"; timeout $(left 590) python $R --workload W1 --modes none all \
    --out "$OUT/rollout_8b_W1.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -45
