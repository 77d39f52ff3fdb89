#!/usr/bin/env bash
# Next session, call 3 (nvidia-h200-x2; carry [".vllm-h200"]): where our BF16 loses to vLLM on W2, and same-session peers.
#   GPU 0: the BF16 decode step by kernel at W2's shape (104 rows x 4k context: our W2 BF16 step 25.7 ms, 72% of the
#          roofline, over ~7,500 steps; vLLM's W2 BF16 wall implies ~22 ms over a similar number of steps, since its
#          KV pool is the same 740,896 tokens and it preempts the same way), with fused projections on and off;
#          then our W2 none and all.
#   GPU 1: vLLM 0.26 W1 FP8 + FP8 KV (bench.py; its first FP8 start, DeepGEMM's JIT included, took ~360 s in
#          session 7, so it gets the call), the peer of the "FP8-all >= 1.3x vLLM" target in the same session.
source experiments/device/env.sh
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
(
  export CUDA_VISIBLE_DEVICES=0
  { echo "== profile W2 shape"; timeout 150 python experiments/profile_decode.py --preset qwen3_8b --batch 104 --context 4096 \
      --modes none --out "$OUT/profile_w2_none.json"; echo "rc=$?"
    timeout 100 python experiments/profile_decode.py --preset qwen3_8b --batch 104 --context 4096 --modes none \
      --fuse-projections on --no-trace --out "$OUT/profile_w2_none_fused.json"; echo "rc=$?"
    echo "== W2 none all"; timeout $((540 - SECONDS)) python $R --workload W2 --modes none all --out "$OUT/rollout_W2.json"
    echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && (
  export CUDA_VISIBLE_DEVICES=1
  { bash .vllm-h200/install.sh >/dev/null && export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
    echo "== vLLM W1 fp8_kv8"; timeout $((540 - SECONDS)) python3 .vllm-h200/bench.py --configs fp8_kv8 --num-prompts 256 \
      --prompt-len 1024 --max-tokens 2048; echo "rc=$?"
  } 2>&1 | filt "Capturing CUDA graphs" > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT"/gpu*.log | grep -v '"partial"' | cut -c1-300 | tail -60
