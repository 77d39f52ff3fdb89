#!/usr/bin/env bash
# Session 10, call 3 (nvidia-h200-x2), after call 2 has run cuBLASLt's block-scaled FP8 GEMM on the GPU.
#   GPU 0: Qwen3-30B-A3B W1 all with the dense projections on cuBLASLt (session 9, Mosaic: 6614 tokens/s, none 4842),
#          then FP8 training of 8 Qwen3-8B layers with cuBLASLt fprop/dgrad/wgrad (session 4, Mosaic: 0.76x BF16's
#          step time).
#   GPU 1: the decode step by kernel with cuBLASLt: Qwen3-8B all at W1's shape (session 8 with Mosaic: linears
#          5.86 ms of 21.5), then Qwen3-30B-A3B all (34.4 ms at 256 rows, 39% of its roofline, session 9).
# Where the cuBLASLt probe fails, both GPUs run the same on Mosaic.
source experiments/device/env.sh
R="experiments/bench_rollout.py --max-slots 256 --steps-per-call 16 --prefill-batch 4"
G=mosaic
CUDA_VISIBLE_DEVICES=0 timeout 120 python experiments/device/cublaslt_probe.py && G=cublaslt
(
  export CUDA_VISIBLE_DEVICES=0
  { echo "== 30B-A3B W1 all ($G)"; timeout 330 python $R --preset qwen3_30b_a3b --workload W1 --stall-dump-s 120 \
      --kv-gib-like-vllm 60 87 --modes all --fp8-gemm $G --out "$OUT/rollout_30b_W1_all_$G.json"; echo "rc=$?"
    echo "== bench_train ($G)"; timeout $((540 - SECONDS)) python experiments/bench_train.py --preset qwen3_8b \
      --layers 8 --batch 8 --seq-len 2048 --fp8-gemm $G --out "$OUT/train_$G.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && (
  export CUDA_VISIBLE_DEVICES=1
  { echo "== profile 8B all ($G)"; timeout 200 python experiments/profile_decode.py --preset qwen3_8b --batch 256 \
      --context 2048 --modes all --fp8-gemm $G --out "$OUT/profile_8b_$G.json"; echo "rc=$?"
    echo "== profile 30B all ($G)"; timeout $((540 - SECONDS)) python experiments/profile_decode.py \
      --preset qwen3_30b_a3b --batch 256 --context 2048 --modes all --fp8-gemm $G --out "$OUT/profile_30b_$G.json"
    echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT"/gpu*.log | grep -v '"partial"' | cut -c1-300 | tail -60
