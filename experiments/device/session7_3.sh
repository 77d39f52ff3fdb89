#!/usr/bin/env bash
# Session 7, call 3 (nvidia-h200-x2; carry [".vllm-h200"]).
#   GPU 0: vLLM 0.26 W1 FP8 W8A8 + FP8 KV alone (its first FP8 start, DeepGEMM JIT and CUDA-graph capture,
#          took > 270 s in session 6, so it gets the whole call; bench.py stops itself before 540 s).
#   GPU 1: our W1 kv, then all, with the 2-warp word-gather FP8 attention config (64.4% of the copy
#          ceiling in session 6's sweep, against 44.9% for the table's 4-warp entry) through
#          FP8RL_PAGED_ATTENTION_TUNING: does it hold at W1 scale (sessions 5-6 stalled on one-warp configs)?
#          (As run; that candidate table became the FP8 entry of pallas_kernels/paged_attention_tuning.json
#          in 6ba88c7 and was removed, so a rerun drops the variable.)
source experiments/device/env.sh
W1="experiments/bench_rollout.py --preset qwen3_8b --workload W1 --kv-fraction 0.8 --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90"
(
  export CUDA_VISIBLE_DEVICES=0
  {
    bash .vllm-h200/install.sh >/dev/null && export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
    echo "== vLLM W1 fp8_kv8"; timeout 570 python3 .vllm-h200/bench.py --configs fp8_kv8 --num-prompts 256 \
      --prompt-len 1024 --max-tokens 2048; echo "rc=$?"
  } 2>&1 | filt "Capturing CUDA graphs" > "$OUT/gpu0.log"
) &
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && (
  export CUDA_VISIBLE_DEVICES=1 FP8RL_PAGED_ATTENTION_TUNING=experiments/device/paged_attention_tuning_fp8_w2.json
  {
    echo "== W1 kv (w2 words)"; timeout 280 python $W1 --modes kv --out "$OUT/rollout_W1_kv_w2words.json"; rc=$?; echo "rc=$rc"
    [ $rc = 0 ] && { echo "== W1 all (w2 words)"; timeout $((580 - SECONDS)) python $W1 --modes all \
      --out "$OUT/rollout_W1_all_w2words.json"; echo "rc=$?"; }
  } 2>&1 | filt > "$OUT/gpu1.log"
) &
wait

grep -v "^  \|^$" "$OUT"/gpu*.log | cut -c1-300 | tail -50
