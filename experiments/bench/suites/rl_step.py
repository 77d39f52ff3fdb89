"""Where the time of an RL step goes: one end-to-end GRPO run on a random mid-size Qwen3, per precision.

Each arm runs ``steps`` real RL steps
(``fp8rl_jax.rl.loop.rl_step``: rollout -> score -> trainer logprobs -> advantages -> update ->
re-quantize and sync weights + KV scales) on random weights of the chosen shape, built on the
device (no download), and records per step the wall time of every stage and of the whole step:
the rollout share of the step, the weight-sync time (``update_weights``: FP8 re-quantization
and swap, KV-scale recalibration), generated tokens/s and the mismatch metrics. The first step
compiles; the summary takes the median of the later ones.

The prompts are random token ids and the reward is a deterministic, verifiable function of the
response ids (1 when their sum is even), so GRPO advantages are nonzero and the update does real
work; with random weights and Qwen3's 152k vocabulary EOS almost never comes, so responses run
to ``max_new`` tokens (as the long responses of reasoning RL do).

    python -m experiments.bench rl_step --preset qwen3_1_7b --arms all:bf16 none:bf16
    python -m experiments.bench rl_step --preset qwen3_8b --devices 0 --prompts 32 --samples 16   # every GPU

On several devices (``--devices``) the step runs as an RL run does (``RLConfig.parallel``): the train
state sharded FSDP-style (``--tensor`` adds tensor parallelism), one engine replica per
``--generator-tensor`` devices.

An arm is ``ROLLOUT:TRAIN``: rollout precision (none | w8a8 | kv | all) and trainer GEMMs
(bf16, or fp8 for end-to-end FP8 training).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from configs.models import PRESETS
from configs.rl import QUICKSTART
from fp8rl_jax.models import Fp8Mode, ModelConfig, count_params, init_params
from fp8rl_jax.parallel.mesh import make_mesh
from fp8rl_jax.rl import config as rlconfig
from fp8rl_jax.rl.generator import make_generator
from fp8rl_jax.rl.loop import MetricsLogger, Task, rl_step
from fp8rl_jax.rl.memory import PHASES, TERMS, check_fits, device_bytes_limit, plan_memory
from fp8rl_jax.rl.sharded import init_sharded_state, make_mesh_trainer
from fp8rl_jax.rl.offload import make_step, offload_moments
from fp8rl_jax.rl.trainer import init_train_state, make_logprob_fn, make_optimizer
from fp8rl_jax.tasks import Example

STAGES = ("time/rollout_s", "time/trainer_logprobs_s", "time/update_s", "time/weight_sync_s")


@dataclasses.dataclass(frozen=True)
class Arm:
    rollout: Fp8Mode
    train_fp8: bool = False

    @property
    def name(self) -> str:
        return f"{self.rollout.value}:{'fp8' if self.train_fp8 else 'bf16'}"

    @classmethod
    def parse(cls, text: str) -> Arm:
        r, _, t = text.partition(":")
        if t not in ("", "bf16", "fp8"):
            raise ValueError(f"arm {text!r}: the trainer part must be bf16 or fp8")
        return cls(Fp8Mode(r), t == "fp8")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """Sizes of the run; ``kv_gib`` is the generator's KV budget, ``micro_batches`` the trainer's
    gradient-accumulation split (it bounds the [B/M, T, vocab] logits in memory)."""

    model: ModelConfig = PRESETS["qwen3_1_7b"]
    arms: tuple[Arm, ...] = (Arm(Fp8Mode.ALL), Arm(Fp8Mode.NONE))
    prompts: int = 16
    samples: int = 8
    prompt_len: int = 512
    max_new: int = 1024
    steps: int = 4
    micro_batches: int = 16
    remat: bool = True
    logits_chunk: int = 1024  # LM-head tokens at a time (trainer.logits_chunk)
    kv_gib: float = 24.0
    max_slots: int = 128
    steps_per_call: int = 16
    prefill_batch: int = 8
    lr: float = 1e-6
    seed: int = 0
    devices: int = 1  # 0: every device
    tensor: int = 1
    generator_tensor: int = 1
    offload_optimizer: bool = False  # AdamW's moments in host memory (one device)

    def __post_init__(self) -> None:
        if min(self.prompts, self.samples, self.prompt_len, self.max_new, self.micro_batches) < 1 or self.steps < 2:
            raise ValueError("prompts, samples, prompt_len, max_new, micro_batches >= 1 and steps >= 2 are required")
        if (self.prompts * self.samples) % self.micro_batches:
            raise ValueError(f"micro_batches = {self.micro_batches} must divide prompts x samples = "
                             f"{self.prompts * self.samples}")

    def rl_config(self, arm: Arm, out_dir: Path) -> rlconfig.RLConfig:
        """The RL config of one arm: the quickstart recipe (DAPO loss, token TIS) at these sizes."""
        q = QUICKSTART
        return dataclasses.replace(
            q, model=self.model, seed=self.seed,
            rollout=dataclasses.replace(
                q.rollout, n_samples=self.samples, max_new_tokens=self.max_new,
                engine=dataclasses.replace(q.rollout.engine, max_seq_len=self.prompt_len + self.max_new,
                                           max_slots=self.max_slots, page_size=16, kv_budget_gib=self.kv_gib,
                                           steps_per_call=self.steps_per_call, prefill_batch=self.prefill_batch)),
            optimizer=dataclasses.replace(q.optimizer, lr=self.lr),
            trainer=dataclasses.replace(q.trainer, micro_batches=self.micro_batches, remat=self.remat,
                                        logits_chunk=self.logits_chunk, offload_optimizer=self.offload_optimizer),
            precision=dataclasses.replace(q.precision, rollout=arm.rollout, train_fp8=arm.train_fp8),
            data=dataclasses.replace(q.data, prompts_per_step=self.prompts, steps=self.steps, eval_every=0),
            parallel=rlconfig.ParallelConfig(tensor=self.tensor, generator_tensor=self.generator_tensor),
            logging=dataclasses.replace(q.logging, out_dir=str(out_dir), tensorboard=False, plot=False, progress=False))


def parity_reward(text: str, answer: str) -> float:
    """1.0 when the response's token ids (space-separated) sum to an even number."""
    ids = [int(t) for t in text.split()]
    return float(sum(ids) % 2 == 0) if ids else 0.0


