"""The weight sync alone: ``JaxEngine.update_weights`` from a BF16 trainer copy, per precision mode.

An engine is built asleep (no KV pool) on random weights of the preset; one sync compiles, then
``--sync-repeats`` syncs are timed (wall clock to the new params' readiness) and the median is the
row (on a mesh the engine also splits the last sync into reshard and quantize: ``last_sync_ms``). FP8 weight
modes re-quantize every linear weight (blockwise 128 x 128 E4M3); BF16 modes in the fused layout
concatenate q/k/v and gate/up. The byte floor is one read of the BF16 weights plus one write of
what the engine keeps, at the device's measured copy bandwidth (`experiments.bench.ceiling`). The
`rollout` suite times the same sync before each mode's workload.

    python -m experiments.bench weight_sync --preset qwen3_8b --modes none all
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

from configs.models import PRESETS
from experiments.bench.ceiling import ceiling_record, hbm_copy_bps
from fp8rl_jax.models import Fp8Mode, init_params
from fp8rl_jax.quant.policy import GemmBackend
from fp8rl_jax.rollout.engine import EngineConfig, JaxEngine


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def sync_mode(model, params, mode: Fp8Mode, engine: EngineConfig, repeats: int) -> dict:
    """One mode's timed syncs (the first, compiling, is not counted)."""
    eng = JaxEngine(model, params, dataclasses.replace(engine, precision=mode), asleep=True)
    jax.block_until_ready(eng.params)
    times = []
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        eng.update_weights(params)
        jax.block_until_ready(eng.params)
        times.append((time.perf_counter() - t0) * 1e3)
    floor_ms = (_bytes(params) + _bytes(eng.params)) / hbm_copy_bps() * 1e3
    ms = statistics.median(times)
    row = {"mode": mode.value, "weight_sync_ms": ms, "weight_sync_ms_all": times, "floor_ms": floor_ms,
           "of_floor": floor_ms / ms, "engine_weight_gb": _bytes(eng.params) / 1e9, "fused_projections": eng.fused,
           "last_sync_ms": {k.removesuffix("_s") + "_ms": v * 1e3 for k, v in eng.last_sync.items()}}
    del eng
    return row


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3_8b")
    ap.add_argument("--layers", type=int, default=0, help="keep only the first N layers of the preset (0: all)")
    ap.add_argument("--modes", nargs="*", choices=[m.value for m in Fp8Mode], default=["none", "all"])
    ap.add_argument("--sync-repeats", type=int, default=5, help="timed syncs per mode (the median is reported)")
    ap.add_argument("--fp8-gemm", choices=[b.value for b in GemmBackend], default="auto",
                    help="EngineConfig.fp8_gemm (the layout the FP8 weights are kept in follows it)")
    ap.add_argument("--dtype", default="bfloat16", help="the trainer copy's and the engine's dtype")


def run(a: argparse.Namespace) -> dict:
    model = PRESETS[a.preset]
    if a.layers:
        model = dataclasses.replace(model, num_layers=a.layers)
    engine = EngineConfig(max_slots=4, max_seq_len=64, dtype=a.dtype, fp8_gemm=GemmBackend(a.fp8_gemm))
    params = jax.block_until_ready(init_params(model, jax.random.key(0), jnp.dtype(a.dtype)))
    rows = [sync_mode(model, params, Fp8Mode(m), engine, a.sync_repeats) for m in a.modes]
    for r in rows:
        print(f"{r['mode']:5s} {r['weight_sync_ms']:8.1f} ms (floor {r['floor_ms']:.1f} ms) {r['last_sync_ms']}",
              flush=True)
    return {"model": dataclasses.asdict(model), "trainer_weight_gb": _bytes(params) / 1e9, **ceiling_record(),
            "runs": rows}


def result_name(a: argparse.Namespace) -> str:
    return "weight_sync" + ("" if a.preset == "qwen3_8b" else f"_{a.preset}")


SMOKE = ["--preset", "tiny_qwen3", "--layers", "1", "--modes", "none", "all", "--sync-repeats", "2",
         "--dtype", "float32"]
