#!/usr/bin/env bash
# Prepared in session 29 for the next device session (one H200): does two-batch overlap pay on one GPU?
# experiments/bench_stream_overlap.py times 36 Qwen3-8B decoder layers (FP8 KV paged attention + FP8 GEMMs, mode
# all's kernels, each layer's K/V write into the donated pool included) at 256 rows x 2048 keys as today's
# one-stream step ("full") against two halves of 128 rows in the two-batch order on one stream and on two streams
# (XLA's experimental stream annotation: attention of one half under the GEMMs of the other; the K/V write on the
# attention's stream, or on the main stream if XLA copies the pool across the stream boundary: see temp GB).
# Session 23's profile of that step: attention 10.1 ms, GEMMs 3.9 ms, one after the other. Runs: XLA's default
# command buffers, then without them (if the annotated calls do not overlap inside CUDA graphs), then 64-row halves
# (128 decode rows: the RL workload's tail). Decides whether the engine's decode step gets two-batch overlap.
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  for spec in "default 200 128 2048" "no_command_buffers 380 128 2048" "rows64 560 64 4096"; do set -- $spec
    echo "== stream overlap, $1: halves of $3 rows x $4 keys"
    flags=""; [ "$1" = no_command_buffers ] && flags="--xla_gpu_enable_command_buffer="
    XLA_FLAGS="$flags" timeout $(left $2) python experiments/bench_stream_overlap.py --preset qwen3_8b --rows $3 \
      --context $4 --layers 36 --repeats 7 --out "$OUT/stream_overlap_$1.json"
    echo "rc=$?"
  done
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | cut -c1-220 | tail -40
