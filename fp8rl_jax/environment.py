"""What every benchmark result records about where it ran: device, versions, date.

``run_environment`` lives with the kernels (``pallas_kernels.common``, the lowest layer, whose
own benchmarks write it too); the experiments add flax's version."""

from __future__ import annotations

from pallas_kernels.common import run_environment as _kernel_environment


def run_environment(**extra) -> dict:
    """``pallas_kernels.common.run_environment`` plus the flax version, plus ``extra``."""
    import flax

    return _kernel_environment(flax=flax.__version__, **extra)
