#!/usr/bin/env bash
# (As run, the flag was --hang-dump-s, a stack dump at a fixed time; now it is --stall-dump-s: no progress for N s.)
# Session 6, call 2 (nvidia-h200-x2, or nvidia-h200 without the GPU 1 part; carry [".vllm-h200"]). Call 1's W1 runs (kv, all) both hit their
# 195 s limit before printing the warm-up's end, the first runs with the FP8 table entry that turns on
# the uint32 word gather. So:
#   GPU 0: a 2-layer W1 kv run (32 prompts) with a stack dump on hang: the word gather in the engine;
#          if it fails, the table entry falls back to the byte gather; then W1 kv and W1 all, with
#          per-program warm-up times and a stack dump before the limit.
#   GPU 1: vLLM 0.26 W1 FP8 W8A8 + FP8 KV alone (call 1's was cut by bench.py's deadline while
#          capturing CUDA graphs after DeepGEMM's first JIT).
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TABLE=pallas_kernels/paged_attention_tuning.json
filt() { grep -v "^W1130\|^I1130\|^W12\|^I12\|DeprecationWarning\|return rule"; }
W1="experiments/bench_rollout.py --preset qwen3_8b --workload W1 --kv-fraction 0.8 --max-slots 256 --steps-per-call 16 --prefill-batch 4"
(
  export CUDA_VISIBLE_DEVICES=0
  {
    echo "== quick: 2 layers, 32 prompts, kv (word gather)"
    timeout 110 python $W1 --layers 2 --prompts 32 --modes kv --stall-dump-s 100 --out "$OUT/quick_kv.json"; rc=$?
    echo "rc=$rc"
    if [ $rc -ne 0 ]; then
      python - "$TABLE" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))
for e in t["entries"]:
    if e["pool"] == "float8_e4m3fn":
        e["config"]["fp8_word_gather"] = False
open(sys.argv[1], "w").write(json.dumps(t, indent=1) + "\n")
print("word gather off in the table")
PY
    fi
    for m in kv all; do
      echo "== W1 $m"; timeout 215 python $W1 --modes $m --stall-dump-s 205 --out "$OUT/rollout_W1_$m.json"; echo "rc=$?"
    done
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && (
  export CUDA_VISIBLE_DEVICES=1
  {
    bash .vllm-h200/install.sh >/dev/null && export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
    echo "== vLLM W1 fp8_kv8"; timeout 570 python3 .vllm-h200/bench.py --configs fp8_kv8 --num-prompts 256 \
      --prompt-len 1024 --max-tokens 2048; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT/gpu0.log" | tail -40; echo; grep -v "^  \|^$" "$OUT/gpu1.log" | grep -v Capturing | tail -12 2>/dev/null
