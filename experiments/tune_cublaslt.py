"""Which of cuBLASLt's block-scaled FP8 algorithms runs each of the generator's GEMMs fastest.

cuBLASLt's heuristic ranks its candidate algorithms by a model and `fp8rl_jax.quant.cublaslt` ran its first
choice. At decode's few rows that choice can leave SMs idle: on the H200 (session 20) the first choice for
Qwen3-8B's o_proj (N = K = 4096) at 256 rows took 14.8 us, about three times its weight bytes at HBM speed.
This script times every candidate the heuristic offers (up to ``--candidates``) per (M, N, K) of the presets'
linear layers (fused q/k/v and gate/up as the generator runs them; MoE presets: attention only, the experts
run the grouped kernel), checks each against the first choice's product, and writes the winners into the table
the dispatcher reads (`fp8rl_jax.quant.cublaslt.ALGO_TABLE`, per device kind and cuBLASLt version) with
``--table-out``. A candidate replaces the first choice only when it is at least ``--min-gain`` faster.

GPU time per call from one profiled program over ``--sets`` different weights (`replay_gpu_ms`). GPU only.

    python experiments/tune_cublaslt.py --presets qwen3_8b --m 256 4096 --out r.json --table-out
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from configs.models import PRESETS  # noqa: E402
from bench_decode_gemms import decode_shapes  # noqa: E402
from fp8rl_jax.quant import cublaslt  # noqa: E402
from fp8rl_jax.quant.fp8 import quantize_activations_t  # noqa: E402
from fp8rl_jax.quant.policy import quantize_weight  # noqa: E402
from pallas_kernels.common import replay_gpu_ms, run_environment, write_results  # noqa: E402


def shapes_of(preset: str) -> dict[str, tuple[int, int]]:
    """(N, K) of the FP8 GEMMs the generator runs through cuBLASLt for ``preset``."""
    cfg = PRESETS[preset]
    shapes = decode_shapes(cfg)
    shapes.pop("lm_head")  # BF16
    if cfg.num_experts:
        shapes.pop("gate_up"), shapes.pop("down_proj")  # the grouped kernel's
    return shapes


def tune_shape(m: int, n: int, k: int, candidates: int, sets: int, rng: np.random.Generator) -> dict:
    """Every candidate's GPU time (us) for one shape, its kernels, its error against candidate 0; the best."""
    ws = [quantize_weight(jnp.asarray(rng.standard_normal((n, k), np.float32) * k ** -0.5, jnp.bfloat16))
          for _ in range(sets)]
    xs = [quantize_activations_t(jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16))
          for _ in range(sets)]
    args = [(x[0], x[1], w.q, w.scale_inv) for x, w in zip(xs, ws)]
    rows, first = [], None
    for algo in range(candidates):
        fn = lambda a, s, q, si, algo=algo: cublaslt.fp8_gemm_cublaslt_t(a, s, q, si, out_dtype=jnp.bfloat16,  # noqa: E731
                                                                          algo=algo)
        try:
            res, outs = replay_gpu_ms(fn, args, with_outputs=True)
        except Exception as e:  # noqa: BLE001 - a candidate that fails is recorded, not fatal
            rows.append({"algo": algo, "error": repr(e)[:300]})
            continue
        out = np.asarray(outs[0], np.float32)
        first = out if first is None else first
        rel = float(np.max(np.abs(out - first)) / max(float(np.max(np.abs(first))), 1e-30))
        rows.append({"algo": algo, "us": res["busy_ms"] * 1e3, "kernels": res["kernels"], "rel_diff_vs_0": rel})
    return {"m": m, "n": n, "k": k, "candidates": rows}


def best_entry(shape: dict, min_gain: float, kind: str, version: int) -> dict | None:
    """The table entry for a tuned shape: the fastest candidate that agrees with the first choice (bf16
    rounding) and beats it by ``min_gain``, else candidate 0."""
    ok = [r for r in shape["candidates"] if "us" in r and r["rel_diff_vs_0"] < 2e-2]
    if not ok or ok[0]["algo"] != 0:
        return None
    base = ok[0]["us"]
    best = min(ok, key=lambda r: r["us"])
    algo = best["algo"] if best["us"] <= (1.0 - min_gain) * base else 0
    return {"device_kind": kind, "cublaslt_version": version, "m": shape["m"], "n": shape["n"], "k": shape["k"],
            "out_dtype": "bfloat16", "b_blocks": 1, "algo": algo,
            "us": round(next(r["us"] for r in ok if r["algo"] == algo), 3), "us_first_choice": round(base, 3),
            "kernel": next(iter(next(r for r in ok if r["algo"] == algo)["kernels"]), "")}


def merged(entries: list[dict]) -> list[dict]:
    """The table at `cublaslt.ALGO_TABLE` with ``entries`` replacing those of the same key."""
    key = lambda e: (e["device_kind"], e["cublaslt_version"], e["m"], e["n"], e["k"], e["out_dtype"],  # noqa: E731
                     e["b_blocks"])
    new = {key(e) for e in entries}
    path = cublaslt.ALGO_TABLE
    old = json.loads(path.read_text()).get("entries", []) if path.exists() else []
    return [e for e in old if key(e) not in new] + entries


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["qwen3_8b"], choices=sorted(PRESETS))
    p.add_argument("--m", type=int, nargs="+", default=[256, 4096], help="rows (decode slots, prefill tokens)")
    p.add_argument("--candidates", type=int, default=16)
    p.add_argument("--sets", type=int, default=6)
    p.add_argument("--min-gain", type=float, default=0.03)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--table-out", action="store_true", help=f"merge the winners into {cublaslt.ALGO_TABLE.name}")
    args = p.parse_args(argv)
    ok, why = cublaslt.available()
    if not ok:
        raise SystemExit(f"cuBLASLt cannot run here: {why}")
    version, kind = cublaslt.cublaslt_version()[0], jax.devices()[0].device_kind
    rng = np.random.default_rng(0)
    seen, shapes, entries = set(), [], []
    for preset in args.presets:
        for name, (n, k) in shapes_of(preset).items():
            for m in args.m:
                mp = -(-m // 16) * 16
                if (mp, n, k) in seen:
                    continue
                seen.add((mp, n, k))
                shape = tune_shape(mp, n, k, args.candidates, args.sets, rng)
                shape.update(preset=preset, name=name)
                shapes.append(shape)
                entry = best_entry(shape, args.min_gain, kind, version)
                if entry is not None:
                    entries.append(entry)
                times = " ".join(f"{r['algo']}:{r['us']:.1f}" for r in shape["candidates"] if "us" in r)
                print(f"{preset} {name:9s} M={mp:5d} N={n:6d} K={k:6d}  choose {entry and entry['algo']}  "
                      f"us {times}", flush=True)
                # after every shape, so a run cut short keeps what it measured
                if args.out is not None:
                    write_results(args.out, [{"cublaslt_version": version, "shapes": shapes, "entries": entries}])
                if args.table_out:
                    table = {"environment": run_environment(cublaslt_version=version), "entries": merged(entries)}
                    cublaslt.ALGO_TABLE.write_text(json.dumps(table, indent=1) + "\n")
    if args.table_out:
        print(f"wrote {cublaslt.ALGO_TABLE}")


if __name__ == "__main__":
    main()
