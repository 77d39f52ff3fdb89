"""Paged prefill-attention kernel: TFLOP/s per config against the gather-all jnp path it replaces.

Qwen3-8B's attention (32 query heads, 8 kv heads of 128, pages of 16 tokens) on prompts of 1024 tokens
and on chunks continuing at 2k context (chunked prefill, recompute after preemption). Each config is
timed with ``--chain`` calls chained in one jitted program and compared with the float32 jnp twin; FLOPs
count the causal work only. The baseline is what the cache runs without the kernel: gather every page
of the table, dequantize, ``dot_attention`` with the causal mask. Off the GPU the kernel runs in
interpret mode (the smoke run).

    python -m experiments.bench prefill_attention --max-seconds 35
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench.suites.paged_attention import chained_ms, random_pool
from experiments.bench.tables import write_results
from fp8rl_jax.models.attention import dot_attention
from pallas_kernels import prefill_attention as pf
from pallas_kernels.prefill_attention import DEFAULT_CONFIG, PrefillAttentionConfig

# (name, B, T new tokens, lengths before the chunk)
BENCH_CASES = (
    ("prompt1024", 4, 1024, 0),
    ("prompt1024", 8, 1024, 0),
    ("prompt1024", 16, 1024, 0),
    ("chunk512@2k", 8, 512, 2048),
    ("chunk1024@2k", 4, 1024, 2048),
)
SWEEP_CONFIGS = (
    PrefillAttentionConfig(block_q=32, pages_per_block=4, num_warps=4, num_stages=2),
    PrefillAttentionConfig(block_q=32, pages_per_block=8, num_warps=8, num_stages=2),
    PrefillAttentionConfig(block_q=32, pages_per_block=4, num_warps=8, num_stages=3),
    PrefillAttentionConfig(block_q=16, pages_per_block=4, num_warps=4, num_stages=2),
    PrefillAttentionConfig(block_q=16, pages_per_block=8, num_warps=4, num_stages=3),
    PrefillAttentionConfig(block_q=64, pages_per_block=4, num_warps=8, num_stages=2),
)

SMOKE = ["--case", "2", "24", "8", "--heads", "4", "2", "32", "--page-size", "8", "--dtypes", "float8_e4m3fn",
         "--quick", "--chain", "1", "--repeats", "1"]


def attention_flops(lengths: np.ndarray, num_new: np.ndarray, num_heads: int, head_dim: int) -> int:
    """Useful FLOPs of causal attention: query t of row b sees ``lengths[b] + t + 1`` keys, 2 x H
    multiply-adds each for QK^T and for PV, per head (masked-off work is not counted)."""
    total = 0
    for L, n in zip(np.asarray(lengths, np.int64), np.asarray(num_new, np.int64)):
        total += n * L + n * (n + 1) // 2
    return int(4 * total * num_heads * head_dim)


def bench_inputs(batch: int, T: int, start: int, pool_dtype, *, num_heads: int = 32, num_kv_heads: int = 8,
                 head_dim: int = 128, page_size: int = 16, seed: int = 0):
    """Random prefill inputs ``(q, k_pages, v_pages, k_scale, v_scale, page_table, lengths, num_new)``:
    every row continuing at ``start`` with T real new tokens, pages shuffled across the pool, one spare
    page-table column of garbage ids."""
    rng = np.random.default_rng(seed)
    need = -(-(start + T) // page_size)
    perm = rng.permutation(batch * need).astype(np.int32)
    table = rng.integers(-(2**20), 2**20, (batch, need + 1)).astype(np.int32)
    table[:, :need] = perm.reshape(batch, need)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    pools = random_pool(kk, kv, (batch * need, page_size, num_kv_heads, head_dim), pool_dtype)
    q = jax.random.normal(kq, (batch, T, num_heads, head_dim), jnp.bfloat16)
    lengths = jnp.full((batch,), start, jnp.int32)
    num_new = jnp.full((batch,), T, jnp.int32)
    return q, *pools, jnp.asarray(table), lengths, num_new


@jax.jit
def gather_all_attention(q, k_pages, v_pages, k_scale, v_scale, page_table, lengths, num_new):
    """What ``PagedKVCache.attend`` runs for T > 1 without the kernel: gather every page of the
    table, dequantize to q's dtype, ``dot_attention`` with the causal mask (``num_new`` unused there)."""
    del num_new
    B, T, _, H = q.shape
    _, ps, K, _ = k_pages.shape
    S = page_table.shape[1] * ps

    def load(pages, scale):
        x = pages[page_table]
        if pages.dtype == jnp.float8_e4m3fn:
            x = x.astype(jnp.float32) * scale
        return x.astype(q.dtype).reshape(B, S, K, H)

    mask = jnp.arange(S)[None, None, :] <= (lengths[:, None] + jnp.arange(T)[None, :])[:, :, None]
    return dot_attention(q, load(k_pages, k_scale), load(v_pages, v_scale), mask)


