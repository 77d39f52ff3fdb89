"""Helpers shared by the kernel files: the interpret-mode rule, wall-clock timing, result files and
measured tuning tables."""

from __future__ import annotations

import collections
import contextlib
import datetime
import gzip
import json
import platform
import re
import statistics
import tempfile
import time
from pathlib import Path

import jax


_FP8_WGMMA: bool | None = None


def enable_fp8_wgmma() -> bool:
    """Lets Triton run the Pallas kernels' FP8 x FP8 -> float32 dots on Hopper's wgmma; idempotent.

    Triton's Hopper matmul pass takes wgmma (MMAv3) for FP8 operands with a float32 result only
    if the dot allows imprecise accumulation (``maxNumImpreciseAcc`` >= 32); otherwise it falls
    back to Ampere-style ``mma.sync`` on operands converted to float16 in registers (ALU work
    per loaded byte, no asynchronous MMA). Pallas' Triton lowering (jax 0.11) builds every
    ``tt.dot`` without the attribute, so every FP8 dot of our Triton kernels ran the fallback
    (offline sm_90 codegen, ``experiments/inspect_triton_codegen.py --kernel grouped_gemm``).
    This wraps the lowering's ``tt.dot`` builder: a dot of FP8 operands gets
    ``maxNumImpreciseAcc = K``, its own contraction length. Our kernels contract one 128-wide
    scale block per dot into a fresh accumulator and add the scaled result in float32 outside
    the MMA, so the tensor core's reduced-precision accumulation spans 128 products, the
    promotion interval of DeepSeek-V3 / cuBLAS block FP8 (the GPU tests hold it to the float64
    reference at their Hopper tolerance; not yet run on the device with this). Other dots are
    untouched. ``FP8RL_TRITON_FP8_MMAV2=1`` keeps the
    fallback (A/B timing); returns whether the wrapper is installed (False also when this JAX's
    lowering does not have the expected shape)."""
    global _FP8_WGMMA
    if _FP8_WGMMA is not None:
        return _FP8_WGMMA
    import inspect
    import os

    _FP8_WGMMA = False
    if os.environ.get("FP8RL_TRITON_FP8_MMAV2", "") not in ("", "0"):
        return False
    try:
        from jax._src.lib.mlir import ir
        from jax._src.pallas.triton import lowering
        dialect = lowering.tt_dialect
        original = dialect.dot
        if "max_num_imprecise_acc" not in inspect.signature(original).parameters:
            return False
    except (ImportError, AttributeError, TypeError, ValueError):
        return False

    def dot(a, b, c, *, max_num_imprecise_acc=None, **kwargs):
        if max_num_imprecise_acc is None:
            a_type = ir.RankedTensorType(a.type)
            if str(a_type.element_type) in ("f8E4M3FN", "f8E5M2"):
                max_num_imprecise_acc = a_type.shape[-1]
        return original(a, b, c, max_num_imprecise_acc=max_num_imprecise_acc, **kwargs)

    dot.__wrapped__ = original
    dialect.dot = dot
    _FP8_WGMMA = True
    return True


@contextlib.contextmanager
def triton_ir_for_h200(native_kernels: bool = False):
    """Within: Pallas Triton lowerings (``jit(...).trace(...).lower(lowering_platforms=("cuda",))`` on
    any host) target an H200 (sm_90), and the Triton IR (TTIR text) of each lowered kernel is
    appended to the yielded list. ``native_kernels``: ``jax.default_backend()`` says "gpu" too, so the
    kernels' ``interpret=None`` (`resolve_interpret`) and the policies' backend choices trace a whole
    program as on the GPU (lower it only). Private JAX API (jax 0.11): offline codegen inspection and tests."""
    from unittest import mock

    from jax._src.pallas.triton import gpu_info, lowering
    from jax._src.pallas.triton import pallas_call_registration as reg

    info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    captured: list[str] = []
    original = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    with mock.patch.object(reg.gpu_info_lib, "get_gpu_info", lambda *a, **k: info), \
            mock.patch.object(reg.lowering, "lower_jaxpr_to_triton_module", capture), \
            mock.patch.object(jax, "default_backend", (lambda: "gpu") if native_kernels else jax.default_backend):
        yield captured


