"""Decode-step q/k/v epilogue: GPU time of `qkv_rope_write` against the ops it replaces.

The composition is the model's per-head norms and RoPE as XLA fuses them, then the `kv_write` kernel;
the kernel does all of it in one pass (one program per row, per ``--warps``). Qwen3-8B's attention shape
by default. Each timed program chains ``--sets`` calls on distinct inputs through donated pools (the
engine's in-place write) and runs once under the profiler; GPU time is the sum of its kernels per call.
Bytes moved: the q/k/v row read, q written, k and v written to the pools. Off the GPU the kernels run in
interpret mode and no GPU time is recorded (None): the smoke run.

    python -m experiments.bench kv_write --rows 64 256
"""

from __future__ import annotations

import tempfile

import jax
import jax.numpy as jnp

from experiments.bench.tables import write_results
from experiments.bench.timing import trace_kernels
from fp8rl_jax.models.attention import apply_rope, rope_cos_sin
from fp8rl_jax.models.policy import rms_norm
from pallas_kernels.kv_write import kv_write, qkv_rope_write

SMOKE = ["--rows", "4", "--heads", "4", "2", "32", "--pools", "float8_e4m3fn", "--warps", "4", "--sets", "2"]
EPS = 1e-6


def add_arguments(parser) -> None:
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("N", "K", "H"))
    parser.add_argument("--pools", nargs="+", default=["float8_e4m3fn", "bfloat16"])
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--sets", type=int, default=6, help="distinct input sets per timed program")
    parser.add_argument("--out", default=None, help="also write the rows to this JSON")


def _composition(n: int, k: int, h: int):
    """The ops `qkv_rope_write` replaces: split, the model's rms_norm and apply_rope, the `kv_write` kernel."""

    def fn(qkv, qn, kn, cos, sin, kp, vp, page, slot, ks, vs):
        b = qkv.shape[0]
        q, kk, v = jnp.split(qkv, [n * h, (n + k) * h], axis=-1)
        q = apply_rope(rms_norm(q.reshape(b, 1, n, h), qn, EPS), cos[:, None], sin[:, None])[:, 0]
        kk = apply_rope(rms_norm(kk.reshape(b, 1, k, h), kn, EPS), cos[:, None], sin[:, None])[:, 0]
        kp, vp = kv_write(kk, v.reshape(b, k, h), kp, vp, page, slot, ks, vs)
        return q, kp, vp

    return fn


def _fused(n: int, warps: int):
    def fn(qkv, qn, kn, cos, sin, kp, vp, page, slot, ks, vs):
        return qkv_rope_write(qkv, qn, kn, cos, sin, kp, vp, page, slot, ks, vs, num_heads=n, q_eps=EPS,
                              k_eps=EPS, num_warps=warps)

    return fn


def _input_sets(b: int, n: int, k: int, h: int, num_pages: int, page_size: int, count: int) -> list[tuple]:
    key = jax.random.key(b)
    sets = []
    for i in range(count):
        kq, kpos, key = jax.random.split(key, 3)
        qkv = (jax.random.normal(kq, (b, (n + 2 * k) * h), jnp.float32) * 4).astype(jnp.bfloat16)
        cos, sin = rope_cos_sin(jax.random.randint(kpos, (b, 1), 0, 4096), h, 1e6)
        page = (jnp.arange(b, dtype=jnp.int32) * 4 + i % 4) % num_pages
        sets.append((qkv, cos[:, 0], sin[:, 0], page, jnp.full((b,), i % page_size, jnp.int32)))
    return sets


def _gpu_us(fn, sets, pools, qn, kn, ks, vs) -> tuple[float | None, dict[str, float]]:
    """GPU microseconds per call of ``fn`` over ``sets`` chained through donated pools, and the top kernels."""

    def chain(pools, sets):
        kp, vp = pools
        qs = []
        for qkv, cos, sin, page, slot in sets:
            q, kp, vp = fn(qkv, qn, kn, cos, sin, kp, vp, page, slot, ks, vs)
            qs.append(q)
        return qs, (kp, vp)

    step = jax.jit(chain, donate_argnums=0)
    _, pools = jax.block_until_ready(step(pools, sets))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        _, pools = jax.block_until_ready(step(pools, sets))
        jax.profiler.stop_trace()
        by_name, _, _ = trace_kernels(d)
    us = sum(by_name.values()) / len(sets) or None  # no GPU kernels off the GPU
    top = {name[:80]: round(v / len(sets), 3) for name, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:8]}
    return us, top


def run(args) -> dict:
    n, k, h = args.heads
    page_size = 16
    qn = jnp.ones((h,), jnp.bfloat16)
    kn = jnp.ones((h,), jnp.bfloat16)
    ks, vs = jnp.float32(0.05), jnp.float32(0.02)
    rows = []
    for pool_name in args.pools:
        pool_dtype = jnp.dtype(pool_name)
        for b in args.rows:
            num_pages = 4 * b
            sets = _input_sets(b, n, k, h, num_pages, page_size, args.sets)
            moved = b * ((n + 2 * k) * h * 2 + n * h * 2 + 2 * k * h * pool_dtype.itemsize)
            impls = [("composition", None, _composition(n, k, h))]
            impls += [("kernel", w, _fused(n, w)) for w in args.warps]
            for name, warps, fn in impls:
                pools = tuple(jnp.zeros((num_pages, page_size, k, h), pool_dtype) for _ in range(2))
                us, top = _gpu_us(fn, sets, pools, qn, kn, ks, vs)
                rows.append({"pool": pool_name, "rows": b, "heads": [n, k, h], "impl": name, "num_warps": warps,
                             "gpu_us": us, "gbps": None if us is None else moved / us / 1e3, "kernels": top})
                shown = "-" if us is None else f"{us:8.2f} us {moved / us / 1e3:7.0f} GB/s"
                print(f"{pool_name:14s} B={b:4d} {name:11s} warps={warps} {shown} {list(top)[:3]}", flush=True)
            if args.out:
                write_results(args.out, rows)
    return {"interpret": jax.default_backend() != "gpu", "results": rows}
