#!/usr/bin/env bash
# Prepared in session 29 for the next device session (one H200), after session30_1.sh (bench_stream_overlap) says
# whether two streams overlap at all: the engine's two-batch decode (EngineConfig.two_batch) end to end. The mode-all
# decode step at 256 rows x 2048 keys (W1's shape; session 26: 15.86 ms, attention 10.7 ms + GEMMs 4.0 ms one after
# the other) with two_batch off / serial / streams, then W1 all with streams against off on the same machine.
# EXTRA_XLA_FLAGS (e.g. --xla_gpu_enable_command_buffer= where session30_1.sh overlapped only without command
# buffers) is added to the streams runs' XLA_FLAGS.
source experiments/device/env.sh
STREAMS_FLAG="--xla_gpu_experimental_stream_annotation=true ${EXTRA_XLA_FLAGS:-}"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  echo "== two-batch decode == one-batch step, on the GPU with real streams"
  XLA_FLAGS="$STREAMS_FLAG" timeout $(left 60) python -m pytest -q tests/test_kv_write.py -k two_batch \
    -p no:cacheprovider 2>&1 | tail -2
  for spec in "off 140" "serial 220" "streams 300"; do set -- $spec
    echo "== decode step all, 256 x 2048, two_batch $1"
    XLA_FLAGS=$([ "$1" = streams ] && echo "$STREAMS_FLAG") timeout $(left $2) python experiments/profile_decode.py \
      --preset qwen3_8b --batch 256 --context 2048 --lengths equal --modes all --two-batch $1 \
      --out "$OUT/profile_all_256_$1.json"; echo "rc=$?"
  done
  for spec in "streams 430" "off 590"; do set -- $spec
    echo "== 8B W1 all, two_batch $1"
    XLA_FLAGS=$([ "$1" = streams ] && echo "$STREAMS_FLAG") timeout $(left $2) python experiments/bench_rollout.py \
      --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --workload W1 --stall-dump-s 90 \
      --kv-gib-like-vllm 101.74 107.52 --modes all --two-batch $1 --out "$OUT/rollout_8b_W1_all_$1.json"
    echo "rc=$?"
  done
} 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"\|^{"mode"' | cut -c1-220 | tail -40
python3 - "$OUT" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("profile_all_*.json")):
    r = json.loads(f.read_text())["runs"][0]
    t = r.get("trace") or {}
    print(f.name, round(r["step_ms"], 3), round(r["hbm_fraction"], 3), "busy", t.get("gpu_busy_us_per_step"),
          "span", t.get("gpu_span_us_per_step"), {k: round(v) for k, v in t.get("per_step_us_by_class", {}).items()})
PY
