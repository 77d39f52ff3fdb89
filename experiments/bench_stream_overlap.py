"""Two-batch overlap on one GPU: does one half of the decode rows' paged attention (HBM-bound) run under the other
half's FP8 GEMMs (tensor-core-bound) when XLA puts them on two CUDA streams?

Why: at W1's 256 decode rows the mode-``all`` step of Qwen3-8B spends ~10.1 ms in paged attention (FP8 KV, ~89% of
4.3 TB/s) and ~3.9 ms in FP8 GEMMs that run compute-bound at ~0.9 PFLOP/s (session 23's profile), one after the
other on one stream. Splitting the rows in two halves A and B and running ``attention(A) || GEMMs(B)``, then
``attention(B) || GEMMs(A)``, layer by layer (two-batch overlap, as NanoFlow and SGLang's TBO do) could hide most of
the GEMM time under the attention's, at the price of each GEMM running at half the rows (its weight bytes read twice
a step). Whether it pays depends on what XLA's streams and the GPU do with two such kernels at once, under its
700 W cap: this script measures it before the engine's decode step is reorganized for it.

What it times (each a jitted program of ``--layers`` decoder layers, unrolled; Qwen3 widths of ``--preset``; the
KV pool donated and threaded from call to call):

- ``full``: today's step shape, all ``2 R`` rows: per layer the rows' new K/V written into the pool in place
  (`pallas_kernels.kv_write`), the paged attention, then o_proj, gate/up (fused), SwiGLU, down and the next
  layer's fused q/k/v, whose parts are the next query and K/V (norms and RoPE left out: in the engine they ride in
  the activation quantization and the fused K/V write);
- ``halves_serial``: the same work as two halves of ``R`` rows in the two-batch order, on one stream;
- ``halves_streams``: that order with each half's K/V write + attention in ``compute_on("gpu_stream:1")`` and each
  half-layer of GEMMs in ``compute_on("gpu_stream:2")``, each overlapping pair in one XLA scheduling group, with
  ``--xla_gpu_experimental_stream_annotation=true`` (set here before jax starts unless ``--no-stream-flag``);
- ``halves_streams_write_on_main``: the same with the K/V write left on the main stream, only the (read-only)
  attention on stream 1: no in-place pool update crosses a stream boundary, in case XLA copies the pool there;
- ``attention`` alone (``2 R`` rows) and ``gemms`` alone at ``2 R`` and at ``R`` rows: the parts.

The attention reads a shuffled FP8 pool (every row at ``--context`` keys; 2.1 GB a call at 256 x 2048, far past
the 50 MB L2) and the GEMMs ``--weight-sets`` different weight sets in turn (193 MB a layer for Qwen3-8B).
Per program: wall milliseconds (median of ``--repeats`` after a warm-up; programs compiled inside the timed calls
are counted, 0 expected), from one profiled run its kernels' busy time and span (with two streams, busy > span is
the overlap), whether the compiled HLO holds the async calls (``call-start`` with ``_xla_stream_annotation``), its
temporary bytes (a copy of the pool would show there), and the board's power and clocks during the repeats. The
half-row programs must give identical outputs (same ops, same order per stream); the script checks it, and how far
they are from the full-batch program's.

    python experiments/bench_stream_overlap.py --preset qwen3_8b --rows 128 --context 2048 \\
        --out experiments/results/stream_overlap_h200.json

Off the GPU it runs the same programs (Pallas in interpret mode, the FP8 GEMMs through the policy's jnp
reference; XLA's CPU backend ignores the stream annotation): a check of the programs, not a measurement.

Measured on the H200 (jax 0.11.2, session 30; ``experiments/results/h200_session30_2026-12-04.md``), 128-row
halves x 2048 keys, 36 layers: ``full`` 15.7-16.3 ms, ``halves_serial`` 20.2-20.8 ms (a GEMM phase at 128 rows
costs 80% of one at 256: the weights are read twice). The two-stream programs first failed to compile: every
kernel wrapper's nested jit lowered as a call of its own inside the annotated region, and XLA's stream assignment
rejects those ("No ExecutionStreamId found for %call-start"); `on_gpu_stream` now inlines them (`inline_jits`).
Then they compiled and ran, but with no overlap: kernel busy time = span, 50.6 ms with the K/V write on the
attention's stream (a 2.15 GB pool copy in the temporaries) and 21.2 ms with it on the main stream, and outputs
that differ from ``halves_serial``'s. So the engine has no two-batch decode (sessions 29-30 built one and removed
it, measured: the one-stream halves at 0.78-0.79x of the full step, the streams version slower still); this script
stays to re-check a newer XLA in one call.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

STREAM_FLAG = "--xla_gpu_experimental_stream_annotation=true"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3_8b")
    p.add_argument("--rows", type=int, default=128, help="rows of one half (the full step has 2 x rows)")
    p.add_argument("--context", type=int, default=2048, help="keys per row")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--weight-sets", type=int, default=None, help="different weight sets (default: one per layer)")
    p.add_argument("--fp8-gemm", default="auto", choices=["auto", "cublaslt", "triton", "mosaic"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-stream-flag", action="store_true",
                   help=f"leave XLA_FLAGS as they are (without {STREAM_FLAG} the annotation is ignored)")
    p.add_argument("--programs", nargs="+", default=None,
                   help="a subset of " + " ".join(PROGRAMS))
    p.add_argument("--no-trace", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    return p


def with_stream_flag(flags: str) -> str:
    """``flags`` (an XLA_FLAGS value) with the stream-annotation flag, unless it already names it."""
    if "xla_gpu_experimental_stream_annotation" in flags:
        return flags
    return f"{flags} {STREAM_FLAG}".strip()


if __name__ == "__main__" and "--no-stream-flag" not in sys.argv:
    os.environ["XLA_FLAGS"] = with_stream_flag(os.environ.get("XLA_FLAGS", ""))  # before jax starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax._src import core, source_info_util  # noqa: E402  (MemorySpace; jaxpr types and source info for inline_jits)
from jax.experimental.compute_on import compute_on  # noqa: E402
from jax.experimental.xla_metadata import set_xla_metadata  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.models import PRESETS  # noqa: E402
from fp8rl_jax.environment import GpuMonitor, run_environment  # noqa: E402
from fp8rl_jax.quant.policy import GemmBackend, W8A8Policy, quantize_weight  # noqa: E402
from pallas_kernels import kv_write as kv_write_kernel  # noqa: E402
from pallas_kernels import paged_attention as paged_kernel  # noqa: E402
from pallas_kernels.common import trace_kernels  # noqa: E402

PROGRAMS = ("full", "halves_serial", "halves_streams", "halves_streams_write_on_main", "attention", "gemms",
            "gemms_half")


def on_gpu_stream(stream: int | None, fn):
    """``fn`` as a call XLA may run on GPU stream ``stream`` (`jax.experimental.compute_on`; real with
    ``--xla_gpu_experimental_stream_annotation=true`` in ``XLA_FLAGS``, ignored by the CPU backend), or ``fn``
    itself when ``stream`` is None. Its outputs stay in device memory.

    ``fn``'s nested jits (every kernel wrapper is one) are inlined into the annotated call (`inline_jits`): lowered
    inside a ``compute_on`` region, each would become a call of its own that carries the stream annotation, and
    XLA 0.11's stream assignment fails on such nested annotated calls ("No ExecutionStreamId found for
    %call-start", measured on an H200 in session 30)."""
    if stream is None:
        return fn

    def call(*args):
        spaces = jax.tree.map(lambda _: core.MemorySpace.Device, jax.eval_shape(fn, *args))
        return compute_on(compute_type=f"gpu_stream:{stream}", out_memory_spaces=spaces)(inline_jits(fn))(*args)

    return call


