"""Where a benchmark ran and where its result goes: the environment record and the result file."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import jax

from fp8rl_jax.environment import run_environment

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results"


def device_slug(kind: str | None = None) -> str:
    """The results folder of a device kind: ``h100``, ``h200``, ``cpu`` (others: the kind, lower-case,
    non-alphanumerics as ``-``)."""
    if kind is None:
        kind = jax.devices()[0].device_kind if jax.default_backend() == "gpu" else "cpu"
    m = re.search(r"\b([a-z]\d{2,3})\b", kind.lower())
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or "unknown"


COMMIT_ENV = "FP8RL_BENCH_COMMIT"  # the commit of a copy of the tree (e.g. a remote GPU's), given by whoever copied it


def git_commit() -> str:
    """``$FP8RL_BENCH_COMMIT`` when set (a copy of the tree whose .git, if any, is not its history), else the
    checkout's commit (with ``+dirty`` when tracked files differ from it), else ``unknown``."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def environment(**extra: Any) -> dict:
    """The library's run record (`fp8rl_jax.environment.run_environment`: device, versions, UTC date) with
    the optional packages' versions that are installed and the commit, plus ``extra``."""
    versions = {}
    for name in ("optax", "vllm", "torch"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - an optional package that is missing or broken is simply not recorded
            pass
    return run_environment(**versions, commit=git_commit(), **extra)


def write_result(name: str, payload: dict, out_dir: Path | str | None = None) -> Path:
    """Writes ``{"environment": ..., **payload}`` to ``<out_dir>/<device>/<name>.json`` (default
    ``experiments/results``), replacing an earlier result; returns the path."""
    folder = Path(out_dir if out_dir is not None else RESULTS) / device_slug()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"environment": environment(), **payload}, indent=1, default=str) + "\n")
    tmp.replace(path)
    return path
