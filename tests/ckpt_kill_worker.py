"""Worker for the save / kill / resume test (tests/test_checkpoint_kill.py), run as a subprocess.

Trains a tiny Qwen3 for ``--steps`` updates on a deterministic stream of synthetic RL batches
(batch i depends only on i), checkpointing the TrainState and the data cursor after every
update and appending each step's metrics to ``--metrics`` (JSONL). ``--kill-at STEP:PHASE``
SIGKILLs the process like a preempted job: ``step`` right after the update of STEP and its
metrics line, before its checkpoint; ``save`` at a random moment while that checkpoint is being
written (a timer thread, ``--seed``); ``saved`` right after it is committed. With ``--resume`` it
removes unfinished saves, restores the newest intact checkpoint, drops the metrics lines written
after it, and continues from its cursor (what it did goes to stderr as JSON). With
``--reference-metrics PATH`` it first does a whole uninterrupted run from a fresh state (its own
checkpoint folder ``--ckpt`` + ``_reference``, metrics to PATH, its final line printed), so one
process gives the reference and the run that gets killed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.models import tiny_qwen3  # noqa: E402
from fp8rl_jax.models import DensePolicy, init_params  # noqa: E402
from fp8rl_jax.rl.checkpointing import CheckpointConfig, Checkpointer, remove_unfinished_saves  # noqa: E402
from fp8rl_jax.rl.trainer import (ComputeDtype, OptimizerConfig, TrainBatch, TrainerConfig,  # noqa: E402
                                  init_train_state, make_optimizer, make_train_step)

CFG = dataclasses.replace(tiny_qwen3, num_layers=1, vocab_size=64)
TC = TrainerConfig(optimizer=OptimizerConfig(lr=1e-2, warmup_steps=2), micro_batches=2,
                   compute_dtype=ComputeDtype.FLOAT32)
PHASES = ("step", "save", "saved")


def batch_at(i: int) -> TrainBatch:
    rng = np.random.default_rng([7, i])
    tokens = rng.integers(2, CFG.vocab_size, (4, 10)).astype(np.int32)
    mask = (np.arange(10)[None, :] >= 4).astype(np.float32) * (rng.random((4, 1)) < 0.9)
    adv = rng.normal(size=(4, 1)).astype(np.float32) * mask
    lp = -rng.exponential(1.0, (4, 10)).astype(np.float32) * mask
    return TrainBatch(tokens=jnp.asarray(tokens), loss_mask=jnp.asarray(mask), advantages=jnp.asarray(adv),
                      old_logprobs=jnp.asarray(lp), rollout_logprobs=jnp.asarray(lp - 0.05 * mask))


def kill_point(text: str) -> tuple[int, str]:
    step, _, phase = text.partition(":")
    if not step.isdigit() or phase not in PHASES:
        raise argparse.ArgumentTypeError(f"--kill-at takes STEP:PHASE with PHASE one of {PHASES}, got {text!r}")
    return int(step), phase


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--metrics", type=Path, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--kill-at", type=kill_point, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--reference-metrics", type=Path, default=None)
    a = ap.parse_args()
    opt = make_optimizer(TC.optimizer)
    step_fn = make_train_step(CFG, DensePolicy("float32"), TC, opt)
    if a.reference_metrics is not None:
        run(step_fn, opt, a.ckpt.with_name(a.ckpt.name + "_reference"), a.reference_metrics, a.steps)
    run(step_fn, opt, a.ckpt, a.metrics, a.steps, kill_at=a.kill_at, resume=a.resume, rng=random.Random(a.seed))


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kept_rows(path: Path, upto: int) -> str:
    """The metrics lines of steps <= ``upto`` (a torn last line dropped)."""
    kept = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            if json.loads(line)["step"] <= upto:
                kept.append(line + "\n")
        except json.JSONDecodeError:
            pass
    return "".join(kept)


def run(step_fn, opt, ckpt_dir: Path, metrics: Path, steps: int, kill_at: tuple[int, str] | None = None,
        resume: bool = False, rng: random.Random | None = None) -> None:
    state = init_train_state(init_params(CFG, jax.random.key(0), jnp.float32), opt, jax.random.key(1))
    report = {"removed": [p.name for p in remove_unfinished_saves(ckpt_dir)]} if resume else {}
    ckpt = Checkpointer(ckpt_dir, CheckpointConfig(max_to_keep=2))
    cursor = {"next_batch": 0}
    if resume:
        report["step"] = 0  # killed before its first checkpoint: starts over
        if ckpt.latest_step() is not None:
            restored = ckpt.restore_latest(jax.eval_shape(lambda: state))
            state, cursor = restored.state, restored.cursor
            report.update(step=restored.step, verified=restored.verified, damaged=[s for s, _, _ in restored.damaged])
        metrics.write_text(_kept_rows(metrics, report["step"]))
        print(json.dumps(report), file=sys.stderr, flush=True)
    with metrics.open("a") as f:
        for i in range(cursor["next_batch"], steps):
            state, m = step_fn(state, batch_at(i))
            f.write(json.dumps({"step": i + 1, **{k: float(v) for k, v in m.items()}}) + "\n")
            f.flush()
            if kill_at == (i + 1, "step"):
                _kill()
            if kill_at == (i + 1, "save"):  # somewhere inside the save (it takes ~0.1-0.3 s here)
                threading.Timer(rng.uniform(0.0, 0.25), _kill).start()
            ckpt.save(state, {"next_batch": i + 1})
            if kill_at is not None and kill_at[0] == i + 1:
                _kill()  # the "saved" point, or a "save" timer that had not fired yet
    leaves = jax.tree.leaves(state.params)
    print(json.dumps({"param_checksum": float(sum(jnp.sum(jnp.abs(x)) for x in leaves))}), flush=True)
    ckpt.close()


if __name__ == "__main__":
    main()
