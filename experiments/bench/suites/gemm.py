"""FP8 GEMMs and the weight quantization, ours against XLA and cuBLAS (needs a GPU).

Contenders on Qwen3-8B GEMM shapes (M in {64, 256, 2048, 8192}; (N, K) in {(4096, 4096),
(1024, 4096), (12288, 4096), (4096, 12288)}) and the Qwen3-30B-A3B expert shapes
((768, 2048) gate/up, (2048, 768) down) as dense GEMMs:
  - ours: the Pallas W8A8 block-scaled GEMMs, Triton-lowered (`pallas_kernels.fp8_gemm`, best of a
    few configs) and Mosaic GPU TMA + wgmma (`pallas_kernels.fp8_gemm_mgpu`, default config), and
    cuBLASLt's block-scaled FP8 called from JAX through our FFI handler (`fp8rl_jax.quant.cublaslt`);
  - XLA BF16 `dot`;
  - XLA FP8 `dot` with one scale per tensor (cuBLASLt FP8, tensorwise);
  - cuBLAS blockwise FP8 through torch (`torch.nn.functional.scaled_mm`, BlockWise1x128 x
    BlockWise128x128), the peer with the same scaling recipe as ours.
And the weight sync's quantization: every linear weight of Qwen3-8B (252 tensors, 6.95 G parameters)
in one jitted program, with the Pallas kernel and with the jnp reference, against the byte floor at
the device's measured copy bandwidth (`experiments.bench.ceiling`).

Timing: R calls on R distinct input sets inside one executable (JAX: one jit; torch: one CUDA
graph), so cache reuse is not measured. Two measures per JAX column: the wall clock (median of 10
runs, divided by R: it includes the host's launch of every call, which for a custom call such as
our cuBLASLt one is ~30 us, twice the GPU time of a decode-size GEMM) and the GPU time (the kernels
of one traced run, summed, divided by R), which is what torch's graph replay measures and what a
call costs inside a decode loop that keeps the GPU busy. The payload holds both; the markdown
tables of each are printed.

    python -m experiments.bench gemm
    python -m experiments.bench gemm --m 64 128 256 --no-triton --backend-table-out fp8rl_jax/quant/gemm_backend.json
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

from experiments.bench.ceiling import ceiling_record, hbm_copy_bps
from fp8rl_jax.quant import cublaslt
from fp8rl_jax.quant.policy import GEMM_BACKEND_TABLE, backend_defaults
from fp8rl_jax.quant import quantize_activations, quantize_weight_blockwise
from pallas_kernels import fp8_gemm as gemm_kernel
from pallas_kernels import fp8_gemm_mgpu as mgpu_kernel
from pallas_kernels import fp8_quant as quant_kernel
from experiments.bench.suites.quant_kernels import QWEN3_8B_LAYER_SHAPES, QWEN3_8B_LAYERS
from experiments.bench.tables import merged_tuning, write_tuning
from experiments.bench.timing import replay_gpu_ms, replay_ms
from pallas_kernels.common import m_bucket
from pallas_kernels.fp8_gemm import BK

BENCH_M = (64, 256, 2048, 8192)
QWEN3_8B_NK = ((4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288))
QWEN3_30B_EXPERT_NK = ((768, 2048), (2048, 768))
# A slice of the kernel's sweep per regime, to keep compile time inside one device call.
SMALL_M_CONFIGS = (gemm_kernel.GemmConfig(64, 64, 4, 4), gemm_kernel.GemmConfig(64, 128, 4, 4),
                   gemm_kernel.GemmConfig(64, 256, 8, 4))
LARGE_M_CONFIGS = (gemm_kernel.GemmConfig(128, 128, 8, 3), gemm_kernel.GemmConfig(128, 256, 8, 3),
                   gemm_kernel.GemmConfig(256, 128, 8, 3))


def time_torch(fn, arg_sets, n_replays: int = 10) -> float:
    """Median ms per call, the calls captured in one CUDA graph."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in arg_sets:  # warm-up outside the graph (lazy init, autotuning)
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn(*args) for args in arg_sets]
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(n_replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    del outs
    return statistics.median(times) / len(arg_sets)


def n_sets(m: int, n: int, k: int) -> int:
    """Distinct input sets (= calls per timed replay): ~4 GB of inputs, between 2 and 64.

    Many calls per replay amortize the one dispatch + synchronize of a replay (~0.1 ms, which
    swamps microsecond decode-shape GEMMs at R = 8); distinct
    inputs keep XLA from merging identical calls and the 50 MB L2 from serving repeats.
    """
    per_set = m * k * 2 + n * k * 2
    return int(min(64, max(2, np.ceil(4e9 / per_set))))


def bench_shape(m: int, n: int, k: int, key, torch_ok: bool, triton: bool = True) -> dict:
    R = n_sets(m, n, k)
    keys = jax.random.split(key, 2 * R)
    xs = [jax.random.normal(keys[2 * r], (m, k), jnp.bfloat16) for r in range(R)]
    ws = [jax.random.normal(keys[2 * r + 1], (n, k), jnp.bfloat16) for r in range(R)]
    qws = [quantize_weight_blockwise(w) for w in ws]
    qas = [quantize_activations(x) for x in xs]
    flop = 2.0 * m * n * k
    row: dict = {"M": m, "N": n, "K": k, "input_sets": R}

    def record(name, fn=None, sets=None, ms=None, gpu_ms=None):
        """Wall ms per call by `replay_ms` (or ``ms`` given) and, with ``fn``, the GPU time per call by
        `replay_gpu_ms` (the kernels' sum, no launch gaps): the measure torch's graph replay gives."""
        if fn is not None:
            ms = replay_ms(fn, sets)
            g = replay_gpu_ms(fn, sets)
            gpu_ms = g["busy_ms"]
        row[name] = {"ms": ms, "tflops": flop / (ms * 1e-3) / 1e12}
        if gpu_ms:
            row[name].update(gpu_ms=gpu_ms, gpu_tflops=flop / (gpu_ms * 1e-3) / 1e12)
        if fn is not None:
            row[name].update(gpu_span_ms=g["span_ms"], kernels=g["kernels"])

    # correctness of ours on this shape first (against the jnp twin, float32 out)
    qa, sa = qas[0]
    ref = gemm_kernel.fp8_gemm_reference(qa, sa, qws[0].q, qws[0].scale_inv, out_dtype=jnp.float32)
    best = None
    for cfg in (SMALL_M_CONFIGS if m <= 256 else LARGE_M_CONFIGS) if triton else ():
        try:
            out = gemm_kernel.fp8_gemm(qa, sa, qws[0].q, qws[0].scale_inv, out_dtype=jnp.float32, config=cfg)
            err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
            ms = replay_ms(lambda a, s, b, bs, cfg=cfg: gemm_kernel.fp8_gemm(a, s, b, bs, config=cfg),
                          [(a, s, w.q, w.scale_inv) for (a, s), w in zip(qas, qws)])
        except Exception as e:  # a config that does not compile is reported, not fatal
            row.setdefault("failed_configs", []).append(f"{dataclasses.asdict(cfg)}: {type(e).__name__}")
            continue
        if best is None or ms < best[1]:
            best = (cfg, ms, err)
    if best is not None:
        record("ours_fp8_block", ms=best[1])
        row["ours_fp8_block"].update(config=dataclasses.asdict(best[0]), rel_err_vs_reference=best[2])
    try:  # the Mosaic GPU (TMA + wgmma) kernel, default config for the shape
        out = mgpu_kernel.fp8_gemm_mgpu(qa, sa, qws[0].q, qws[0].scale_inv, out_dtype=jnp.float32)
        err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
        record("ours_mgpu", lambda a, s, b, bs: mgpu_kernel.fp8_gemm_mgpu(a, s, b, bs),
               [(a, s, w.q, w.scale_inv) for (a, s), w in zip(qas, qws)])
        row["ours_mgpu"]["rel_err_vs_reference"] = err
        row["ours_mgpu"]["config"] = mgpu_kernel.config_dict(mgpu_kernel.default_config(m, n, k))
    except Exception as e:
        row["ours_mgpu"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    ok, why = cublaslt.available()
    if ok and cublaslt.supports(n, k):  # cuBLASLt's block-scaled FP8 through our FFI handler
        try:
            out = cublaslt.fp8_gemm_cublaslt(qa, sa, qws[0].q, qws[0].scale_inv, out_dtype=jnp.float32)
            err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
            # the scales in cuBLASLt's order, as the engine's quantization writes them (quantize_activations_t)
            # and as torch's column gets them: laid out outside the timed calls
            record("ours_cublaslt", lambda a, st, b, bs: cublaslt.fp8_gemm_cublaslt_t(a, st, b, bs),
                   [(a, s.T, w.q, w.scale_inv) for (a, s), w in zip(qas, qws)])
            row["ours_cublaslt"]["rel_err_vs_reference"] = err
        except Exception as e:
            row["ours_cublaslt"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        if cublaslt.one_d_available():  # the same product with the weight's 128x128 scales repeated per row:
            try:  # cuBLASLt's 1x128 x 1x128 scaling, the configuration of its samples' operand order
                def one_d(a, s, b, bs_rows):
                    return cublaslt.fp8_gemm_cublaslt_1d(a, s, b, bs_rows, out_dtype=jnp.bfloat16)
                sets = [(a, s, w.q, jnp.repeat(w.scale_inv, BK, axis=0)[:n]) for (a, s), w in zip(qas, qws)]
                out = one_d(*sets[0]).astype(jnp.float32)
                err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
                record("ours_cublaslt_1d", one_d, sets)
                row["ours_cublaslt_1d"]["rel_err_vs_reference"] = err  # bf16 output: ~1e-3
            except Exception as e:
                row["ours_cublaslt_1d"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    elif not ok:
        row["ours_cublaslt"] = {"error": why}
    record("xla_bf16", lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.bfloat16), list(zip(xs, ws)))
    a8 = [x.astype(jnp.float8_e4m3fn) for x in xs]
    record("xla_fp8_tensorwise",
           lambda a, b: (jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                         * jnp.float32(0.5)).astype(jnp.bfloat16),
           [(a, w.q) for a, w in zip(a8, qws)])
    if torch_ok:
        try:
            t_ms = bench_torch_blockwise(qas, qws, ref, row)  # events around a CUDA graph's replay: GPU time
            record("torch_cublas_fp8_block", ms=t_ms, gpu_ms=t_ms)
        except Exception as e:
            row["torch_cublas_fp8_block"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    return row


def bench_torch_blockwise(qas, qws, ref, row) -> float:
    """torch.nn.functional.scaled_mm, BlockWise1x128 (A) x BlockWise128x128 (B^T), via DLPack."""
    import torch
    import torch.nn.functional as F

    def t(x):
        return torch.from_dlpack(x)

    sets = []
    for (a, s), w in zip(qas, qws):
        kb = s.shape[1]
        # A scales [M, kb] must be outer-dim-major (strides (1, M)); B scales [kb padded to 4, nb] likewise, the
        # padding rows included (torch checks the padded shape: K = 768 needs 8 x nb, not 6 x nb)
        sa = t(s.T).contiguous().t()
        kb4 = -(-kb // 4) * 4
        sb = torch.zeros((w.scale_inv.shape[0], kb4), dtype=torch.float32, device="cuda")
        sb[:, :kb] = t(w.scale_inv)
        sets.append((t(a), t(w.q).t(), sa, sb.t()))

    def call(a, bt, sa, sb):
        return F.scaled_mm(a, bt, scale_a=[sa], scale_recipe_a=[F.ScalingType.BlockWise1x128],
                           scale_b=[sb], scale_recipe_b=[F.ScalingType.BlockWise128x128],
                           swizzle_a=[F.SwizzleType.NO_SWIZZLE], swizzle_b=[F.SwizzleType.NO_SWIZZLE],
                           output_dtype=torch.bfloat16)

    out = call(*sets[0]).float()
    ref_t = t(ref)
    row["torch_rel_err_vs_reference"] = float(torch.linalg.norm(out - ref_t) / torch.linalg.norm(ref_t))
    return time_torch(call, sets)


def bench_weight_sync(key) -> dict:
    """All Qwen3-8B linear weights quantized in one jitted program (what a weight sync runs)."""
    shapes = [s for _ in range(QWEN3_8B_LAYERS) for s in QWEN3_8B_LAYER_SHAPES.values()]
    weights = [jax.random.normal(jax.random.fold_in(key, i), s, jnp.bfloat16) for i, s in enumerate(shapes)]
    n_params = sum(int(np.prod(s)) for s in shapes)
    nbytes = sum(int(np.prod(s)) * 3 + 4 * (-(-s[0] // 128)) * (-(-s[1] // 128)) for s in shapes)
    out = {"tensors": len(shapes), "params": n_params, "bytes_moved": nbytes,
           "floor_ms": nbytes / hbm_copy_bps() * 1e3}
    for name, fn in [("pallas", lambda w: quant_kernel.quantize_weight(w)),
                     ("jnp_reference", lambda w: quantize_weight_blockwise(w))]:
        run = jax.jit(lambda ws, fn=fn: [fn(w) for w in ws])
        jax.block_until_ready(run(weights))
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            jax.block_until_ready(run(weights))
            times.append((time.perf_counter() - t0) * 1e3)
        ms = statistics.median(times)
        out[name] = {"ms": ms, "GBps": nbytes / (ms * 1e-3) / 1e9, "frac_of_copy_ceiling": nbytes / (ms * 1e-3) / hbm_copy_bps()}
    sample = weights[4]
    (aq, a_s), (bq, b_s) = quant_kernel.quantize_weight(sample), quant_kernel.quantize_weight_reference(sample)
    out["pallas_bit_exact_vs_reference"] = bool(
        np.array_equal(np.asarray(aq).view(np.uint8), np.asarray(bq).view(np.uint8))
        and np.array_equal(np.asarray(a_s), np.asarray(b_s)))
    return out


def backend_entries(rows: list[dict], kind: str) -> list[dict]:
    """The faster of our two dense FP8 GEMMs per measured shape, as `GEMM_BACKEND_TABLE` entries (by GPU
    time where measured: the engine's decode loop keeps the GPU busy, so launch gaps are not its cost)."""
    out = []
    for r in rows:
        ms = {name: r[key].get("gpu_ms", r[key]["ms"]) for name, key in (("mosaic", "ours_mgpu"),
                                                                         ("cublaslt", "ours_cublaslt"))
              if isinstance(r.get(key), dict) and "ms" in r[key]}
        if len(ms) == 2:
            out.append({"device_kind": kind, "m_bucket": m_bucket(r["M"]), "n": r["N"], "k": r["K"],
                        "backend": min(ms, key=ms.get), "ms": ms})
    return out


def write_backend_table(path: Path, entries: list[dict]) -> None:
    """`GEMM_BACKEND_TABLE` with ``entries`` merged in (they replace the shapes they measure) and its
    per-device-kind defaults kept."""
    write_tuning(path, merged_tuning(GEMM_BACKEND_TABLE, entries))
    defaults = backend_defaults(GEMM_BACKEND_TABLE)
    if defaults:
        table = json.loads(Path(path).read_text())
        table["defaults"] = defaults
        Path(path).write_text(json.dumps(table, indent=1) + "\n")


_COLUMNS = (("ours Triton", "ours_fp8_block"), ("ours Mosaic", "ours_mgpu"), ("cuBLASLt via our FFI", "ours_cublaslt"),
            ("cuBLASLt 1D x 1D (weight scales per row)", "ours_cublaslt_1d"),
            ("cuBLAS FP8 block (torch)", "torch_cublas_fp8_block"), ("XLA FP8 tensorwise", "xla_fp8_tensorwise"),
            ("XLA BF16", "xla_bf16"))


def _table(rows: list[dict], field: str) -> list[str]:
    head = " | ".join(c for c, _ in _COLUMNS)
    lines = [f"| M | N | K | {head} | best own kernel / cuBLAS block | best own kernel / BF16 | "
             "best dispatchable (incl. cuBLASLt) / BF16 | best dispatchable / cuBLAS block |",
             "|---|---|---|" + "---|" * (len(_COLUMNS) + 4)]
    for r in rows:
        def tf(k):
            v = r.get(k, {})
            return v.get(field) if isinstance(v, dict) else None
        tri, mos, lt = tf("ours_fp8_block"), tf("ours_mgpu"), tf("ours_cublaslt")
        cub, bf = tf("torch_cublas_fp8_block"), tf("xla_bf16")
        ours = max((v for v in (tri, mos) if v is not None), default=None)  # our own kernels
        stack = max((v for v in (tri, mos, lt) if v is not None), default=None)  # what the dispatcher can pick
        fmt = lambda v: "n/a" if v is None else f"{v:.0f}"  # noqa: E731
        ratio = lambda a, b: "n/a" if a is None or b is None else f"{a / b:.2f}x"  # noqa: E731
        cells = " | ".join(fmt(tf(key)) for _, key in _COLUMNS)
        lines.append(f"| {r['M']} | {r['N']} | {r['K']} | {cells} | {ratio(ours, cub)} | {ratio(ours, bf)} | "
                     f"{ratio(stack, bf)} | {ratio(stack, cub)} |")
    return lines


def markdown(results: dict) -> str:
    lines = ["# FP8 GEMM", "", "TFLOP/s, R distinct input sets per timed program.", "",
             "## By GPU time", "",
             "The kernels' time per call: for our and XLA's calls, the sum of the kernels of one program of R calls "
             "under the JAX profiler (the scale transposes and padding copies of our wrappers included); for torch, "
             "CUDA events around a CUDA graph of the R calls (median of 10). Neither includes the host's launch "
             "gaps, so this is what a call costs inside a step that keeps the GPU busy (the rollout's decode loop).",
             "", *_table(results["gemm"], "gpu_tflops"), "",
             "## By wall clock", "",
             "Median of 10 wall-clock runs of the R-call program, per call (host dispatch included: a call that "
             "launches slower than it runs is timed at its launch rate; torch's column is its graph replay).", "",
             *_table(results["gemm"], "tflops")]
    ws = results.get("weight_sync")
    if ws:
        lines += ["", f"Weight sync, all {ws['tensors']} Qwen3-8B linear weights ({ws['params'] / 1e9:.2f} G params, "
                  f"{ws['bytes_moved'] / 1e9:.1f} GB moved, floor {ws['floor_ms']:.1f} ms at "
                  f"{results['hbm_copy_gbps']:.0f} GB/s):",
                  f"- Pallas kernel: {ws['pallas']['ms']:.1f} ms ({ws['pallas']['GBps']:.0f} GB/s, "
                  f"{100 * ws['pallas']['frac_of_copy_ceiling']:.0f}% of the copy ceiling); bit-exact vs reference: "
                  f"{ws['pallas_bit_exact_vs_reference']}",
                  f"- jnp reference (XLA-fused): {ws['jnp_reference']['ms']:.1f} ms ({ws['jnp_reference']['GBps']:.0f} GB/s)"]
    return "\n".join(lines) + "\n"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--m", type=int, nargs="*", default=list(BENCH_M))
    ap.add_argument("--nk", type=int, nargs="*", default=None,
                    help="N K pairs, flattened (default: the Qwen3-8B shapes and the 30B-A3B expert shapes)")
    ap.add_argument("--no-triton", action="store_true",
                    help="skip the Triton-lowered kernel (its compiles take most of a full run)")
    ap.add_argument("--backend-table-out", type=Path, default=None,
                    help="write the faster dense FP8 GEMM (Mosaic or cuBLASLt) per (M bucket, N, K) measured here, "
                         f"merged into {GEMM_BACKEND_TABLE.name} (which GemmBackend.AUTO follows)")
    ap.add_argument("--skip-sync", action="store_true", help="skip the weight-quantization timing")


def run(args: argparse.Namespace) -> dict:
    try:
        import torch

        torch_ok = torch.cuda.is_available()
    except ImportError:
        torch_ok = False
    results = {**ceiling_record(), "gemm": []}
    key = jax.random.key(0)
    nk = QWEN3_8B_NK + QWEN3_30B_EXPERT_NK if args.nk is None else tuple(zip(args.nk[::2], args.nk[1::2]))
    for n, k in nk:
        for m in args.m:
            row = bench_shape(m, n, k, jax.random.fold_in(key, m * 100003 + n * 7 + k), torch_ok,
                              triton=not args.no_triton)
            results["gemm"].append(row)
            print(json.dumps(row), flush=True)
            if args.backend_table_out is not None:  # after every shape: a cut run keeps what it measured
                entries = backend_entries(results["gemm"], mgpu_kernel._device_kind())
                write_backend_table(args.backend_table_out, entries)
    if not args.skip_sync:
        results["weight_sync"] = bench_weight_sync(key)
        print(json.dumps(results["weight_sync"]), flush=True)
    print(markdown(results))
    return results


SMOKE = None  # GPU kernels and GPU time only
