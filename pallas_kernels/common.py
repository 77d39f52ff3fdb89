"""Helpers shared by the kernel files: the interpret-mode rule and wall-clock timing."""

from __future__ import annotations

import statistics
import time

import jax


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
