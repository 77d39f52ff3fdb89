#!/usr/bin/env bash
# Next session, call 1 (nvidia-h200-x2; carry [".vllm-h200"]).
#   GPU 0: our W1 none and w8a8 under vLLM's KV budget per weight precision (--kv-gib-like-vllm: 101.74 GiB
#          beside BF16 weights, 107.52 beside FP8, the BF16 copy freed in w8a8 as vLLM holds none), then kv
#          and all if time is left (the FP8 KV modes hold W1 whole either way).
#          (overlap_host on, the default: compare wall - prefill_s - decode_s with session 7's 2.4-3.6 s)
#   GPU 1: the decode step by kernel with the 2-warp FP8 attention entry (profile_decode, 256 rows, context
#          <= 3072 as W1 reaches), then vLLM 0.26 W2 BF16 (its W2 numbers are from session 1).
source experiments/device/env.sh
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
(
  export CUDA_VISIBLE_DEVICES=0
  { echo "== W1 none w8a8"; timeout 400 python $R --workload W1 --modes none w8a8 --out "$OUT/rollout_W1_none_w8a8.json"
    echo "rc=$?"
    echo "== W1 kv all"; timeout $((585 - SECONDS)) python $R --workload W1 --modes kv all \
      --out "$OUT/rollout_W1_kv_all.json"; echo "rc=$?"
  } 2>&1 | filt > "$OUT/gpu0.log"
) &
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && (
  export CUDA_VISIBLE_DEVICES=1
  { echo "== decode profile"; timeout 200 python experiments/profile_decode.py --preset qwen3_8b --batch 256 \
      --context 3072 --modes none kv all --out "$OUT/decode_profile.json"; echo "rc=$?"
    bash .vllm-h200/install.sh >/dev/null && export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
    echo "== vLLM W2 bf16"; timeout $((580 - SECONDS)) python3 .vllm-h200/bench.py --configs bf16 --num-prompts 128 \
      --prompt-len 1024 --max-tokens 6144; echo "rc=$?"
  } 2>&1 | filt "Capturing CUDA graphs" > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT"/gpu*.log | grep -v '"partial"' | cut -c1-300 | tail -60