def inline_jits(fn):
    """``fn`` with every nested ``jax.jit`` call (and custom-JVP/VJP rule wrapper) evaluated in place, at any
    depth, so that a trace of it holds only the primitives those calls run: the same values, no nested call in
    the lowered program. Forward only (the custom rules' derivatives are not kept): for inference regions such as
    `on_gpu_stream`'s."""

    def run(jaxpr, consts, args):
        env = {}

        def read(v):
            return v.val if isinstance(v, core.Literal) else env[v]

        for v, x in zip(jaxpr.constvars, consts, strict=True):
            env[v] = x
        for v, x in zip(jaxpr.invars, args, strict=True):
            env[v] = x
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            inner = _INLINED_CALLS.get(eqn.primitive.name)
            if inner is not None:
                closed = eqn.params[inner]
                outs = run(closed.jaxpr, closed.consts, ins)
            else:
                name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
                with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
                    outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
                outs = outs if eqn.primitive.multiple_results else [outs]
            for v, x in zip(eqn.outvars, outs, strict=True):
                if not isinstance(v, core.DropVar):
                    env[v] = x
        return [read(v) for v in jaxpr.outvars]

    @functools.wraps(fn)
    def inlined(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs = run(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return inlined


def nested_stream_calls(stablehlo: str) -> int:
    """Stream-annotated calls made from inside a stream-annotated call in a lowered program's StableHLO text
    (``jit(f).lower(...).as_text()``). XLA's GPU stream assignment fails on any ("No ExecutionStreamId found"), so
    a program with `on_gpu_stream` regions that runs has none (a GPU lowering: interpret-mode kernels lower to
    calls of their own)."""
    bodies = {}
    for chunk in stablehlo.split("func.func ")[1:]:
        header, _, body = chunk.partition("{")
        bodies[header.split("(", 1)[0].split()[-1]] = body
    annotated = re.compile(r"(?<!\w)call (@[\w.$\"<>-]+)\(.*_xla_stream_annotation")
    regions = {m.group(1) for body in bodies.values() for m in annotated.finditer(body)}
    return sum(len(annotated.findall(bodies[name])) for name in regions if name in bodies)


# primitives whose sub-jaxpr `inline_jits` evaluates in place of the call: name -> its ClosedJaxpr parameter
_INLINED_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr"}


def gemm_block(policy: W8A8Policy, w: dict, x: jax.Array, o: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One layer's GEMMs for rows ``x`` [R, D] after their attention output ``o`` [R, N*H]: o_proj into the
    residual, gate/up (fused), SwiGLU + down, then the next layer's fused q/k/v; ``(x, qkv [R, (N + 2K) H])``."""
    x = x + policy.dot(o, w["o"], None)
    gu = policy.dot(x, w["gate_up"], None)
    x = x + policy.swiglu_dot(gu, w["down"], None)
    return x, policy.dot(x, w["qkv"], None)


def build(args, cfg):
    """Operands: the rows' starting q/k/v and residuals, the pool (2 R rows), its page table and lengths, the weight
    sets, and each row's write position (the page and slot of its last key)."""
    N, K, H, D, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    R = args.rows
    _, k_pages, v_pages, ks, vs, table, lengths = paged_kernel.bench_inputs(
        2 * R, args.context, jnp.float8_e4m3fn, num_heads=N, num_kv_heads=K, head_dim=H)
    key = jax.random.key(1)
    x = jax.random.normal(jax.random.fold_in(key, 0), (2 * R, D), jnp.bfloat16)
    qkv = jax.random.normal(jax.random.fold_in(key, 1), (2 * R, (N + 2 * K) * H), jnp.bfloat16)
    shapes = {"qkv": ((N + 2 * K) * H, D), "o": (D, N * H), "gate_up": (2 * F, D), "down": (D, F)}
    sets = []
    for i in range(args.weight_sets or args.layers):  # drawn on the device: 36 x 193 MB for Qwen3-8B
        keys = jax.random.split(jax.random.fold_in(key, i + 2), len(shapes))
        sets.append({name: quantize_weight(jax.random.normal(k, s, jnp.bfloat16) * s[1] ** -0.5)
                     for k, (name, s) in zip(keys, shapes.items())})
    ps = k_pages.shape[1]
    last = lengths - 1
    page = jnp.take_along_axis(table, (last // ps)[:, None], axis=1)[:, 0]
    operands = (qkv, x, (k_pages, v_pages, ks, vs), table, lengths, sets, page, last % ps)
    # committed, as the programs' outputs are: jit keys on commitment, so the pool a call returns would otherwise
    # recompile the program at the next call (the engine places its arrays the same way)
    return jax.device_put(operands, jax.devices()[0])


def programs(args, cfg, policy: W8A8Policy):
    """The timed programs, jitted, each ``(qkv, x, pool, table, lengths, sets, page, slot) -> (x, qkv, pool)`` with
    the pool donated (every layer's attention writes its rows' new K/V into it in place first, as the engine's
    decode does)."""
    N, K, H, R, L = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, args.rows, args.layers
    nh, kh = N * H, K * H

    def write(qkv, pool, page, slot):
        """The rows' new K/V into the pool (in place): the updated pool."""
        k_pages, v_pages, ks, vs = pool
        B = qkv.shape[0]
        k_new, v_new = qkv[:, nh:nh + kh].reshape(B, K, H), qkv[:, nh + kh:].reshape(B, K, H)
        k_pages, v_pages = kv_write_kernel.kv_write(k_new, v_new, k_pages, v_pages, page, slot, ks, vs)
        return k_pages, v_pages, ks, vs

    def read(qkv, pool, table, lengths):
        """The rows' paged attention: ``out [R, N*H]``."""
        k_pages, v_pages, ks, vs = pool
        B = qkv.shape[0]
        out = paged_kernel.paged_attention(qkv[:, :nh].reshape(B, N, H), k_pages, v_pages, ks, vs, table, lengths)
        return out.reshape(B, nh)

    def attend(qkv, pool, table, lengths, page, slot):
        """The rows' K/V write, then their paged attention: ``(out [R, N*H], pool)``."""
        pool = write(qkv, pool, page, slot)
        return read(qkv, pool, table, lengths), pool

    def full(qkv, x, pool, table, lengths, sets, page, slot):
        for layer in range(L):
            o, pool = attend(qkv, pool, table, lengths, page, slot)
            x, qkv = gemm_block(policy, sets[layer % len(sets)], x, o)
        return x, qkv, pool

    def halves(streams: bool, write_on_main: bool = False):
        """The two-batch order; with ``streams`` the attention on stream 1 (with its K/V write, or after it on the
        main stream when ``write_on_main``: then no pool update crosses a stream boundary) and the GEMMs on
        stream 2."""
        if write_on_main:
            read_1 = on_gpu_stream(1, read)

            def att(qkv, pool, table, lengths, page, slot):
                pool = write(qkv, pool, page, slot)
                return read_1(qkv, pool, table, lengths), pool
        else:
            att = on_gpu_stream(1 if streams else None, attend)
        gem = on_gpu_stream(2 if streams else None, lambda w, x, o: gemm_block(policy, w, x, o))

        def run(qkv, x, pool, table, lengths, sets, page, slot):
            (qa, qb), (xa, xb) = (qkv[:R], qkv[R:]), (x[:R], x[R:])
            a, b = (table[:R], lengths[:R], page[:R], slot[:R]), (table[R:], lengths[R:], page[R:], slot[R:])
            ob = None
            for layer in range(L):
                with set_xla_metadata(_scheduling_group_id=str(2 * layer)):  # attention A || GEMMs of B's last layer
                    oa, pool = att(qa, pool, *a)
                    if ob is not None:
                        xb, qb = gem(sets[(layer - 1) % len(sets)], xb, ob)
                with set_xla_metadata(_scheduling_group_id=str(2 * layer + 1)):  # attention B || GEMMs of A
                    ob, pool = att(qb, pool, *b)
                    xa, qa = gem(sets[layer % len(sets)], xa, oa)
            xb, qb = gem(sets[(L - 1) % len(sets)], xb, ob)
            return jnp.concatenate([xa, xb]), jnp.concatenate([qa, qb]), pool

        return run

    def attention_only(qkv, x, pool, table, lengths, sets, page, slot):
        for _ in range(L):
            o, pool = attend(qkv, pool, table, lengths, page, slot)
            qkv = qkv.at[:, :nh].add((o * 0).astype(qkv.dtype))  # chained: x*0 is not folded (NaN semantics)
        return x, qkv, pool

    def gemms(rows):
        def run(qkv, x, pool, table, lengths, sets, page, slot):
            qkv, x = qkv[:rows], x[:rows]
            for layer in range(L):
                x, qkv = gemm_block(policy, sets[layer % len(sets)], x, qkv[:, :nh])
            return x, qkv, pool

        return run

    every = {"full": full, "halves_serial": halves(False), "halves_streams": halves(True),
             "halves_streams_write_on_main": halves(True, write_on_main=True),
             "attention": attention_only, "gemms": gemms(2 * R), "gemms_half": gemms(R)}
    chosen = args.programs or PROGRAMS
    return {name: jax.jit(every[name], donate_argnums=2) for name in PROGRAMS if name in chosen}


def timed(fn, operands: tuple, pool, repeats: int, trace: bool) -> tuple[dict, tuple, tuple]:
    """``(row, (x, qkv), pool)`` of ``fn(qkv, x, pool, *rest)`` for ``operands = (qkv, x, *rest)``, the donated pool
    threaded from call to call: wall ms per call (median of ``repeats`` after one warm-up call), the GPU during
    them, and from one profiled call the kernels' busy time and span (ms; None without GPU kernels)."""
    def call(pool):
        x, qkv, pool = fn(operands[0], operands[1], pool, *operands[2:])
        return jax.block_until_ready((x, qkv)), pool

    out, pool = call(pool)
    programs = fn._cache_size()
    walls = []
    with GpuMonitor(interval_ms=100) as gpu:
        for _ in range(repeats):
            t0 = time.perf_counter()
            _, pool = call(pool)
            walls.append((time.perf_counter() - t0) * 1e3)
    # programs compiled inside the timed calls (0 unless a returned array's placement differs from its input's)
    row = {"wall_ms": statistics.median(walls), "wall_ms_all": [round(w, 3) for w in walls],
           "recompiled_in_timed_calls": fn._cache_size() - programs,
           "gpu_during_repeats": gpu.summary(), "busy_ms": None, "span_ms": None}
    if trace:
        with tempfile.TemporaryDirectory() as d:
            jax.profiler.start_trace(d)
            _, pool = call(pool)
            jax.profiler.stop_trace()
            by_name, span, _ = trace_kernels(d)
        if by_name:
            row["busy_ms"], row["span_ms"] = sum(by_name.values()) / 1e3, span / 1e3
    return row, out, pool


def main(argv=None) -> dict:
    args = _parser().parse_args(argv)
    if args.preset not in PRESETS:
        raise SystemExit(f"--preset must be one of {sorted(PRESETS)}, got {args.preset!r}")
    for name in args.programs or ():
        if name not in PROGRAMS:
            raise SystemExit(f"--programs takes {' '.join(PROGRAMS)}, got {name!r}")
    cfg = PRESETS[args.preset]
    if cfg.num_experts:
        raise SystemExit("--preset must be a dense model (the GEMM block is a dense MLP's)")
    if args.rows < 1 or args.layers < 1 or args.context < 1 or args.repeats < 1:
        raise SystemExit("--rows, --layers, --context and --repeats must be at least 1")
    policy = W8A8Policy("bfloat16", gemm=GemmBackend(args.fp8_gemm))
    qkv, x, pool, table, lengths, sets, page, slot = build(args, cfg)
    operands = (qkv, x, table, lengths, sets, page, slot)
    pool_gb = sum(a.nbytes for a in pool[:2]) / 1e9
    result = {"environment": run_environment(xla_flags=os.environ.get("XLA_FLAGS", "")),
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "kv_gb_per_layer": 2 * int(np.sum(-(-np.asarray(lengths) // pool[0].shape[1])))
              * pool[0].shape[1] * cfg.num_kv_heads * cfg.head_dim / 1e9,
              "pool_gb": pool_gb, "runs": {}}
    outs = {}
    for name, fn in programs(args, cfg, policy).items():
        try:
            lowered = fn.lower(qkv, x, pool, *operands[2:])
            nested = nested_stream_calls(lowered.as_text())
            compiled = lowered.compile()
            hlo = compiled.as_text() or ""
            memory = compiled.memory_analysis()
            row, outs[name], pool = timed(fn, operands, pool, args.repeats,
                                          not args.no_trace and jax.default_backend() == "gpu")
        except Exception as e:  # noqa: BLE001 - a program XLA rejects (the stream annotation is experimental) is a row
            result["runs"][name] = {"error": repr(e)[:600]}
            print(f"{name:15s} failed: {e!r}"[:300], flush=True)
            save(result, args.out)
            if any(a.is_deleted() for a in pool[:2]):  # donated to a call that failed: nothing more can run
                break
            continue
        row["async_calls"] = hlo.count("call-start")
        row["stream_annotations"] = hlo.count("_xla_stream_annotation")
        row["nested_stream_calls"] = nested  # on the GPU XLA rejects a program with any (session 30)
        # a copy of the pool (XLA failing to update it in place across the stream boundary) shows here
        row["temp_gb"] = None if memory is None else memory.temp_size_in_bytes / 1e9
        row["per_layer_ms"] = row["wall_ms"] / args.layers
        result["runs"][name] = row
        print(f"{name:15s} {row['wall_ms']:9.3f} ms ({row['per_layer_ms'] * 1e3:7.1f} us a layer)  busy "
              f"{row['busy_ms']} span {row['span_ms']}  async calls {row['async_calls']}  temp GB {row['temp_gb']}",
              flush=True)
        save(result, args.out)
    for name in ("halves_streams", "halves_streams_write_on_main"):
        if "halves_serial" in outs and name in outs:
            same = all(bool(jnp.array_equal(a, b)) for a, b in zip(outs["halves_serial"], outs[name]))
            result[f"{name}_equal_serial"] = same
            if not same:
                print(f"{name} differs from halves_serial: the two-stream program is wrong", flush=True)
    if "halves_serial" in outs and "full" in outs:  # the halves compute the full batch's rows
        a, b = (np.asarray(outs[k][0], np.float64) for k in ("halves_serial", "full"))
        result["halves_vs_full_max_rel_err"] = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
    runs = result["runs"]
    for name in ("halves_serial", "halves_streams", "halves_streams_write_on_main"):
        if "wall_ms" in runs.get("full", {}) and "wall_ms" in runs.get(name, {}):
            result[f"speedup_{name}_vs_full"] = runs["full"]["wall_ms"] / runs[name]["wall_ms"]
            print(f"{name} against the full-batch step: {result[f'speedup_{name}_vs_full']:.3f}x", flush=True)
    save(result, args.out)
    return result


def save(result: dict, out: Path | None) -> None:
    if out is not None:
        import json

        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
