"""Where a decode-size cuBLASLt FP8 GEMM's time goes (session 10: our call ran 0.55-0.65x torch's cuBLAS at M <= 256
with the same cuBLAS kernel). For each shape, 64 distinct input sets in one jitted program, timed (median of 10) and
traced once, in four variants:
  full      fp8_gemm_cublaslt as the engine calls it (scale transpose + custom call), graph-capturable registration
  pre_t     the custom call alone, scales already [K/128, M] (no transpose kernel)
  eager     pre_t through the eager registration
  quant     activation quantization + full (what a decode projection runs)
Per variant: wall us per call, and from the trace the GPU us per call of the cuBLAS kernel(s), of everything, and the
GPU span (span - busy = idle gaps). torch's scaled_mm BlockWise in one CUDA graph is timed alongside when torch is
importable. Prints one JSON line per (shape, variant); --out writes them all."""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments.profile_decode import kernel_times  # noqa: E402
from fp8rl_jax.environment import run_environment  # noqa: E402
from fp8rl_jax.quant import cublaslt, quantize_activations, quantize_weight_blockwise  # noqa: E402

SETS = 64


def timed(fn, args, name):
    run = jax.jit(fn)
    jax.block_until_ready(run(*args))
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        ts.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        jax.block_until_ready(run(*args))
        jax.profiler.stop_trace()
        by_class, by_name, span, _ = kernel_times(Path(d))
    gemm = sum(v for k, v in by_name.items() if any(s in k.lower() for s in ("nvjet", "gemm", "xmma", "cutlass", "sm90")))
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:6]
    return {"variant": name, "wall_us": 1e6 * statistics.median(ts) / SETS, "gemm_gpu_us": gemm / SETS,
            "busy_gpu_us": sum(by_name.values()) / SETS, "span_gpu_us": span / SETS,
            "top": {k[:80]: round(v / SETS, 2) for k, v in top}}


def torch_us(qs, ws, row):
    try:
        from experiments.bench_gemm import bench_torch_blockwise
        ref = jnp.zeros((qs[0][0].shape[0], ws[0].q.shape[0]), jnp.float32)  # error column unused here
        return 1e3 * bench_torch_blockwise(qs, ws, ref, dict(row))
    except Exception as e:  # noqa: BLE001 - no torch, or no block scaling in it
        return f"{type(e).__name__}: {str(e)[:200]}"


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="256x4096x4096,256x12288x4096,64x4096x4096,2048x4096x4096")
    p.add_argument("--out")
    args = p.parse_args(argv)
    print("cuBLASLt available:", cublaslt.available(), flush=True)  # also registers the handlers
    rows = []
    for shape in args.shapes.split(","):
        m, n, k = map(int, shape.split("x"))
        keys = jax.random.split(jax.random.key(m + n + k), 2 * SETS)
        xs = [jax.random.normal(keys[i], (m, k), jnp.bfloat16) for i in range(SETS)]
        ws = [quantize_weight_blockwise(jax.random.normal(keys[SETS + i], (n, k), jnp.float32) * 0.02)
              for i in range(SETS)]
        qs = [quantize_activations(x) for x in xs]
        bf = jnp.dtype(jnp.bfloat16)
        full = lambda qs, ws: [cublaslt._call(q, s, w.q, w.scale_inv, bf) for (q, s), w in zip(qs, ws)]  # noqa: E731
        quant = lambda xs, ws: [cublaslt._call(*quantize_activations(x), w.q, w.scale_inv, bf)  # noqa: E731
                                for x, w in zip(xs, ws)]
        qts = [(q, s.T) for q, s in qs]

        def pre(target):
            return lambda qts, ws: [cublaslt._ffi(q, st, w.q, w.scale_inv, bf, target, 1) for (q, st), w in zip(qts, ws)]

        row = {"M": m, "N": n, "K": k}
        row["torch_graph_us"] = torch_us(qs, ws, row)
        for name, fn, a in (("full", full, (qs, ws)), ("pre_t", pre(cublaslt.FFI_TARGET), (qts, ws)),
                            ("eager", pre(cublaslt.FFI_TARGET_EAGER), (qts, ws)), ("quant", quant, (xs, ws))):
            try:
                r = timed(fn, a, name)
            except Exception as e:  # noqa: BLE001
                r = {"variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            r.update(M=m, N=n, K=k, tflops_wall=(2 * m * n * k / (r["wall_us"] * 1e6)) if "wall_us" in r else None)
            print(json.dumps(r), flush=True)
            row[name] = r
        rows.append(row)
        print(json.dumps({"M": m, "N": n, "K": k, "torch_graph_us": row["torch_graph_us"]}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"environment": run_environment(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
