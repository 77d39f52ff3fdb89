#!/usr/bin/env bash
# Next session, call 3 (nvidia-h200-x2), after session6_1/2.sh. Copy into pallas_kernels/ first the
# tuning tables those calls returned: a call gets this checkout's files, not what earlier calls wrote.
#   GPU 0: Qwen3-30B-A3B shape (random weights, ~61 GB BF16): decode-step profile none / all, then
#          rollout W1 none.
#   GPU 1: Qwen3-30B-A3B rollout W1 all, then the RL-shaped workload (256 x 512 -> up to 8192, lengths
#          spread) on Qwen3-8B, FP8 all.
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
filt() { grep -v "^W1130\|^I1130\|^W12\|^I12\|DeprecationWarning\|return rule"; }
R="experiments/bench_rollout.py --kv-fraction 0.8 --max-slots 256 --steps-per-call 16 --prefill-batch 4"
(
  export CUDA_VISIBLE_DEVICES=0
  {
    echo "== profile 30b-a3b"; timeout 200 python experiments/profile_decode.py --preset qwen3_30b_a3b --batch 256 \
      --context 2048 --modes none all --out "$OUT/decode_profile_qwen3_30b_a3b.json"; echo "rc=$?"
    echo "== 30b-a3b W1 none"; timeout 330 python $R --preset qwen3_30b_a3b --workload W1 --modes none \
      --out "$OUT/rollout_30b_W1_none.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  {
    echo "== 30b-a3b W1 all"; timeout 300 python $R --preset qwen3_30b_a3b --workload W1 --modes all \
      --out "$OUT/rollout_30b_W1_all.json"; echo "rc=$?"
    echo "== 8b RL all"; timeout 230 python $R --preset qwen3_8b --workload RL --modes all \
      --out "$OUT/rollout_8b_RL_all.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT/gpu0.log" | tail -30; echo; grep -v "^  \|^$" "$OUT/gpu1.log" | tail -30
