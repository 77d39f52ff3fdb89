#!/usr/bin/env bash
# Planned for session 19, call 1 (one H200; written in session 18, which had no device time left): the paged-attention
# kernel on the GPU since its last run, and the E4M3 logits dot (`fp8_qk_dot`) timed against the table's FP8 config.
#   0. the paged-attention GPU tests: since session 17's run the kernel loads q as given and stores its output in the
#      natural order (same bits in interpret mode), and the fp8_qk_dot cases are new (wgmma on the GPU); then
#      tests/test_sampling.py on the GPU backend (the inverse-CDF draw's chi-square tests under XLA:GPU);
#   1. `main --qk8`: the qk8 sweep next to the table's FP8 config at B = 256, context <= 2048 (the table's shape),
#      every config printed; the fastest goes into a candidate table, $OUT/pa_tuning_qk8.json;
#   2. the kv decode step with the table vs the candidate (rows uniform in [1024, 2048], as session 17's 16.62 ms),
#      and with the inverse-CDF draw (`EngineConfig.sampling_draw`: one uniform per row instead of 256 x 151936
#      Gumbel numbers, whose fusion took 287 us of session 17's step), then with every row at context 2048 and
#      pages as the engine hands them out (W1's state: session 17's W1 kv step, 20.10 ms, was ~1 ms over the uniform
#      profile scaled to 2048).
# Call 2 (session19_2.sh) runs W1 none / kv / all with the candidate table if it holds a qk8 config (and with
# `--draw inverse_cdf` given to it if that draw won).
source experiments/device/env.sh
P="experiments/profile_decode.py --preset qwen3_8b --batch 256 --modes kv"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  GPU_WORKERS=8 SUITE_S=200 bash experiments/device/gpu_tests.sh tests/test_paged_attention.py
  echo "== sampling tests on the GPU (both draws' chi-square tests)"; XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 \
    timeout $(left 260) python -m pytest -q -n 4 -p no:cacheprovider tests/test_sampling.py 2>&1 | tail -3
  echo "== qk8 sweep"; timeout $(left 370) python -m pallas_kernels.paged_attention --qk8 --batch 256 --context 2048 \
    --dtypes float8_e4m3fn --max-seconds 90 --tuning-out "$OUT/pa_tuning_qk8.json" --out "$OUT/pa_qk8.json"
  echo "rc=$?"; cat "$OUT/pa_tuning_qk8.json" 2>/dev/null | grep -v '^  *"\(max_splits\|fp8_dot_dtype\)'
  echo "== profile kv, table"; timeout $(left 420) python $P --out "$OUT/profile_kv_table.json"; echo "rc=$?"
  if [ -f "$OUT/pa_tuning_qk8.json" ]; then
    echo "== profile kv, candidate"; FP8RL_PAGED_ATTENTION_TUNING="$OUT/pa_tuning_qk8.json" timeout $(left 470) \
      python $P --out "$OUT/profile_kv_candidate.json"; echo "rc=$?"
  fi
  echo "== profile kv, table, inverse-CDF draw"; timeout $(left 520) python $P --draw inverse_cdf \
    --out "$OUT/profile_kv_table_icdf.json"; echo "rc=$?"
  echo "== profile kv, context 2048 equal, engine pages"; timeout $(left 570) python $P --lengths equal \
    --pages engine --out "$OUT/profile_kv_equal_engine.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -70
