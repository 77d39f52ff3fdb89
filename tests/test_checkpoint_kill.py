"""Save / kill / resume: a training process SIGKILLed at random points (after an update, in the
middle of writing a checkpoint, right after one is committed), twice, and resumed each time,
reproduces the metrics and parameters of an uninterrupted run exactly, and leaves no unfinished
save behind. The kill points come from a random seed, printed on failure; ``FP8RL_KILL_SEED=N``
repeats a run's points."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "ckpt_kill_worker.py"
STEPS = 5
PHASES = ("step", "save", "saved")  # the worker's kill points within a step


def _run(tmp: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(WORKER), "--ckpt", str(tmp / f"{name}_ckpt"),
                           "--metrics", str(tmp / f"{name}.jsonl"), "--steps", str(STEPS), *extra],
                          capture_output=True, text=True, timeout=300)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_killed_at_random_points_and_resumed_reproduces_the_uninterrupted_run(tmp_path):
    seed = int(os.environ.get("FP8RL_KILL_SEED", random.randrange(1 << 20)))
    rng = random.Random(seed)
    first = (rng.randint(1, STEPS - 2), rng.choice(PHASES))
    second = (rng.randint(first[0] + 1, STEPS), rng.choice(PHASES))
    why = f"killed at {first}, then at {second} (FP8RL_KILL_SEED={seed} repeats it)"
    # one process: the uninterrupted run (the reference, full.jsonl), then a fresh run killed at `first`
    killed = _run(tmp_path, "cut", "--kill-at", f"{first[0]}:{first[1]}", "--seed", str(seed),
                  "--reference-metrics", str(tmp_path / "full.jsonl"))
    assert killed.returncode == -signal.SIGKILL, (why, killed.returncode, killed.stderr[-2000:])
    assert [r["step"] for r in _rows(tmp_path / "full.jsonl")] == list(range(1, STEPS + 1))
    assert [r["step"] for r in _rows(tmp_path / "cut.jsonl")] == list(range(1, first[0] + 1)), why
    full_checksum = json.loads(killed.stdout.splitlines()[-1])  # printed by the reference run
    leftovers = sorted(p.name for p in (tmp_path / "cut_ckpt").glob("*.orbax-checkpoint-tmp*"))  # a killed save's
    # a new process removes those, resumes from the newest intact checkpoint and is killed again at `second`
    again = _run(tmp_path, "cut", "--resume", "--kill-at", f"{second[0]}:{second[1]}", "--seed", str(seed + 1))
    assert again.returncode == -signal.SIGKILL, (why, again.returncode, again.stderr[-2000:])
    # where it resumed (the worker's JSON line among any library warnings): the newest committed checkpoint
    report = json.loads(next(line for line in again.stderr.splitlines() if line.startswith('{"removed"')))
    resumable = {"step": [first[0] - 1], "save": [first[0] - 1, first[0]], "saved": [first[0]]}[first[1]]
    assert report["step"] in resumable and report["removed"] == leftovers, (why, report, leftovers)
    resumed = _run(tmp_path, "cut", "--resume")  # and a third one finishes the run
    assert resumed.returncode == 0, (why, resumed.stderr[-2000:])
    a, b = _rows(tmp_path / "full.jsonl"), _rows(tmp_path / "cut.jsonl")
    assert [r["step"] for r in b] == list(range(1, STEPS + 1)), why
    assert a == b, why  # every metric of every step, bit for bit (JSON floats round-trip exactly)
    assert full_checksum == json.loads(resumed.stdout.splitlines()[-1]), why
    assert not list((tmp_path / "cut_ckpt").glob("*.orbax-checkpoint-tmp*")), why  # unfinished saves cleaned up
