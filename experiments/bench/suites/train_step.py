"""Train-step time, BF16 vs end-to-end FP8 (``Fp8TrainPolicy``), on random weights built on the device.

The FP8-training target: step time <= 0.8x BF16. One jitted, donated
``train_step`` (the real one: PPO/GRPO loss with TIS, AdamW, float32 master weights) per
policy, on the same random batch of ``batch`` sequences of ``seq_len`` tokens; median of
``repeats`` steps after ``warmup`` (compile excluded). Also reports tokens/s, the peak device
memory when the backend exposes it, each step program's own peak from the compiler's buffer accounting
(the comparison of FP8 and BF16 memory: the allocator's peak lasts for the process) and the gradient
relative error of FP8 vs BF16 at step 0.

    python -m experiments.bench train_step --preset qwen3_8b --layers 4 --batch 8 --seq-len 2048
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.quant.policy import GemmBackend
from configs.models import PRESETS
from fp8rl_jax.models import DensePolicy, ModelConfig, init_params
from fp8rl_jax.quant.training import Fp8TrainPolicy, Fp8TrainRecipe
from fp8rl_jax.rl.memory import check_fits, device_bytes_limit, generator_weight_bytes
from fp8rl_jax.rl.trainer import (ComputeDtype, TrainBatch, TrainerConfig, compute_grads, init_train_state,
                                  make_optimizer, make_train_step)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    model: ModelConfig = dataclasses.replace(PRESETS["qwen3_8b"], num_layers=4)
    batch: int = 8
    seq_len: int = 2048
    micro_batches: int = 1
    remat: bool = True
    warmup: int = 2
    repeats: int = 5
    grad_check: bool = True
    seed: int = 0
    fp8_gemm: GemmBackend = GemmBackend.AUTO  # the FP8 run's GEMMs (Fp8TrainRecipe.gemm): Mosaic or cuBLASLt

    def __post_init__(self) -> None:
        if self.batch < 1 or self.seq_len < 2 or self.repeats < 1 or self.warmup < 1:
            raise ValueError("batch >= 1, seq_len >= 2, warmup >= 1 and repeats >= 1 are required")
        if self.batch % self.micro_batches:
            raise ValueError(f"micro_batches = {self.micro_batches} must divide batch = {self.batch}")


def _batch(cfg: BenchConfig) -> TrainBatch:
    rng = np.random.default_rng(cfg.seed)
    B, T = cfg.batch, cfg.seq_len
    tokens = rng.integers(2, cfg.model.vocab_size, (B, T)).astype(np.int32)
    mask = np.zeros((B, T), np.float32)
    mask[:, T // 4:] = 1.0  # a prompt quarter, then the response
    lp = -rng.exponential(1.0, (B, T)).astype(np.float32) * mask
    adv = rng.normal(size=(B, 1)).astype(np.float32) * mask
    return TrainBatch(tokens=jnp.asarray(tokens), loss_mask=jnp.asarray(mask), advantages=jnp.asarray(adv),
                      old_logprobs=jnp.asarray(lp), rollout_logprobs=jnp.asarray(lp + 0.01 * mask))


def _peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() if hasattr(jax.devices()[0], "memory_stats") else None
    return None if not stats else int(stats.get("peak_bytes_in_use", 0)) or None


def compiled_bytes(compiled) -> dict[str, int]:
    """The compiler's own buffer accounting of one program (``memory_analysis``): its temporaries, and its
    peak (arguments + outputs not aliased to them + temporaries). Per program, unlike the allocator's
    peak, which lasts for the process."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    temp, args, out, alias = (int(getattr(m, f"{k}_size_in_bytes")) for k in ("temp", "argument", "output", "alias"))
    return {"temp_bytes": temp, "program_peak_bytes": args + out - alias + temp}


def compile_step(cfg: BenchConfig, policy, batch: TrainBatch):
    """The donated train step of ``policy`` compiled from shapes alone (nothing allocated), and its program bytes."""
    tc = TrainerConfig(micro_batches=cfg.micro_batches, compute_dtype=ComputeDtype.BFLOAT16, remat=cfg.remat)
    opt = make_optimizer(tc.optimizer)
    state = jax.eval_shape(lambda: init_train_state(_params(cfg), opt, jax.random.key(cfg.seed)))
    step = make_train_step(cfg.model, policy, tc, opt).lower(state, batch).compile()
    program = compiled_bytes(step)
    print(f"{type(policy).__name__} step program: " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in program.items()),
          flush=True)
    return step, opt, program


def _params(cfg: BenchConfig):
    return init_params(cfg.model, jax.random.key(cfg.seed), jnp.float32)


def time_step(cfg: BenchConfig, step, opt, batch: TrainBatch) -> dict:
    """Median time of the compiled ``step`` on a train state built for it alone (the same random weights for
    every policy; the previous policy's state is gone)."""
    state = init_train_state(_params(cfg), opt, jax.random.key(cfg.seed))
    times = []
    for i in range(cfg.warmup + cfg.repeats):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m["loss"])
        if i >= cfg.warmup:
            times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    tokens = cfg.batch * cfg.seq_len
    return {"step_ms_median": ms, "step_ms_all": [t * 1e3 for t in times], "tokens_per_s": tokens / (ms / 1e3),
            "final_loss": float(m["loss"]), "peak_bytes": _peak_bytes()}


