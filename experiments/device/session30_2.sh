#!/usr/bin/env bash
# Prepared in session 29 for the next device session (one H200): the Triton FP8 GEMM now reads the activation
# scales as the quantization kernels write them ([K/128, M], a_scale_t), as cuBLASLt does, so AUTO's Triton shapes
# lose the transpose kernel before every call (session 29's 64-row profile: wrapped_transpose 126 us a step, 1.3%).
# (1) The GPU tests of that path; (2) the mode-all decode step at 64 and 16 rows, cuBLASLt against AUTO, one machine
# (session 29 at 64 x 4096: 9.771 against 9.526 ms with the transposes).
source experiments/device/env.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  echo "== GPU tests"; timeout $(left 150) python -m pytest -q -m gpu tests/test_pallas_kernels.py \
    -k "TestGemmGpu and scales_transposed" -p no:cacheprovider 2>&1 | tail -2
  timeout $(left 230) python -m pytest -q -m gpu tests/test_cublaslt.py -k "committed_triton_table" \
    -p no:cacheprovider 2>&1 | tail -2
  for spec in "64 4096 cublaslt 300" "64 4096 auto 370" "16 4096 cublaslt 440" "16 4096 auto 510"; do set -- $spec
    echo "== decode step all, $1 x $2, --fp8-gemm $3"
    timeout $(left $4) python experiments/profile_decode.py --preset qwen3_8b --batch $1 --context $2 \
      --lengths equal --modes all --fp8-gemm $3 --out "$OUT/profile_all_$1_$3.json"; echo "rc=$?"
  done
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep "passed\|failed\|rc=\|step_ms\|==" | cut -c1-200 | tail -30
python3 - "$OUT" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("profile_all_*.json")):
    r = json.loads(f.read_text())["runs"][0]
    print(f.name, round(r["step_ms"], 3), round(r["hbm_fraction"], 3),
          {k: round(v) for k, v in (r.get("trace") or {}).get("per_step_us_by_class", {}).items()})
PY
