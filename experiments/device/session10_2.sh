#!/usr/bin/env bash
# Next session, call 2 (nvidia-h200-x2), after call 1 has shown cuBLASLt's GEMM correct on the GPU.
#   GPU 0: FP8 training through cuBLASLt: bench_train on 8 Qwen3-8B layers (session 4 with the Mosaic kernel and BF16
#          wgrad: FP8 0.76x BF16's step time), with --fp8-gemm cublaslt (fprop/dgrad block-scaled, wgrad 1Dx1D
#          where cuBLASLt has it), then the cuBLASLt 1Dx1D GPU test result is in call 1's log.
#   GPU 1: the decode step by kernel: Qwen3-30B-A3B all (34.4 ms at 256 rows, 39% of its roofline, session 9), then
#          Qwen3-8B all with cuBLASLt at W1's shape (session 8 with Mosaic: linears 5.86 ms of 21.5).
source experiments/device/env.sh
(
  export CUDA_VISIBLE_DEVICES=0
  { echo "== bench_train (Mosaic)"; timeout 250 python experiments/bench_train.py --preset qwen3_8b --layers 8 --batch 8 \
      --seq-len 2048 --out "$OUT/train_mosaic.json"; echo "rc=$?"
    echo "== bench_train (cuBLASLt)"; timeout $((540 - SECONDS)) python experiments/bench_train.py \
      --preset qwen3_8b --layers 8 --batch 8 --seq-len 2048 --fp8-gemm cublaslt --out "$OUT/train_cublaslt.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && (
  export CUDA_VISIBLE_DEVICES=1
  { echo "== profile 30B all"; timeout 250 python experiments/profile_decode.py --preset qwen3_30b_a3b --batch 256 \
      --context 2048 --modes all --out "$OUT/profile_30b.json"; echo "rc=$?"
    echo "== profile 8B all cuBLASLt"; timeout $((540 - SECONDS)) python experiments/profile_decode.py --preset qwen3_8b \
      --batch 256 --context 2048 --modes all --fp8-gemm cublaslt --out "$OUT/profile_8b_cublaslt.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT"/gpu*.log | grep -v '"partial"' | cut -c1-300 | tail -60
