"""The decode step's GEMMs one by one, as the generator runs them, with split-K variants.

At 256 decode rows an ``[M, K] x [N, K]^T`` GEMM with N = 4096 has 2 x 32 output tiles of 128 x 128 for 132 SMs,
so cuBLAS may leave half the GPU idle on Qwen3-8B's o_proj and down_proj. This script times, per shape (the
preset's fused q/k/v and gate/up, o_proj, down_proj, lm_head) and per M:

- ``bf16``: `DensePolicy(fused_cast=True).dot`, the generator's BF16 linear;
- ``bf16_splitk{s}``: K cut in ``s`` slices as a batched dot (float32 partials) summed in float32 and rounded once;
- ``fp8``: `W8A8Policy().dot` (the measured backend table's GEMM: cuBLASLt or the Mosaic kernel), the activations'
  quantization included;
- with ``--triton``, kernel against kernel on the same quantized operands: ``fp8_cublaslt`` (cuBLASLt's block-scaled
  GEMM) and ``fp8_triton_<config>`` for each of `pallas_kernels.fp8_gemm.DECODE_CONFIGS` (our Triton kernel with
  split-K, its partials' sum included); ``--triton-table-out PATH`` then writes (merges into) the measured Triton
  table that `fp8rl_jax.quant.policy.triton_config` and ``GemmBackend.AUTO`` read (`TRITON_GEMM_TABLE`): per
  (M bucket, N, K) the fastest config and whether it beat cuBLASLt by ``--triton-margin``.

GPU time per call from one profiled program (`experiments.bench.timing.replay_gpu_ms`) over ``--sets`` different
weights (so no weight is read from L2), TFLOP/s and the weight bytes' GB/s; each variant's max relative error
against float64 numpy of the same BF16 / FP8 operands. Off the GPU it
checks the errors only (the timings are NaN: no GPU kernels to trace; FP8 through the policy's jnp reference).

An FP8 split-K made of cuBLASLt calls over K slices is not offered: slicing the operands copies them
(100+ us a call). The BF16 split-K helps no Qwen3-8B shape at M = 256; FP8 o_proj and qkv take ~15 us in
cuBLASLt's kernel whatever their size.

    python -m experiments.bench decode_gemms --preset qwen3_8b --m 64 128 256
    python -m experiments.bench decode_gemms --preset qwen3_8b --m 64 128 256 --triton --triton-table-out fp8rl_jax/quant/fp8_gemm_triton.json
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from configs.models import PRESETS
from fp8rl_jax.models.policy import DensePolicy
from fp8rl_jax.numerics.fp8 import codes_to_float32, quantize_activations
from fp8rl_jax.quant.policy import W8A8Policy, quantize_weight
from pallas_kernels import fp8_gemm as triton_gemm
from experiments.bench.tables import merged_tuning, write_tuning
from fp8rl_jax.quant import cublaslt
from experiments.bench.timing import replay_gpu_ms
from pallas_kernels.common import device_kind, m_bucket


def triton_table_entries(rows: list[dict], kind: str, margin: float) -> list[dict]:
    """Per (M bucket, N, K) of ``rows`` with timed Triton and cuBLASLt variants: the fastest Triton config, both GPU
    times (us), and ``backend`` "triton" where it took at most ``1 - margin`` of cuBLASLt's time, else "cublaslt"."""
    by_shape: dict[tuple[int, int, int], dict] = {}
    for r in rows:
        if "gpu_ms" not in r or not math.isfinite(r["gpu_ms"]):
            continue
        key = (m_bucket(r["m"]), r["n"], r["k"])
        slot = by_shape.setdefault(key, {"triton": None, "cublaslt": None})
        if r["variant"] == "fp8_cublaslt":
            slot["cublaslt"] = r["gpu_ms"]
        elif r["variant"].startswith("fp8_triton_") and (slot["triton"] is None or r["gpu_ms"] < slot["triton"][0]):
            slot["triton"] = (r["gpu_ms"], r["config"])
    entries = []
    for (mb, n, k), slot in sorted(by_shape.items()):
        if slot["triton"] is None or slot["cublaslt"] is None:
            continue
        ms, config = slot["triton"]
        entries.append({"device_kind": kind, "m_bucket": mb, "n": n, "k": k, "config": config,
                        "us": {"triton": round(ms * 1e3, 2), "cublaslt": round(slot["cublaslt"] * 1e3, 2)},
                        "backend": "triton" if ms <= (1 - margin) * slot["cublaslt"] else "cublaslt"})
    return entries


