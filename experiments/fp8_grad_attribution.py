"""Where the gradient error of end-to-end FP8 training comes from, projection by projection.

``bench_train.py`` reports the relative error of the FP8 train step's gradient against BF16's
(0.63 over 8 random Qwen3-8B layers on the H200). This script takes that number apart on the CPU:
on one random batch of the benchmark's RL loss (PPO/GRPO with TIS, the real ``compute_grads``), the
gradient of every parameter under

    bf16            DensePolicy("bfloat16")            (the floor: BF16 rounding alone)
    fp8             Fp8TrainPolicy (every default FP8 projection, E4M3, 128x128 blocks)
    fp8_on_policy   fp8 with old/rollout logprobs set to the policy's own (ratio 1: no PPO-ratio
                    amplification; the benchmark's batch holds random old logprobs)
    only_<proj>     FP8 on that one projection kind, BF16 elsewhere
    e5m2_grads      fp8 with E5M2 output gradients
    blocks_32       fp8 with 32x32 weight blocks and 1x32 activation groups

is compared with float32 (``DensePolicy("float32")``, float32 compute) as
``||g - g_f32|| / ||g_f32||`` over all parameters. If the error of ``fp8`` is about the root sum
of squares of the ``only_<proj>`` errors, and neither finer blocks nor the gradient format move it,
it is E4M3's 3-bit mantissa rounding accumulated over every FP8 matmul (forward, dgrad, wgrad),
not a defect of scaling or layout.

    python experiments/fp8_grad_attribution.py --preset qwen3_1_7b --layers 2 --batch 2 --seq-len 256 \\
        --out experiments/results/fp8_grad_attribution_cpu.json
    python experiments/fp8_grad_attribution.py --preset tiny_qwen3 --batch 2 --seq-len 32   # smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train import BenchConfig, _batch  # noqa: E402
from configs.models import PRESETS  # noqa: E402
from fp8rl_jax.environment import run_environment  # noqa: E402
from fp8rl_jax.models import DensePolicy, init_params  # noqa: E402
from fp8rl_jax.numerics.fp8 import Fp8Format  # noqa: E402
from fp8rl_jax.quant.policy import FP8_PROJS, LayerPolicy  # noqa: E402
from fp8rl_jax.quant.training import Fp8TrainPolicy, Fp8TrainRecipe  # noqa: E402
from fp8rl_jax.rl.trainer import ComputeDtype, TrainerConfig, compute_grads, trainer_logprobs  # noqa: E402


def _grads(params, batch, model, policy, compute: ComputeDtype) -> list[np.ndarray]:
    tc = TrainerConfig(compute_dtype=compute, remat=False)
    g = jax.jit(lambda p, b: compute_grads(p, b, model_config=model, policy=policy, trainer_config=tc)[0])(params, batch)
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(g)]


def _on_policy(params, batch, model, policy, compute: ComputeDtype):
    """The batch with old and rollout logprobs set to ``policy``'s own (ratio 1, no TIS weight)."""
    tc = TrainerConfig(compute_dtype=compute, remat=False)
    lp = trainer_logprobs(params, batch.tokens, model_config=model, policy=policy, trainer_config=tc)
    lp = lp * batch.loss_mask
    return dataclasses.replace(batch, old_logprobs=lp, rollout_logprobs=lp)


def rel_err(g, ref) -> float:
    return float(np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(g, ref)) / sum(np.sum(b**2) for b in ref)))