def random_task(cfg: BenchConfig) -> Task:
    rng = np.random.default_rng(cfg.seed)
    lo, hi = 2, cfg.model.vocab_size
    eos = set(cfg.model.eos_token_ids)

    def next_batch(n: int) -> list[Example]:
        return [Example(" ".join(map(str, rng.integers(lo, hi, cfg.prompt_len))), "") for _ in range(n)]

    return Task(next_batch=next_batch, encode=lambda s: [int(t) for t in s.split()],
                decode=lambda ids: " ".join(str(i) for i in ids if i not in eos), reward_fn=parity_reward)


def run_arm(cfg: BenchConfig, arm: Arm, out_dir: Path) -> dict:
    rl = cfg.rl_config(arm, out_dir / arm.name.replace(":", "_"))
    model = rl.model
    trainer_cfg, policy = rl.trainer_config(), rl.train_policy()
    devices = bench_devices(cfg)
    params = init_params(model, jax.random.key(cfg.seed), jnp.float32)
    if len(devices) > 1:
        trainer = make_mesh_trainer(model, policy, trainer_cfg, make_mesh(rl.parallel.mesh_config(len(devices)), devices))
        state = init_sharded_state(trainer, params, jax.random.key(cfg.seed + 1))
        train_step, logprob_fn = trainer.train_step, trainer.logprob_fn
    else:
        state = init_train_state(params, make_optimizer(rl.optimizer), jax.random.key(cfg.seed + 1))
        if trainer_cfg.offload_optimizer:
            state = offload_moments(state)
        train_step = make_step(model, policy, trainer_cfg)
        logprob_fn = make_logprob_fn(model, policy, trainer_cfg)
    del params
    engine = make_generator(rl, model, state.params, rl.out_dir, devices)
    task = random_task(cfg)
    rows = []
    with MetricsLogger(rl.out_dir, tensorboard=False) as logger:
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            state, m = rl_step(step, state, cfg=rl, task=task, engine=engine, train_step=train_step,
                               logprob_fn=logprob_fn, model_config=model)
            m["time/step_s"] = time.perf_counter() - t0
            logger.log(step + 1, m)
            rows.append(m)
            print(f"[{arm.name}] step {step}: " + ", ".join(f"{k.split('/')[-1]}={m[k]:.3f}" for k in
                                                           ("time/step_s", *STAGES)) +
                  f", tokens/s={m['rollout/tokens_per_s']:.0f}, kl_k3={m.get('mismatch/kl_k3', float('nan')):.2e}",
                  flush=True)
    later = rows[1:]  # step 0 compiles

    def med(key: str) -> float:
        return statistics.median(r[key] for r in later)

    step_s = med("time/step_s")
    summary = {
        "arm": arm.name, "rollout_precision": arm.rollout.value, "train_fp8": arm.train_fp8,
        "step_s_median": step_s,
        **{f"{k.split('/')[-1]}_median": med(k) for k in STAGES},
        "other_s_median": statistics.median(r["time/step_s"] - sum(r[k] for k in STAGES) for r in later),
        "rollout_share": med("time/rollout_s") / step_s,
        "weight_sync_ms_median": med("time/weight_sync_s") * 1e3,
        "rollout_tokens_per_s_median": med("rollout/tokens_per_s"),
        "generated_tokens_per_step": float(np.mean([r["rollout/response_len_mean"] * cfg.prompts * cfg.samples
                                                    for r in rows])),
        "preemptions": [r["rollout/preemptions"] for r in rows],
        "mismatch_kl_k3": [r.get("mismatch/kl_k3") for r in rows],
        "reward_mean": [r["reward/mean"] for r in rows],
        "first_step_s (compile)": rows[0]["time/step_s"],
        **memory_against_plan(rl, devices),
        "steps": rows,
    }
    del engine, state
    return summary


