#!/usr/bin/env bash
# Session 5, call 3 (nvidia-h200-x2, one job per GPU; at most 8 files come back):
#   GPU 0: FP8 paged-attention sweep (bfloat16 vs float16 dots), its best merged into the tuning
#          table the library reads; then rollout W1 FP8 all and kv.
#   GPU 1: paged-attention GPU tests (float16 dots); rollout W1 BF16 and w8a8.
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TABLE=pallas_kernels/paged_attention_tuning.json
filt() { grep -v "^W1130\|^I1130\|DeprecationWarning\|return rule"; }
W1="experiments/bench_rollout.py --preset qwen3_8b --workload W1 --kv-fraction 0.8 --max-slots 256 --steps-per-call 16 --prefill-batch 4"
(
  export CUDA_VISIBLE_DEVICES=0
  {
    echo "== paged attention fp8 sweep"; timeout 150 python -m pallas_kernels.paged_attention --batch 256 \
      --context 2048 --dtypes float8_e4m3fn --max-seconds 120 --tuning-out "$OUT/pa_tuning_fp8.json" \
      --out "$OUT/pa_fp8.json"; echo "rc=$?"
    python - "$OUT/pa_tuning_fp8.json" "$TABLE" <<'PY'
import json, sys
new, path = json.load(open(sys.argv[1])), sys.argv[2]
table = json.load(open(path))
pools = {e["pool"] for e in new["entries"]}
table["entries"] = [e for e in table["entries"] if e["pool"] not in pools] + new["entries"]
open(path + ".tmp", "w").write(json.dumps(table, indent=1) + "\n")
PY
    mv "$TABLE.tmp" "$TABLE"; touch "$OUT/.table_done"; cp "$TABLE" "$OUT/paged_attention_tuning.json"
    echo "== W1 all"; timeout 230 python $W1 --modes all --out "$OUT/rollout_W1_all.json"; echo "rc=$?"
    echo "== W1 kv"; timeout 190 python $W1 --modes kv --out "$OUT/rollout_W1_kv.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  {
    echo "== W1 none"; timeout 230 python $W1 --modes none --out "$OUT/rollout_W1_none.json"; echo "rc=$?"
    echo "== W1 w8a8"; timeout 220 python $W1 --modes w8a8 --out "$OUT/rollout_W1_w8a8.json"; echo "rc=$?"
    echo "== gpu tests"; timeout 100 python -m pytest -q -m gpu tests/test_paged_attention.py -k "Gpu and not FullSize" \
      -p no:cacheprovider 2>&1 | tail -4; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu1.log"
) &
wait
rm -f "$OUT/.table_done"
grep -v "^  \|^$" "$OUT/gpu0.log" | tail -40; echo; grep -v "^  \|^$" "$OUT/gpu1.log" | tail -40
