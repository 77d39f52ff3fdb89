#!/usr/bin/env bash
# Session 13, call 1 (one H200): the MoE expert GEMM on wgmma. Offline sm_90 codegen (session 12) showed every FP8
# dot of our Pallas Triton kernels ran Triton's float16 mma.sync fallback (jax's lowering builds tt.dot without
# maxNumImpreciseAcc); `enable_fp8_wgmma` lets them run wgmma, and swap_ab configs put a decode tile's 16 token rows
# on the wgmma's N side. Session 2's grouped GEMM read the 30B experts at ~1 TB/s, ~29 of the 34.4 ms 30B decode step.
#   1. the grouped FP8 GEMM sweep at Qwen3-30B-A3B expert shapes (swap_ab configs included) -> tuning table;
#   2. its GPU tests (wgmma's reduced-precision accumulation against the float64 reference);
#   3. 30B W1 all with the table (session 9: 6614 tokens/s, 1.37x none's 4842).
source experiments/device/env.sh
{ echo "== A/B: the same sweep row on Triton's mma.sync fallback"; FP8RL_TRITON_FP8_MMAV2=1 timeout 70 python -m \
    pallas_kernels.fp8_grouped_gemm --tokens 256 --shapes gate_up --routing uniform --out "$OUT/grouped_gemm_mmav2.json"
  echo "== grouped GEMM sweep"; timeout 230 python -m pallas_kernels.fp8_grouped_gemm --tokens 64 256 2048 \
    --shapes gate_up down --budget-s 200 --out "$OUT/grouped_gemm.json" --tuning-out "$OUT/gg_tuning.json"
  echo "rc=$?"
  [ -f "$OUT/gg_tuning.json" ] && cp "$OUT/gg_tuning.json" pallas_kernels/fp8_grouped_gemm_tuning.json
  echo "== GPU tests"; timeout 120 python -m pytest -q -m gpu -x tests/test_fp8_grouped_gemm.py \
    tests/test_grouped_gemm_dense.py 2>&1 | tail -5
  echo "== 30B-A3B W1 all"; timeout $(left 560) python experiments/bench_rollout.py --preset qwen3_30b_a3b \
    --max-slots 256 --steps-per-call 16 --prefill-batch 4 --workload W1 --stall-dump-s 120 --kv-gib-like-vllm 60 87 \
    --modes all --out "$OUT/rollout_30b_W1_all.json"; echo "rc=$?"
} 2>&1 | filt > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"' | cut -c1-300 | tail -40