def resolve_interpret(interpret: bool | None) -> bool:
    """None: native on a GPU backend, interpret mode elsewhere; a bool forces it."""
    if interpret is None:
        return jax.default_backend() != "gpu"
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret must be None or a bool, got {interpret!r}")
    return interpret


def median_ms(fn, n_iter: int = 10, n_warmup: int = 2) -> float:
    """Median wall-clock milliseconds of ``fn()`` (synchronized), after warm-up calls."""
    for _ in range(n_warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(n_iter):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def replay_ms(fn, arg_sets, n_replays: int = 10) -> float:
    """Median milliseconds per call of ``fn``: all of ``arg_sets`` (distinct inputs) run inside one
    jitted program per replay, so one dispatch + synchronize is spread over ``len(arg_sets)`` calls
    and no call is served from L2 by a repeat of the previous one (the method of METHOD.md)."""
    import jax.numpy as jnp

    @jax.jit
    def run(sets):
        acc = jnp.float32(0)
        for args in sets:
            acc = acc + fn(*args).reshape(-1)[0].astype(jnp.float32)
        return acc

    jax.block_until_ready(run(arg_sets))
    times = []
    for _ in range(n_replays):
        t0 = time.perf_counter()
        jax.block_until_ready(run(arg_sets))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times) / len(arg_sets)


def trace_kernels(trace_dir) -> tuple[dict[str, float], float, dict[str, dict]]:
    """GPU kernels of the newest ``*.trace.json.gz`` under ``trace_dir`` (a JAX profiler trace):
    ``(us per kernel name, GPU span us, one event's args per name)``. Kernels are the ``X`` events on
    the "Stream #..." lines of the trace's GPU processes (the "XLA Ops" / "XLA Modules" lines repeat
    them by op); the args carry what the profiler knows of a kernel (e.g. its HLO op)."""
    files = sorted(Path(trace_dir).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}")
    with gzip.open(files[-1], "rb") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names[e["pid"]] = str(e.get("args", {}).get("name", ""))
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    gpu_pids = {pid for pid, n in names.items() if "/device:GPU" in n}
    streams = {key for key, n in threads.items() if key[0] in gpu_pids and n.lower().startswith("stream")}
    by_name: dict[str, float] = collections.defaultdict(float)
    args: dict[str, dict] = {}
    lo, hi = float("inf"), 0.0
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in gpu_pids:
            continue
        if streams and (e["pid"], e.get("tid")) not in streams:
            continue
        d = float(e.get("dur", 0.0))
        by_name[e["name"]] += d
        args.setdefault(e["name"], e.get("args", {}))
        lo, hi = min(lo, float(e["ts"])), max(hi, float(e["ts"]) + d)
    return dict(by_name), (hi - lo if hi > lo else 0.0), args


