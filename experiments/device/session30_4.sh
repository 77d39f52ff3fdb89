#!/usr/bin/env bash
# (Ran on 75a4499 plus inline_jits in models.qwen3.on_gpu_stream; the engine's two-batch decode, profile_decode --two-batch
# and those helpers in the library were removed after this run: the helpers live in bench_stream_overlap.py.)
# Session 30, after session30_1.sh: every two-stream program failed to compile ("No ExecutionStreamId found for
# %call-start": the kernels' nested jits lowered as annotated calls inside the annotated regions). on_gpu_stream now
# inlines them (inline_jits). (1) bench_stream_overlap's halves on two streams against one stream and the full step
# (128-row halves x 2048 keys, XLA's default command buffers, then without them); (2) the engine's two-batch GPU
# test with real streams; (3) the mode-all decode step at 256 x 2048 with two_batch off / streams.
source experiments/device/env.sh
STREAMS_FLAG="--xla_gpu_experimental_stream_annotation=true"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  for spec in "default 150" "no_command_buffers 250"; do set -- $spec
    echo "== stream overlap, $1: halves of 128 rows x 2048 keys"
    flags=""; [ "$1" = no_command_buffers ] && flags="--xla_gpu_enable_command_buffer="
    XLA_FLAGS="$flags" timeout $(left $2) python experiments/bench_stream_overlap.py --preset qwen3_8b --rows 128 \
      --context 2048 --layers 36 --repeats 7 --programs full halves_serial halves_streams halves_streams_write_on_main \
      --out "$OUT/stream_overlap_$1.json"
    echo "rc=$?"
  done
  echo "== two-batch decode == one-batch step, on the GPU with real streams"
  XLA_FLAGS="$STREAMS_FLAG" timeout $(left 310) python -m pytest -q tests/test_kv_write.py -k two_batch \
    -p no:cacheprovider 2>&1 | tail -2
  for spec in "off 420" "streams 540"; do set -- $spec
    echo "== decode step all, 256 x 2048, two_batch $1"
    XLA_FLAGS=$([ "$1" = streams ] && echo "$STREAMS_FLAG") timeout $(left $2) python experiments/profile_decode.py \
      --preset qwen3_8b --batch 256 --context 2048 --lengths equal --modes all --two-batch $1 \
      --out "$OUT/profile_all_256_$1.json"; echo "rc=$?"
  done
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"\|^{"mode"' | cut -c1-260 | tail -40
python3 - "$OUT" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("profile_all_*.json")):
    r = json.loads(f.read_text())["runs"][0]
    t = r.get("trace") or {}
    print(f.name, round(r["step_ms"], 3), round(r["hbm_fraction"], 3), "busy", t.get("gpu_busy_us_per_step"),
          "span", t.get("gpu_span_us_per_step"), {k: round(v) for k, v in t.get("per_step_us_by_class", {}).items()})
PY
