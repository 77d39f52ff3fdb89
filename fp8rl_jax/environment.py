"""What every benchmark result records about where it ran (device, versions, date), and the
process-wide JAX settings the entry points share (the persistent compilation cache).

``run_environment`` lives with the kernels (``pallas_kernels.common``, the lowest layer, whose
own benchmarks write it too); the experiments add flax's version."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pallas_kernels.common import run_environment as _kernel_environment


def run_environment(**extra) -> dict:
    """``pallas_kernels.common.run_environment`` plus the flax version, plus ``extra``."""
    import flax

    return _kernel_environment(flax=flax.__version__, **extra)


CACHE_ENV = "FP8RL_COMPILATION_CACHE"


def enable_compilation_cache(path: str | os.PathLike | None = None, min_compile_s: float = 1.0) -> Path | None:
    """Turns on JAX's persistent compilation cache, so a restarted job (``--resume`` after a stall
    exit, the next ``fp8rl generate``) loads its programs instead of compiling them again (Qwen3-8B
    on the H200: 13-27 s per engine program cold, 2-7 s from the cache, session 7).

    ``path``: the cache folder; default ``$FP8RL_COMPILATION_CACHE``, else
    ``~/.cache/fp8rl_jax/jax``. ``"off"`` (argument or variable) leaves the cache off. A cache
    folder the user already gave JAX (``JAX_COMPILATION_CACHE_DIR`` or ``jax.config``) is kept.
    Programs that compile in under ``min_compile_s`` seconds are not stored (unless
    ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` says otherwise). Call it before the
    first compile. Returns the folder in use, or None when off."""
    import jax

    configured = jax.config.jax_compilation_cache_dir
    if configured:
        return Path(configured)
    choice = path if path is not None else os.environ.get(CACHE_ENV)
    if choice is not None and str(choice).strip().lower() in ("off", "0", "none", ""):
        return None
    folder = Path(choice).expanduser() if choice else Path.home() / ".cache" / "fp8rl_jax" / "jax"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only home must not stop a run: compile as usual
        print(f"fp8rl_jax: compilation cache off ({folder}: {e})", file=sys.stderr)
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # else the user's threshold stands
        jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_s))
    return folder
