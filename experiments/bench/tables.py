"""Files a measurement leaves besides the runner's result: a sweep's rows written as it goes (so a
run cut short keeps what it measured) and the kernels' tuning tables (``pallas_kernels/*_tuning.json``,
read at run time by `pallas_kernels.common.tuning_entries`)."""

from __future__ import annotations

import json
from pathlib import Path

from experiments.bench.record import environment


def write_results(path, results: list) -> None:
    """A sweep's rows as JSON with the environment at the top level; rewrite it after every shape."""
    Path(path).write_text(json.dumps({**environment(), "results": results}, indent=1, default=str))


def merged_tuning(path: Path, entries: list[dict]) -> list[dict]:
    """The tuning table at ``path`` with ``entries`` replacing those of the same (device kind, M
    bucket, N, K); entries of other shapes and device kinds are kept."""
    key = lambda e: (e["device_kind"], int(e["m_bucket"]), int(e["n"]), int(e["k"]))  # noqa: E731
    new = {key(e) for e in entries}
    old = json.loads(Path(path).read_text()).get("entries", []) if Path(path).exists() else []
    return [e for e in old if key(e) not in new] + list(entries)


def write_tuning(path, entries: list[dict]) -> None:
    """A tuning table: the best config per shape key measured here, with the environment."""
    Path(path).write_text(json.dumps({"environment": environment(), "entries": entries}, indent=1) + "\n")
    print(f"wrote {path}")
