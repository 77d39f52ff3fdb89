"""fp8rl_jax.environment.GpuMonitor against a stand-in nvidia-smi (a shell script on PATH)."""

from __future__ import annotations

import os
import stat
import time

import pytest

from fp8rl_jax.environment import GpuMonitor

# each query prints the next line of SAMPLES (a counter file keeps the place), as nvidia-smi's
# "--format=csv,noheader,nounits" does: SM MHz, memory MHz, W, C, reasons bitmask
SAMPLES = ["1980, 3201, 312.50, 41, 0x0000000000000000",
           "1755, 3201, 698.10, 55, 0x0000000000000004",
           "1830, 3201, 690.00, 58, 0x0000000000000004",
           "[N/A], 3201, 700.00, 59, 0x0000000000000000",  # a sample the driver could not read: skipped
           "1410, 3201, 701.30, 60, 0x0000000000000024"]


def _fake_smi(folder, reasons_field: str | None):
    lines = "\n".join(SAMPLES)
    script = folder / "nvidia-smi"
    reject = f'case "$*" in *{reasons_field}*) ;; *clocks_*reasons*) echo "Field is not valid" >&2; exit 2;; esac' \
        if reasons_field else 'case "$*" in *reasons*) exit 2;; esac'
    script.write_text(f"""#!/bin/sh
{reject}
n=$(cat "{folder}/n" 2>/dev/null || echo 0)
echo $((n + 1)) > "{folder}/n"
i=$((n % {len(SAMPLES)} + 1))
printf '%s\\n' "{lines}" | sed -n "${{i}}p" {'' if reasons_field else "| cut -d, -f1-4"}
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("reasons_field", ["clocks_throttle_reasons.active", None], ids=["old-name", "no-reasons"])
def test_gpu_monitor_summarizes_samples(tmp_path, monkeypatch, reasons_field):
    _fake_smi(tmp_path, reasons_field)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with GpuMonitor(interval_ms=10) as gpu:
        deadline = time.time() + 20
        while int((tmp_path / "n").read_text() or 0) < 2 + len(SAMPLES) and time.time() < deadline:
            time.sleep(0.01)  # the probes, then every sample at least once
    s = gpu.summary()
    assert s is not None and s["samples"] >= 4 and s["interval_ms"] == 10
    # the first len(SAMPLES) queries after the probes cycle through every line but the probes'
    assert s["sm_clock_mhz"]["min"] == 1410 and s["sm_clock_mhz"]["max"] == 1980
    assert s["mem_clock_mhz_median"] == 3201 and s["temperature_c_max"] == 60 and s["power_w"]["max"] == 701.3
    if reasons_field:
        r = s["clock_event_reasons"]
        assert set(r) == {"sw_power_cap", "sw_thermal_slowdown"} and 0 < r["sw_thermal_slowdown"] < r["sw_power_cap"] < 1
    else:
        assert s["clock_event_reasons"] is None


def test_gpu_monitor_without_nvidia_smi(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with GpuMonitor(interval_ms=10) as gpu:
        pass
    assert gpu.summary() is None