def memory_against_plan(rl: rlconfig.RLConfig, devices: list) -> dict:
    """The allocator's peak so far on the first device (the process's peak: an arm run first in its process
    measures itself alone) beside the memory plan's peak for this config at its configured micro-batches
    (`fp8rl_jax.rl.memory.plan_memory`) and each phase's planned total; empty where the backend has no
    memory statistics."""
    stats = devices[0].memory_stats() if hasattr(devices[0], "memory_stats") else None
    if not stats or "peak_bytes_in_use" not in stats:
        return {}
    plan = plan_memory(rl, len(devices), int(stats["bytes_limit"]), choose_micro_batches=False)
    buffers = {p: plan.total(p) - plan.phases[p]["reserve"] for p in PHASES}  # the allocator sees no reserve
    peak = int(stats["peak_bytes_in_use"])
    return {"process_peak_bytes": peak, "plan_buffer_peak_bytes": max(buffers.values()),
            "peak_over_plan": peak / max(buffers.values()), "plan_phase_buffer_bytes": buffers,
            "bytes_limit": int(stats["bytes_limit"])}


def bench_devices(cfg: BenchConfig) -> list:
    """The devices the run uses (``cfg.devices``; 0: all)."""
    n = cfg.devices or jax.device_count()
    if n > jax.device_count():
        raise ValueError(f"--devices {n}: only {jax.device_count()} device(s) here")
    return jax.devices()[:n]


def check_memory(cfg: BenchConfig, limit: int | None = None) -> None:
    """Before anything is allocated: a ``ValueError`` (one line) when an arm's train state (float32 masters,
    AdamW moments), generator weights and KV pool (`fp8rl_jax.rl.memory.plan_memory`'s rollout terms) exceed
    ``limit`` bytes (default: the device's allocator limit; none on the CPU)."""
    limit = device_bytes_limit() if limit is None else limit
    if limit is None:
        return
    for arm in cfg.arms:
        rollout = plan_memory(cfg.rl_config(arm, Path("runs")), len(bench_devices(cfg)), limit,
                              choose_micro_batches=False).phases["rollout"]
        terms = {TERMS[k]: rollout[k] for k in ("masters", "optimizer", "generator", "kv_pool")}
        smaller = "fewer --layers or a smaller --preset" + ("" if cfg.offload_optimizer else ", or --offload-optimizer")
        check_fits(terms, limit, what=f"rl_step arm {arm.name} ({cfg.model.num_layers} layers)",
                   fixes={TERMS["kv_pool"]: "lower --kv-gib", TERMS["generator"]: smaller, TERMS["masters"]: smaller,
                          TERMS["optimizer"]: smaller})


