"""Times cuBLASLt's block-scaled FP8 algorithms at the decode step's GEMMs and writes the fastest per shape.

cuBLASLt's heuristic takes one algorithm per (M, N, K). At decode sizes its choice can leave most of the GPU idle:
on the H200 (session 25's W2 profile, 128 rows) the generator's FP8 GEMMs took 3.05 ms a step for 6.95 GB of
weights (53% of the HBM roofline), the fused q/k/v and o_proj ~15 us each whatever their size (32-48 output tiles
of 128 x 128 on 132 SMs). The heuristic may rank more than one algorithm, and an algorithm's K splits can be
pinned (`fp8rl_jax.quant.cublaslt`: ``algo=(index, split_k)``). For each shape (the preset's fused q/k/v, o_proj, fused
gate/up, down_proj) and each M this script:

1. lists the heuristic's algorithms (`cublaslt.list_algos`), as they are and with their K splits pinned to each of
   ``--splits`` where cuBLASLt accepts it; candidates that configure the same kernel are timed once;
2. times every candidate by GPU time (`pallas_kernels.common.replay_gpu_ms`: the kernels' busy time per call over
   ``--sets`` different weights in one traced program, so no call reads its weight from L2; what a call costs inside
   the engine's CUDA graphs), the heuristic's own choice first, and checks its output against that choice's (the
   products are the same up to float32 summation order and the BF16 rounding);
3. keeps the fastest where it beats the heuristic's choice by more than ``--min-gain``.

Measured on the H200 (session 26, cuBLASLt 13.1, `experiments/results/h200_session26_2026-12-04.md`): at every
decode shape of Qwen3-8B and M = 64, 128, 256 the heuristic offers one algorithm (one nvjet kernel, 128 x 128 tiles),
and by GPU time pinning its K splits to 2 or 4 made no shape at M = 128 or 256 faster by more than 0.5 us (o_proj at
128 rows: 14.4 -> 13.9 us; q/k/v 14.9 -> 16.7 and 18.2). No table is committed: the script is a tool for another
cuBLASLt or GPU, not a speed-up here.

It writes the candidates' times as JSON (``--out``) and the winners into `fp8rl_jax.quant.policy.CUBLASLT_ALGO_TABLE`
(``--table-out``, merged by device kind, M bucket, N, K), which the W8A8 policy reads (``FP8RL_CUBLASLT_ALGO=
heuristic`` ignores it). A table entry serves its M bucket (`pallas_kernels.common.m_bucket`: M = 16-64 share 64).
Needs cuBLASLt on a CUDA GPU.

    python experiments/tune_cublaslt_algos.py --preset qwen3_8b --m 64 128 256 \\
        --out experiments/results/cublaslt_sweep_h200.json --table-out fp8rl_jax/quant/cublaslt_algos.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.models import PRESETS  # noqa: E402
from experiments.bench_decode_gemms import decode_shapes  # noqa: E402
from fp8rl_jax.quant import cublaslt, quantize_activations_t  # noqa: E402
from fp8rl_jax.quant.policy import CUBLASLT_ALGO_TABLE, quantize_weight  # noqa: E402
from pallas_kernels.common import (device_kind, m_bucket, merged_tuning, replay_gpu_ms, write_results,  # noqa: E402
                                   write_tuning)

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


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3_8b", choices=sorted(PRESETS))
    p.add_argument("--m", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--algos", type=int, default=8, help="the heuristic's first this many algorithms")
    p.add_argument("--shapes", nargs="+", default=["qkv", "o_proj", "gate_up", "down_proj"])
    p.add_argument("--sets", type=int, default=6, help="different weights per timed program (no L2 reuse)")
    p.add_argument("--min-gain", type=float, default=0.03, help="keep a winner only if this much faster")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--table-out", type=Path, default=None,
                   help=f"merge the winners into this table (the policy reads {CUBLASLT_ALGO_TABLE.name})")
    args = p.parse_args(argv)
    ok, why = cublaslt.available()
    if not ok:
        raise SystemExit(f"tune_cublaslt_algos needs cuBLASLt on a CUDA GPU: {why}")
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
            if args.out is not None:
                write_results(args.out, rows)
    if args.table_out is not None:
        write_tuning(args.table_out, merged_tuning(args.table_out, entries))
    return rows


if __name__ == "__main__":
    main()
