#!/usr/bin/env bash
# Session 8, call 2 (nvidia-h200-x2; carry [".vllm-h200"]): the vLLM backend live (issue 8).
#   GPU 0: experiments/vllm_live_check.py --phase small (agreement with our engine, logprobs, update
#          effect, KV scales) then --phase sync8b (Qwen3-8B-shaped update_weights time), then the GPU test.
#   GPU 1: bench_rollout --backend vllm, mode all (our FP8 checkpoint + FP8 KV), W1 then W2 on one engine.
source experiments/device/env.sh
bash .vllm-h200/install.sh > "$OUT/install.log" 2>&1; echo "install rc=$?"
export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
(
  export CUDA_VISIBLE_DEVICES=0
  { echo "== live small"; timeout 240 python experiments/vllm_live_check.py --phase small --out "$OUT/vllm_live_small.json"
    echo "rc=$?"
    echo "== live sync8b"; timeout $((560 - SECONDS)) python experiments/vllm_live_check.py --phase sync8b \
      --out "$OUT/vllm_live_sync8b.json"; echo "rc=$?"
  } 2>&1 | filt "Capturing CUDA graphs" > "$OUT/gpu0.log"
) &
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && (
  export CUDA_VISIBLE_DEVICES=1
  { echo "== backend vllm all W1 W2"; timeout 570 python experiments/bench_rollout.py --backend vllm --preset qwen3_8b \
      --workload W1 --also-workloads W2 --modes all --sync-repeats 3 --out "$OUT/rollout_vllm_backend_all.json"
    echo "rc=$?"
  } 2>&1 | filt "Capturing CUDA graphs" > "$OUT/gpu1.log"
) &
wait
grep -v "^  \|^$" "$OUT"/gpu*.log | grep -v '"partial"' | grep -v "^.*INFO .*\(default_loader\|weight_utils\|gpu_model_runner.py:\(4\|5\)\)" | cut -c1-400 | tail -80
