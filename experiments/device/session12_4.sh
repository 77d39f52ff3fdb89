#!/usr/bin/env bash
# Session 12, call 4 (one H200; order the session's calls by what is most needed):
#   1. the 8B decode step by kernel in mode all with each top XLA kernel's HLO (--hlo): session 11 saw 1.95 ms of
#      "other fusions" and 0.77 ms of reductions per step without being able to name them (the trace of a step run
#      in CUDA graphs names only the command buffer);
#   2. W1 mode all: the weight sync with the fused parts quantized straight into place (session 11: 20.2 ms, target
#      <= 20), and a third run of the 1.6x;
#   3. W2 none and all on cuBLASLt (session 7 on Mosaic: 3758 / 5594, 1.49x).
source experiments/device/env.sh
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
{ echo "== profile 8B all --hlo"; timeout 200 python experiments/profile_decode.py --preset qwen3_8b --batch 256 \
    --context 2048 --modes all --hlo --out "$OUT/profile_8b_all_hlo.json"; echo "rc=$?"
  echo "== W1 all"; timeout 150 python $R --workload W1 --modes all --out "$OUT/rollout_W1_all.json"; echo "rc=$?"
  echo "== W2 none all"; timeout $(left 540) python $R --workload W2 --modes none all --out "$OUT/rollout_W2.json"
  echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"' | cut -c1-300 | tail -40
