"""The FP8 quantization kernels against their jnp twins (XLA's fusions).

``weight``: `pallas_kernels.fp8_quant.quantize_weight` of every Qwen3-8B linear weight (bf16, ``--layers``
layers, one stacked array per projection) per tiling of `SWEEP_CONFIGS`, median wall clock and the fraction of
the device's HBM copy ceiling (bf16 read + fp8 write + scales), beside XLA's jit of the reference; the kernel is
checked bit for bit against `quantize_weight_reference` on one weight first.

``silu`` / ``norm`` / ``bnorm`` / ``plain``: the one-pass activation kernels of `pallas_kernels.act_quant` per M
(SwiGLU of ``[M, 2I]``; residual add + RMSNorm + quantization of ``[M, D]``; the same in bf16 without the
quantization; plain 1 x 128 quantization of ``[M, D]``), GPU time per call over ``--sets`` distinct inputs, and
GB/s with inputs read once and outputs written once; ``--sweep`` also times the tilings.

Off the GPU the kernels run in interpret mode and no GPU time is recorded (NaN): a smoke test.

    python -m experiments.bench quant_kernels --kernels weight
    python -m experiments.bench quant_kernels --kernels silu norm bnorm plain --m 256 4096 --sweep
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench.ceiling import ceiling_record, hbm_copy_bps
from experiments.bench.tables import write_results
from experiments.bench.timing import median_ms, replay_gpu_ms
from pallas_kernels import act_quant as aq
from pallas_kernels import fp8_quant as fq

# Qwen3-8B linear weights per layer, [N, K] = [out, in]; 36 layers.
QWEN3_8B_LAYER_SHAPES = {
    "q": (4096, 4096),
    "k": (1024, 4096),
    "v": (1024, 4096),
    "o": (4096, 4096),
    "gate": (12288, 4096),
    "up": (12288, 4096),
    "down": (4096, 12288),
}
QWEN3_8B_LAYERS = 36
KERNELS = ("weight", "silu", "norm", "bnorm", "plain")

SMOKE = ["--kernels", *KERNELS, "--layers", "1", "--scale-shapes", "32", "--configs", "1", "--m", "8", "--i", "256",
         "--d", "256", "--sets", "1", "--replays", "1"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernels", nargs="+", default=["weight", "silu", "norm", "plain"], choices=KERNELS)
    p.add_argument("--layers", type=int, default=QWEN3_8B_LAYERS, help="weight: Qwen3-8B layers quantized per pass")
    p.add_argument("--scale-shapes", type=int, default=1, help="weight: divide the weight shapes by this (smoke)")
    p.add_argument("--replays", type=int, default=10, help="weight: timed passes per config")
    p.add_argument("--configs", type=int, default=None, help="weight: time only the first N tilings")
    p.add_argument("--m", type=int, nargs="+", default=[256, 4096], help="activations: rows")
    p.add_argument("--i", type=int, default=12288, help="silu: intermediate width I of [M, 2I]")
    p.add_argument("--d", type=int, default=4096, help="norm/bnorm/plain: width D of [M, D]")
    p.add_argument("--sweep", action="store_true", help="activations: also time the tilings")
    p.add_argument("--sets", type=int, default=6, help="activations: distinct inputs per timed program")
    p.add_argument("--out", default=None, help="also write the activation rows to this path")


def _interpret() -> bool | None:
    return None if jax.default_backend() != "gpu" else False


def _bits_equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)) for x, y in zip(a, b))


def bench_weight(args: argparse.Namespace) -> dict:
    """All Qwen3-8B linear weights quantized per tiling (one stacked [L, N, K] array per projection: the bytes
    of L separate weights)."""
    shapes = {name: (n // args.scale_shapes, k // args.scale_shapes) for name, (n, k) in QWEN3_8B_LAYER_SHAPES.items()}
    key = jax.random.key(0)
    weights = {name: jax.random.normal(jax.random.fold_in(key, i), (args.layers, n, k), jnp.bfloat16)
               for i, (name, (n, k)) in enumerate(shapes.items())}
    n_bytes = sum(args.layers * (n * k * 2 + n * k + -(-n // fq.QBLOCK) * -(-k // fq.QBLOCK) * 4)
                  for n, k in shapes.values())
    ceiling = hbm_copy_bps()
    sample = weights["k"][0]
    out = {"layers": args.layers, "bytes_per_pass": n_bytes, **ceiling_record(),
           "bit_exact_vs_reference": _bits_equal(fq.quantize_weight(sample, interpret=_interpret()),
                                                 fq.quantize_weight_reference(sample)),
           "configs": []}
    print(f"Qwen3-8B, {args.layers} layers, {n_bytes / 1e9:.2f} GB moved per pass; bit-exact vs reference: "
          f"{out['bit_exact_vs_reference']}")

    def row(ms: float) -> dict:
        bps = n_bytes / (ms * 1e-3)
        return {"ms": ms, "GBps": bps / 1e9, "frac_of_copy_ceiling": bps / ceiling}

    for cfg in fq.SWEEP_CONFIGS[:args.configs] if args.configs else fq.SWEEP_CONFIGS:
        try:
            ms = median_ms(lambda cfg=cfg: [fq.quantize_weight(w, cfg, interpret=_interpret())
                                            for w in weights.values()], args.replays)
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is reported, not fatal
            out["configs"].append({"config": dataclasses.asdict(cfg), "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        out["configs"].append({"config": dataclasses.asdict(cfg), **row(ms)})
        print(f"  {cfg}: {ms:8.3f} ms  {out['configs'][-1]['GBps']:8.1f} GB/s", flush=True)
    ref_jit = jax.jit(fq.quantize_blocks_reference)  # on the GPU XLA's fusion: timed for speed, not exactness
    out["xla_reference"] = row(median_ms(lambda: [ref_jit(w) for w in weights.values()], args.replays))
    print(f"  XLA jit(quantize_blocks_reference): {out['xla_reference']['ms']:8.3f} ms")
    return out


def _random(m: int, width: int, seed: int) -> jax.Array:
    return (jax.random.normal(jax.random.key(seed), (m, width), jnp.float32) * 3).astype(jnp.bfloat16)


def _activation_case(kind: str, m: int, args: argparse.Namespace):
    """(input sets, bytes moved, twin, kernel(config), tilings, default tiling) of one activation kernel."""
    itp = _interpret()
    if kind == "silu":
        sets = [(_random(m, 2 * args.i, seed),) for seed in range(args.sets)]
        moved = m * 2 * args.i * 2 + m * args.i + 4 * m * args.i // aq.GROUP
        impl = lambda cfg: lambda gu: aq.silu_mul_quant(gu, config=cfg, interpret=itp)  # noqa: E731
        configs = [aq.ActQuantConfig(bm, g, w) for bm, g, w in itertools.product((4, 8, 16, 32), (1, 2, 4), (2, 4))]
        return sets, moved, aq.silu_mul_quant_reference, impl, configs, aq.DEFAULT_CONFIG
    d = args.d
    if kind == "plain":
        sets = [(_random(m, d, seed),) for seed in range(args.sets)]
        moved = m * d * 2 + m * d + 4 * m * d // aq.GROUP
        impl = lambda cfg: lambda x: aq.quantize_1x128(x, config=cfg, interpret=itp)  # noqa: E731
        configs = [aq.ActQuantConfig(bm, g, 4) for bm, g in itertools.product((4, 8, 32), (1, 4, 8))]
        return sets, moved, aq.quantize_1x128_reference, impl, configs, aq.DEFAULT_CONFIG
    sets = [(_random(m, d, seed), _random(m, d, seed + 100) * 0.25, jnp.ones((d,), jnp.bfloat16))
            for seed in range(args.sets)]
    if kind == "norm":
        moved = 3 * m * d * 2 + m * d + 4 * m * d // aq.GROUP
        ref = lambda x, r, w: aq.add_rms_norm_quant_reference(x, w, 1e-6, residual=r)  # noqa: E731
        impl = lambda cfg: lambda x, r, w: aq.add_rms_norm_quant(x, w, 1e-6, residual=r, config=cfg,  # noqa: E731
                                                                  interpret=itp)
        configs = [aq.NormQuantConfig(bm, w) for bm, w in itertools.product((1, 2, 4, 8), (2, 4, 8))]
    else:  # bnorm: add + RMSNorm, bf16 out (the BF16 linears' input)
        moved = 4 * m * d * 2
        ref = lambda x, r, w: aq.add_rms_norm_reference(x, w, 1e-6, residual=r)  # noqa: E731
        impl = lambda cfg: lambda x, r, w: aq.add_rms_norm(x, w, 1e-6, residual=r, config=cfg,  # noqa: E731
                                                            interpret=itp)
        configs = [aq.NormQuantConfig(bm, w) for bm, w in itertools.product((1, 2, 4), (4, 8, 16))]
    return sets, moved, ref, impl, configs, aq.DEFAULT_NORM_CONFIG


def bench_activations(args: argparse.Namespace, kinds: list[str]) -> list[dict]:
    """GPU time per call of each activation kernel and its twin, per M (module note)."""
    rows = []
    for kind, m in itertools.product(kinds, args.m):
        sets, moved, ref, impl, configs, default = _activation_case(kind, m, args)
        runs = [("reference", None, ref), ("kernel", default, impl(default))]
        if args.sweep:
            runs += [("sweep", c, impl(c)) for c in configs if c != default]
        for name, cfg, fn in runs:
            res = replay_gpu_ms(fn, sets)
            busy = res["busy_ms"] if jax.default_backend() == "gpu" else float("nan")
            rows.append({"kernel": kind, "m": m, "width": args.i if kind == "silu" else args.d, "impl": name,
                         "config": None if cfg is None else dataclasses.asdict(cfg), "gpu_us": busy * 1e3,
                         "gbps": moved / busy / 1e6, "kernels": res["kernels"]})
            print(f"{kind:5s} M={m:5d} {name:9s} {cfg} {busy * 1e3:8.2f} us {rows[-1]['gbps']:7.0f} GB/s "
                  f"{list(res['kernels'])[:2]}", flush=True)
        if args.out:
            write_results(args.out, rows)
    return rows


def run(args: argparse.Namespace) -> dict:
    out: dict = {"interpret": jax.default_backend() != "gpu"}
    if "weight" in args.kernels:
        out["weight"] = bench_weight(args)
    kinds = [k for k in args.kernels if k != "weight"]
    if kinds:
        out["activations"] = bench_activations(args, kinds)
    return out