def decode_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(N, K) of each GEMM of a dense preset's decode step, with q/k/v and gate/up fused as the generator runs
    them."""
    h, d = cfg.hidden_size, cfg.head_dim
    return {"qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h), "o_proj": (h, cfg.num_heads * d),
            "gate_up": (2 * cfg.intermediate_size, h), "down_proj": (h, cfg.intermediate_size),
            "lm_head": (cfg.vocab_size, h)}


def bf16_splitk(x: jax.Array, w: jax.Array, s: int) -> jax.Array:
    """``x @ w.T`` with K in ``s`` slices: one batched dot writing float32 partials, summed, rounded once."""
    m, k = x.shape
    n = w.shape[0]
    parts = jax.lax.dot_general(x.reshape(m, s, k // s), w.reshape(n, s, k // s), (((2,), (2,)), ((1,), (1,))),
                                preferred_element_type=jnp.float32)  # [s, M, N]
    return parts.sum(0).astype(x.dtype)


def reference_fp8(x: np.ndarray, qw) -> np.ndarray:
    """float64 numpy of the W8A8 product of ``x`` (quantized per 1x128 group as the generator does) and ``qw``."""
    xq, xs = quantize_activations(jnp.asarray(x), 128)
    a = np.asarray(codes_to_float32(xq), np.float64)
    a = a * np.repeat(np.asarray(xs, np.float64), 128, axis=1)[:, : a.shape[1]]
    w = np.asarray(codes_to_float32(qw.q), np.float64)
    si = np.asarray(qw.scale_inv, np.float64)
    w = w * np.repeat(np.repeat(si, 128, axis=0), 128, axis=1)[: w.shape[0], : w.shape[1]]
    return a @ w.T


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="qwen3_8b", choices=sorted(PRESETS))
    p.add_argument("--m", type=int, nargs="+", default=[256])
    p.add_argument("--splits", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--sets", type=int, default=6, help="different weights per timed program (no L2 reuse)")
    p.add_argument("--shapes", nargs="+", default=None, help="a subset of qkv o_proj gate_up down_proj lm_head")
    p.add_argument("--no-fp8", action="store_true")
    p.add_argument("--triton", action="store_true",
                   help="also time cuBLASLt and our split-K Triton kernel on pre-quantized operands")
    p.add_argument("--triton-configs", nargs="+", default=None, metavar="SPEC",
                   help="with --triton: these Triton configs (block_m,block_n,warps,stages,k_splits[,swap][,preload]"
                        "[,prefetch]) instead of pallas_kernels.fp8_gemm.DECODE_CONFIGS")
    p.add_argument("--triton-table-out", type=Path, default=None,
                   help="with --triton: merge the per-shape winners into this table (the policy reads "
                        "fp8rl_jax/quant/fp8_gemm_triton.json)")
    p.add_argument("--triton-margin", type=float, default=0.03,
                   help="Triton wins a shape where it takes at most (1 - margin) of cuBLASLt's GPU time")


def run(args: argparse.Namespace) -> dict:
    """Every variant of every chosen shape and M; ValueError for flags that need ``--triton`` without it."""
    if args.triton_table_out is not None and not args.triton:
        raise ValueError("--triton-table-out needs --triton")
    if args.triton_configs is not None and not args.triton:
        raise ValueError("--triton-configs needs --triton")
    triton_configs = ([triton_gemm.GemmConfig.from_spec(s) for s in args.triton_configs]
                      if args.triton_configs else list(triton_gemm.DECODE_CONFIGS))

    cfg = PRESETS[args.preset]
    shapes = {k: v for k, v in decode_shapes(cfg).items() if args.shapes is None or k in args.shapes}
    dense = DensePolicy("bfloat16", fused_cast=True)
    w8a8 = W8A8Policy("bfloat16")
    fp8_ok = not args.no_fp8  # off the GPU the policy's jnp reference (errors only)
    rng = np.random.default_rng(0)
    rows = []
    for name, (n, k) in shapes.items():
        ws = [jnp.asarray(rng.standard_normal((n, k), np.float32) * k ** -0.5, jnp.bfloat16) for _ in range(args.sets)]
        qws = [quantize_weight(w) for w in ws] if fp8_ok and name != "lm_head" else []
        for m in args.m:
            xs = [jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16) for _ in range(args.sets)]
            ref = np.asarray(xs[0], np.float64) @ np.asarray(ws[0], np.float64).T
            ref8 = reference_fp8(np.asarray(xs[0], np.float32), qws[0]) if qws else None
            variants = {"bf16": (lambda x, w: dense.dot(x, w, None), ws, ref)}
            configs = {}  # Triton variant -> its GemmConfig
            variants.update({f"bf16_splitk{s}": (lambda x, w, s=s: bf16_splitk(x, w, s), ws, ref)
                             for s in args.splits if k % s == 0})
            if qws:
                variants["fp8"] = (lambda x, w: w8a8.dot(x, w, None), qws, ref8)
            if qws and args.triton:
                xq = [quantize_activations(x, 128) for x in xs]
                ops = [(a, sa, w.q, w.scale_inv) for (a, sa), w in zip(xq, qws)]
                ref_q = np.asarray(triton_gemm.fp8_gemm_reference(*ops[0], out_dtype=jnp.float32), np.float64)
                if jax.default_backend() == "gpu":
                    variants["fp8_cublaslt"] = (lambda x, op: cublaslt.fp8_gemm_cublaslt(*op), ops, ref_q)
                for cfg in triton_configs:
                    name_ = (f"fp8_triton_{cfg.block_m}x{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}k{cfg.k_splits}"
                             + "_swap" * cfg.swap_ab + "_preload" * cfg.preload_scales
                             + "_prefetch" * cfg.prefetch_scales)
                    variants[name_] = (lambda x, op, cfg=cfg: triton_gemm.fp8_gemm(*op, config=cfg), ops,
                                       ref_q)
                    configs[name_] = dataclasses.asdict(cfg)
            flop = 2.0 * m * n * k
            for vname, (fn, wset, r) in variants.items():
                try:
                    res, outs = replay_gpu_ms(fn, list(zip(xs, wset)), with_outputs=True)
                except Exception as e:  # noqa: BLE001 - a variant the backend rejects is a row, not a crash
                    rows.append({"shape": name, "m": m, "n": n, "k": k, "variant": vname, "error": repr(e)[:300]})
                    print(f"{name:9s} M={m:4d} {vname:12s} failed: {e!r}"[:200], flush=True)
                    continue
                ms = res["busy_ms"] or float("nan")  # no GPU kernels on the CPU: errors only
                err = float(np.max(np.abs(np.asarray(outs[0], np.float64) - r)) / np.max(np.abs(r)))
                wbytes = n * k * (1 if vname.startswith("fp8") else 2)
                row = {"shape": name, "m": m, "n": n, "k": k, "variant": vname, "gpu_ms": ms,
                       "span_ms": res["span_ms"], "tflops": flop / ms / 1e9, "weight_gbps": wbytes / ms / 1e6,
                       "max_rel_err": err, "kernels": res["kernels"]}
                if vname in configs:
                    row["config"] = configs[vname]
                rows.append(row)
                print(f"{name:9s} M={m:4d} {vname:12s} {ms * 1e3:8.1f} us {row['tflops']:7.1f} TFLOP/s "
                      f"{row['weight_gbps']:7.0f} GB/s err {err:.1e}  {list(res['kernels'])[:2]}", flush=True)
        save(rows, args)  # after every shape: a run cut short keeps its table entries
    save(rows, args, final=True)
    return {"preset": args.preset, "rows": rows}


def save(rows: list[dict], args, final: bool = False) -> None:
    """Merges the Triton winners so far into ``--triton-table-out`` (printing them at the end); off the GPU
    nothing is timed, so no table is written."""
    if args.triton_table_out is not None:
        entries = triton_table_entries(rows, device_kind(), args.triton_margin)
        for e in entries if final else []:
            print(f"M<={e['m_bucket']:4d} N={e['n']:5d} K={e['k']:5d}: {e['backend']:8s} triton {e['us']['triton']} us "
                  f"cuBLASLt {e['us']['cublaslt']} us  {e['config']}", flush=True)
        if entries:
            write_tuning(args.triton_table_out, merged_tuning(args.triton_table_out, entries))


def result_name(args: argparse.Namespace) -> str:
    return "decode_gemms" + ("_triton" if args.triton else "") + ("" if args.preset == "qwen3_8b" else f"_{args.preset}")


SMOKE = ["--preset", "tiny_qwen3", "--m", "8", "--splits", "2", "--sets", "2",
         "--shapes", "qkv", "o_proj", "gate_up", "down_proj", "lm_head"]
