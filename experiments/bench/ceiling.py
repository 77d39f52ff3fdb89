"""The device's memory-bandwidth ceiling, measured on the device the suite runs on.

Rooflines in the suites are fractions of this number, not of a datasheet constant: one elementwise
kernel reads and writes a large buffer once (what a device-to-device copy moves), and bytes read +
written over the kernel's time is the ceiling. On a GPU the kernel's time comes from a profiler trace
(`experiments.bench.timing.replay_gpu_ms`): the wall clock of one call carries the host's launch and
synchronization (~0.8 ms on a virtualized H200, against a 1 ms kernel), which would halve the ceiling.
The median of three traced calls is taken, once per process, and recorded in each payload that uses
it (``hbm_copy_gbps``). Off the GPU (no kernels to trace) the wall clock is used.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp

from experiments.bench.timing import replay_gpu_ms

GPU_BYTES = 2 << 30  # 2 GiB: far past every cache, ~1 ms on an H100/H200
CPU_BYTES = 64 << 20


def _flip(a: jax.Array) -> jax.Array:
    return a ^ jnp.uint32(1)  # not elidable: one read and one write per element


@functools.cache
def hbm_copy_bps(nbytes: int | None = None, repeats: int = 3) -> float:
    """Bytes per second (read + write) of one pass over a ``nbytes`` buffer on device 0: the median of
    ``repeats`` traced kernel times on a GPU, of ``repeats`` wall-clock calls after a compiling one
    elsewhere."""
    gpu = jax.default_backend() == "gpu"
    nbytes = nbytes or (GPU_BYTES if gpu else CPU_BYTES)
    x = jnp.zeros((nbytes // 4,), jnp.uint32)
    seconds = []
    if gpu:
        seconds = [replay_gpu_ms(_flip, [(x,)])["busy_ms"] / 1e3 for _ in range(repeats)]
    if not seconds or not all(seconds):  # off the GPU, or no kernels traced: the wall clock
        copy = jax.jit(_flip)
        jax.block_until_ready(copy(x))
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(copy(x))
            seconds.append(time.perf_counter() - t0)
    del x
    return 2 * nbytes / statistics.median(seconds)


def ceiling_record() -> dict:
    """The payload field naming the ceiling a suite's fractions are taken against."""
    return {"hbm_copy_gbps": round(hbm_copy_bps() / 1e9, 1)}
