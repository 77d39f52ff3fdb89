#!/usr/bin/env bash
# Session 23, call 3 (one H200; carry [".vllm-h200"]): the decode program now forces XLA's split-K off
# (compiler option xla_gpu_experimental_force_split_k=1; FP8RL_XLA_SPLIT_K=1 restores XLA's heuristic, which split the
# BF16 o_proj / down_proj / fused q/k/v at 256 rows into batched GEMMs + float32 reductions). The decode profile in
# modes kv and none both ways on one machine, then Qwen3-8B W1 in modes none, kv, all, w8a8 (one process) with
# whichever split-K setting gave the faster kv step. vLLM on W1 follows in call 4 on the same machine.
source experiments/device/env.sh
P="experiments/profile_decode.py --preset qwen3_8b --batch 256 --context 2048 --lengths equal --pages engine --no-trace"
R="experiments/bench_rollout.py --preset qwen3_8b --max-slots 256 --steps-per-call 16 --prefill-batch 4 --stall-dump-s 90 --kv-gib-like-vllm 101.74 107.52"
step() { python3 -c "import json,sys; print({r['mode']: round(r['step_ms'], 3) for r in json.load(open(sys.argv[1]))['runs']})" "$1"; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv
  echo "== profile, split-K forced off (the engine's default)"; timeout $(left 90) python $P --modes kv none --out "$OUT/profile_nosplit.json"
  echo "== profile, XLA's split-K heuristic"; FP8RL_XLA_SPLIT_K=1 timeout $(left 170) python $P --modes kv none --out "$OUT/profile_xla_splitk.json"
  echo "nosplit $(step $OUT/profile_nosplit.json)"; echo "xla_splitk $(step $OUT/profile_xla_splitk.json)"
  faster=$(python3 -c "import json,sys; s=lambda p: {r['mode']: r['step_ms'] for r in json.load(open(p))['runs']}; print(int(s(sys.argv[2]).get('kv', 1e9) < s(sys.argv[1]).get('kv', 0)))" "$OUT/profile_nosplit.json" "$OUT/profile_xla_splitk.json" 2>/dev/null || echo 0)
  echo "W1 with FP8RL_XLA_SPLIT_K=$faster"
  echo "== 8B W1 none kv all w8a8"; FP8RL_XLA_SPLIT_K=$faster timeout $(left 585) python $R --workload W1 --modes none kv all w8a8 \
    --out "$OUT/rollout_8b_W1.json"; echo "rc=$?"
} 2>&1 | filt "Capturing CUDA graphs" > "$OUT/run.log"
grep -v "^  \|^$" "$OUT/run.log" | grep -v '"partial"\|^\[[a-z0-9]*\]  ' | cut -c1-300 | tail -40
