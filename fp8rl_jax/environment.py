"""What every benchmark result records about where it ran: device, versions, date."""

from __future__ import annotations

import datetime
import platform

import jax


def run_environment(**extra) -> dict:
    """``{"device", "devices", "backend", "jax", "jaxlib", "flax", "python", "date"}`` of this process
    (date in UTC), plus ``extra``."""
    import flax
    import jaxlib

    return {"device": jax.devices()[0].device_kind, "devices": jax.device_count(), "backend": jax.default_backend(),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **extra}
