"""Scale-out on one host: TP generator, FSDP train step and the sync between them, 1 vs 2 devices.

The tensor-parallel generator, the FSDP train step and the resharding between them, on 1 vs 2
devices of one host.

Random weights of the chosen shape are built on the devices (no download). Three numbers, each
the median of ``repeats`` after a warm-up (compile excluded):

1. generator: ``JaxEngine`` tokens/s on device 0 alone vs ``JaxEngine(mesh=tensor x 2)`` on
   devices 0-1 (same workload, same per-device KV budget; scaling efficiency = tp2 / (2 x tp1));
2. trainer: the jitted train step (DAPO loss + TIS, AdamW, float32 masters) on device 0 vs FSDP
   over devices 0-1 (``make_sharded_train_step``), same global batch;
3. weight sync: the FSDP-sharded trainer params -> the TP generator (``update_weights``: reshard,
   then FP8 re-quantization of each shard where it lives), as ``JaxEngine.last_sync`` times it.

    python -m experiments.bench scaling --preset qwen3_8b --train-layers 8   # 2 GPUs
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m experiments.bench scaling --preset tiny_qwen3 --tiny

The full Qwen3-8B trainer state (float32 masters + Adam, 131 GB) does not fit one H200, so the
train-step comparison uses ``--train-layers`` decoder layers (the generator always the full model).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from configs.models import PRESETS
from fp8rl_jax.models import DensePolicy, Fp8Mode, ModelConfig, init_params
from fp8rl_jax.parallel import MeshConfig, ShardingPreset, make_mesh
from fp8rl_jax.rl.sharded import make_sharded_train_step, shard_train_state
from fp8rl_jax.rl.trainer import (ComputeDtype, TrainBatch, TrainerConfig, init_train_state,
                                  make_optimizer, make_train_step)
from fp8rl_jax.rollout.engine import EngineConfig, JaxEngine
from fp8rl_jax.rollout.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True)
class ScalingConfig:
    model: ModelConfig = PRESETS["qwen3_8b"]
    train_layers: int = 8
    precision: Fp8Mode = Fp8Mode.ALL
    prompts: int = 128
    prompt_len: int = 1024
    max_new: int = 1024
    kv_gib: float = 40.0  # per device
    max_slots: int = 128
    steps_per_call: int = 16
    prefill_batch: int = 4
    train_batch: int = 8
    train_seq: int = 2048
    micro_batches: int = 1
    repeats: int = 3
    dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.prompts, self.prompt_len, self.max_new, self.train_batch, self.repeats) < 1 or self.train_seq < 2:
            raise ValueError("sizes and repeats must be >= 1 (train_seq >= 2)")
        if self.train_batch % (2 * self.micro_batches):
            raise ValueError("train_batch must split over 2 devices and micro_batches")


def _median_s(fn, repeats: int) -> tuple[float, list[float]]:
    fn()  # warm-up: compiles
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def bench_generator(cfg: ScalingConfig, params, devices) -> dict:
    rng = np.random.default_rng(cfg.seed)
    prompts = rng.integers(2, cfg.model.vocab_size, (cfg.prompts, cfg.prompt_len)).tolist()
    sampling = [SamplingConfig(temperature=1.0, max_tokens=cfg.max_new, ignore_eos=True, seed=cfg.seed + i)
                for i in range(cfg.prompts)]
    ec = EngineConfig(max_slots=cfg.max_slots, page_size=16, kv_budget_gib=cfg.kv_gib,
                      max_seq_len=cfg.prompt_len + cfg.max_new, steps_per_call=cfg.steps_per_call,
                      prefill_batch=cfg.prefill_batch, precision=cfg.precision, dtype=cfg.dtype)
    out = {}
    for name, n in (("tp1", 1), ("tp2", 2)):
        gc.collect()
        mesh = None if n == 1 else make_mesh(MeshConfig(tensor=2), devices[:2])
        local = jax.device_put(params, devices[0]) if n == 1 else params
        engine = JaxEngine(cfg.model, local, ec, mesh=mesh)
        generated = cfg.prompts * cfg.max_new
        last = {}

        def gen(e=engine, last=last):
            last["batch"] = e.generate(prompts, sampling)

        med, times = _median_s(gen, cfg.repeats)
        out[name] = {"tokens_per_s": generated / med, "wall_s": times, "preemptions": int(last["batch"].preemptions),
                     "kv_pages": engine.num_pages, "sequences_that_fit": engine.sequences_that_fit}
        del engine, local
    out["tp2_over_tp1"] = out["tp2"]["tokens_per_s"] / out["tp1"]["tokens_per_s"]
    out["scaling_efficiency"] = out["tp2_over_tp1"] / 2
    return out


def _train_batch(cfg: ScalingConfig, model: ModelConfig) -> TrainBatch:
    rng = np.random.default_rng(cfg.seed)
    B, T = cfg.train_batch, cfg.train_seq
    tokens = rng.integers(2, model.vocab_size, (B, T)).astype(np.int32)
    mask = np.zeros((B, T), np.float32)
    mask[:, T // 4:] = 1.0
    lp = (-rng.exponential(1.0, (B, T)) * mask).astype(np.float32)
    adv = (rng.normal(size=(B, 1)) * mask).astype(np.float32)
    return TrainBatch(tokens=jnp.asarray(tokens), loss_mask=jnp.asarray(mask), advantages=jnp.asarray(adv),
                      old_logprobs=jnp.asarray(lp), rollout_logprobs=jnp.asarray(lp + 0.01 * mask))


def bench_trainer_and_sync(cfg: ScalingConfig, devices) -> dict:
    model = dataclasses.replace(cfg.model, num_layers=cfg.train_layers)
    tc = TrainerConfig(micro_batches=cfg.micro_batches, compute_dtype=ComputeDtype(cfg.dtype), remat=True)
    opt = make_optimizer(tc.optimizer)
    policy = DensePolicy(cfg.dtype)
    batch = _train_batch(cfg, model)
    params = init_params(model, jax.random.key(cfg.seed), jnp.float32)  # on device 0
    out = {}
    step1 = make_train_step(model, policy, tc, opt)
    holder = {"s": init_train_state(params, opt, jax.random.key(1))}

    def run1():
        holder["s"], m = step1(holder["s"], batch)
        jax.block_until_ready(m["loss"])

    med, times = _median_s(run1, cfg.repeats)
    out["train_1dev"] = {"step_s": med, "all_s": times}
    state = jax.device_get(holder.pop("s"))
    gc.collect()
    mesh = make_mesh(MeshConfig(fsdp=2), devices[:2])
    step2 = make_sharded_train_step(model, policy, tc, opt, mesh, ShardingPreset.FSDP)
    holder["s"] = shard_train_state(state, mesh, ShardingPreset.FSDP, config=model)
    del state

    def run2():
        holder["s"], m = step2(holder["s"], batch)
        jax.block_until_ready(m["loss"])

    med2, times2 = _median_s(run2, cfg.repeats)
    out["train_fsdp2"] = {"step_s": med2, "all_s": times2}
    out["train_speedup"] = out["train_1dev"]["step_s"] / med2
    out["train_scaling_efficiency"] = out["train_speedup"] / 2
    # the RL loop's sync: FSDP trainer params (cast to the compute dtype) -> the TP generator
    ec = EngineConfig(max_slots=8, page_size=16, num_pages=64, max_seq_len=1024, precision=cfg.precision,
                      dtype=cfg.dtype)
    gen_mesh = make_mesh(MeshConfig(tensor=2), devices[:2])
    cast = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(cfg.dtype), p))
    engine = JaxEngine(model, cast(holder["s"].params), ec, mesh=gen_mesh)
    syncs = []
    for _ in range(cfg.repeats + 1):
        engine.update_weights(jax.block_until_ready(cast(holder["s"].params)))
        syncs.append(dict(engine.last_sync))
    syncs = syncs[1:]
    out["sync_fsdp2_to_tp2"] = {k: statistics.median(s[k] for s in syncs) * 1e3 for k in syncs[0]}
    out["sync_fsdp2_to_tp2"] = {f"{k[:-2]}_ms": v for k, v in out["sync_fsdp2_to_tp2"].items()}
    return out


def measure(cfg: ScalingConfig) -> dict:
    """The generator, trainer and sync comparisons; ValueError without 2 devices."""
    devices = jax.devices()
    if len(devices) < 2:
        raise ValueError("scaling needs 2 devices (on the CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    results = {"config": {k: (str(v) if isinstance(v, (Path, Fp8Mode)) else v)
                          for k, v in dataclasses.asdict(cfg).items() if k != "model"},
               "model": dataclasses.asdict(cfg.model)}
    params = init_params(cfg.model, jax.random.key(cfg.seed), jnp.dtype(cfg.dtype))  # device 0
    results["generator"] = bench_generator(cfg, params, devices)
    del params
    gc.collect()
    print("generator", json.dumps(results["generator"]), flush=True)
    results.update(bench_trainer_and_sync(cfg, devices))
    print("trainer", json.dumps({k: v for k, v in results.items() if k.startswith(("train", "sync"))}), flush=True)
    g = results["generator"]
    print(f"\ngenerator: TP1 {g['tp1']['tokens_per_s']:.0f} tok/s, TP2 {g['tp2']['tokens_per_s']:.0f} tok/s "
          f"(efficiency {g['scaling_efficiency']:.0%}); train step: 1 device {results['train_1dev']['step_s']:.3f} s, "
          f"FSDP 2 {results['train_fsdp2']['step_s']:.3f} s (efficiency {results['train_scaling_efficiency']:.0%}); "
          f"sync FSDP2 -> TP2: {results['sync_fsdp2_to_tp2']}")
    return results


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3_8b")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers of the generator's model (0: the preset's)")
    ap.add_argument("--train-layers", type=int, default=ScalingConfig.train_layers)
    ap.add_argument("--precision", choices=[m.value for m in Fp8Mode], default=ScalingConfig.precision.value)
    for name in ("prompts", "prompt_len", "max_new", "max_slots", "train_batch", "train_seq", "repeats"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(ScalingConfig, name))
    ap.add_argument("--kv-gib", type=float, default=ScalingConfig.kv_gib)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke sizes (float32, a few tokens)")


def config(a: argparse.Namespace) -> ScalingConfig:
    model = PRESETS[a.preset]
    if a.layers:
        model = dataclasses.replace(model, num_layers=a.layers)
    cfg = ScalingConfig(model=model, train_layers=a.train_layers, precision=Fp8Mode(a.precision),
                        prompts=a.prompts, prompt_len=a.prompt_len, max_new=a.max_new, kv_gib=a.kv_gib,
                        max_slots=a.max_slots, train_batch=a.train_batch, train_seq=a.train_seq, repeats=a.repeats)
    if a.tiny:
        cfg = dataclasses.replace(cfg, train_layers=1, precision=Fp8Mode.NONE, prompts=4, prompt_len=8, max_new=6,
                                  kv_gib=0.01, max_slots=4, steps_per_call=2, prefill_batch=2, train_batch=2,
                                  train_seq=16, repeats=1, dtype="float32")
    return cfg


def run(a: argparse.Namespace) -> dict:
    return measure(config(a))


def result_name(a: argparse.Namespace) -> str:
    return f"scaling_{a.preset}"


SMOKE = ["--preset", "tiny_qwen3", "--layers", "1", "--tiny"]
SMOKE_DEVICES = 2  # the smoke run needs this many (CPU) devices: a child process with that device count
