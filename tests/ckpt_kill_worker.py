"""Worker for the save / kill / resume test (tests/test_checkpoint_kill.py), run as a subprocess.

Trains a tiny Qwen3 for ``--steps`` updates on a deterministic stream of synthetic RL batches
(batch i depends only on i), checkpointing the TrainState and the data cursor after every
update and appending each step's metrics to ``--metrics`` (JSONL). With ``--kill-after k`` it
SIGKILLs itself right after the checkpoint of step k is committed, like a preempted job; with
``--resume`` it restores the latest checkpoint and continues from its cursor. With
``--reference-metrics PATH`` it first does a whole uninterrupted run from a fresh state (its own
checkpoint folder ``--ckpt`` + ``_reference``, metrics to PATH, its final line printed), so one
process gives the reference and the run that gets killed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.models import tiny_qwen3  # noqa: E402
from fp8rl_jax.models import DensePolicy, init_params  # noqa: E402
from fp8rl_jax.rl.checkpointing import CheckpointConfig, Checkpointer  # noqa: E402
from fp8rl_jax.rl.trainer import (ComputeDtype, OptimizerConfig, TrainBatch, TrainerConfig,  # noqa: E402
                                  init_train_state, make_optimizer, make_train_step)

CFG = dataclasses.replace(tiny_qwen3, num_layers=1, vocab_size=64)
TC = TrainerConfig(optimizer=OptimizerConfig(lr=1e-2, warmup_steps=2), micro_batches=2,
                   compute_dtype=ComputeDtype.FLOAT32)


def batch_at(i: int) -> TrainBatch:
    rng = np.random.default_rng([7, i])
    tokens = rng.integers(2, CFG.vocab_size, (4, 10)).astype(np.int32)
    mask = (np.arange(10)[None, :] >= 4).astype(np.float32) * (rng.random((4, 1)) < 0.9)
    adv = rng.normal(size=(4, 1)).astype(np.float32) * mask
    lp = -rng.exponential(1.0, (4, 10)).astype(np.float32) * mask
    return TrainBatch(tokens=jnp.asarray(tokens), loss_mask=jnp.asarray(mask), advantages=jnp.asarray(adv),
                      old_logprobs=jnp.asarray(lp), rollout_logprobs=jnp.asarray(lp - 0.05 * mask))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--metrics", type=Path, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--kill-after", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--reference-metrics", type=Path, default=None)
    a = ap.parse_args()
    opt = make_optimizer(TC.optimizer)
    step_fn = make_train_step(CFG, DensePolicy("float32"), TC, opt)
    if a.reference_metrics is not None:
        run(step_fn, opt, a.ckpt.with_name(a.ckpt.name + "_reference"), a.reference_metrics, a.steps)
    run(step_fn, opt, a.ckpt, a.metrics, a.steps, kill_after=a.kill_after, resume=a.resume)


def run(step_fn, opt, ckpt_dir: Path, metrics: Path, steps: int, kill_after: int = 0, resume: bool = False) -> None:
    state = init_train_state(init_params(CFG, jax.random.key(0), jnp.float32), opt, jax.random.key(1))
    ckpt = Checkpointer(ckpt_dir, CheckpointConfig(max_to_keep=2))
    cursor = {"next_batch": 0}
    if resume:
        state, cursor = ckpt.restore(jax.eval_shape(lambda: state))
    with metrics.open("a") as f:
        for i in range(cursor["next_batch"], steps):
            state, m = step_fn(state, batch_at(i))
            f.write(json.dumps({"step": i + 1, **{k: float(v) for k, v in m.items()}}) + "\n")
            f.flush()
            ckpt.save(state, {"next_batch": i + 1})
            if i + 1 == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
    leaves = jax.tree.leaves(state.params)
    print(json.dumps({"param_checksum": float(sum(jnp.sum(jnp.abs(x)) for x in leaves))}), flush=True)
    ckpt.close()


if __name__ == "__main__":
    main()
