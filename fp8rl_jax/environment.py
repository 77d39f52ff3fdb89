"""What every benchmark result records about where it ran (device, versions, date), and the
process-wide JAX settings the entry points share (the persistent compilation cache)."""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import flax
import jax
import jaxlib


def run_environment(**extra) -> dict:
    """Where a run happened: device kind and count, backend, jax/jaxlib/flax/python versions and the
    UTC date, plus ``extra``."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return dict(device=jax.devices()[0].device_kind, devices=jax.device_count(), backend=jax.default_backend(),
                jax=jax.__version__, jaxlib=jaxlib.__version__, python=platform.python_version(),
                date=now, flax=flax.__version__, **extra)


CACHE_ENV = "FP8RL_COMPILATION_CACHE"


def enable_compilation_cache(path: str | os.PathLike | None = None, min_compile_s: float = 1.0) -> Path | None:
    """Turns on JAX's persistent compilation cache, so a restarted job (``--resume`` after a stall
    exit, the next ``fp8rl generate``) loads its programs instead of compiling them again (Qwen3-8B
    engine programs: tens of seconds cold, a few seconds from the cache).

    ``path``: the cache folder; default ``$FP8RL_COMPILATION_CACHE``, else
    ``~/.cache/fp8rl_jax/jax``. ``"off"`` (argument or variable) leaves the cache off. A cache
    folder the user already gave JAX (``JAX_COMPILATION_CACHE_DIR`` or ``jax.config``) is kept.
    Programs that compile in under ``min_compile_s`` seconds are not stored (unless
    ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` says otherwise). Call it before the
    first compile. Returns the folder in use, or None when off."""
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


# nvidia-smi's clock-event (throttle) reason bits (nvml.h, nvmlClocksEventReason*)
_CLOCK_EVENTS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                 0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
                 0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}
_SMI_FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu")
_SMI_REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


class GpuMonitor:
    """Samples a GPU's SM and memory clocks, power, temperature and clock-event (throttle) reasons
    with ``nvidia-smi`` every ``interval_ms`` (a background thread, one query each) while a benchmark
    runs, so a result can say whether the GPU held its clocks (a 40 s rollout run draws far more
    power than a 1 s profile of the same decode step)::

        with GpuMonitor() as gpu:
            run()
        row["gpu_during_run"] = gpu.summary()   # None where there is no nvidia-smi

    ``summary()``: samples, SM clock (median / min / max MHz), memory clock (median), power (mean /
    max W), temperature (max C), and each clock-event reason seen with the fraction of samples it
    was active in (None where the driver names no reasons field). The GPU is the first one
    ``CUDA_VISIBLE_DEVICES`` names (else GPU 0). A failing query never fails the run."""

    def __init__(self, interval_ms: int = 500, smi: str = "nvidia-smi"):
        self.interval_ms, self.smi = int(interval_ms), smi
        self._lines: list[str] = []
        self._fields: tuple[str, ...] = ()
        self._thread = None
        self._stop = None

    def _query(self, fields: tuple[str, ...]):
        gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        try:
            return subprocess.run([self.smi, "-i", gpu, f"--query-gpu={','.join(fields)}",
                                   "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None

    def __enter__(self) -> GpuMonitor:
        if shutil.which(self.smi) is None:
            return self
        for reasons in (*_SMI_REASONS, None):  # the reasons field's name changed across drivers
            fields = _SMI_FIELDS + ((reasons,) if reasons else ())
            probe = self._query(fields)
            if probe is not None and probe.returncode == 0:
                self._fields = fields
                break
        else:
            return self
        self._stop = threading.Event()

        def loop():
            while not self._stop.is_set():
                out = self._query(self._fields)
                if out is not None and out.returncode == 0:
                    self._lines.extend(ln for ln in out.stdout.splitlines() if ln.strip())
                self._stop.wait(self.interval_ms / 1e3)

        self._thread = threading.Thread(target=loop, name="GpuMonitor", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=15)
            self._thread = None

    def summary(self) -> dict | None:
        rows = []
        for line in self._lines:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != len(self._fields):
                continue
            try:
                rows.append([float(p) for p in parts[:4]] + [int(parts[4], 16) if len(parts) > 4 else 0])
            except ValueError:
                continue  # "[N/A]" or a cut line
        if not rows:
            return None
        sm, mem, power, temp, reasons = zip(*rows)
        seen = {}
        for bit, name in _CLOCK_EVENTS.items():
            active = sum(1 for r in reasons if r & bit)
            if active:
                seen[name] = round(active / len(rows), 3)
        return {"samples": len(rows), "interval_ms": self.interval_ms,
                "sm_clock_mhz": {"median": statistics.median(sm), "min": min(sm), "max": max(sm)},
                "mem_clock_mhz_median": statistics.median(mem),
                "power_w": {"mean": round(statistics.fmean(power), 1), "max": max(power)},
                "temperature_c_max": max(temp),
                "clock_event_reasons": seen if len(self._fields) > 4 else None}
