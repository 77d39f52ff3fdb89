#!/usr/bin/env bash
# Planned for session 18, call 1 (one H200; written in session 17, not run yet): where W1's decode step loses ~1 ms
# against the profile. Session 17: W1 kv ran 20.10 ms per step at a mean context of 2048; the profile (rows uniform in
# [1024, 2048], pages shuffled) ran 16.62 ms at ~1590, i.e. ~19.1 ms with its attention scaled to 2048.
#   0. the paged-attention GPU tests first: since session 17's GPU run the kernel loads q as given and stores its
#      output in the natural order (untimed; its profile should show the q fusion smaller and no output transpose);
#   1. the kv decode step in W1's own state: every row at one context (2048, and 3072 where rows take 3 splits), pages
#      as the engine hands them out (--pages engine) against shuffled through the pool;
#   2. W1 kv again, now with the step time of every decode call along the run (bench_rollout's decode_calls).
source experiments/device/env.sh
P="experiments/profile_decode.py --preset qwen3_8b --batch 256 --modes kv --lengths equal"
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  GPU_WORKERS=8 SUITE_S=150 bash experiments/device/gpu_tests.sh tests/test_paged_attention.py
  for ctx in 2048 3072; do
    for pages in engine shuffled; do
      echo "== profile kv, context $ctx, pages $pages"; timeout $(left 330) python $P --context $ctx --pages $pages \
        --out "$OUT/profile_kv_${ctx}_$pages.json"; echo "rc=$?"
    done
  done
  echo "== 8B W1 kv"; timeout $(left 590) python $R --workload W1 --modes kv --out "$OUT/rollout_8b_W1_kv.json"
  echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -60
