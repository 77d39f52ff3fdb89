#!/usr/bin/env bash
# Session 16, call 3 (one H200): does the heads-fastest launch order of the paged attention kernel pay inside the
# engine? Call 1's kernel benchmark (B = 256, context <= 2048, pages shuffled) timed it 4.6% (BF16) / 3.6% (FP8)
# faster, but call 1's W1 with it ran slower than session 15's without it (kv 10090 vs 10450: another machine).
# A/B on one machine, one process per table, back to back: W1 kv with the committed table (then rows fastest)
# and with call 1's table (heads fastest).
# The call's command, as run (call 2's GPU tests had stopped at collection: math_verify is not on the image):
#   source experiments/device/env.sh; { timeout 300 python -m pytest -q -m gpu tests --ignore=tests/test_rewards.py \
#     -p no:cacheprovider -rfE --durations=15 --junitxml="$OUT/gpu_tests.xml" ...; } > "$OUT/tests.log";
#   OUT=$OUT/ab bash experiments/device/session16_3.sh
# The tests ran out their 300 s (35 passed, none failed, no summary) and the call's 600 s cut this script's 4th run.
source experiments/device/env.sh
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
{ nvidia-smi --query-gpu=name,driver_version --format=csv
  for t in rows heads rows heads; do
    [ $SECONDS -gt 470 ] && break
    [ $t = heads ] && export FP8RL_PAGED_ATTENTION_TUNING=experiments/results/logs/session16_1_pa_table.json
    [ $t = rows ] && unset FP8RL_PAGED_ATTENTION_TUNING
    echo "== W1 kv, launch order: $t"; timeout $(left 585) python $R --workload W1 --modes kv \
      --out "$OUT/rollout_W1_kv_${t}_${SECONDS}.json"; echo "rc=$?"
  done
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[kv\]  ' | cut -c1-300 | tail -40