def fusion_hlo(hlo_text: str, kernel_names, max_lines: int = 24) -> dict[str, dict]:
    """What XLA's kernels named ``kernel_names`` compute, from the optimized HLO of the program
    (``jitted.lower(...).compile().as_text()``): a GPU kernel is named after its fusion instruction
    with "." and "-" as "_" (``input_reduce_fusion.3`` -> ``input_reduce_fusion_3``). Per name found: the
    instruction (shape, kind, operands), the source ops its metadata names, and the first
    ``max_lines`` instructions of the fused computation. A profiler trace of a program run in CUDA
    graphs names the command buffer, not the fusion: this is how its kernels are told apart."""
    comps: dict[str, list[str]] = {}
    instrs: dict[str, str] = {}
    current = None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{\s*$", line)
        if head:
            current = comps.setdefault(head.group(1), [])
            continue
        if line.startswith("}"):
            current = None
            continue
        m = re.match(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$", line)
        if m:
            instrs.setdefault(re.sub(r"\W", "_", m.group(1)), m.group(2))
            if current is not None:
                current.append(line.strip())
    strip = lambda text: re.sub(r", (metadata|backend_config)=.*$", "", text)  # noqa: E731
    out = {}
    for name in kernel_names:
        rest = instrs.get(re.sub(r"\W", "_", name))
        if rest is None:
            continue
        called = re.search(r"calls=%([\w.\-]+)", rest)
        body = comps.get(called.group(1), []) if called else []
        ops = sorted(set(re.findall(r'op_name="([^"]+)"', "\n".join([rest, *body]))))
        out[name] = {"instruction": strip(rest)[:400], "source_ops": ops[:16],
                     "computation": [strip(line)[:200] for line in body[:max_lines]]}
    return out


def replay_gpu_ms(fn, arg_sets, *, with_outputs: bool = False):
    """GPU time per call of ``fn`` over ``arg_sets`` (one jitted program returning every output, run
    once under the JAX profiler): ``{"busy_ms", "span_ms", "kernels"}``, busy = the sum of the
    program's kernel times / calls (what a call costs the GPU, without the host's launch gaps that
    `replay_ms`'s wall clock includes when a call launches slower than it runs; the measure of a CUDA
    graph replay), span = first kernel start to last kernel end / calls, kernels = us per call by name.
    ``with_outputs``: returns ``(that dict, the outputs of the calls)``."""
    run = jax.jit(lambda sets: [fn(*args) for args in sets])
    outputs = jax.block_until_ready(run(arg_sets))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        jax.block_until_ready(run(arg_sets))
        jax.profiler.stop_trace()
        by_name, span, _ = trace_kernels(d)
    n = len(arg_sets)
    res = {"busy_ms": sum(by_name.values()) / n / 1e3, "span_ms": span / n / 1e3,
           "kernels": {k[:120]: round(v / n, 3) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:4]}}
    return (res, outputs) if with_outputs else res


def run_environment(**extra) -> dict:
    """Where a benchmark ran: ``{"device", "devices", "backend", "jax", "jaxlib", "python", "date"}``
    (date in UTC), plus ``extra``. Every result file under ``experiments/results/`` records it."""
    import jaxlib

    return {"device": jax.devices()[0].device_kind, "devices": jax.device_count(), "backend": jax.default_backend(),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **extra}


def write_results(path, results: list) -> None:
    """A kernel benchmark's rows as JSON with the environment (rewritten after every shape, so a
    run cut short keeps what it measured)."""
    with open(path, "w") as f:
        json.dump({**run_environment(), "results": results}, f, indent=1)



def m_bucket(m: int) -> int:
    """The M key of the measured tables (GEMM configs, GEMM backends): the next power of two, at least 64."""
    return max(64, 1 << (max(m, 1) - 1).bit_length())


def device_kind() -> str:
    """The key of a tuning-table entry: the GPU's device kind, or "cpu" off the GPU."""
    return jax.devices()[0].device_kind if jax.default_backend() == "gpu" else "cpu"


def tuning_entries(path: Path, kind: str) -> list[dict]:
    """The entries of a kernel's measured tuning table (``main --tuning-out``) made on device kind
    ``kind``; none when the file does not exist."""
    if not path.exists():
        return []
    return [e for e in json.loads(path.read_text()).get("entries", []) if e.get("device_kind") == kind]


def merged_tuning(path: Path, entries: list[dict]) -> list[dict]:
    """The tuning table at ``path`` with ``entries`` replacing those of the same (device kind, M
    bucket, N, K); entries of other shapes and device kinds are kept."""
    key = lambda e: (e["device_kind"], int(e["m_bucket"]), int(e["n"]), int(e["k"]))  # noqa: E731
    new = {key(e) for e in entries}
    old = json.loads(path.read_text()).get("entries", []) if path.exists() else []
    return [e for e in old if key(e) not in new] + list(entries)


def write_tuning(path, entries: list[dict]) -> None:
    """A tuning table: the best config per shape key measured here, with the environment."""
    Path(path).write_text(json.dumps({"environment": run_environment(), "entries": entries}, indent=1) + "\n")
    print(f"wrote {path}")
