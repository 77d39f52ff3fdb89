"""How the suites time device work: wall-clock medians, replays of distinct inputs in one program,
and GPU kernel time from a profiler trace (with the optimized HLO to name what each kernel computes)."""

from __future__ import annotations

import collections
import gzip
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp


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
    and no call is served from L2 by a repeat of the previous one."""

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