def measure(cfg: BenchConfig, runs_dir: Path = Path("runs/rl_step")) -> dict:
    """Every arm's steps (their metrics logs under ``runs_dir``) and its summary."""
    check_memory(cfg)
    results = {"model": dataclasses.asdict(cfg.model), "devices": len(bench_devices(cfg)),
               "params": count_params(jax.eval_shape(lambda: init_params(cfg.model, jax.random.key(0)))),
               "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("model", "arms")},
               "arms": []}
    for arm in cfg.arms:
        gc.collect()  # the previous arm's engine, KV pool and train state must be gone first
        results["arms"].append(run_arm(cfg, arm, runs_dir))
    print("\n| arm | step s | rollout s (share) | trainer logprobs s | update s | weight sync ms | rollout tok/s | "
          "peak GiB (plan) |")
    print("|---|---|---|---|---|---|---|---|")
    for a in results["arms"]:
        print(f"| {a['arm']} | {a['step_s_median']:.2f} | {a['rollout_s_median']:.2f} ({a['rollout_share']:.0%}) | "
              f"{a['trainer_logprobs_s_median']:.2f} | {a['update_s_median']:.2f} | {a['weight_sync_ms_median']:.1f} | "
              f"{a['rollout_tokens_per_s_median']:.0f} | " + (f"{a['process_peak_bytes'] / 2**30:.1f} "
                                                                f"({a['plan_buffer_peak_bytes'] / 2**30:.1f}) |"
                                                                if "process_peak_bytes" in a else "- |"))
    return results


def add_arguments(ap: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3_1_7b")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the preset's)")
    ap.add_argument("--arms", nargs="+", default=[a.name for a in d.arms], help="ROLLOUT:TRAIN, e.g. all:bf16 none:bf16")
    for name in ("prompts", "samples", "prompt_len", "max_new", "steps", "micro_batches", "max_slots",
                 "steps_per_call", "prefill_batch", "devices", "tensor", "generator_tensor"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    ap.add_argument("--kv-gib", type=float, default=d.kv_gib)
    ap.add_argument("--no-remat", action="store_true")
    ap.add_argument("--offload-optimizer", action="store_true", help="AdamW's moments in host memory (one device)")
    ap.add_argument("--runs-dir", type=Path, default=Path("runs/rl_step"), help="the arms' metrics logs")


def config(a: argparse.Namespace) -> BenchConfig:
    model = PRESETS[a.preset]
    if a.layers:
        model = dataclasses.replace(model, num_layers=a.layers)
    return BenchConfig(model=model, arms=tuple(Arm.parse(s) for s in a.arms), prompts=a.prompts, samples=a.samples,
                       prompt_len=a.prompt_len, max_new=a.max_new, steps=a.steps, micro_batches=a.micro_batches,
                       remat=not a.no_remat, kv_gib=a.kv_gib, max_slots=a.max_slots, steps_per_call=a.steps_per_call,
                       prefill_batch=a.prefill_batch, devices=a.devices, tensor=a.tensor,
                       generator_tensor=a.generator_tensor, offload_optimizer=a.offload_optimizer)


def run(a: argparse.Namespace) -> dict:
    return measure(config(a), a.runs_dir)


def result_name(a: argparse.Namespace) -> str:
    n = a.devices or jax.device_count()
    return f"rl_step_{a.preset}" + (f"_{n}dev" if n > 1 else "")


SMOKE = ["--preset", "tiny_qwen3", "--layers", "1", "--prompts", "2", "--samples", "2", "--prompt-len", "6",
         "--max-new", "4", "--steps", "2", "--micro-batches", "2", "--kv-gib", "0.0005", "--max-slots", "4",
         "--arms", "all:fp8"]
