#!/usr/bin/env bash
# Session 22, call 2 (one H200): after call 1, the BF16 linears' add + RMSNorm kernel (`act_quant.add_rms_norm`,
# DensePolicy.norm_kernels in the generator) and the paged attention's split combine as one kernel: the GPU tests of
# the changed kernels and of the engine decoding through them, the kernels' GPU time (`act_quant --kernels bnorm`,
# `kv_write` at 16 warps too), the FP8 / BF16 attention at other pages_per_split (equal rows at 2048 and 3072, W1's
# shape), and the Qwen3-8B decode profile (256 rows at 2048) in modes all and kv.
source experiments/device/env.sh
P="experiments/profile_decode.py --preset qwen3_8b --batch 256 --context 2048 --lengths equal --pages engine"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  GPU_WORKERS=4 SUITE_S=150 bash experiments/device/gpu_tests.sh tests/test_kv_write.py tests/test_act_quant.py
  echo "== attention + engine GPU tests"; timeout $(left 300) python -m pytest -q -m gpu tests/test_paged_attention.py \
    tests/test_prefill_attention.py -k "engine or combine" -p no:cacheprovider -rfE 2>&1 | grep -v "^SKIPPED\|^$" | tail -8
  echo "== bnorm"; timeout $(left 340) python -m pallas_kernels.act_quant --kernels bnorm --m 256 4096 --sweep \
    --out "$OUT/act_quant_bnorm.json" 2>&1 | grep -v "^  "
  echo "== kv_write"; timeout $(left 370) python -m pallas_kernels.kv_write --rows 256 --warps 8 16 \
    --out "$OUT/kv_write_qkv.json"
  echo "== attention splits"; timeout $(left 440) python -m pallas_kernels.paged_attention --table-only --equal \
    --batch 256 --context 2048 3072 --dtypes float8_e4m3fn --pages-per-split 64 128 256 1048576 --out "$OUT/pa_splits.json" 2>&1 | grep -v "^ *jnp reference"
  echo "== profile"; timeout $(left 580) python $P --modes all kv --out "$OUT/profile.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^    \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -60
