"""Times cuBLASLt's block-scaled FP8 algorithms at the decode step's GEMMs and writes the fastest per shape.

cuBLASLt's heuristic takes one algorithm per (M, N, K). At decode sizes its choice can leave most of the GPU idle:
at 128 decode rows of Qwen3-8B the FP8 GEMMs take ~3 ms a step for 6.95 GB of weights (about half of the HBM
roofline), the fused q/k/v and o_proj ~15 us each whatever their size (32-48 output tiles of 128 x 128 on 132 SMs).
The heuristic may rank more than one algorithm, and an algorithm's K splits can be
pinned (`fp8rl_jax.quant.cublaslt`: ``algo=(index, split_k)``). For each shape (the preset's fused q/k/v, o_proj, fused
gate/up, down_proj) and each M this script:

1. lists the heuristic's algorithms (`cublaslt.list_algos`), as they are and with their K splits pinned to each of
   ``--splits`` where cuBLASLt accepts it; candidates that configure the same kernel are timed once;
2. times every candidate by GPU time (`experiments.bench.timing.replay_gpu_ms`: the kernels' busy time per call over
   ``--sets`` different weights in one traced program, so no call reads its weight from L2; what a call costs inside
   the engine's CUDA graphs), the heuristic's own choice first, and checks its output against that choice's (the
   products are the same up to float32 summation order and the BF16 rounding);
3. keeps the fastest where it beats the heuristic's choice by more than ``--min-gain``.

No algorithm table is committed: with cuBLASLt 13.1 on Hopper pinned K splits gain at most 0.5 us a call at
the Qwen3-8B decode shapes (docs/performance.md); the suite is the tool for another cuBLASLt or GPU.

The payload holds the candidates' times; the winners go into `fp8rl_jax.quant.policy.CUBLASLT_ALGO_TABLE`
(``--table-out``, merged by device kind, M bucket, N, K), which the W8A8 policy reads (``FP8RL_CUBLASLT_ALGO=
heuristic`` ignores it). A table entry serves its M bucket (`pallas_kernels.common.m_bucket`: M = 16-64 share 64).
Needs cuBLASLt on a CUDA GPU.

    python -m experiments.bench cublaslt_tune --preset qwen3_8b --m 64 128 256 \\
        --table-out fp8rl_jax/quant/cublaslt_algos.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from configs.models import PRESETS
from experiments.bench.suites.decode_gemms import decode_shapes
from fp8rl_jax.quant import cublaslt, quantize_activations_t
from fp8rl_jax.quant.policy import CUBLASLT_ALGO_TABLE, quantize_weight
from experiments.bench.tables import merged_tuning, write_tuning
from experiments.bench.timing import replay_gpu_ms
from pallas_kernels.common import device_kind, m_bucket

_SIGNATURE = ("tile_id", "stages_id", "split_k", "reduction_scheme", "cluster_shape_id")


def candidates(m: int, n: int, k: int, splits: list[int], top: int = 32) -> list[dict]:
    """(index, split_k) pairs cuBLASLt accepts for the shape, the heuristic's own choice (0, 0) first; a pair whose
    algorithm configures the same kernel as an earlier one (same tile, stages, splits, reduction, cluster) is left
    out, unless cuBLASLt reports no configuration at all (ids 0), where every pair is kept; the heuristic's first
    ``top`` algorithms only. Each: ``algo``,
    ``split_k`` (the pair), the configuration ids (``split_k`` of the configuration as ``kernel_splits``), workspace
    bytes and waves count."""
    out, seen = [], set()
    for split in [0, *splits]:
        for a in cublaslt.list_algos(m, n, k, jnp.bfloat16, split_k=split)[:top]:
            if split and not a["accepted"]:
                continue
            sig = tuple(a[c] for c in _SIGNATURE)
            if any(sig) and sig in seen:
                continue
            seen.add(sig)
            out.append({**{c: a[c] for c in _SIGNATURE}, "kernel_splits": a["split_k"], "algo": a["index"],
                        "split_k": split, "workspace_bytes": a["workspace_bytes"], "waves_count": a["waves_count"]})
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="qwen3_8b", choices=sorted(PRESETS))
    p.add_argument("--m", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--algos", type=int, default=8, help="the heuristic's first this many algorithms")
    p.add_argument("--shapes", nargs="+", default=["qkv", "o_proj", "gate_up", "down_proj"])
    p.add_argument("--sets", type=int, default=6, help="different weights per timed program (no L2 reuse)")
    p.add_argument("--min-gain", type=float, default=0.03, help="keep a winner only if this much faster")
    p.add_argument("--table-out", type=Path, default=None,
                   help=f"merge the winners into this table (the policy reads {CUBLASLT_ALGO_TABLE.name})")


def run(args: argparse.Namespace) -> dict:
    ok, why = cublaslt.available()
    if not ok:
        raise ValueError(f"cublaslt_tune needs cuBLASLt on a CUDA GPU: {why}")
    version, _ = cublaslt.cublaslt_version()
    kind = device_kind()
    shapes = {s: nk for s, nk in decode_shapes(PRESETS[args.preset]).items() if s in args.shapes}
    rng = np.random.default_rng(0)
    rows, entries = [], []
    for name, (n, k) in shapes.items():
        qws = [quantize_weight(jnp.asarray(rng.standard_normal((n, k), np.float32) * k ** -0.5, jnp.bfloat16))
               for _ in range(args.sets)]
        for m in args.m:
            xs = [quantize_activations_t(jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16))
                  for _ in range(args.sets)]
            sets = [(xq, xs_t, w.q, w.scale_inv) for (xq, xs_t), w in zip(xs, qws)]
            cands = candidates(m, n, k, args.splits, args.algos)
            base = None
            for c in cands:
                algo = (c["algo"], c["split_k"])
                fn = lambda a, st, b, bs, algo=algo: cublaslt.fp8_gemm_cublaslt_t(a, st, b, bs, algo=algo)  # noqa: E731
                try:
                    out = np.asarray(fn(*sets[0]), np.float32)
                    gpu = replay_gpu_ms(fn, sets)
                except Exception as e:  # noqa: BLE001 - a candidate cuBLASLt fails at run time is a row, not a crash
                    c["error"] = repr(e)[:300]
                    print(f"{name:9s} M={m:4d} algo {algo} failed: {e!r}"[:200], flush=True)
                    continue
                c.update(ms=gpu["busy_ms"], kernels=gpu["kernels"])
                if base is None:
                    base = out
                c["max_rel_diff"] = float(np.max(np.abs(out - base)) / max(np.max(np.abs(base)), 1e-30))
                c["weight_gbps"] = n * k / c["ms"] / 1e6
                print(f"{name:9s} M={m:4d} algo {algo!s:8s} tile {c['tile_id']:3d} stages {c['stages_id']:3d} "
                      f"splits {c['kernel_splits']:2d} waves {c['waves_count']:5.2f}: {c['ms'] * 1e3:7.1f} us "
                      f"{c['weight_gbps']:6.0f} GB/s diff {c['max_rel_diff']:.1e} {list(c['kernels'])[:2]}", flush=True)
            timed = [c for c in cands if "ms" in c and c["max_rel_diff"] <= 2e-2]
            row = {"shape": name, "m": m, "n": n, "k": k, "cublaslt_version": version, "candidates": cands}
            if timed and "ms" in cands[0]:
                default, best = cands[0], min(timed, key=lambda c: c["ms"])
                keep = best is not default and best["ms"] < (1 - args.min_gain) * default["ms"]
                chosen = best if keep else default
                row.update(default_ms=default["ms"], best_ms=best["ms"], chosen=[chosen["algo"], chosen["split_k"]])
                print(f"{name:9s} M={m:4d} heuristic {default['ms'] * 1e3:.1f} us, best {best['ms'] * 1e3:.1f} us "
                      f"(algo {best['algo']}, splits {best['split_k']}): {'kept' if keep else 'not kept'}", flush=True)
                if keep:
                    entries.append({"device_kind": kind, "m_bucket": m_bucket(m), "n": n, "k": k,
                                    "algo": best["algo"], "split_k": best["split_k"], "cublaslt_version": version,
                                    "ms": {"heuristic": default["ms"], "chosen": best["ms"]}})
            rows.append(row)
    if args.table_out is not None:
        write_tuning(args.table_out, merged_tuning(args.table_out, entries))
    return {"preset": args.preset, "rows": rows, "table_entries": entries}


SMOKE = None  # cuBLASLt on a CUDA GPU