def check_memory(cfg: BenchConfig, limit: int | None = None) -> None:
    """Before anything is allocated: a ``ValueError`` (one line) when the float32 parameters, AdamW's two
    moments and one float32 gradient exceed ``limit`` bytes (default: the device's allocator limit; none on the
    CPU). Activations come on top."""
    limit = device_bytes_limit() if limit is None else limit
    params = generator_weight_bytes(cfg.model, False, jnp.float32)
    fix = "fewer --layers or a smaller --preset"
    check_fits({"float32 parameters": params, "AdamW moments": 2 * params, "float32 gradients": params}, limit,
               what=f"train_step ({cfg.model.num_layers} layers)",
               fixes={"float32 parameters": fix, "AdamW moments": fix, "float32 gradients": fix})


def measure(cfg: BenchConfig) -> dict:
    """Each policy's timed steps, then (``grad_check``) the gradients' agreement at the initial params: it holds
    both policies' float32 gradients at once, so it runs last, after the peaks were read."""
    check_memory(cfg)
    batch = _batch(cfg)
    policies = {"bf16": DensePolicy("bfloat16"),
                "fp8": Fp8TrainPolicy.for_model(cfg.model, "bfloat16", Fp8TrainRecipe(gemm=cfg.fp8_gemm))}
    results = {
        "fp8_gemm": cfg.fp8_gemm.describe(),  # the FP8 GEMMs: Mosaic, cuBLASLt or per shape (auto)
        "config": {k: (str(v) if isinstance(v, Path) else v.value if isinstance(v, GemmBackend) else v)
                   for k, v in dataclasses.asdict(cfg).items() if k != "model"},
        "model": dataclasses.asdict(cfg.model),
        "runs": {},
    }
    # Both programs compile before anything runs: their memory comparison stands even where a step cannot run.
    compiled = {name: compile_step(cfg, pol, batch) for name, pol in policies.items()}
    for name, (step, opt, program) in compiled.items():
        results["runs"][name] = dict(program)
    peaks = [results["runs"][k].get("program_peak_bytes") for k in ("fp8", "bf16")]
    if all(peaks):
        results["fp8_over_bf16_program_peak"] = peaks[0] / peaks[1]
    # peak_bytes is the process's peak so far: the later policy's includes the earlier
    for name, (step, opt, program) in compiled.items():
        results["runs"][name].update(time_step(cfg, step, opt, batch))
        print(name, json.dumps({k: v for k, v in results["runs"][name].items() if k != "step_ms_all"}), flush=True)
    del compiled
    if cfg.grad_check:  # gradient agreement at the initial params (same batch)
        tc = TrainerConfig(micro_batches=cfg.micro_batches, compute_dtype=ComputeDtype.BFLOAT16, remat=cfg.remat)
        params = _params(cfg)
        grads = {name: jax.jit(lambda p, b, pol=pol: compute_grads(p, b, model_config=cfg.model, policy=pol,
                                                                  trainer_config=tc)[0])(params, batch)
                 for name, pol in policies.items()}
        num = sum(float(jnp.sum((a - b) ** 2))
                  for a, b in zip(jax.tree.leaves(grads["fp8"]), jax.tree.leaves(grads["bf16"])))
        den = sum(float(jnp.sum(b**2)) for b in jax.tree.leaves(grads["bf16"]))
        results["grad_rel_err_fp8_vs_bf16"] = (num / max(den, 1e-30)) ** 0.5
        del grads, params
    results["fp8_over_bf16_step_time"] = results["runs"]["fp8"]["step_ms_median"] / results["runs"]["bf16"]["step_ms_median"]
    print(f"FP8 / BF16 step time: {results['fp8_over_bf16_step_time']:.2f}x (target <= 0.8x); "
          f"gradient relative error {results.get('grad_rel_err_fp8_vs_bf16', float('nan')):.3e}; program peak FP8 / BF16: "
          f"{results.get('fp8_over_bf16_program_peak', float('nan')):.2f}x (target <= 1)")
    return results


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3_8b")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (0: the preset's)")
    ap.add_argument("--batch", type=int, default=BenchConfig.batch)
    ap.add_argument("--seq-len", type=int, default=BenchConfig.seq_len)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--no-remat", action="store_true")
    ap.add_argument("--warmup", type=int, default=BenchConfig.warmup, help="untimed steps first (the compile)")
    ap.add_argument("--repeats", type=int, default=BenchConfig.repeats)
    ap.add_argument("--no-grad-check", action="store_true", help="skip the FP8-vs-BF16 gradient comparison")
    ap.add_argument("--fp8-gemm", choices=[b.value for b in GemmBackend], default="auto",
                    help="the FP8 run's GEMMs (Fp8TrainRecipe.gemm): our Mosaic kernel or cuBLASLt; auto: "
                         "FP8RL_FP8_GEMM, else the measured per-shape table, else mosaic")


def run(a: argparse.Namespace) -> dict:
    model = PRESETS[a.preset]
    if a.layers:
        model = dataclasses.replace(model, num_layers=a.layers)
    return measure(BenchConfig(model=model, batch=a.batch, seq_len=a.seq_len, micro_batches=a.micro_batches,
                               remat=not a.no_remat, warmup=a.warmup, repeats=a.repeats, grad_check=not a.no_grad_check,
                               fp8_gemm=GemmBackend(a.fp8_gemm)))


def result_name(a: argparse.Namespace) -> str:
    return "train_step" + ("" if a.preset == "qwen3_8b" else f"_{a.preset}")


SMOKE = ["--preset", "tiny_qwen3", "--layers", "1", "--batch", "2", "--seq-len", "16", "--warmup", "1",
         "--repeats", "1", "--no-remat"]
