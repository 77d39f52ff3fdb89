#!/usr/bin/env bash
# Planned for session 19, call 2 (after session19_1.sh; written in session 18): Qwen3-8B W1 none / kv / all in one
# process, with the paged-attention table of call 1's qk8 sweep when it holds an fp8_qk_dot config (copy call 1's
# pa_tuning_qk8.json to experiments/results/ first: $OUT is emptied between calls), else with the committed table.
# Every decode call's step time goes into the JSON (decode_calls). Arguments go to bench_rollout (e.g. --draw
# inverse_cdf).
source experiments/device/env.sh
T=experiments/results/pa_tuning_qk8_candidate.json
if [ -f "$T" ] && grep -q '"fp8_qk_dot": true' "$T"; then
  # the committed table with its FP8 entry replaced by the candidate's (BF16 pools keep the committed config)
  python - "$T" /tmp/pa_tuning_merged.json <<'PY'
import json, sys
from pallas_kernels.paged_attention import TUNING_FILE
table, cand = json.loads(TUNING_FILE.read_text()), json.loads(open(sys.argv[1]).read())
fp8 = [e for e in cand["entries"] if e["pool"] == "float8_e4m3fn"]
table["entries"] = [e for e in table["entries"] if e["pool"] != "float8_e4m3fn"] + fp8
open(sys.argv[2], "w").write(json.dumps(table, indent=1))
PY
  export FP8RL_PAGED_ATTENTION_TUNING=/tmp/pa_tuning_merged.json
fi
echo "paged-attention table: ${FP8RL_PAGED_ATTENTION_TUNING:-committed}"
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52 $*"
{ echo "== 8B W1 none kv all"; timeout $(left 590) python $R --workload W1 --modes none kv all \
    --out "$OUT/rollout_8b_W1.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -60