def arms(model) -> dict:
    """name -> (policy, compute dtype, on-policy batch?)"""
    bf16 = ComputeDtype.BFLOAT16
    out = {"bf16": (DensePolicy("bfloat16"), bf16, False),
           "fp8": (Fp8TrainPolicy.for_model(model, "bfloat16"), bf16, False),
           "fp8_on_policy": (Fp8TrainPolicy.for_model(model, "bfloat16"), bf16, True)}
    projs = sorted(FP8_PROJS, key=lambda p: p.value)
    if not model.num_experts:
        projs = [p for p in projs if not p.value.startswith("experts.")]
    for p in projs:
        out[f"only_{p.value}"] = (Fp8TrainPolicy.for_model(model, "bfloat16", layer_policy=LayerPolicy(
            projs=frozenset({p}))), bf16, False)
    out["e5m2_grads"] = (Fp8TrainPolicy.for_model(model, "bfloat16", recipe=Fp8TrainRecipe(
        grad_format=Fp8Format.E5M2)), bf16, False)
    rec32 = Fp8TrainRecipe(block_size=(32, 32), token_group=32)
    out["blocks_32"] = (Fp8TrainPolicy.for_model(model, "bfloat16", recipe=rec32,
                                                 layer_policy=LayerPolicy(block_size=(32, 32))), bf16, False)
    return out


def main(argv: list[str] | None = None) -> dict:
    """Runs the arms (all, or ``--arms``) and returns (and writes) each one's error vs float32."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3_1_7b")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (0: the preset's)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", default=None, help="comma-separated subset of the arms (default: all)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path; a markdown table is written next to it")
    a = ap.parse_args(argv)
    model = PRESETS[a.preset]
    if a.layers:
        model = dataclasses.replace(model, num_layers=a.layers)
    cfg = BenchConfig(model=model, batch=a.batch, seq_len=a.seq_len, seed=a.seed)
    params = init_params(model, jax.random.key(a.seed), jnp.float32)
    batch = _batch(cfg)
    f32 = DensePolicy("float32"), ComputeDtype.FLOAT32
    ref = _grads(params, batch, model, *f32)
    ref_on = _grads(params, _on_policy(params, batch, model, *f32), model, *f32)
    errs, todo = {}, arms(model)
    if a.arms:
        names = a.arms.split(",")
        unknown = sorted(set(names) - set(todo))
        if unknown:
            raise SystemExit(f"unknown arms {unknown}; choose from {sorted(todo)}")
        todo = {k: todo[k] for k in names}
    for name, (policy, compute, on_policy) in todo.items():
        t0 = time.perf_counter()
        b = _on_policy(params, batch, model, policy, compute) if on_policy else batch
        errs[name] = rel_err(_grads(params, b, model, policy, compute), ref_on if on_policy else ref)
        print(f"{name:22s} gradient relative error vs float32: {errs[name]:.4f} ({time.perf_counter() - t0:.1f} s)",
              flush=True)
    only = [v for k, v in errs.items() if k.startswith("only_")]
    floor = errs.get("bf16", 0.0)
    rss = float(np.sqrt(sum(max(v**2 - floor**2, 0.0) for v in only) + floor**2))
    print(f"root sum of squares of the single-projection errors (BF16 floor counted once): {rss:.4f}; "
          f"all FP8 projections together: {errs.get('fp8', float('nan')):.4f}")
    result = {"environment": run_environment(), "model": dataclasses.asdict(model),
              "args": {k: str(v) for k, v in vars(a).items()}, "rel_err_vs_float32": errs,
              "rss_of_single_projection_errors": rss}
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
        rows = "\n".join(f"| {k} | {v:.4f} |" for k, v in errs.items())
        a.out.with_suffix(".md").write_text(
            f"# FP8 training gradient error by projection ({a.preset}, {model.num_layers} layers, batch {a.batch} x "
            f"{a.seq_len}, {result['environment'].get('device', 'cpu')})\n\n`python experiments/fp8_grad_attribution.py "
            f"--preset {a.preset} --layers {model.num_layers} --batch {a.batch} --seq-len {a.seq_len}`\n\n"
            f"| arm | gradient relative error vs float32 |\n|---|---|\n{rows}\n\nRoot sum of squares of the single-"
            f"projection errors (BF16 floor counted once): {rss:.4f}.\n")
    return result


if __name__ == "__main__":
    main()
