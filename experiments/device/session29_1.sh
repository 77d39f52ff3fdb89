#!/usr/bin/env bash
# Prepared in session 28 for the next device session (one H200). (1) The Triton GEMM's GPU tests, the new swap_ab
# cases over several 128-row scale blocks among them. (2) Those sub-tiled configs (256 weight rows a program, A loaded
# once a step for both blocks: half the activation bytes a program re-reads from L2 of 128-row tiles) against cuBLASLt
# at 64, 128 and 256 rows. Session 28: Triton won q/k/v, o_proj and gate/up at 64 rows only, its time growing with the
# rows as its L2 reads do; cuBLASLt kept 128 and 256. The winners merge into a copy of the committed table
# ($OUT/fp8_gemm_triton.json: commit it, adding its new configs to DECODE_CONFIGS, where a shape changed). (3) The
# decode step at 64 rows, cuBLASLt against AUTO with the committed table (q/k/v, o_proj, gate/up on Triton;
# session 28 timed only the o_proj entry end to end).
source experiments/device/env.sh
cp fp8rl_jax/quant/fp8_gemm_triton.json "$OUT/fp8_gemm_triton.json"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  echo "== Triton GEMM GPU tests"; timeout $(left 140) python -m pytest -q -x -m gpu tests/test_pallas_kernels.py \
    -k "TestGemmGpu and (vs_reference or zero_scale)" -p no:cacheprovider 2>&1 | tail -3
  timeout $(left 170) python -m pytest -q -m gpu tests/test_cublaslt.py -k "committed_triton_table" -p no:cacheprovider \
    2>&1 | tail -2
  # configs (all swap_ab + prefetch) chosen offline (session 28: Triton 3.6 sm_90 codegen for registers, spills and
  # shared memory, hence CTAs per SM): one wave of programs or less on 132 SMs at the large shapes, and fewer
  # activation bytes re-read from L2 per weight byte (128- and 256-row weight tiles); each M's best so far first
  for spec in "64 270 64,64,4,4,1 64,64,4,4,4 64,64,4,3,1 64,64,4,3,4 64,128,4,3,1 64,128,8,3,1 64,128,8,3,4 64,256,8,3,1 64,256,8,3,8" \
              "128 385 128,64,4,4,2 128,64,4,3,1 128,64,4,3,4 128,256,8,2,1 128,256,8,3,1 128,256,8,2,8" \
              "256 490 128,64,4,4,2 128,64,4,3,1 128,256,8,2,1 128,256,8,2,2 128,256,8,2,8"; do
    set -- $spec; m=$1 until=$2; shift 2
    echo "== decode GEMMs, $m rows"; timeout $(left $until) python experiments/bench_decode_gemms.py \
      --preset qwen3_8b --m $m --shapes qkv o_proj gate_up down_proj --splits 2 --triton --out "$OUT/decode_gemms_m$m.json" \
      --triton-table-out "$OUT/fp8_gemm_triton.json" --triton-configs $(printf '%s,swap,prefetch ' "$@")
    echo "rc=$?"
  done
  for gemm in cublaslt auto; do
    echo "== decode step all, 64 x 4096, --fp8-gemm $gemm"
    timeout $(left 590) python experiments/profile_decode.py --preset qwen3_8b --batch 64 --context 4096 \
      --lengths equal --modes all --fp8-gemm $gemm --out "$OUT/profile_all_64_$gemm.json"; echo "rc=$?"
  done
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep "passed\|failed\|fp8_cublaslt\|fp8_triton\|rc=\|^M<=\|step_ms" | cut -c1-150 | tail -80
