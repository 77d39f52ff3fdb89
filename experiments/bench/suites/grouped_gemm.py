"""The MoE grouped FP8 GEMM (`pallas_kernels.fp8_grouped_gemm`) on Qwen3-30B-A3B expert shapes.

E = 128 experts, top-8 routing, D = 2048, F = 768; M = tokens * 8 rows sorted by expert, with uniform or skewed
(Zipf-like) routing. Per shape: the configs of its M regime (``--all-configs``: every `SWEEP_CONFIGS`), each
checked against `fp8_grouped_gemm_reference`, beside XLA's BF16 ``ragged_dot``, the unscaled BF16 grouped kernel
at the best tiles, and the dense `fp8_gemm` on the same total work. Timing ``gpu`` (default) is the kernels' GPU
time per call (what a call costs inside the decode step's CUDA graph, without the host's launch gaps); ``wall``
the median wall clock of 10 replays. ``--tuning-out PATH`` writes the best config per (M bucket, N, K) on this
device kind (uniform routing), merged into `pallas_kernels/fp8_grouped_gemm_tuning.json`, after every row.

Off the GPU the kernels run in interpret mode and no GPU time is recorded (NaN): a smoke test.

    python -m experiments.bench grouped_gemm --tokens 32 256 --tuning-out pallas_kernels/fp8_grouped_gemm_tuning.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp

from experiments.bench.tables import merged_tuning, write_results, write_tuning
from experiments.bench.timing import replay_gpu_ms
from fp8rl_jax.models.policy import RAGGED_DN
from fp8rl_jax.quant import quantize_activations, quantize_weight_blockwise
from pallas_kernels import fp8_gemm as gemm_kernel
from pallas_kernels import fp8_grouped_gemm as gg
from pallas_kernels.common import device_kind, m_bucket

BENCH_E, BENCH_TOP_K = 128, 8
BENCH_TOKENS = (64, 256, 2048, 8192)
# name -> (N, K): gate or up [E, 768, 2048], fused gate+up [E, 1536, 2048], down [E, 2048, 768].
BENCH_SHAPES = {"gate_up": (768, 2048), "gate_up_fused": (1536, 2048), "down": (2048, 768)}
ROUTINGS = ("uniform", "skewed")
# The slice of SWEEP_CONFIGS timed per regime (M = tokens * 8), to keep the compile time of one run short.
SMALL_M_CONFIGS = (*gg.SWEEP_CONFIGS[:4], *gg.SWEEP_CONFIGS[8:13])  # M <= 2048 (the swap_ab ones included)
LARGE_M_CONFIGS = gg.SWEEP_CONFIGS[3:8]

SMOKE = ["--tokens", "4", "--shapes", "down", "--routing", "uniform", "--experts", "8", "--scale-shapes", "16",
         "--configs", "1", "--reps", "1", "--timing", "wall", "--replays", "1"]


@functools.partial(jax.jit, static_argnames=("tokens", "routing", "e", "top_k"))
def route(key: jax.Array, tokens: int, routing: str, e: int = BENCH_E, top_k: int = BENCH_TOP_K) -> jax.Array:
    """group_sizes [E] of ``tokens`` tokens each sent to ``top_k`` distinct experts.

    uniform: every expert equally likely. skewed: Gumbel top-k on logits -1.2 * log(rank + 1) (a
    Zipf-like popularity: a few hot experts and a long tail, some experts often empty).
    """
    if routing == "uniform":
        logits = jnp.zeros((e,), jnp.float32)
    elif routing == "skewed":
        logits = -1.2 * jnp.log(jnp.arange(1, e + 1, dtype=jnp.float32))
    else:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    gumbel = jax.random.gumbel(key, (tokens, e), jnp.float32)
    _, experts = jax.lax.top_k(logits[None, :] + gumbel, top_k)
    return jnp.bincount(experts.reshape(-1), length=e).astype(jnp.int32)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, nargs="*", default=list(BENCH_TOKENS), help="tokens (M = tokens * top-k)")
    p.add_argument("--shapes", nargs="*", default=["gate_up", "down"], choices=list(BENCH_SHAPES))
    p.add_argument("--routing", nargs="*", default=list(ROUTINGS), choices=list(ROUTINGS))
    p.add_argument("--all-configs", action="store_true", help="time every SWEEP_CONFIG on every shape")
    p.add_argument("--configs", type=int, default=None, help="time only the first N configs of the regime")
    p.add_argument("--reps", type=int, default=4, help="distinct activation sets per timed jit")
    p.add_argument("--timing", choices=("gpu", "wall"), default="gpu",
                   help="gpu: the kernels' GPU time per call; wall: median wall clock of --replays replays")
    p.add_argument("--replays", type=int, default=10, help="wall timing: timed replays")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new row after this many seconds (skipped rows are listed)")
    p.add_argument("--experts", type=int, default=BENCH_E, help="experts (smaller for a smoke run)")
    p.add_argument("--scale-shapes", type=int, default=1,
                   help="divide N and K by this (a smoke run's tiny shapes; 1 for the real ones)")
    p.add_argument("--tuning-out", default=None,
                   help="write the best config per (M bucket, N, K) on this device kind (uniform routing) as a "
                        f"tuning table, merged into {gg.TUNING_FILE.name}'s entries")
    p.add_argument("--out", default=None, help="also write the rows to this path after every row")


def _interpret() -> bool | None:
    return None if jax.default_backend() != "gpu" else False


def _time_ms(fn, arg_sets, shared=(), n_replays: int = 10, gpu: bool = False) -> tuple[float, jax.Array]:
    """(ms per call, first output) of ``fn(*args, *shared)``: len(arg_sets) calls on distinct inputs in
    one jit, so neither dispatch overhead nor one input's cache residency is measured. The weights come
    in ``shared`` as jit arguments (closed over, they would become HLO constants). ``gpu``: the calls'
    kernels' GPU time (`replay_gpu_ms` busy: the work items and scale layouts included, the launch gaps
    of a wall clock not); NaN off the GPU. Else the median wall clock of ``n_replays`` runs."""
    if gpu:
        res, outs = replay_gpu_ms(fn, [(*args, *shared) for args in arg_sets], with_outputs=True)
        return (res["busy_ms"] if jax.default_backend() == "gpu" else float("nan")), outs[0]
    run = jax.jit(lambda sets, shared: tuple(fn(*args, *shared) for args in sets))
    first = jax.block_until_ready(run(arg_sets, shared))[0]
    times = []
    for _ in range(n_replays):
        t0 = time.perf_counter()
        jax.block_until_ready(run(arg_sets, shared))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times) / len(arg_sets), first


def _tflops(flop: float, ms: float) -> float:
    return flop / (ms * 1e-3) / 1e12


def run(args: argparse.Namespace) -> dict:
    t_start = time.perf_counter()
    _time = functools.partial(_time_ms, gpu=args.timing == "gpu", n_replays=args.replays)
    e, interp = args.experts, _interpret()

    def bf16_ragged(x, w, gs):
        return jax.lax.ragged_dot_general(x, w, gs, RAGGED_DN,
                                          preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    dense_configs = (gemm_kernel.GemmConfig(64, 128, 4, 4), gemm_kernel.DEFAULT_CONFIG)
    key = jax.random.key(0)
    weights = {}
    for name in args.shapes:
        n, k = (d // args.scale_shapes for d in BENCH_SHAPES[name])
        w = jax.random.normal(jax.random.fold_in(key, n * 7 + k), (e, n, k), jnp.bfloat16) * 0.05
        weights[name] = (n, k, w, quantize_weight_blockwise(w), quantize_weight_blockwise(w[0]))
    out = {"E": e, "top_k": BENCH_TOP_K, "interpret": jax.default_backend() != "gpu",
           "timing": (f"GPU time (replay_gpu_ms busy) of {args.reps} calls on distinct activations in one jit, per call"
                      if args.timing == "gpu" else
                      f"median of {args.replays} replays of {args.reps} calls on distinct activations in one jit, "
                      "per call"),
           "results": [], "skipped": []}
    tuned: list[dict] = []
    for tokens in args.tokens:
        m = tokens * BENCH_TOP_K
        configs = gg.SWEEP_CONFIGS if args.all_configs else (SMALL_M_CONFIGS if m <= 2048 else LARGE_M_CONFIGS)
        configs = configs[:args.configs] if args.configs else configs
        for name in args.shapes:
            n, k, w, qw, qw_dense = weights[name]
            if args.budget_s is not None and time.perf_counter() - t_start > args.budget_s:
                out["skipped"].append({"shape": name, "tokens": tokens})
                print(f"budget: skipped {name} tokens={tokens}", flush=True)
                continue
            xs = [jax.random.normal(jax.random.fold_in(key, 1000 * tokens + r), (m, k), jnp.bfloat16)
                  for r in range(args.reps)]
            qxs = [quantize_activations(x) for x in xs]
            flop = 2.0 * m * n * k
            dense = []
            for cfg in dense_configs:
                ms, _ = _time(lambda qa, sa, q, s, cfg=cfg: gemm_kernel.fp8_gemm(
                    qa, sa, q, s, config=cfg, interpret=interp), qxs, (qw_dense.q, qw_dense.scale_inv))
                dense.append({"config": dataclasses.asdict(cfg), "ms": ms, "tflops": _tflops(flop, ms)})
            dense = min(dense, key=lambda r: r["ms"])
            for routing in args.routing:
                gs = route(jax.random.fold_in(key, tokens), tokens, routing, e, BENCH_TOP_K)
                row = {"shape": name, "tokens": tokens, "M": m, "N": n, "K": k, "routing": routing,
                       "nonempty_groups": int(jnp.sum(gs > 0)), "max_group": int(jnp.max(gs)), "configs": []}
                ref = gg.fp8_grouped_gemm_reference(*qxs[0], qw.q, qw.scale_inv, gs, out_dtype=jnp.float32)
                ref_max = float(jnp.max(jnp.abs(ref)))
                best = None
                for cfg in configs:
                    try:
                        ms, got = _time(lambda qa, sa, q, s, g, cfg=cfg: gg.fp8_grouped_gemm(
                            qa, sa, q, s, g, config=cfg, interpret=interp), qxs, (qw.q, qw.scale_inv, gs))
                        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref))) / (ref_max + 1e-30)
                    except Exception as ex:  # noqa: BLE001 - a config that fails is reported, the sweep goes on
                        row["configs"].append({"config": dataclasses.asdict(cfg),
                                               "error": f"{type(ex).__name__}: {str(ex)[:300]}"})
                        continue
                    res = {"config": dataclasses.asdict(cfg), "ms": ms, "tflops": _tflops(flop, ms),
                           "max_rel_err_bf16_out": err}
                    row["configs"].append(res)
                    if best is None or ms < best["ms"]:  # NaN times (no GPU) keep the first
                        best = res
                ms_bf16, _ = _time(bf16_ragged, [(x,) for x in xs], (w, gs))
                row["xla_bf16_ragged_dot"] = {"ms": ms_bf16, "tflops": _tflops(flop, ms_bf16)}
                try:  # the unscaled BF16 twin (the generator's BF16 MoE), at the FP8 kernel's best tiles
                    cfg = gg.GroupedGemmConfig(**best["config"]) if best is not None else gg.DEFAULT_CONFIG
                    ms_g, _ = _time(lambda x, q, g, cfg=cfg: gg.grouped_gemm(x, q, g, config=cfg, interpret=interp),
                                    [(x,) for x in xs], (w, gs))
                    row["bf16_grouped_gemm"] = {"config": dataclasses.asdict(cfg), "ms": ms_g,
                                                "tflops": _tflops(flop, ms_g)}
                except Exception as ex:  # noqa: BLE001 - reported in the row
                    row["bf16_grouped_gemm"] = {"error": f"{type(ex).__name__}: {str(ex)[:300]}"}
                row["dense_fp8_gemm"] = dense
                row["best"] = best
                out["results"].append(row)
                if args.out:
                    write_results(args.out, out["results"])
                if args.tuning_out and best is not None and routing == "uniform":
                    tuned.append({"device_kind": device_kind(), "m_bucket": m_bucket(m), "n": n, "k": k,
                                  "config": best["config"], "ms": best["ms"], "tflops": best["tflops"]})
                    write_tuning(args.tuning_out, merged_tuning(gg.TUNING_FILE, tuned))
                if best is None:
                    print(f"{name} tokens={tokens} {routing}: every config failed: {row['configs'][0]['error']}",
                          flush=True)
                    continue
                c = best["config"]
                print(f"{name:13s} tokens={tokens:5d} M={m:6d} {routing:7s} ({row['nonempty_groups']:3d} experts, "
                      f"max {row['max_group']:5d} rows): grouped fp8 {best['tflops']:6.1f} TFLOP/s "
                      f"({best['ms']:.3f} ms, bm={c['block_m']} bn={c['block_n']} w={c['num_warps']} "
                      f"s={c['num_stages']}{'' if c['n_fastest'] else ' items-fastest'}"
                      f"{' swap_ab' if c['swap_ab'] else ''}, err {best['max_rel_err_bf16_out']:.1e}) | XLA bf16 "
                      f"ragged_dot {row['xla_bf16_ragged_dot']['tflops']:6.1f} ({ms_bf16:.3f} ms) | bf16 grouped "
                      f"{row['bf16_grouped_gemm'].get('tflops', float('nan')):6.1f} | dense fp8_gemm "
                      f"{dense['tflops']:6.1f} ({dense['ms']:.3f} ms)", flush=True)
    out["wall_s"] = time.perf_counter() - t_start
    out["tuning_entries"] = tuned
    return out
