"""Quickstart: GRPO with FP8 rollout learns addition on a CPU in a few minutes.

What it does, all in-process (no downloads):
1. builds a character tokenizer (digits, ``+``, ``=``, ``<pad>``, ``<eos>``) and a tiny random
   Qwen3-architecture model (the same model code as Qwen3-8B, 2 layers);
2. a short supervised warm-up on answers from an unreliable teacher (right 10% of the time,
   otherwise off by 1-3): the model learns the format and where the answer lies, but picks the
   right one rarely, like an LLM before RL (about 16% of sampled answers are right);
3. GRPO: each step samples 8 answers per prompt from the JAX rollout engine in FP8 W8A8 with
   an FP8 KV cache, rewards exact matches, computes the trainer's logprobs in BF16, and
   updates with the DAPO-style clipped loss, reweighted by token-level truncated importance
   sampling (TIS) for the FP8-vs-BF16 mismatch; the new weights are re-quantized to FP8 and
   synced into the engine (KV scales recalibrated) every step;
4. writes ``metrics.jsonl`` (+ TensorBoard events) and ``quickstart.png`` (reward, mismatch KL,
   tokens/s) under ``--out`` and prints a summary table.

    python experiments/quickstart.py [--out runs/quickstart] [--resume] [--set data.steps=40 ...]

The run owns ``--out`` while it lasts (``OUT/run.lock``; a second run there exits with status 2).
With ``--set logging.checkpoint_every=N`` the RL phase writes checkpoints (TrainState, the task's
random generator, with a checksum) under ``OUT/checkpoints``; ``--resume`` continues from the newest
intact one, as the AIME scripts do: same seed, model and digits required (``RUN_IDENTITY``; ``--set
resume_other_config=true`` skips the check), the warm-up is not repeated, and the engine starts from
the restored weights. A fresh run into a folder with checkpoints is refused, never deletes them.

``--set`` takes the RL config's keys, as the AIME scripts do (``--set precision.rollout=none``,
``--set rollout.temperature=0.8``, ``--set rollout.engine.decode_buckets=16,64``), and the
quickstart's own fields by name (``--set sft_steps=100``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from configs.rl import QUICKSTART  # noqa: E402
from experiments.bench.record import write_result  # noqa: E402
from fp8rl_jax.models import abstract_params, init_params  # noqa: E402
from fp8rl_jax.rl import config as rlconfig  # noqa: E402
from fp8rl_jax.rl.checkpointing import (CheckpointConfig, Checkpointer, CheckpointError, latest_step,  # noqa: E402
                                         open_run_notes)
from fp8rl_jax.rl.loop import MetricsLogger, Task, evaluate, make_sft_step, plot_metrics, read_metrics, run  # noqa: E402
from fp8rl_jax.rl.run_dir import RunFolderError, RunLock, config_differences, read_config  # noqa: E402
from fp8rl_jax.rl.trainer import (  # noqa: E402
    init_train_state,
    make_logprob_fn,
    make_logprob_value_fn,
    make_optimizer,
    make_train_step,
    model_params,
    with_value_head,
)
from fp8rl_jax.rollout.engine import JaxEngine  # noqa: E402
from fp8rl_jax.rollout.sampling import SamplingConfig  # noqa: E402
from fp8rl_jax.tasks import AdditionTask, supervised_batch  # noqa: E402
from fp8rl_jax.tokenization import char_tokenizer  # noqa: E402

ALPHABET = "0123456789+="
# What makes a folder's checkpoints this run's (a resume with another value stops unless
# resume_other_config is set): the seed, the model and the task.
RUN_IDENTITY = ("rl.seed", "rl.model", "digits", "rl.data.prompts_per_step")


class UsageError(Exception):
    """An input or run folder the run cannot use; the command line prints ``error: ...`` and exits 2."""


@dataclasses.dataclass(frozen=True)
class QuickstartConfig:
    """The RL run (``rl``) plus the synthetic task and the supervised warm-up."""

    rl: rlconfig.RLConfig = QUICKSTART
    digits: int = 1
    sft_steps: int = 200
    sft_batch: int = 64
    sft_lr: float = 3e-3
    teacher_p_correct: float = 0.1  # the warm-up teacher is right this often, else off by 1-3
    eval_prompts: int = 200
    resume: bool = False  # continue from the newest intact checkpoint under out/checkpoints
    resume_other_config: bool = False  # resume even if out/config.json differs in RUN_IDENTITY

    def __post_init__(self) -> None:
        AdditionTask(self.digits)
        if self.sft_steps < 0 or self.sft_batch < 1 or self.eval_prompts < 1 or self.sft_lr <= 0:
            raise rlconfig.ConfigError("sft_steps >= 0, sft_batch >= 1, sft_lr > 0 and eval_prompts >= 1 are required")


def main(config: QuickstartConfig = QuickstartConfig(), out: Path = Path("runs/quickstart")) -> dict:
    """The run, in ``out``, which it owns (``run.lock``) until it returns; returns the summary."""
    lock = RunLock(out)
    try:
        lock.acquire()
    except RunFolderError as e:
        raise UsageError(f"{e}; pass another --out") from None
    try:
        return _run(config, Path(out), lock)
    finally:
        lock.release()


def _check_folder(config: QuickstartConfig, out: Path, lock: RunLock) -> Path:
    """The checkpoint folder, after the checks a fresh run or a resume needs."""
    ckpt_dir = out / "checkpoints"
    for note in open_run_notes(lock, ckpt_dir):
        print(f"note: {note}")
    latest = latest_step(ckpt_dir)
    if config.resume and latest is None:
        raise UsageError(f"--resume: no checkpoint under {ckpt_dir}")
    if not config.resume and latest is not None:
        raise UsageError(f"{out} already holds checkpoints (latest step {latest}): pass --resume to continue "
                         "that run, or another --out (a fresh run never replaces them)")
    if config.resume and not config.resume_other_config:
        try:
            saved = read_config(out)
        except RunFolderError as e:
            raise UsageError(f"--resume: {e}; pass --set resume_other_config=true to resume anyway") from None
        diffs = ["config.json is missing"] if saved is None else \
            config_differences(saved, rlconfig.to_dict(config), RUN_IDENTITY)
        if diffs:
            raise UsageError(f"--resume: {out} holds another run's checkpoints ({'; '.join(diffs[:4])}): pass the "
                             "same settings, another --out, or --set resume_other_config=true to resume anyway")
    return ckpt_dir


def _run(config: QuickstartConfig, out: Path, lock: RunLock) -> dict:
    t_start = time.perf_counter()
    cfg = dataclasses.replace(config.rl, logging=dataclasses.replace(config.rl.logging, out_dir=str(out)))
    ckpt_dir = _check_folder(config, out, lock)
    out.mkdir(parents=True, exist_ok=True)
    if not config.resume:
        (out / "metrics.jsonl").unlink(missing_ok=True)

    tok = char_tokenizer(ALPHABET)
    eos = tok.token_to_id("<eos>")
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tok.get_vocab_size(), eos_token_ids=(eos,))
    task_def = AdditionTask(config.digits)
    rng = np.random.default_rng(cfg.seed)

    def encode(text: str) -> list[int]:
        return tok.encode(text).ids

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    eval_examples = task_def.sample(np.random.default_rng(cfg.seed + 12345), config.eval_prompts)
    sft_loss = float("nan")
    task = Task(next_batch=lambda n: task_def.sample(rng, n), encode=encode, decode=decode,
                reward_fn=task_def.reward, eval_examples=eval_examples,
                cursor=lambda: {"task_rng": rng.bit_generator.state,
                                "sft_final_loss": sft_loss if math.isfinite(sft_loss) else None})

    # trainer: float32 master weights, BF16 compute, AdamW
    trainer_cfg = cfg.trainer_config()
    policy = dataclasses.replace(cfg, model=model_cfg).train_policy()
    optimizer = make_optimizer(cfg.optimizer)
    value_head = cfg.algorithm.uses_value_head
    checkpointer = Checkpointer(ckpt_dir, CheckpointConfig(max_to_keep=cfg.logging.keep_checkpoints)) \
        if cfg.logging.checkpoint_every or config.resume else None
    start_step = 0
    if config.resume:
        # the RL state, the task's generator and the warm-up's loss come back; the warm-up is not rerun
        def fresh(p):
            return init_train_state(with_value_head(p, model_cfg) if value_head else p, optimizer,
                                    jax.random.key(cfg.seed + 2))

        target = jax.eval_shape(fresh, abstract_params(model_cfg, jnp.float32))
        try:
            restored = checkpointer.restore_latest(target)
        except CheckpointError as e:
            raise UsageError(f"--resume: {' '.join(str(e).split())}") from None
        for line in restored.messages():
            print(line)
        state, cursor = restored.state, restored.cursor
        start_step = int(cursor["step"])
        rng.bit_generator.state = cursor["task_rng"]
        sft_loss = float("nan") if cursor.get("sft_final_loss") is None else cursor["sft_final_loss"]
        model_weights = model_params(state.params)
        print(f"resumed from {restored.path}: step {start_step}")
        kept = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] <= start_step] \
            if (out / "metrics.jsonl").exists() else []
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    else:
        # 1. supervised warm-up (format + a little arithmetic)
        params = init_params(model_cfg, jax.random.key(cfg.seed), jnp.float32)
        sft_opt = make_optimizer(dataclasses.replace(cfg.optimizer, lr=config.sft_lr))
        state = init_train_state(params, sft_opt, jax.random.key(cfg.seed + 1))
        sft_step = make_sft_step(model_cfg, policy, trainer_cfg, sft_opt)
        T = 2 * config.digits + 2 + task_def.max_answer_chars + 1
        for _ in tqdm(range(config.sft_steps), desc="supervised warm-up (the first step compiles)",
                      disable=not cfg.logging.progress, dynamic_ncols=True):
            tokens, mask = supervised_batch(task_def.noisy_teacher(rng, config.sft_batch, config.teacher_p_correct), encode,
                                            eos, T)
            state, m = sft_step(state, jnp.asarray(tokens), jnp.asarray(mask))
            sft_loss = float(m["loss"])

        # 2. RL: fresh optimizer state on the warmed-up weights (PPO + GAE: plus a zero-initialized value head)
        model_weights = state.params
        if value_head:
            state = init_train_state(with_value_head(model_weights, model_cfg), optimizer, jax.random.key(cfg.seed + 2))
        else:
            state = init_train_state(model_weights, optimizer, jax.random.key(cfg.seed + 2))
    (out / "config.json").write_text(json.dumps(rlconfig.to_dict(config), indent=1) + "\n")
    logprob_fn = (make_logprob_value_fn if value_head else make_logprob_fn)(model_cfg, policy, trainer_cfg)
    train_step = make_train_step(model_cfg, policy, trainer_cfg, optimizer)
    cast = jax.tree.map(lambda p: p.astype(cfg.trainer.compute_dtype.value), model_weights)
    if cfg.logging.progress:
        print("RL: the first evaluation and step compile the engine's and the trainer's programs", flush=True)
    engine = JaxEngine(model_cfg, cast, cfg.engine_config())
    greedy = lambda seed: SamplingConfig(temperature=0.0, max_tokens=cfg.rollout.max_new_tokens, seed=seed)  # noqa: E731
    with MetricsLogger(out, tensorboard=cfg.logging.tensorboard) as logger:
        state = run(cfg, state=state, task=task, engine=engine, train_step=train_step, logprob_fn=logprob_fn,
                    model_config=model_cfg, logger=logger, start_step=start_step, checkpointer=checkpointer,
                    eval_sampling=greedy)
    if checkpointer is not None:
        checkpointer.close()
    final = evaluate(engine, [encode(e.prompt) for e in eval_examples], [e.answer for e in eval_examples],
                     reward_fn=task_def.reward, decode=decode, sampling=greedy)

    rows = read_metrics(out / "metrics.jsonl")
    evals = [r for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "reward/mean" in r]
    png = None
    if cfg.logging.plot:
        png = plot_metrics(out / "metrics.jsonl", out / "quickstart.png", [
            ("reward (train samples) and eval accuracy (greedy)", ["reward/mean", "eval/accuracy"]),
            ("rollout vs trainer mismatch", ["mismatch/kl_k3", "mismatch/kl_k1"]),
            ("rollout tokens/s (CPU)", ["rollout/tokens_per_s"]),
        ])
    summary = {
        "sft_final_loss": sft_loss,
        "eval_accuracy_before_rl": evals[0]["eval/accuracy"] if evals else None,
        "eval_accuracy_after_rl": final["eval/accuracy"],
        "train_reward_first_step": steps[0]["reward/mean"] if steps else None,
        "train_reward_last_step": steps[-1]["reward/mean"] if steps else None,
        "train_reward_first_10_mean": float(np.mean([r["reward/mean"] for r in steps[:10]])) if steps else None,
        "train_reward_last_10_mean": float(np.mean([r["reward/mean"] for r in steps[-10:]])) if steps else None,
        "mismatch_kl_k3_mean": float(np.mean([r["mismatch/kl_k3"] for r in steps if r.get("mismatch/kl_k3") is not None]))
        if steps else None,
        "rollout_tokens_per_s_mean": float(np.mean([r["rollout/tokens_per_s"] for r in steps])) if steps else None,
        "weight_sync_s_mean": float(np.mean([r["time/weight_sync_s"] for r in steps])) if steps else None,
        "rl_steps": len(steps),
        "precision": cfg.precision.rollout.value,
        "seconds": time.perf_counter() - t_start,
        "plot": str(png) if png else None,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("\nquickstart summary")
    for k, v in summary.items():
        print(f"  {k:28s} {v:.4g}" if isinstance(v, float) else f"  {k:28s} {v}")
    return summary


def parse_args(argv: list[str] | None = None) -> tuple[QuickstartConfig, Path, bool]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/quickstart"))
    ap.add_argument("--resume", action="store_true",
                    help="continue from the newest intact checkpoint under OUT/checkpoints (written with "
                         "--set logging.checkpoint_every=N)")
    ap.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                    help="override a config field, e.g. data.steps=20, precision.rollout=none, sft_steps=100")
    ap.add_argument("--record", action="store_true",
                    help="also write the summary with the run's environment to experiments/results/cpu/quickstart.json "
                         "(the default run only: the numbers the README and docs/quickstart.md quote)")
    args = ap.parse_args(argv)
    try:
        config = rlconfig.override(QuickstartConfig(resume=args.resume), args.set)
    except rlconfig.ConfigError as e:
        ap.error(str(e))
    if args.record and (args.set or args.resume):
        ap.error("--record records the default run: drop --set and --resume")
    return config, args.out, args.record


def cli(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (2 for unusable inputs or run folders)."""
    config, out, record = parse_args(argv)
    try:
        summary = main(config, out)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if record:
        summary = {k: v for k, v in summary.items() if k != "plot"}
        print(f"wrote {write_result('quickstart', {'summary': summary})}")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
