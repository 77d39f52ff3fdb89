#!/usr/bin/env bash
# Session 15, call 2 (one H200; planned in session 12 as session12_3.sh, never run there, shorter sweep here): FP8 paged attention with two kv heads per program (session 11, untimed; offline
# sm_90 codegen: no spills at 2-4 pages / 2-4 warps, 3-4 CTAs per SM). In session 11's FP8 decode profile the
# attention was 8.7 of 15.6 ms at 3.4 TB/s, where the BF16 kernel reads 4.2.
#   1. the FP8 focus sweep (the kh=2 configs first) at the rollout's decode shape, with a tuning table of its best;
#   2. W1 in mode kv with that table (FP8RL_PAGED_ATTENTION_TUNING), against session 8's kv 10620 / none 7626.
source experiments/device/env.sh
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
{ echo "== FP8 attention sweep"; timeout 190 python -m pallas_kernels.paged_attention --fp8-focus --batch 256 \
    --context 2048 --dtypes float8_e4m3fn --max-seconds 140 --out "$OUT/pa_fp8_sweep.json" \
    --tuning-out /tmp/pa_table_fp8.json; echo "rc=$?"
  python - <<'PY'
import json  # the FP8 entry of the sweep next to the committed BF16 one: a table the engine can read
new = json.load(open("/tmp/pa_table_fp8.json"))
old = json.load(open("pallas_kernels/paged_attention_tuning.json"))
fp8 = [e for e in new["entries"] if e["pool"] == "float8_e4m3fn"]
table = {**old, "entries": [e for e in old["entries"] if e["pool"] != "float8_e4m3fn"] + fp8}
json.dump(table, open("/tmp/pa_table.json", "w"), indent=1)
print("FP8 entry:", json.dumps(fp8))
PY
  cp /tmp/pa_table.json "$OUT/"
  echo "== W1 kv with the swept FP8 attention"; FP8RL_PAGED_ATTENTION_TUNING=/tmp/pa_table.json \
    timeout $(left 585) python $R --workload W1 --modes kv none --out "$OUT/rollout_W1_kv.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"' | cut -c1-300 | tail -40
