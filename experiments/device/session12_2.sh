#!/usr/bin/env bash
# Session 12, call 2 (was session 11 call 3, not run) (nvidia-h200-x2 if lent; carry [".vllm-h200"]): same-session peers and the remaining shapes.
#   A: vLLM 0.26 W1 FP8 + FP8 KV (bench.py; its first FP8 start with DeepGEMM's JIT took ~360 s in session 7), the
#      peer of "our FP8 all >= 1.3x vLLM's" (session 10: ours 11840 against vLLM's 10960 from 2026-11-30).
#   B: the RL-shaped workload in mode all on cuBLASLt (session 9 on Mosaic: 7009, 1.40x none's 5009), then FP8
#      training of 8 Qwen3-8B layers with the FP8 GEMMs on cuBLASLt (session 4 on Mosaic: 0.772x BF16's step time).
# On one GPU only B runs.
source experiments/device/env.sh
R="experiments/bench_rollout.py --max-slots 256 --steps-per-call 16 --prefill-batch 4"
part_a() {
  { bash .vllm-h200/install.sh >/dev/null && export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
    echo "== vLLM W1 fp8_kv8"; timeout $(left $1) python3 .vllm-h200/bench.py --configs fp8_kv8 --num-prompts 256 \
      --prompt-len 1024 --max-tokens 2048; echo "rc=$?"
  } 2>&1 | filt "Capturing CUDA graphs" > "$OUT/a.log"
}
part_b() {
  { echo "== RL all"; timeout 330 python $R --preset qwen3_8b --workload RL --stall-dump-s 90 \
      --kv-gib-like-vllm 101.74 107.52 --modes all --out "$OUT/rollout_RL_all.json"; echo "rc=$?"
    echo "== bench_train (cuBLASLt)"; timeout $(left $1) python experiments/bench_train.py --preset qwen3_8b \
      --layers 8 --batch 8 --seq-len 2048 --fp8-gemm cublaslt --out "$OUT/train_cublaslt.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/b.log"
}
two_gpus_or 545 "part_b 545"
grep -v "^  \|^$" "$OUT"/*.log | grep -v '"partial"' | cut -c1-300 | tail -60
