"""Where a decode step's time goes: the engine's decode (or prefill) program at a fixed shape, timed and traced.

The engine's jitted decode loop runs at a fixed batch and context, timed, then traced with the JAX
profiler and summed per GPU kernel.

The engine's cache is filled with a ragged batch (row lengths uniform in [context / 2, context],
pages shuffled through the pool; or, with ``--lengths equal --pages engine``, the state of W1's
lockstep rows with pages placed as the engine hands them out; the pool's contents are whatever it
holds, which does not change the work) and the decode program (``engine.runner.decode``) runs ``steps`` steps
per call exactly as ``JaxEngine.generate`` runs them. Reported per precision mode: ms per decode step (median of ``repeats`` calls), the HBM
roofline of that step (weight bytes + KV bytes read, over the device's measured copy bandwidth,
`experiments.bench.ceiling`), and from one traced call
the GPU time per kernel class (paged attention, GEMMs, sampling, the rest) and the idle gap. With ``--prefill N``
it profiles the prefill program instead: N prompts of ``--prompt-len`` tokens per call, as W1's prefill runs them
(prefill is about a tenth of W1's generate time).

    python -m experiments.bench decode --preset qwen3_8b --batch 256 --context 2048 --modes none all
    python -m experiments.bench decode --preset qwen3_8b --prefill 4 --prompt-len 1024 --modes all   # W1's prefill
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from configs.models import PRESETS
from experiments.bench.ceiling import ceiling_record, hbm_copy_bps
from fp8rl_jax.environment import GpuMonitor
from fp8rl_jax.models import Fp8Mode, init_params
from fp8rl_jax.quant.policy import GemmBackend, describe_cublaslt_algos
from fp8rl_jax.rl.memory import check_fits, device_bytes_limit, generator_weight_bytes, kv_page_bytes
from fp8rl_jax.rollout import programs
from fp8rl_jax.rollout.engine import EngineConfig, JaxEngine
from fp8rl_jax.rollout.sampling import Draw, SamplingConfig
from fp8rl_jax.rollout.scheduler import Request
from pallas_kernels import paged_attention as paged_kernel
from experiments.bench.timing import fusion_hlo, trace_kernels

# kernel-name fragments -> class (first match wins; names are XLA fusions, cuBLAS kernels and our
# Pallas kernels' names)
CLASSES = (
    ("paged_attention", "attention (paged decode kernel)"),
    ("kv_write", "KV write (kernel)"),
    ("attention", "attention (other)"),
    ("fp8_gemm", "FP8 GEMM (ours)"),
    ("mosaic", "FP8 GEMM (ours)"),
    ("quant", "activation quantization"),
    ("gemm", "GEMM (cuBLAS)"),
    ("nvjet", "GEMM (cuBLAS)"),
    ("xmma", "GEMM (cuBLAS)"),
    ("cutlass", "GEMM (cuBLAS)"),
    ("sort", "sampling (sort)"),
    ("threefry", "sampling (random bits)"),
    ("random", "sampling (random bits)"),
    ("reduce", "reductions"),
    ("scatter", "KV write (scatter)"),
    ("dynamic-update", "KV write (scatter)"),
    ("dynamic_update", "KV write (scatter)"),
)


def classify(name: str) -> str:
    low = name.lower()
    for frag, cls in CLASSES:
        if frag in low:
            return cls
    return "other fusions"


def kernel_times(trace_dir: Path) -> tuple[dict[str, float], dict[str, float], float, dict[str, dict]]:
    """(us per class, us per kernel name, GPU busy span us, one event's args per kernel name) of the
    newest trace under ``trace_dir`` (`experiments.bench.timing.trace_kernels`)."""
    by_name, span, args = trace_kernels(trace_dir)
    by_class: dict[str, float] = collections.defaultdict(float)
    for name, us in by_name.items():
        by_class[classify(name)] += us
    return dict(by_class), by_name, span, args


class PageOrder(enum.Enum):
    """Where the rows' pages sit in the pool. SHUFFLED: drawn from a random permutation of the pool. ENGINE: as
    `JaxEngine.generate` hands them out when all rows are admitted at once and decode together (W1): each row's
    prompt pages contiguous, rows one after another, then one page per row per decode call, side by side."""

    SHUFFLED = "shuffled"
    ENGINE = "engine"


class Lengths(enum.Enum):
    """Row lengths: UNIFORM in [context / 2, context], or all EQUAL to context (W1's lockstep rows)."""

    UNIFORM = "uniform"
    EQUAL = "equal"


def page_table(need: np.ndarray, max_pages: int, order: PageOrder, rng: np.random.Generator, prompt_pages: int = 0,
               num_pages: int = 0) -> np.ndarray:
    """``[B, max_pages]`` page ids for rows of ``need[b]`` pages in ``order`` (`PageOrder`; SHUFFLED draws from a
    pool of ``num_pages``, ENGINE gives each row's first ``prompt_pages``, its prompt and first decode call,
    contiguously)."""
    B = len(need)
    table = np.zeros((B, max_pages), np.int32)
    if order is PageOrder.SHUFFLED:
        perm = rng.permutation(num_pages).astype(np.int32)
        off = 0
        for b in range(B):
            table[b, : need[b]] = perm[off : off + need[b]]
            off += need[b]
        return table
    first = np.minimum(need, prompt_pages)
    starts = np.concatenate([[0], np.cumsum(first)[:-1]])
    nxt = int(first.sum())
    for b in range(B):
        table[b, : first[b]] = starts[b] + np.arange(first[b])
    for k in range(int((need - first).max(initial=0))):  # chunk k's page of every row still growing
        for b in np.flatnonzero(need - first > k):
            table[b, first[b] + k] = nxt
            nxt += 1
    return table


def setup(engine: JaxEngine, batch: int, context: int, seed: int, lengths: Lengths = Lengths.UNIFORM,
          order: PageOrder = PageOrder.SHUFFLED, prompt_len: int = 1024, calls: int = 1):
    """Fills the engine's cache metadata with a batch of ``lengths`` (`Lengths`) and pages in ``order``
    (`PageOrder`; ENGINE: prompts of ``prompt_len`` tokens); every row gets the pages of the tokens ``calls``
    decode calls add. Returns the row lengths, the decode program's arguments and its static ``truncation``
    (decided on the host as the engine does: these rows use neither top-k nor top-p)."""
    rng = np.random.default_rng(seed)
    ps, steps = engine.config.page_size, engine.config.steps_per_call
    if lengths is Lengths.UNIFORM:
        lengths = rng.integers(context // 2, context + 1, batch).astype(np.int32)
    else:
        lengths = np.full((batch,), context, np.int32)
    need = -(-(lengths + steps * calls) // ps)
    table = page_table(need, engine.max_pages, order, rng, prompt_pages=-(-(prompt_len + steps) // ps),
                       num_pages=engine.num_pages)
    # placed as the engine places its inputs (committed to the device, as the cache is): every call then has the
    # first call's signature and compiles nothing more
    engine.cache = engine.cache.replace(page_table=engine.runner.put(table), lengths=engine.runner.put(lengths))
    reqs = [Request(b, [1] * int(lengths[b]), SamplingConfig(temperature=1.0, max_tokens=1 << 20, ignore_eos=True,
                                                             seed=b), ())
            for b in range(batch)]
    sampling, stops, remaining = engine.runner.row_inputs(reqs)
    last = engine.runner.put(rng.integers(2, engine.model_config.vocab_size, batch).astype(np.int32))
    active = engine.runner.put(np.ones((batch,), bool))
    return lengths, (last, active, sampling, stops, remaining), engine.runner.truncation(reqs)


def traced(call, per: int, trace_out: Path | None, name: str) -> dict:
    """One traced ``call()``: GPU time per kernel class and per kernel (top 25), divided by ``per`` (the decode
    steps of a call, or 1), the busy span and what the profiler says of each top kernel."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            call()
        by_class, by_name, span, kargs = kernel_times(Path(d))
        if trace_out is not None:
            trace_out.mkdir(parents=True, exist_ok=True)
            for f in Path(d).rglob("*.trace.json.gz"):
                (trace_out / f"{name}.trace.json.gz").write_bytes(f.read_bytes())
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:25]
    return {
        "per_step_us_by_class": {k: v / per for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
        "gpu_busy_us_per_step": sum(by_class.values()) / per,
        "gpu_span_us_per_step": span / per,
        "top_kernels_us_per_step": {k: v / per for k, v in top},
        # what the profiler says of each top kernel (inside CUDA graphs it names the command buffer)
        "top_kernels_args": {k: {a: str(v)[:600] for a, v in kargs.get(k, {}).items()} for k, _ in top},
    }


def engine_config(args, mode: Fp8Mode, **sizes) -> EngineConfig:
    """The engine of a profile: ``sizes`` (slots, pages, lengths) and the command line's precision and options."""
    return EngineConfig(steps_per_call=args.steps, precision=mode, dtype=args.dtype,
                        fuse_projections={"auto": None, "on": True, "off": False}[args.fuse_projections],
                        fp8_gemm=GemmBackend(args.fp8_gemm), fused_cast=args.fused_cast == "on",
                        sampling_draw=Draw(args.draw), **sizes)


def model_config(args):
    """The preset, cut to ``--layers`` decoder layers where given."""
    cfg = PRESETS[args.preset]
    return dataclasses.replace(cfg, num_layers=args.layers) if args.layers else cfg


def run_prefill(args, params, mode: Fp8Mode) -> dict:
    """One prefill call as `JaxEngine.generate` makes it (``runner.prefill``): ``--prefill`` prompts of ``--prompt-len``
    random tokens into fresh slots (pages in ``--pages`` order), timed (median of ``--repeats`` calls; each call
    prefills the same slots again) and traced per kernel class (per call)."""
    cfg = model_config(args)
    ps, n, t = 16, args.prefill, args.prompt_len
    max_seq = t + args.steps + ps
    per_row = -(-max_seq // ps)
    engine = JaxEngine(cfg, params, engine_config(args, mode, max_slots=n, page_size=ps, num_pages=n * per_row + 8,
                                                  max_seq_len=max_seq, prefill_batch=n, prefill_buckets=(t,)))
    rng = np.random.default_rng(args.seed)
    table = page_table(np.full((n,), per_row), engine.max_pages, PageOrder(args.pages), rng, prompt_pages=per_row,
                       num_pages=engine.num_pages)
    engine.cache = engine.cache.replace(page_table=engine.runner.put(table))
    reqs = [Request(b, rng.integers(2, cfg.vocab_size, t).tolist(),
                    SamplingConfig(temperature=1.0, max_tokens=args.steps, ignore_eos=True, seed=b), ())
            for b in range(n)]
    sampling, stops, remaining = engine.runner.row_inputs(reqs)
    inputs = engine.runner.put((np.arange(n, dtype=np.int32), np.array([r.prompt for r in reqs], np.int32),
                          np.full((n,), t, np.int32)))
    truncation = engine.runner.truncation(reqs)

    def call():
        out = engine.runner.prefill(engine.params, engine.cache, *inputs, sampling, stops, remaining,
                                    truncation=truncation)
        engine.cache = out[3]
        return jax.block_until_ready(out[0])

    t0 = time.perf_counter()
    call()
    compile_s = time.perf_counter() - t0
    times = []
    with GpuMonitor(interval_ms=100) as gpu:
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    call_ms = statistics.median(times) * 1e3
    row = {"mode": mode.value, "program": "prefill", "prompts": n, "prompt_len": t, "compile_s": compile_s,
           "call_s": times, "call_ms": call_ms, "prompt_tokens_per_s": n * t / call_ms * 1e3,
           "gpu_during_calls": gpu.summary()}
    if jax.default_backend() == "gpu" and not args.no_trace:
        row["trace"] = traced(call, 1, args.trace_out, f"prefill_{mode.value}")
    print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
    if "trace" in row:
        for k, v in row["trace"]["per_step_us_by_class"].items():
            print(f"  {v / 1e3:8.3f} ms  {k}", flush=True)
    del engine
    return row


def run_mode(args, params, mode: Fp8Mode) -> dict:
    cfg = model_config(args)
    ps = 16
    calls = 3 if args.hold else args.repeats + 2  # compile, repeats (one state with --hold), trace
    max_seq = args.context + args.steps * (calls + 1) + ps
    pages = args.batch * -(-max_seq // ps) + 8
    ec = engine_config(args, mode, max_slots=args.batch, page_size=ps, num_pages=pages, max_seq_len=max_seq)
    engine = JaxEngine(cfg, params, ec)
    lengths, rest, truncation = setup(engine, args.batch, args.context, args.seed, Lengths(args.lengths),
                                      PageOrder(args.pages), args.prompt_len, calls=calls)
    start_lengths = np.asarray(engine.cache.lengths)  # a host copy: the cache is donated to each call

    def call():
        out = engine.runner.decode(engine.params, engine.cache, *rest, steps=args.steps, truncation=truncation)
        # --hold: every call starts from the same lengths (it rewrites the same KV slots): one state, any repeats
        engine.cache = out[3].replace(lengths=engine.runner.put(start_lengths)) if args.hold else out[3]
        return jax.block_until_ready(out[0])

    t0 = time.perf_counter()
    call()
    compile_s = time.perf_counter() - t0
    compiled = programs.decode_program()._cache_size()
    times = []
    with GpuMonitor(interval_ms=100) as gpu:  # the timed calls' clocks and power, beside a long run's (the rollout suite)
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    step_ms = statistics.median(times) / args.steps * 1e3
    # programs compiled inside the timed calls (0 unless an input's placement changed after the first call)
    recompiled = programs.decode_program()._cache_size() - compiled
    # roofline of one step at the mean context of the timed calls
    kv_dtype = jnp.dtype(jnp.float8_e4m3fn) if ec.fp8_kv else jnp.dtype(args.dtype)
    kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_dtype.itemsize
    mean_ctx = float(lengths.mean()) + args.steps * (1 if args.hold else args.repeats + 1) / 2
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(engine.params))
    kv_bytes = args.batch * mean_ctx * kv_token
    roof_ms = (weight_bytes + kv_bytes) / hbm_copy_bps() * 1e3
    row = {"mode": mode.value, "paged_attention": paged_kernel.describe_config(engine.kv_dtype),
           "cublaslt_algos": describe_cublaslt_algos() if mode.fp8_weights else None,
           "compile_s": compile_s, "call_s": times, "step_ms": step_ms, "recompiled_in_timed_calls": recompiled,
           "tokens_per_s": args.batch / step_ms * 1e3, "weight_gb": weight_bytes / 1e9, "kv_gb_per_step": kv_bytes / 1e9,
           "roofline_step_ms": roof_ms, "hbm_fraction": roof_ms / step_ms, "gpu_during_calls": gpu.summary()}
    if jax.default_backend() == "gpu" and not args.no_trace:
        row["trace"] = traced(call, args.steps, args.trace_out, f"decode_{mode.value}")
        if args.hlo:  # what each top XLA kernel computes, from the program's optimized HLO
            hlo = programs.decode_program().lower(engine.params, engine.cache, *rest, steps=args.steps,
                                                  truncation=truncation, **engine.runner.static).compile().as_text()
            row["trace"]["top_kernels_hlo"] = fusion_hlo(hlo, list(row["trace"]["top_kernels_us_per_step"]))
            if args.hlo_out:  # the whole program, for kernels the top list's excerpts do not explain
                args.hlo_out.mkdir(parents=True, exist_ok=True)
                (args.hlo_out / f"decode_{mode.value}.hlo.txt").write_text(hlo)
    print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
    if "trace" in row:
        t = row["trace"]
        print(f"  GPU busy {t['gpu_busy_us_per_step'] / 1e3:.2f} ms/step of {step_ms:.2f} ms wall", flush=True)
        for k, v in t["per_step_us_by_class"].items():
            print(f"  {v / 1e3:8.3f} ms  {k}", flush=True)
    del engine
    return row


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3_8b")
    ap.add_argument("--layers", type=int, default=0, help="keep only the first N layers of the preset (0: all)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", nargs="*", default=["none", "all"], choices=[m.value for m in Fp8Mode])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fuse-projections", choices=["auto", "on", "off"], default="auto",
                    help="EngineConfig.fuse_projections (auto: on, on one device)")
    ap.add_argument("--fused-cast", choices=["on", "off"], default="on",
                    help="EngineConfig.fused_cast: the BF16 GEMMs write BF16 themselves (off: float32 + a convert)")
    ap.add_argument("--draw", choices=[d.value for d in Draw], default=Draw.INVERSE_CDF.value,
                    help="EngineConfig.sampling_draw: how the rows (temperature 1) draw their tokens")
    ap.add_argument("--fp8-gemm", choices=[b.value for b in GemmBackend], default="auto",
                    help="EngineConfig.fp8_gemm: the Mosaic kernel or cuBLASLt (auto: FP8RL_FP8_GEMM, else the measured per-shape table, else mosaic)")
    ap.add_argument("--lengths", choices=[m.value for m in Lengths], default=Lengths.UNIFORM.value,
                    help="row lengths: uniform in [context / 2, context], or all equal to context (W1's lockstep rows)")
    ap.add_argument("--pages", choices=[m.value for m in PageOrder], default=PageOrder.SHUFFLED.value,
                    help="page placement: shuffled through the pool, or as the engine hands pages out in W1 (each "
                         "row's prompt pages contiguous, then one page per row per decode call, side by side)")
    ap.add_argument("--prompt-len", type=int, default=1024, help="the prompt length of --pages engine")
    ap.add_argument("--hold", action="store_true",
                    help="every timed call starts from the same lengths, so --repeats N runs one state for N calls "
                         "(a sustained run's clocks and step time beside a short one's; call_s keeps each call)")
    ap.add_argument("--prefill", type=int, default=0,
                    help="profile the prefill program instead: this many prompts of --prompt-len tokens per call "
                         "(W1 runs 4 x 1024); --steps only sizes the rows' pages, --batch and --context are unused")
    ap.add_argument("--no-trace", action="store_true")
    ap.add_argument("--hlo", action="store_true",
                    help="also record the optimized HLO of the top XLA kernels (compiles the decode program again)")
    ap.add_argument("--hlo-out", type=Path, default=None, help="with --hlo, also write each mode's whole HLO here")
    ap.add_argument("--trace-out", type=Path, default=None, help="also keep each traced call's trace.json.gz here")


def check_memory(args: argparse.Namespace, limit: int | None = None) -> None:
    """Before anything is allocated: a ``ValueError`` (one line) when a mode's weights, the engine's own copy
    (FP8, or fused on one device) and its KV pool exceed ``limit`` bytes (default: the device's allocator
    limit; none on the CPU). The pool is sized as `run_mode` / `run_prefill` size it."""
    limit = device_bytes_limit() if limit is None else limit
    cfg, dtype, ps = model_config(args), jnp.dtype(args.dtype), 16
    weights = generator_weight_bytes(cfg, False, dtype)
    fused = args.fuse_projections != "off"  # one device: auto fuses
    for m in args.modes:
        mode = Fp8Mode(m)
        if args.prefill > 0:
            rows, max_seq = args.prefill, args.prompt_len + args.steps + ps
            pages = rows * -(-max_seq // ps) + 8
        else:
            rows, max_seq = args.batch, args.context + args.steps * ((3 if args.hold else args.repeats + 2) + 1) + ps
            pages = rows * -(-max_seq // ps) + 8
        copy = generator_weight_bytes(cfg, True, dtype) if mode.fp8_weights else weights if fused else 0
        kv = pages * kv_page_bytes(cfg, ps, mode.fp8_kv, dtype)
        check_fits({"weights": weights, "engine weight copy": copy, "KV pool": kv}, limit,
                   what=f"decode ({mode.value}, {rows} sequences x {max_seq} tokens, {args.preset})",
                   fixes={"KV pool": "lower --batch or --context (--prefill / --prompt-len), or an FP8 KV mode "
                                     "(--modes kv all) for half the bytes",
                          "weights": "fewer --layers or a smaller --preset",
                          "engine weight copy": "--fuse-projections off, fewer --layers or a smaller --preset"})


def run(args: argparse.Namespace) -> dict:
    check_memory(args)
    cfg = model_config(args)
    params = init_params(cfg, jax.random.key(args.seed), jnp.dtype(args.dtype))
    results = {"args": {k: str(v) for k, v in vars(args).items()}, **ceiling_record(),
               "model": dataclasses.asdict(cfg), "runs": []}
    for m in args.modes:
        run_one = run_prefill if args.prefill > 0 else run_mode
        results["runs"].append(run_one(args, params, Fp8Mode(m)))
    return results


def result_name(args: argparse.Namespace) -> str:
    """``decode_<batch>x<context>`` (``prefill_<prompts>x<prompt len>``), the preset first where it is not
    Qwen3-8B."""
    preset = "" if args.preset == "qwen3_8b" else f"{args.preset}_"
    shape = f"prefill_{args.prefill}x{args.prompt_len}" if args.prefill > 0 else f"decode_{args.batch}x{args.context}"
    return f"{preset}{shape}"


SMOKE = ["--preset", "tiny_qwen3", "--layers", "1", "--batch", "4", "--context", "40", "--steps", "4", "--repeats", "1",
         "--modes", "none", "kv", "--dtype", "float32", "--lengths", "equal", "--pages", "engine", "--prompt-len", "24",
         "--no-trace"]
