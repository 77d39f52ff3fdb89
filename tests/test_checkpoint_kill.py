"""Save / kill / resume: a training process SIGKILLed after a checkpoint and resumed from it
reproduces the metrics and parameters of an uninterrupted run exactly."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "ckpt_kill_worker.py"


def _run(tmp: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(WORKER), "--ckpt", str(tmp / f"{name}_ckpt"),
                           "--metrics", str(tmp / f"{name}.jsonl"), "--steps", "5", *extra],
                          capture_output=True, text=True, timeout=300)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_kill_and_resume_reproduces_the_uninterrupted_run(tmp_path):
    # one process: the uninterrupted run (the reference, full.jsonl), then a fresh run killed after step 3
    killed = _run(tmp_path, "cut", "--kill-after", "3", "--reference-metrics", str(tmp_path / "full.jsonl"))
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    assert [r["step"] for r in _rows(tmp_path / "full.jsonl")] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in _rows(tmp_path / "cut.jsonl")] == [1, 2, 3]
    full_checksum = json.loads(killed.stdout.splitlines()[-1])  # printed by the reference run
    resumed = _run(tmp_path, "cut", "--resume")  # a new process, from the checkpoint of step 3
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = _rows(tmp_path / "full.jsonl"), _rows(tmp_path / "cut.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]
    assert a == b  # every metric of every step, bit for bit (JSON floats round-trip exactly)
    assert full_checksum == json.loads(resumed.stdout.splitlines()[-1])
