#!/usr/bin/env bash
# Next session, call 2 (nvidia-h200-x2 or nvidia-h200; carry [".vllm-h200"]), after session7_1.sh (copy any
# table change it justified into pallas_kernels/ first: a call gets this checkout's files).
#   GPU 0: vLLM 0.26 W1 FP8 W8A8 + FP8 KV alone (its first FP8 start, DeepGEMM JIT and CUDA-graph capture,
#          took > 270 s in session 6, so it gets the whole call; bench.py stops itself before 540 s).
#   GPU 1 (x2 only): our W2 (128 x 1024 -> 6144) FP8 all, then the live vLLM backend test if time is left.
source experiments/device/env.sh
R="experiments/bench_rollout.py --preset qwen3_8b --kv-fraction 0.8 --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 60"
(
  export CUDA_VISIBLE_DEVICES=0
  {
    bash .vllm-h200/install.sh >/dev/null && export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
    echo "== vLLM W1 fp8_kv8"; timeout 570 python3 .vllm-h200/bench.py --configs fp8_kv8 --num-prompts 256 \
      --prompt-len 1024 --max-tokens 2048; echo "rc=$?"
  } 2>&1 | filt "Capturing CUDA graphs" > "$OUT/gpu0.log"
) &
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && (
  export CUDA_VISIBLE_DEVICES=1
  {
    echo "== W2 all"; timeout 300 python $R --workload W2 --modes all --out "$OUT/rollout_W2_all.json"; echo "rc=$?"
    (bash .vllm-h200/install.sh >/dev/null && PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 \
      timeout 240 python -m pytest -q -m gpu tests/test_vllm_backend.py -p no:cacheprovider 2>&1 | tail -15)
  } 2>&1 | filt "Capturing CUDA graphs" > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT"/gpu*.log | cut -c1-400 | tail -50
