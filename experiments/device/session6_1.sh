#!/usr/bin/env bash
# Next session, call 1 (nvidia-h200-x2; carry [".vllm-h200"]; at most 8 files come back):
#   GPU 0: FP8 paged-attention sweep around the measured best (`--fp8-focus`: with and without the
#          uint32 word gather, whose inline-PTX unpacking has only been compiled offline: its GPU test
#          is `pytest -m gpu tests/test_paged_attention.py -k "Gpu and words"`), merged into the
#          tuning table; then our W1 rollouts, FP8 all and kv (JaxEngine.warmup before the clock).
#   GPU 1: vLLM 0.26 on the same W1 (BF16 and FP8 W8A8 + FP8 KV, ../shared/vllm-h200 bench.py),
#          the peer re-measured in the same session (its defaults, as in ../shared/vllm-h200/README.md).
# Then, in a second call: our W1 none and w8a8 (one per GPU), then W2 none and all.
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TABLE=pallas_kernels/paged_attention_tuning.json
filt() { grep -v "^W1130\|^I1130\|^W12\|^I12\|DeprecationWarning\|return rule"; }
W1="experiments/bench_rollout.py --preset qwen3_8b --workload W1 --kv-fraction 0.8 --max-slots 256 --steps-per-call 16 --prefill-batch 4"
(
  export CUDA_VISIBLE_DEVICES=0
  {
    echo "== word-gather GPU tests"; timeout 60 python -m pytest -q -m gpu tests/test_paged_attention.py \
      -k "Gpu and words" -p no:cacheprovider 2>&1 | tail -3
    echo "== paged attention fp8 focus sweep"; timeout 130 python -m pallas_kernels.paged_attention --fp8-focus \
      --batch 256 --context 2048 --dtypes float8_e4m3fn --max-seconds 100 --tuning-out "$OUT/pa_tuning_fp8.json" \
      --out "$OUT/pa_fp8_focus.json"; echo "rc=$?"
    python - "$OUT/pa_tuning_fp8.json" "$TABLE" <<'PY'
import json, sys
new, path = json.load(open(sys.argv[1])), sys.argv[2]
table = json.load(open(path))
old = {e["pool"]: e for e in table["entries"]}
for e in new["entries"]:  # keep the faster of the table's and the new measurement
    if e["pool"] not in old or e["ms"] < old[e["pool"]]["ms"]:
        old[e["pool"]] = e
table["entries"] = sorted(old.values(), key=lambda e: e["pool"])
open(path, "w").write(json.dumps(table, indent=1) + "\n")
print("table:", [(e["pool"], e["config"], round(e["ms"], 3)) for e in table["entries"]])
PY
    cp "$TABLE" "$OUT/paged_attention_tuning.json"
    for m in all kv; do
      echo "== W1 $m"; timeout 195 python $W1 --modes $m --out "$OUT/rollout_W1_$m.json"; echo "rc=$?"
    done
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  {
    bash .vllm-h200/install.sh >/dev/null && export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
    echo "== vLLM W1"; timeout 560 python3 .vllm-h200/bench.py --configs bf16,fp8_kv8 --num-prompts 256 \
      --prompt-len 1024 --max-tokens 2048; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT/gpu0.log" | tail -30; echo; grep -v "^  \|^$" "$OUT/gpu1.log" | tail -25
