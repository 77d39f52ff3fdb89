#!/usr/bin/env bash
# Planned for session 20, call 1 (one H200; written in session 19): does W1's decode step lose its ~1 ms against a
# profile of the same state (session 19: kv at context 2048, W1 18.69 ms vs profile 17.93 with Gumbel, ~17.7 with
# the inverse CDF, on other machines) to the GPU's clocks under sustained load? Every run records nvidia-smi's
# SM clock, power and throttle reasons along its timed part (GpuMonitor: gpu_during_calls / gpu_during_run).
#   1. profile kv and all, every row at context 2048, pages as the engine hands them out: 3 calls (short), then the
#      same state held for 100 calls (--hold: ~30 s of sustained decode; call_s keeps every call);
#   2. one prefill call of W1 (4 x 1024, mode all) profiled per kernel class (`profile_decode --prefill`: prefill was
#      4.56 s of W1 all's 40.5 s);
#   3. W1 kv on the same machine (bench_rollout; decode_calls and the run's clocks).
# Call 2 (session20_2.sh): W1 none / w8a8 / all.
source experiments/device/env.sh
P="experiments/profile_decode.py --preset qwen3_8b --batch 256 --context 2048 --lengths equal --pages engine"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  for m in kv all; do
    echo "== profile $m, short"; timeout $(left 300) python $P --modes $m --out "$OUT/profile_${m}_short.json"; echo "rc=$?"
    echo "== profile $m, held 100 calls"; timeout $(left 300) python $P --modes $m --hold --repeats 100 --no-trace \
      --out "$OUT/profile_${m}_held.json"; echo "rc=$?"
  done
  echo "== profile prefill, all, 4 x 1024 (W1's prefill calls)"; timeout $(left 400) python experiments/profile_decode.py \
    --preset qwen3_8b --prefill 4 --prompt-len 1024 --modes all --out "$OUT/profile_prefill_all.json"; echo "rc=$?"
  echo "== W1 kv"; timeout $(left 570) python experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 \
    --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52 --workload W1 --modes kv \
    --out "$OUT/rollout_8b_W1_kv.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-400 | tail -40
