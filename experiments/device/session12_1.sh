#!/usr/bin/env bash
# Session 12, call 1 (was session 11 call 2, not run): the other rollout shapes with the FP8 GEMMs on cuBLASLt (the H200 default since session 10).
#   A: Qwen3-30B-A3B W1 all (session 9 on Mosaic: 6614 tokens/s, 1.37x none's 4842), then its decode step by kernel
#      (34.4 ms at 256 rows, 39% of its roofline: the grouped expert GEMMs are still our Triton kernel).
#   B (second GPU only): Qwen3-8B W2 none + all (session 7 on Mosaic: 3758 / 5594, 1.49x); RL all (session 9:
#      7009, 1.40x none's 5009) goes to a later call.
source experiments/device/env.sh
R="experiments/bench_rollout.py --max-slots 256 --steps-per-call 16 --prefill-batch 4"
part_a() {
  { echo "== 30B-A3B W1 all"; timeout 330 python $R --preset qwen3_30b_a3b --workload W1 --stall-dump-s 120 \
      --kv-gib-like-vllm 60 87 --modes all --out "$OUT/rollout_30b_W1_all.json"; echo "rc=$?"
    echo "== profile 30B all"; timeout $(left $1) python experiments/profile_decode.py --preset qwen3_30b_a3b \
      --batch 256 --context 2048 --modes all --hlo --out "$OUT/profile_30b.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/a.log"
}
part_b() {
  { echo "== W2 none all"; timeout $(left $1) python $R --preset qwen3_8b --workload W2 --stall-dump-s 90 \
      --kv-gib-like-vllm 101.74 107.52 --modes none all --out "$OUT/rollout_W2.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/b.log"
}
two_gpus_or 545 "part_a 545"
grep -v "^  \|^$" "$OUT"/*.log | grep -v '"partial"' | cut -c1-300 | tail -60
