"""Config sweeps of the FP8 block-scaled GEMM kernels on Qwen3-8B shapes.

``--kernel mosaic`` (default): `pallas_kernels.fp8_gemm_mgpu` over `SWEEP_CONFIGS` (``--decode-sweep``:
`DECODE_SWEEP_CONFIGS`), each shape timed by `replay_ms` over distinct input sets (about 2 GB of FP8 operands,
2 to 16 sets, so no call reads its operands from L2), against XLA's BF16 dot and the Triton kernel's default.
``--tuning-out PATH`` writes the fastest config per (M bucket, N, K) on this device kind, merged into the
kernel's table (`pallas_kernels/fp8_gemm_mgpu_tuning.json`, which `default_config` reads), after every shape.

``--kernel triton``: `pallas_kernels.fp8_gemm` over its `SWEEP_CONFIGS` (median wall clock), against XLA's BF16 dot.

Off the GPU the kernels run in interpret mode (a smoke test: the times are the interpreter's).

    python -m experiments.bench gemm_tune --decode-sweep --m 64 128 256 \\
        --nk 6144 4096 4096 4096 24576 4096 4096 12288 --tuning-out pallas_kernels/fp8_gemm_mgpu_tuning.json
    python -m experiments.bench gemm_tune --kernel triton --m 64 256
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from experiments.bench.tables import merged_tuning, write_results, write_tuning
from experiments.bench.timing import median_ms, replay_ms
from fp8rl_jax.quant import quantize_activations, quantize_weight_blockwise
from pallas_kernels import fp8_gemm as triton_gemm
from pallas_kernels import fp8_gemm_mgpu as mgpu
from pallas_kernels.common import device_kind, m_bucket

BENCH_M = (64, 256, 2048, 8192)
# Qwen3-8B's linears, (N, K): q/o, k/v, gate/up, down
BENCH_NK = ((4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288))

SMOKE = ["--kernel", "mosaic", "--m", "16", "--nk", "256", "256", "--configs", "1", "--sets", "1",
         "--replays", "1", "--no-triton"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernel", choices=("mosaic", "triton"), default="mosaic")
    p.add_argument("--m", type=int, nargs="*", default=list(BENCH_M), help="M values")
    p.add_argument("--nk", type=int, nargs="*", default=None, help="N K pairs, flattened (default: Qwen3-8B's)")
    p.add_argument("--decode-sweep", action="store_true", help="mosaic: sweep DECODE_SWEEP_CONFIGS")
    p.add_argument("--no-triton", action="store_true", help="mosaic: skip timing the Triton fp8_gemm baseline")
    p.add_argument("--tuning-out", default=None,
                   help="mosaic: write the best config per (M bucket, N, K) on this device kind as a tuning table, "
                        f"merged into {mgpu.TUNING_FILE.name}'s entries")
    p.add_argument("--configs", type=int, default=None, help="time only the first N configs of the sweep")
    p.add_argument("--sets", type=int, default=None, help="mosaic: input sets per replay (default: ~2 GB of operands)")
    p.add_argument("--replays", type=int, default=10, help="timed replays (mosaic) / calls (triton) per config")
    p.add_argument("--out", default=None, help="also write the rows to this path after every shape")


def result_name(args: argparse.Namespace) -> str:
    return "gemm_tune_" + (args.kernel + ("_decode" if args.decode_sweep and args.kernel == "mosaic" else ""))


def _interpret() -> bool | None:
    return None if jax.default_backend() != "gpu" else False


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


def _rel_err(out: jax.Array, ref: jax.Array) -> float:
    return float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / (jnp.max(jnp.abs(ref)) + 1e-30))


def _operands(key, m: int, n: int, k: int, sets: int):
    keys = jax.random.split(jax.random.fold_in(key, m * 100003 + n * 7 + k), 2 * sets)
    xs = [jax.random.normal(keys[2 * r], (m, k), jnp.bfloat16) for r in range(sets)]
    ws = [jax.random.normal(keys[2 * r + 1], (n, k), jnp.bfloat16) for r in range(sets)]
    qws = [quantize_weight_blockwise(w) for w in ws]
    qas = [quantize_activations(x) for x in xs]
    return xs, ws, [(qa, sa, w.q, w.scale_inv) for (qa, sa), w in zip(qas, qws)]


def _sweep_mosaic(args, shapes, rows: list, entries: list) -> None:
    configs = mgpu.DECODE_SWEEP_CONFIGS if args.decode_sweep else mgpu.SWEEP_CONFIGS
    configs = configs[:args.configs] if args.configs else configs
    key = jax.random.key(0)
    for n, k in shapes:
        for m in args.m:
            sets = args.sets or int(min(16, max(2, 2e9 // (m * k + n * k))))
            xs, ws, arg_sets = _operands(key, m, n, k, sets)
            flop = 2.0 * m * n * k
            ref = triton_gemm.fp8_gemm_reference(*arg_sets[0], out_dtype=jnp.float32)
            row = {"M": m, "N": n, "K": k, "input_sets": sets, "configs": []}
            best = None
            for cfg in configs:
                if n % cfg.cluster_tile_n:
                    continue
                call = lambda *a, cfg=cfg: mgpu.fp8_gemm_mgpu(*a, config=cfg, interpret=_interpret())  # noqa: E731
                try:  # bf16 out (what is timed): some sweep configs do not fit f32 epilogue buffers
                    err = _rel_err(call(*arg_sets[0]), ref)
                    ms = replay_ms(call, arg_sets, args.replays)
                except Exception as e:  # noqa: BLE001 - a config that fails is reported, the sweep goes on
                    row["configs"].append({"config": mgpu.config_dict(cfg), "error": _error(e)})
                    print(f"  M={m} N={n} K={k} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                tf = flop / (ms * 1e-3) / 1e12
                row["configs"].append({"config": mgpu.config_dict(cfg), "ms": ms, "tflops": tf,
                                       "max_rel_err_bf16_out": err, "is_default": cfg == mgpu.default_config(m, n, k)})
                if best is None or ms < best[1]:
                    best = (cfg, ms, tf, err)
            ms_bf16 = replay_ms(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.bfloat16), list(zip(xs, ws)),
                                args.replays)
            row["xla_bf16"] = {"ms": ms_bf16, "tflops": flop / (ms_bf16 * 1e-3) / 1e12}
            if not args.no_triton:
                ms_tr = replay_ms(lambda *a: triton_gemm.fp8_gemm(*a, interpret=_interpret()), arg_sets, args.replays)
                row["triton_fp8_gemm_default"] = {"ms": ms_tr, "tflops": flop / (ms_tr * 1e-3) / 1e12}
            if best is not None:
                c = best[0]
                row["best"] = {"config": mgpu.config_dict(c), "ms": best[1], "tflops": best[2],
                               "max_rel_err_bf16_out": best[3]}
                entries.append({"device_kind": device_kind(), "m_bucket": m_bucket(m), "n": n, "k": k,
                                "config": mgpu.config_dict(c), "ms": best[1], "tflops": best[2]})
                print(f"M={m:5d} N={n:5d} K={k:5d}: mgpu fp8 {best[2]:7.1f} TFLOP/s ({best[1]:.3f} ms, tm={c.tile_m} "
                      f"tn={c.tile_n} wg={c.wg_dimension.name} s={c.max_concurrent_steps}, err {best[3]:.1e}) | "
                      f"XLA bf16 {row['xla_bf16']['tflops']:7.1f}", flush=True)
            rows.append(row)
            if args.out:
                write_results(args.out, rows)
            if args.tuning_out:  # after every shape: a run cut by its time limit keeps what it measured
                write_tuning(args.tuning_out, merged_tuning(mgpu.TUNING_FILE, entries))


def _sweep_triton(args, shapes, rows: list) -> None:
    configs = triton_gemm.SWEEP_CONFIGS[:args.configs] if args.configs else triton_gemm.SWEEP_CONFIGS
    bf16_dot = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.bfloat16))
    key = jax.random.key(0)
    for n, k in shapes:
        for m in args.m:
            (x,), (w,), ((qa, sa, q, s),) = _operands(key, m, n, k, 1)
            flop = 2.0 * m * n * k
            ref = triton_gemm.fp8_gemm_reference(qa, sa, q, s, out_dtype=jnp.float32)
            row = {"M": m, "N": n, "K": k, "configs": []}
            best = None
            for cfg in configs:
                try:
                    err = _rel_err(triton_gemm.fp8_gemm(qa, sa, q, s, out_dtype=jnp.float32, config=cfg,
                                                        interpret=_interpret()), ref)
                    ms = median_ms(lambda cfg=cfg: triton_gemm.fp8_gemm(qa, sa, q, s, config=cfg,
                                                                        interpret=_interpret()), args.replays)
                except Exception as e:  # noqa: BLE001 - a config that fails is reported, the sweep goes on
                    row["configs"].append({"config": dataclasses.asdict(cfg), "error": _error(e)})
                    continue
                tf = flop / (ms * 1e-3) / 1e12
                row["configs"].append({"config": dataclasses.asdict(cfg), "ms": ms, "tflops": tf,
                                       "max_rel_err_f32": err})
                if best is None or ms < best[1]:
                    best = (cfg, ms, tf, err)
            ms_bf16 = median_ms(lambda: bf16_dot(x, w), args.replays)
            row["xla_bf16"] = {"ms": ms_bf16, "tflops": flop / (ms_bf16 * 1e-3) / 1e12}
            if best is not None:
                row["best"] = {"config": dataclasses.asdict(best[0]), "ms": best[1], "tflops": best[2],
                               "max_rel_err_f32": best[3]}
                print(f"M={m:5d} N={n:5d} K={k:5d}: fp8 {best[2]:7.1f} TFLOP/s ({best[1]:.3f} ms, {best[0]}, "
                      f"err {best[3]:.1e}) | XLA bf16 {row['xla_bf16']['tflops']:7.1f} TFLOP/s", flush=True)
            rows.append(row)
            if args.out:
                write_results(args.out, rows)


def run(args: argparse.Namespace) -> dict:
    shapes = BENCH_NK if args.nk is None else tuple(zip(args.nk[::2], args.nk[1::2]))
    rows: list[dict] = []
    entries: list[dict] = []
    if args.kernel == "mosaic":
        _sweep_mosaic(args, shapes, rows, entries)
    else:
        _sweep_triton(args, shapes, rows)
    return {"kernel": args.kernel, "decode_sweep": bool(args.decode_sweep), "interpret": jax.default_backend() != "gpu",
            "results": rows, "tuning_entries": entries}