def add_arguments(parser) -> None:
    parser.add_argument("--out", default=None, help="also write the rows to this JSON as they are measured")
    parser.add_argument("--dtypes", nargs="*", default=["bfloat16", "float8_e4m3fn"])
    parser.add_argument("--cases", nargs="*", default=None,
                        help="indices into BENCH_CASES (default all): " +
                        ", ".join(f"{i}={c[0]} B={c[1]}" for i, c in enumerate(BENCH_CASES)))
    parser.add_argument("--case", type=int, nargs=3, default=None, metavar=("B", "T", "START"),
                        help="one case of B rows, T new tokens after START cached ones, instead of BENCH_CASES")
    parser.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("N", "K", "H"),
                        help="query heads, kv heads, head dim (default Qwen3-8B's)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="default config only (no sweep)")
    parser.add_argument("--chain", type=int, default=4, help="kernel calls chained in one timed program")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs of that program (the median counts)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="after this many seconds, time the default config only (keeps a device run bounded)")


def run(args) -> dict:
    t_start = time.perf_counter()
    interpret = jax.default_backend() != "gpu"
    num_heads, num_kv_heads, head_dim = args.heads
    if args.case is not None:
        cases = (("case", *args.case),)
    else:
        cases = BENCH_CASES if args.cases is None else tuple(BENCH_CASES[int(i)] for i in args.cases)
    configs = (DEFAULT_CONFIG,) if args.quick else (DEFAULT_CONFIG,) + SWEEP_CONFIGS
    results = []
    for name, batch, T, start in cases:
        for dtype_name in args.dtypes:
            inputs = bench_inputs(batch, T, start, jnp.dtype(dtype_name), num_heads=num_heads,
                                  num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=args.page_size)
            q, kp, lengths, num_new = inputs[0], inputs[1], inputs[6], inputs[7]
            flops = attention_flops(np.asarray(lengths), np.asarray(num_new), num_heads, head_dim)
            ref = pf.prefill_attention_reference(*inputs).astype(jnp.float32)
            row = {"case": name, "pool": dtype_name, "B": batch, "T": T, "lengths": start, "flops": flops,
                   "configs": []}
            best = None
            over = args.max_seconds is not None and time.perf_counter() - t_start > args.max_seconds
            for cfg in (DEFAULT_CONFIG,) if over else configs:
                try:
                    out = pf.prefill_attention(*inputs, config=cfg, interpret=interpret)
                    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / (jnp.max(jnp.abs(ref)) + 1e-30))
                    run_cfg = pf.fit_config(cfg, T, num_heads // num_kv_heads, args.page_size, head_dim, kp.dtype,
                                            q.dtype)
                    ms = chained_ms(functools.partial(pf._prefill_attention, config=run_cfg, interpret=interpret),
                                    *inputs, n=args.chain, repeats=args.repeats)
                except Exception as e:  # noqa: BLE001 - a config that fails to compile is reported, not fatal
                    row["configs"].append({"config": dataclasses.asdict(cfg),
                                           "error": f"{type(e).__name__}: {str(e)[:300]}"})
                    continue
                tflops = flops / (ms * 1e-3) / 1e12
                row["configs"].append({"config": dataclasses.asdict(cfg), "ms": ms, "TFLOPs": tflops,
                                       "max_rel_err": err})
                if best is None or ms < best[1]:
                    best = (cfg, ms, tflops, err)
            try:  # the path the kernel replaces in the engine (max_pages = the context here; the engine's
                # follows max_seq_len, so its gather-all cost there is larger still)
                row["gather_all_ms"] = chained_ms(gather_all_attention, *inputs, n=max(1, args.chain // 2),
                                                  repeats=args.repeats)
                row["gather_all_TFLOPs"] = flops / (row["gather_all_ms"] * 1e-3) / 1e12
            except Exception as e:  # noqa: BLE001 - it can run out of memory at large B
                row["gather_all_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            if best is not None:
                c = best[0]
                row["best"] = {"config": dataclasses.asdict(c), "ms": best[1], "TFLOPs": best[2],
                               "max_rel_err": best[3]}
                g = row.get("gather_all_ms", float("nan"))
                print(f"{name:13s} {dtype_name:14s} B={batch:3d}: {best[2]:6.1f} TFLOP/s, {best[1]:.3f} ms "
                      f"(bq={c.block_q} bp={c.pages_per_block} w={c.num_warps} st={c.num_stages}), "
                      f"err {best[3]:.1e} | gather-all jnp {g:.3f} ms ({g / best[1]:.1f}x)", flush=True)
            else:
                print(f"{name} {dtype_name} B={batch}: every config failed", flush=True)
            row["swept"] = not over and not args.quick
            results.append(row)
            if args.out:
                write_results(args.out, results)
    return {"interpret": interpret, "results": results}
