"""Paged-attention decode kernel: GB/s per config and pool layout against the device's copy ceiling.

Qwen3-8B's attention (32 query heads, 8 kv heads of 128, pages of 16 tokens) at each batch and context,
rows ragged in ``[context / 2, context]`` (``--equal``: all at the context), pages shuffled through the
pool. Each config is timed with ``--chain`` calls chained in one jitted program (each call's query
depends on the previous output) and compared with the float32 jnp twin; bytes moved are the KV pages
below each row's length plus q and the output; percentages are of the HBM copy bandwidth measured on
this device (`experiments.bench.ceiling`). Off the GPU the kernel runs in interpret mode (the smoke run).

    python -m experiments.bench paged_attention                            # default sweep, bf16 and fp8
    python -m experiments.bench paged_attention --wide --layouts nhd hnd   # block x warps x stages grid
    python -m experiments.bench paged_attention --fp8-focus --batch 256 --context 2048 \\
        --dtypes float8_e4m3fn --tuning-out pallas_kernels/paged_attention_tuning.json
    python -m experiments.bench paged_attention --table-only --equal --orders rows heads

``--tuning-out`` writes the fastest config per pool dtype of the largest swept NHD shape, with at least
``--table-min-warps`` warps, as the kernel's tuning table for this device kind.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from experiments.bench.ceiling import ceiling_record, hbm_copy_bps
from experiments.bench.tables import write_results, write_tuning
from experiments.bench.timing import median_ms
from pallas_kernels import paged_attention as pa
from pallas_kernels.paged_attention import DEFAULT_CONFIG, KvLayout, PagedAttentionConfig

BENCH_BATCH = (64, 256)
BENCH_CONTEXT = (1024, 2048, 4096, 8192)
_FP8 = jnp.dtype(jnp.float8_e4m3fn)
_FP8_DOT_DTYPES = ("bfloat16", "float16")

SMOKE = ["--batch", "2", "--context", "40", "--heads", "4", "2", "64", "--dtypes", "bfloat16", "float8_e4m3fn",
         "--fp8-dot-dtypes", "float16", "--chain", "1", "--repeats", "1", "--quick"]

SWEEP_CONFIGS = (
    PagedAttentionConfig(pages_per_block=4, pages_per_split=64, num_warps=4, num_stages=2),
    PagedAttentionConfig(pages_per_block=8, pages_per_split=32, num_warps=4, num_stages=2),
    PagedAttentionConfig(pages_per_block=8, pages_per_split=64, num_warps=4, num_stages=3),
    PagedAttentionConfig(pages_per_block=8, pages_per_split=64, num_warps=8, num_stages=3),
    PagedAttentionConfig(pages_per_block=8, pages_per_split=128, num_warps=4, num_stages=2),
    PagedAttentionConfig(pages_per_block=16, pages_per_split=64, num_warps=8, num_stages=2),
    PagedAttentionConfig(pages_per_block=8, pages_per_split=1 << 20, num_warps=4, num_stages=2),  # no split
    # Triton splits the num_stages - 1 pipeline slots between the page-id load and the K/V gathers
    # that depend on it: only num_stages >= 5 double-buffers K/V (cp.async.wait_group 3 instead of 0)
    PagedAttentionConfig(pages_per_block=4, pages_per_split=64, num_warps=4, num_stages=5),
    PagedAttentionConfig(pages_per_block=2, pages_per_split=64, num_warps=4, num_stages=5),
    PagedAttentionConfig(pages_per_block=2, pages_per_split=64, num_warps=4, num_stages=7),
    # one warp: no cross-warp softmax reductions (2 barriers per block instead of 9); the fastest in
    # isolation, kept out of the tuning table by --table-min-warps
    PagedAttentionConfig(pages_per_block=2, pages_per_split=64, num_warps=1, num_stages=5),
    PagedAttentionConfig(pages_per_block=2, pages_per_split=64, num_warps=1, num_stages=7),
    PagedAttentionConfig(pages_per_block=4, pages_per_split=64, num_warps=1, num_stages=5),
    PagedAttentionConfig(pages_per_block=16, pages_per_split=64, num_warps=4, num_stages=2),
)


def wide_sweep() -> tuple[PagedAttentionConfig, ...]:
    """Block size x warps x pipeline stages (and two split sizes at the default block): the grid
    searched when the default config is far from the roofline."""
    grid = [PagedAttentionConfig(pages_per_block=b, pages_per_split=64, num_warps=w, num_stages=st)
            for b in (2, 4, 8, 16) for w in (1, 4, 8) for st in (2, 3, 5, 7)]
    grid += [PagedAttentionConfig(pages_per_split=pps) for pps in (32, 128)]
    return tuple(c for c in grid if c != DEFAULT_CONFIG)


def fp8_sweep() -> tuple[PagedAttentionConfig, ...]:
    """FP8 pools, float16 dots, with and without the word gather, at 2-8 pages per block, 2-4 warps and
    4-6 stages; first (so a run cut short times them) the word gather with two kv heads per program,
    in the configs that compile for sm_90 without register spills. No one-warp configs: a tuning table
    may not hold them (``--table-min-warps``)."""
    pairs = tuple(PagedAttentionConfig(pages_per_block=b, pages_per_split=64, num_warps=w, num_stages=5,
                                       fp8_dot_dtype="float16", fp8_word_gather=True, kv_heads_per_program=2)
                  for b in (2, 4) for w in (2, 4))
    base = tuple(PagedAttentionConfig(pages_per_block=b, pages_per_split=64, num_warps=w, num_stages=st,
                                      fp8_dot_dtype="float16", fp8_word_gather=words)
                 for words in (True, False) for b in (2, 4, 8) for w in (2, 4) for st in (4, 5, 6))
    return pairs + base


def bytes_moved(q, k_pages, page_size: int, lengths: np.ndarray, num_kv_heads: int, head_dim: int) -> int:
    """Bytes the kernel must move: the KV pages below each row's length (K and V), q and out."""
    pages = int(np.sum(-(-np.asarray(lengths) // page_size)))
    kv = 2 * pages * page_size * num_kv_heads * head_dim * jnp.dtype(k_pages.dtype).itemsize
    return kv + 2 * q.size * jnp.dtype(q.dtype).itemsize


def random_pool(kk, kv, shape, pool_dtype):
    """Random K and V pools of ``shape`` (from keys ``kk``, ``kv``) and their scales: FP8 values spread
    over E4M3's range with scale 1/64, other dtypes unit normal with scale 1."""
    if jnp.dtype(pool_dtype) == _FP8:
        pools = [(jax.random.normal(k, shape, jnp.float32) * 64).astype(_FP8) for k in (kk, kv)]
        return (*pools, jnp.float32(1 / 64), jnp.float32(1 / 64))
    return (jax.random.normal(kk, shape, pool_dtype), jax.random.normal(kv, shape, pool_dtype),
            jnp.float32(1.0), jnp.float32(1.0))


def bench_inputs(batch: int, context: int, pool_dtype, *, num_heads: int = 32, num_kv_heads: int = 8,
                 head_dim: int = 128, page_size: int = 16, ragged: bool = False, seed: int = 0):
    """Random decode inputs ``(q, k_pages, v_pages, k_scale, v_scale, page_table, lengths)``: every row
    at ``context`` keys (or uniform in [context/2, context] if ragged), pages shuffled across the pool,
    one spare page-table column of garbage ids."""
    rng = np.random.default_rng(seed)
    max_pages = pl.cdiv(context, page_size) + 1
    lengths = np.full((batch,), context, np.int32)
    if ragged:
        lengths = rng.integers(context // 2, context + 1, batch).astype(np.int32)
    need = -(-lengths // page_size)
    perm = rng.permutation(int(need.sum())).astype(np.int32)
    table = rng.integers(-(2**20), 2**20, (batch, max_pages)).astype(np.int32)
    off = 0
    for b in range(batch):
        table[b, : need[b]] = perm[off : off + need[b]]
        off += need[b]
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    pools = random_pool(kk, kv, (int(need.sum()), page_size, num_kv_heads, head_dim), pool_dtype)
    q = jax.random.normal(kq, (batch, num_heads, head_dim), jnp.bfloat16)
    return q, *pools, jnp.asarray(table), jnp.asarray(lengths)


def chained_ms(fn, q, *rest, n: int = 8, repeats: int = 10) -> float:
    """Median milliseconds per call of ``fn(q, *rest)`` with ``n`` calls chained in one jitted
    program (each call's q depends on the previous output, so none is merged or reordered): the
    host dispatch is paid once per ``n`` calls. The KV bytes of every shape benchmarked exceed the
    L2 cache many times over, so repeating the same pool measures HBM reads."""

    @jax.jit
    def run(q, *rest):
        def body(_, x):
            return x + (fn(x, *rest) * 0).astype(x.dtype)  # float x*0 is not folded (NaN semantics)

        return jax.lax.fori_loop(0, n, body, q, unroll=True)

    return median_ms(lambda: run(q, *rest), n_iter=repeats, n_warmup=min(2, repeats)) / n


def table_candidate(row: dict, min_warps: int) -> dict | None:
    """The fastest timed config of a benchmark row with at least ``min_warps`` warps (None if none)."""
    timed = [c for c in row["configs"] if "ms" in c and c["config"]["num_warps"] >= min_warps]
    return min(timed, key=lambda c: c["ms"], default=None)


def add_arguments(parser) -> None:
    parser.add_argument("--out", default=None, help="also write the rows to this JSON as they are measured")
    parser.add_argument("--batch", type=int, nargs="*", default=list(BENCH_BATCH))
    parser.add_argument("--context", type=int, nargs="*", default=list(BENCH_CONTEXT))
    parser.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("N", "K", "H"),
                        help="query heads, kv heads, head dim (default Qwen3-8B's)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtypes", nargs="*", default=["bfloat16", "float8_e4m3fn"])
    parser.add_argument("--layouts", nargs="*", default=[KvLayout.NHD.value], choices=[x.value for x in KvLayout])
    parser.add_argument("--quick", action="store_true", help="default config only (no sweep)")
    parser.add_argument("--wide", action="store_true", help="sweep `wide_sweep()` instead of SWEEP_CONFIGS")
    parser.add_argument("--fp8-focus", action="store_true",
                        help="sweep `fp8_sweep()` (float16 dots only) instead of SWEEP_CONFIGS")
    parser.add_argument("--fp8-dot-dtypes", nargs="*", default=list(_FP8_DOT_DTYPES), choices=_FP8_DOT_DTYPES,
                        help="for FP8 pools, time every config with each of these dot dtypes")
    parser.add_argument("--tuning-out", default=None,
                        help="write the best config per pool dtype on this device kind as a tuning table (the "
                             f"kernel reads {pa.TUNING_FILE.name} next to it); from the largest shape swept")
    parser.add_argument("--table-min-warps", type=int, default=2,
                        help="--tuning-out takes the fastest config with at least this many warps (rollouts "
                             "decoding with one-warp configs stopped advancing; 2 and 4 warps ran to the end)")
    parser.add_argument("--table-only", action="store_true",
                        help="time the tuning table's config of each pool dtype only (with --orders / --kv-heads "
                             "variants), no sweep")
    parser.add_argument("--orders", nargs="*", default=None, choices=["rows", "heads"],
                        help="launch orders to time every config in (`PagedAttentionConfig.heads_fastest`; "
                             "default: each config's own)")
    parser.add_argument("--kv-heads", type=int, nargs="*", default=None,
                        help="also time every config with these kv_heads_per_program")
    parser.add_argument("--pages-per-split", type=int, nargs="*", default=None,
                        help="time each config at each of these pages_per_split (1048576: no split)")
    parser.add_argument("--equal", action="store_true",
                        help="every row at the full context (the rollout's shape) instead of ragged in "
                             "[context/2, context]")
    parser.add_argument("--chain", type=int, default=8, help="calls chained in one timed program")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs of that program (the median counts)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="after this many seconds, time the default config only (keeps a device run bounded)")


def run(args) -> dict:
    t_start = time.perf_counter()
    ceiling_gbps = hbm_copy_bps() / 1e9
    interpret = jax.default_backend() != "gpu"
    num_heads, num_kv_heads, head_dim = args.heads
    sweep = wide_sweep() if args.wide else fp8_sweep() if args.fp8_focus else SWEEP_CONFIGS
    # the table's config (this device's measured best, if any) is timed first, next to DEFAULT_CONFIG
    first = tuple(dict.fromkeys(pa.default_config(jnp.dtype(d)) for d in args.dtypes))

    def variants(cs):  # each config in every launch order (and kv heads per program) asked for
        return tuple(dict.fromkeys(dataclasses.replace(c, heads_fastest=hf, kv_heads_per_program=kh)
                                   for c in cs for kh in (c.kv_heads_per_program, *(args.kv_heads or ()))
                                   for hf in ([c.heads_fastest] if args.orders is None else
                                              [o == "heads" for o in args.orders])))

    configs = variants((DEFAULT_CONFIG,) if args.quick else tuple(dict.fromkeys((DEFAULT_CONFIG, *first, *sweep))))
    timer = functools.partial(chained_ms, n=args.chain, repeats=args.repeats)
    results, tuned = [], {}
    for batch in args.batch:  # bf16 and fp8 side by side per shape, so a cut-short run compares them
        for context in args.context:
            for dtype_name in args.dtypes:
                inputs = bench_inputs(batch, context, jnp.dtype(dtype_name), num_heads=num_heads,
                                      num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=args.page_size,
                                      ragged=not args.equal)
                q, kp_nhd, vp_nhd, ks, vs, table, lengths = inputs
                nbytes = bytes_moved(q, kp_nhd, args.page_size, np.asarray(lengths), num_kv_heads, head_dim)
                ref = pa.paged_attention_reference(*inputs).astype(jnp.float32)
                for layout in map(KvLayout, args.layouts):
                    if layout is KvLayout.HND:
                        kp, vp = (jnp.transpose(x, (0, 2, 1, 3)) for x in (kp_nhd, vp_nhd))
                    else:
                        kp, vp = kp_nhd, vp_nhd
                    shape_configs = variants((pa.default_config(jnp.dtype(dtype_name)),)) if args.table_only \
                        else configs
                    if args.pages_per_split:
                        shape_configs = tuple(dict.fromkeys(dataclasses.replace(c, pages_per_split=n)
                                                            for c in shape_configs for n in args.pages_per_split))
                    if jnp.dtype(dtype_name) == _FP8 and not (args.fp8_focus or args.table_only):
                        shape_configs = tuple(dict.fromkeys(dataclasses.replace(c, fp8_dot_dtype=d)
                                                            for c in shape_configs for d in args.fp8_dot_dtypes))
                    row = _bench_shape(args, t_start, shape_configs, layout, dtype_name, batch, context, nbytes,
                                       ref, (q, kp, vp, ks, vs, table, lengths), ceiling_gbps, interpret, timer)
                    results.append(row)
                    table_best = table_candidate(row, args.table_min_warps)
                    if layout is KvLayout.NHD and row.get("swept") and table_best is not None:
                        size = batch * context
                        if size >= tuned.get(dtype_name, (0, None))[0]:
                            tuned[dtype_name] = (size, table_best, _shape_name(batch, context, args),
                                                 len(row["configs"]))
                    if args.out:
                        write_results(args.out, results)
                    del kp, vp
                # the dense path it replaces: gather the whole table, then attend (same inputs)
                try:
                    results[-1]["reference_ms"] = timer(pa.paged_attention_reference, *inputs)
                except Exception as e:  # noqa: BLE001 - reported in the row, the sweep goes on
                    results[-1]["reference_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"    jnp reference (gather all): {results[-1].get('reference_ms', float('nan')):.3f} ms",
                      flush=True)
                if args.out:
                    write_results(args.out, results)
    tuning = [{"device_kind": pa._device_kind(), "pool": name, "config": best["config"], "ms": best["ms"],
               "pct_copy_ceiling": best["pct_copy_ceiling"], "shape": shape,
               "source": f"python -m experiments.bench paged_attention: the fastest of {timed} configs timed with "
                         f"at least {args.table_min_warps} warps; copy ceiling {ceiling_gbps:.0f} GB/s measured "
                         f"on the device"}
              for name, (_, best, shape, timed) in sorted(tuned.items())]
    if args.tuning_out:
        write_tuning(args.tuning_out, tuning)
    return {**ceiling_record(), "interpret": interpret, "results": results, "tuning": tuning}


def _shape_name(batch: int, context: int, args) -> str:
    return f"B={batch}, context {'=' if args.equal else '<='} {context} ({'equal' if args.equal else 'ragged'})"


def _bench_shape(args, t_start, configs, layout, dtype_name, batch, context, nbytes, ref, inputs, ceiling_gbps,
                 interpret, timer) -> dict:
    """Times every config on one shape and layout; the row of results (best config included)."""
    kp = inputs[1]
    row = {"pool": dtype_name, "layout": layout.value, "B": batch, "context": context, "bytes": nbytes,
           "configs": []}
    pct = lambda gbs: 100 * gbs / ceiling_gbps  # noqa: E731
    best = None
    over = args.max_seconds is not None and time.perf_counter() - t_start > args.max_seconds
    for cfg in (DEFAULT_CONFIG,) if over else configs:
        if args.max_seconds is not None and time.perf_counter() - t_start > args.max_seconds and row["configs"]:
            over = True  # the time is up in the middle of a sweep: keep what was timed
            break
        run_cfg = pa.fit_config(cfg, kp, layout)
        try:
            out = pa.paged_attention(*inputs, config=run_cfg, interpret=interpret, layout=layout)
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / (jnp.max(jnp.abs(ref)) + 1e-30))
            ms = timer(functools.partial(pa._paged_attention, config=run_cfg, interpret=interpret, layout=layout),
                       *inputs)
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is reported, not fatal
            row["configs"].append({"config": dataclasses.asdict(cfg), "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        gbs = nbytes / (ms * 1e-3) / 1e9
        if args.table_only:
            print(f"  {dtype_name} {layout.value} kh={run_cfg.kv_heads_per_program} bp={run_cfg.pages_per_block} "
                  f"w={run_cfg.num_warps} st={run_cfg.num_stages} words={run_cfg.fp8_word_gather} "
                  f"heads_fastest={run_cfg.heads_fastest}: {ms:.4f} ms, {pct(gbs):.1f}%, err {err:.1e}", flush=True)
        row["configs"].append({"config": dataclasses.asdict(run_cfg), "ms": ms, "GBps": gbs,
                               "pct_copy_ceiling": pct(gbs), "max_rel_err": err})
        if best is None or ms < best[1]:
            best = (run_cfg, ms, gbs, err)
    if best is not None:
        c = best[0]
        row["best"] = {"config": dataclasses.asdict(c), "ms": best[1], "GBps": best[2],
                       "pct_copy_ceiling": pct(best[2]), "max_rel_err": best[3]}
        print(f"{dtype_name:14s} {layout.value} B={batch:4d} ctx<={context:5d}: {best[2]:7.1f} GB/s "
              f"({pct(best[2]):4.1f}% of {ceiling_gbps:.0f} GB/s), {best[1]:.3f} ms, "
              f"pps={c.pages_per_split} bp={c.pages_per_block} w={c.num_warps} st={c.num_stages} "
              f"kh={c.kv_heads_per_program} heads_fastest={c.heads_fastest} "
              f"dot={c.fp8_dot_dtype}, err {best[3]:.1e} ({len(row['configs'])} configs)", flush=True)
    else:
        print(f"{dtype_name} {layout.value} B={batch} ctx={context}: every config failed", flush=True)
    row["swept"] = not args.quick and len(row["configs"]) > 1
    row["sweep_complete"] = not over and not args.quick
    return row
