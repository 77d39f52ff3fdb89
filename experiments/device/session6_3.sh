#!/usr/bin/env bash
# (As run, the flag was --hang-dump-s, a stack dump at a fixed time; now it is --stall-dump-s: no progress for N s.)
# Session 6, call 3 (nvidia-h200): our W1 in the three modes one after the other, the FP8 table entry
# back on the byte gather (call 2: the word-gather decode stopped advancing ~15 s into the W1 kv run,
# after running 2-layer W1 to the end; not yet understood), warm-up without the recompute buckets
# where nothing can be preempted, a stack dump before each limit.
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
filt() { grep -v "^W1130\|^I1130\|^W12\|^I12\|DeprecationWarning\|return rule"; }
W1="experiments/bench_rollout.py --preset qwen3_8b --workload W1 --kv-fraction 0.8 --max-slots 256 --steps-per-call 16 --prefill-batch 4"
{
  for m in kv:195 all:200 none:240; do
    echo "== W1 ${m%:*}"; timeout $((${m#*:} + 10)) python $W1 --modes ${m%:*} --stall-dump-s ${m#*:} \
      --out "$OUT/rollout_W1_${m%:*}.json"; echo "rc=$?"
  done
} 2>&1 | filt > "$OUT/gpu0.log"
grep -v "^  \|^$" "$OUT/gpu0.log" | cut -c1-600 | tail -40
