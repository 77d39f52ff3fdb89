"""The GPU-time measures of the benchmarks: the profiler-trace reader (`experiments.bench.timing.trace_kernels`)
on a synthetic trace, and the gemm suite's use of GPU time (backend choice, both markdown tables)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

import jax
import jax.numpy as jnp

from experiments.bench.timing import fusion_hlo, trace_kernels


def _write_trace(d: Path, events: list[dict]) -> None:
    run = d / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    with gzip.open(run / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_trace_kernels_sums_the_stream_lines_of_gpu_processes(tmp_path):
    rng = np.random.default_rng()
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 7, "tid": 1, "args": {"name": "Stream #13(Compute)"}},
            {"ph": "M", "name": "thread_name", "pid": 7, "tid": 2, "args": {"name": "XLA Ops"}}]
    kernels, expect, t = [], {}, 100.0
    for _ in range(int(rng.integers(5, 20))):
        name = str(rng.choice(["nvjet_gemm", "loop_transpose_fusion", "paged_attention_decode"]))
        dur = float(rng.uniform(1, 50))
        kernels.append({"ph": "X", "pid": 7, "tid": 1, "name": name, "ts": t, "dur": dur, "args": {"hlo_op": name}})
        expect[name] = expect.get(name, 0.0) + dur
        t += dur + float(rng.uniform(0, 10))  # idle gaps count in the span, not in the sums
    span = t - 100.0 - (t - kernels[-1]["ts"] - kernels[-1]["dur"])
    noise = [{"ph": "X", "pid": 7, "tid": 2, "name": "nvjet_gemm", "ts": 0.0, "dur": 1e6},  # the op line repeats kernels
             {"ph": "X", "pid": 1, "tid": 1, "name": "host_work", "ts": 0.0, "dur": 1e6}]  # a host thread
    _write_trace(tmp_path, meta + kernels + noise)
    by_name, got_span, args = trace_kernels(tmp_path)
    assert set(by_name) == set(expect)
    for name, us in expect.items():
        assert abs(by_name[name] - us) < 1e-6 * us
    assert abs(got_span - span) < 1e-6 * span
    assert all(args[name]["hlo_op"] == name for name in expect)


def test_bench_gemm_picks_backends_by_gpu_time_and_writes_both_tables():
    from experiments.bench.suites import gemm as bench_gemm

    # wall clock says Mosaic (cuBLASLt's host launch is slower than its kernel), GPU time says cuBLASLt
    row = {"M": 256, "N": 4096, "K": 4096, "input_sets": 64,
           "ours_mgpu": {"ms": 0.028, "tflops": 307.0, "gpu_ms": 0.027, "gpu_tflops": 318.0},
           "ours_cublaslt": {"ms": 0.034, "tflops": 252.0, "gpu_ms": 0.016, "gpu_tflops": 537.0},
           "torch_cublas_fp8_block": {"ms": 0.0153, "tflops": 561.0, "gpu_ms": 0.0153, "gpu_tflops": 561.0},
           "xla_bf16": {"ms": 0.024, "tflops": 358.0, "gpu_ms": 0.020, "gpu_tflops": 429.0}}
    (entry,) = bench_gemm.backend_entries([row], "NVIDIA H200")
    assert entry["backend"] == "cublaslt" and entry["ms"] == {"mosaic": 0.027, "cublaslt": 0.016}
    wall_only = {k: ({"ms": v["ms"]} if isinstance(v, dict) else v) for k, v in row.items()}
    assert bench_gemm.backend_entries([wall_only], "NVIDIA H200")[0]["backend"] == "mosaic"
    md = bench_gemm.markdown({"environment": {"device": "NVIDIA H200", "date": "d", "jax": "j", "torch": "t"},
                              "gemm": [row]})
    gpu_part, wall_part = md.split("## By wall clock")
    gpu_line = [ln for ln in gpu_part.splitlines() if ln.startswith("| 256 |")][0]
    wall_line = [ln for ln in wall_part.splitlines() if ln.startswith("| 256 |")][0]
    assert "| 537 |" in gpu_line and "| 252 |" in wall_line
    assert gpu_line.endswith(f"| {537 / 429:.2f}x | {537 / 561:.2f}x |")  # best dispatchable / BF16, / cuBLAS


def test_fusion_hlo_names_what_each_kernel_computes():
    """A kernel named after its fusion instruction (dots as underscores) maps to the instruction, the
    source ops of its metadata and its fused computation; unknown names are left out."""
    rng = np.random.default_rng()
    m, n = (int(v) for v in rng.integers(8, 64, 2))
    f = jax.jit(lambda x, y: (jnp.exp(x) * y).sum(1) + jnp.tanh(x).T.sum(0))
    hlo = f.lower(jnp.ones((m, n)), jnp.ones((m, n))).compile().as_text()
    names = [ln.split("=")[0].strip().removeprefix("ROOT ").lstrip("%").replace(".", "_")
             for ln in hlo.splitlines() if " fusion(" in ln]
    got = fusion_hlo(hlo, [*names, "no_such_kernel"])
    assert set(got) == set(names) and names
    exp = [v for v in got.values() if any("exponential(" in line for line in v["computation"])]
    assert len(exp) == 1 and "jit(<lambda>)/exp" in exp[0]["source_ops"]
    assert "fusion(" in exp[0]["instruction"] and f"f32[{m},{n}]" in "\n".join(exp[0]["computation"])


def test_replay_gpu_ms_returns_the_calls_outputs():
    """``with_outputs``: the outputs of the timed program's calls, one per argument set (the grouped GEMM's
    sweep checks its error on them without compiling the call again). No GPU here: only the outputs are
    checked, and the timing keys are present."""
    from experiments.bench.timing import replay_gpu_ms

    rng = np.random.default_rng()
    sets = [(jnp.asarray(rng.standard_normal((5, 7)), jnp.float32), jnp.float32(rng.uniform(1, 2))) for _ in range(3)]
    res, outs = replay_gpu_ms(lambda x, s: jnp.tanh(x) * s, sets, with_outputs=True)
    assert {"busy_ms", "span_ms", "kernels"} <= set(res) and len(outs) == 3
    for (x, s), out in zip(sets, outs):
        np.testing.assert_allclose(np.asarray(out), np.tanh(np.asarray(x, np.float64)) * float(s), rtol=1e-5)
