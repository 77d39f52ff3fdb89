"""The RL loop as explicit stages, each a function a notebook can call on its own.

One step of on-policy RL (GRPO / DAPO-style) is::

    examples = data.next_batch(P)                              # prompts + reference answers
    ro       = rollout(engine, prompt_ids, n_samples=G, ...)   # FP8 generation, rollout logprobs
    rewards  = score(ro, answers, reward_fn, decode)           # verifiable reward per sample
    batch    = build_batch(ro, rewards, estimator=...)         # tokens, mask, advantages
    batch    = with_trainer_logprobs(batch, logprob_fn, state.params)   # pi_old (+ V_old, GAE), trainer precision
    state, m = train_step(state, batch)                        # PPO/GRPO loss with TIS/MIS
    t_sync   = sync_weights(engine, state.params, ...)         # re-quantize + swap (+ KV scales)
    logger.log(step, metrics)                                  # JSONL + TensorBoard

``run`` strings these together with progress bars, evaluation and checkpoints, and nothing
else: every piece of state (the train state, the engine, the data cursor) is visible to the
caller. The rollout logprobs come from the generator (FP8), the trainer's from the training
precision; the gap between them is what the correction in the loss reweights and what the
``mismatch/*`` metrics report every step.

PPO with GAE (``algorithm.estimator = gae``) runs the same stages: the train state's params carry
a value head (``trainer.with_value_head``), ``logprob_fn`` is ``trainer.make_logprob_value_fn``,
``build_batch`` puts the outcome reward on the last response token (``token_rewards``), and
``with_trainer_logprobs`` takes ``V_old`` from the same trainer forward as ``old_logprobs`` and
computes advantages (whitened if asked) and returns by GAE; the train step adds the value loss.
The generator only ever receives the model's params (``sync_weights`` strips the head).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from fp8rl_jax.models import ModelConfig
from fp8rl_jax.models.calibration import calibrate_kv_scales_jit
from fp8rl_jax.models.policy import DensePolicy, Fp8Mode, MatmulPolicy
from fp8rl_jax.rl.algos import (
    AdvantageEstimator,
    compute_advantages,
    gae_advantages,
    masked_whiten,
    outcome_to_token_rewards,
    overlong_penalty,
)
from fp8rl_jax.rl.trainer import (
    TrainBatch,
    TrainerConfig,
    TrainState,
    has_value_head,
    model_params,
    token_logprobs,
)
from fp8rl_jax.rollout.base import FinishReason, Generator, RolloutBatch
from fp8rl_jax.rollout.config import KvCalibration

__all__ = [
    "MetricsLogger",
    "Rollout",
    "Task",
    "build_batch",
    "evaluate",
    "make_sft_step",
    "plot_metrics",
    "read_metrics",
    "rl_step",
    "rollout",
    "run",
    "score",
    "sync_weights",
    "timed",
    "with_trainer_logprobs",
]


@dataclasses.dataclass
class Rollout:
    """Responses of one step: ``n_samples`` per prompt, grouped by prompt.

    Attributes:
      prompts: N prompt token lists (each prompt repeated ``n_samples`` times, consecutively).
      group_ids: [N] int32, the prompt index of each sample (its GRPO group).
      batch: the generator's output (tokens, rollout logprobs, lengths, finish reasons).
      seconds: wall time of the generation.
    """

    prompts: list[list[int]]
    group_ids: np.ndarray
    batch: RolloutBatch
    seconds: float

    @property
    def generated_tokens(self) -> int:
        return int(self.batch.lengths.sum())

    def metrics(self) -> dict[str, float]:
        lengths = self.batch.lengths
        return {"rollout/tokens_per_s": self.generated_tokens / max(self.seconds, 1e-9),
                "rollout/response_len_mean": float(lengths.mean()), "rollout/response_len_max": float(lengths.max()),
                "rollout/truncated_frac": float(np.mean([f is not FinishReason.STOP for f in self.batch.finish_reasons])),
                "rollout/preemptions": float(self.batch.preemptions), "time/rollout_s": self.seconds,
                **({} if self.batch.routing is None else
                   {"rollout/routing_recompute_mismatches": float(self.batch.routing_recompute_mismatches)})}


def rollout(generator: Generator, prompt_ids: Sequence[Sequence[int]], *, n_samples: int,
            sampling: Callable[[int], Any], step: int, seed: int = 0) -> Rollout:
    """Generates ``n_samples`` responses per prompt. ``sampling(seed)`` builds the SamplingConfig of
    one sample (e.g. ``RolloutConfig.sampling``); seeds differ per (run seed, step, sample), so the
    members of a group differ and a rerun reproduces them."""
    prompts = [list(p) for p in prompt_ids for _ in range(n_samples)]
    group_ids = np.repeat(np.arange(len(prompt_ids), dtype=np.int32), n_samples)
    base = (seed * 1_000_003 + step * 7_919) % (2**31 - 2**20)
    samplings = [sampling(base + i) for i in range(len(prompts))]
    t0 = time.perf_counter()
    batch = generator.generate(prompts, samplings)
    return Rollout(prompts, group_ids, batch, time.perf_counter() - t0)


def score(ro: Rollout, answers: Sequence[str], reward_fn: Callable[[str, str], float],
          decode: Callable[[list[int]], str]) -> tuple[np.ndarray, list[str]]:
    """Rewards [N] (float32) of every response against its prompt's answer, and the decoded texts."""
    if len(answers) != int(ro.group_ids.max()) + 1:
        raise ValueError(f"score needs one answer per prompt: {int(ro.group_ids.max()) + 1} prompts, {len(answers)} answers")
    texts = [decode(t) for t in ro.batch.token_lists()]
    rewards = np.array([reward_fn(txt, answers[g]) for txt, g in zip(texts, ro.group_ids)], np.float32)
    return rewards, texts


def overlong_shaping(ro: Rollout, alg: Any, max_new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """DAPO's overlong handling of a rollout under ``alg`` (``AlgorithmConfig``): the length penalty ``[N]``
    float32 added to each reward (zeros without ``overlong_buffer``; ``algos.overlong_penalty``) and which
    responses stay in the loss ``[N]`` bool (those that ended with EOS, under ``overlong_filter``; else all)."""
    penalty = np.asarray(overlong_penalty(ro.batch.lengths, max_new_tokens, alg.overlong_buffer, alg.overlong_penalty),
                         np.float32)
    kept = np.array([f is FinishReason.STOP for f in ro.batch.finish_reasons]) if alg.overlong_filter else \
        np.ones(len(ro.batch.lengths), bool)
    return penalty, kept


def build_batch(ro: Rollout, rewards: np.ndarray, *, estimator: AdvantageEstimator = AdvantageEstimator.GRPO,
                pad_multiple: int = 32, pad_id: int = 0, replay_routing: bool = True) -> TrainBatch:
    """The ``TrainBatch`` of a scored rollout: prompt + response tokens right-padded to a multiple of
    ``pad_multiple`` (bounded recompiles), the loss mask on response tokens, token advantages from
    the group outcome rewards, the rollout logprobs at their tokens; ``old_logprobs`` still zero
    (fill with :func:`with_trainer_logprobs`). When the generator recorded MoE routing
    (``RolloutBatch.routing``) and ``replay_routing``, ``routing`` holds it at the same positions
    (``-1`` on padding), so the trainer's forwards replay the rollout's experts.

    ``estimator = GAE``: advantages need the value model, so they stay 0 here; ``token_rewards``
    holds each outcome reward on the last response token of its row
    (:func:`algos.outcome_to_token_rewards`), and :func:`with_trainer_logprobs` (with a logprob
    function that also returns values) fills ``values``, ``advantages`` and ``returns``."""
    N = len(ro.prompts)
    if rewards.shape != (N,):
        raise ValueError(f"rewards must have shape [{N}], got {rewards.shape}")
    if not np.all(np.isfinite(rewards)):
        raise ValueError(f"rewards contain NaN/Inf at samples {np.flatnonzero(~np.isfinite(rewards))[:8].tolist()}")
    resp = ro.batch.token_lists()
    resp_lp = ro.batch.logprob_lists()
    T_real = max(len(p) + len(r) for p, r in zip(ro.prompts, resp))
    T = max(2, math.ceil(T_real / pad_multiple) * pad_multiple)
    tokens = np.full((N, T), pad_id, np.int32)
    mask = np.zeros((N, T), np.float32)
    rollout_lp = np.zeros((N, T), np.float32)
    for i, (p, r, lp) in enumerate(zip(ro.prompts, resp, resp_lp)):
        tokens[i, : len(p)] = p
        tokens[i, len(p) : len(p) + len(r)] = r
        mask[i, len(p) : len(p) + len(r)] = 1.0
        rollout_lp[i, len(p) : len(p) + len(r)] = lp
    token_rewards = None
    if estimator is AdvantageEstimator.GAE:
        mask[:, 0] = 0.0  # column 0 is never trained (no logprob): the reward goes on a trained token
        token_rewards = outcome_to_token_rewards(jnp.asarray(rewards), jnp.asarray(mask))
        adv = jnp.zeros((N, T), jnp.float32)
    else:
        adv, _ = compute_advantages(estimator, jnp.asarray(rewards), jnp.asarray(mask),
                                    group_ids=jnp.asarray(ro.group_ids))
    routing = None
    if replay_routing and ro.batch.routing is not None:
        src = np.asarray(ro.batch.routing)
        if src.ndim != 4 or src.shape[0] != N or src.shape[1] < T_real:
            raise ValueError(f"RolloutBatch.routing must be [N, S, L_moe, k] with N = {N} and S >= {T_real} "
                             f"(longest prompt + response), got shape {src.shape}")
        routing = np.full((N, T, *src.shape[2:]), -1, np.int32)
        for i, (p, r) in enumerate(zip(ro.prompts, resp)):
            routing[i, : len(p) + len(r)] = src[i, : len(p) + len(r)]
        routing = jnp.asarray(routing)
    return TrainBatch(tokens=jnp.asarray(tokens), loss_mask=jnp.asarray(mask), advantages=adv,
                      old_logprobs=jnp.zeros((N, T), jnp.float32), rollout_logprobs=jnp.asarray(rollout_lp),
                      routing=routing, token_rewards=token_rewards)


def with_trainer_logprobs(batch: TrainBatch, logprob_fn: Callable[..., Any], params: Any, *, gamma: float = 1.0,
                          lam: float = 1.0, whiten_advantages: bool = True) -> TrainBatch:
    """``old_logprobs`` = the trainer's logprobs of the batch under ``params`` (the policy that
    generated it, in training precision): the PPO ratio's denominator; the correction compares
    it with the rollout logprobs. With ``batch.routing`` (MoE routing replay) it is passed as
    ``logprob_fn(params, tokens, routing=...)`` (``trainer.make_logprob_fn`` accepts it).

    GAE (a batch with ``token_rewards``, from ``build_batch(..., estimator=GAE)``): ``logprob_fn``
    must return ``(logprobs, values)`` from one forward (``trainer.make_logprob_value_fn``, params
    with a value head); then ``values = V_old`` and, on the trained tokens ``m`` (column 0 never)::

        A, R = gae_advantages(token_rewards, V_old, m, gamma, lam)     # R = A + V_old
        A    = masked_whiten(A, m)                                     # if whiten_advantages

    ``values[:, t]`` is the value of the prefix ``tokens[:t]`` (hidden state ``t - 1``), aligned
    with ``old_logprobs[:, t]``. Batches without ``token_rewards`` (GRPO) come out as before."""
    kw = {} if batch.routing is None else {"routing": batch.routing}
    out = logprob_fn(params, batch.tokens, **kw)
    old, values = out if isinstance(out, tuple) else (out, None)
    m = batch.loss_mask != 0
    batch = batch.replace(old_logprobs=jnp.where(m, old, 0.0))
    if batch.token_rewards is None:
        return batch
    if values is None:
        raise ValueError("a GAE batch (token_rewards) needs V_old: pass a logprob_fn that returns (logprobs, values), "
                         "trainer.make_logprob_value_fn, with params that carry a value head (trainer.with_value_head)")
    values = jnp.where(m, values, 0.0)
    adv, ret = _gae_stage(batch.token_rewards, values, batch.loss_mask, gamma, lam, whiten=whiten_advantages)
    return batch.replace(values=values, advantages=adv, returns=ret)


@functools.partial(jax.jit, static_argnames=("whiten",))
def _gae_stage(token_rewards, values, loss_mask, gamma, lam, *, whiten: bool):
    m = (loss_mask != 0) & (jnp.arange(loss_mask.shape[1]) > 0)[None, :]
    adv, ret = gae_advantages(token_rewards, values, m, gamma=gamma, lam=lam)
    if whiten:
        adv = masked_whiten(adv, m)
    return adv, ret


def sync_weights(generator: Generator, params: Any, *, model_config: ModelConfig, dtype: Any = jnp.bfloat16,
                 precision: Fp8Mode = Fp8Mode.NONE, kv_calibration: KvCalibration = KvCalibration.INFERENCE,
                 calibration_tokens: np.ndarray | None = None, calibration_lengths: np.ndarray | None = None) -> float:
    """Hands the trainer's params to the generator (which re-quantizes them for W8A8) and, for FP8
    KV with trainer-side calibration, computes the K/V scales on a calibration batch and syncs
    them. Returns the wall seconds (the weight-sync time of the step). ``params`` may carry a value
    head (``trainer.PolicyValueParams``): only the model's params reach the generator."""
    t0 = time.perf_counter()
    params = model_params(params)  # a value head (PPO) stays with the trainer
    cast = jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)
    generator.update_weights(cast)
    if precision.fp8_kv and kv_calibration is KvCalibration.TRAINER:
        if calibration_tokens is None or calibration_lengths is None:
            raise ValueError("trainer-side KV calibration needs calibration_tokens and calibration_lengths")
        k, v = _calibrate(cast, jnp.asarray(calibration_tokens), jnp.asarray(calibration_lengths),
                          config=model_config, policy=DensePolicy(jnp.dtype(dtype).name))
        generator.set_kv_scales(k, v)
    jax.block_until_ready(generator.params)
    return time.perf_counter() - t0


_calibrate = calibrate_kv_scales_jit


def make_sft_step(model_config: ModelConfig, policy: MatmulPolicy, trainer_config: TrainerConfig,
                  optimizer: optax.GradientTransformation) -> Callable[[TrainState, jax.Array, jax.Array], tuple]:
    """A jitted supervised step ``(state, tokens [B, T], mask [B, T]) -> (state, {"loss"})``: the
    masked token-mean cross-entropy of ``tokens[t]`` given ``tokens[:t]`` (a warm-up before RL)."""
    dt = jnp.dtype(trainer_config.compute_dtype.value)

    def loss(params, tokens, mask):
        p = jax.tree.map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
        logp, _ = token_logprobs(p, tokens, config=model_config, policy=policy)
        m = mask.at[:, 0].set(0)
        return -jnp.sum(logp * m) / jnp.maximum(jnp.sum(m), 1)

    def step(state: TrainState, tokens, mask):
        value, grads = jax.value_and_grad(loss)(state.params, tokens, mask)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), {"loss": value}

    return jax.jit(step, donate_argnums=0)


def evaluate(generator: Generator, prompt_ids: Sequence[Sequence[int]], answers: Sequence[str], *,
             reward_fn: Callable[[str, str], float], decode: Callable[[list[int]], str],
             sampling: Callable[[int], Any], k: int = 1, seed: int = 0) -> dict[str, float]:
    """Mean accuracy over ``k`` samples per prompt (``avg@k``) and ``pass@k``, with the generator as it is."""
    ro = rollout(generator, prompt_ids, n_samples=k, sampling=sampling, step=10**6, seed=seed)
    rewards, _ = score(ro, answers, reward_fn, decode)
    per_prompt = rewards.reshape(len(prompt_ids), k)
    return {"eval/accuracy": float(per_prompt.mean()), "eval/pass_at_k": float((per_prompt > 0.5).any(1).mean()),
            "eval/response_len_mean": float(ro.batch.lengths.mean()), "eval/k": float(k)}


# ------------------------------------------------------------------------------------ logging


class MetricsLogger:
    """Per-step metrics to ``out_dir/metrics.jsonl`` (one JSON object per line, appended, so a
    resumed run continues the file) and, when tensorboardX is installed, TensorBoard events."""

    def __init__(self, out_dir: str | Path, *, tensorboard: bool = True):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                print("note: tensorboardX is not installed; metrics go to metrics.jsonl only")
            else:
                self._tb = SummaryWriter(str(self.out_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        row = {"step": int(step)}
        for k, v in metrics.items():
            v = float(np.asarray(v))
            row[k] = v if math.isfinite(v) else None
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and v is not None:
                    self._tb.add_scalar(k, v, step)
        return row

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_metrics(jsonl: str | Path, png: str | Path, panels: Sequence[tuple[str, Sequence[str]]]) -> Path | None:
    """One PNG with a panel per ``(title, [metric keys])``, x = step; None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plot written")
        return None
    rows = read_metrics(jsonl)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (title, keys) in zip(axes[0], panels):
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker=".", label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    png = Path(png)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def timed(fn: Callable, *args, **kwargs) -> tuple[Any, float]:
    """``(fn(*args, **kwargs), seconds)`` with the result synchronized."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    return out, time.perf_counter() - t0



# ------------------------------------------------------------------------------------ the loop


@dataclasses.dataclass
class Task:
    """What ``run`` needs from the data side.

    Attributes:
      next_batch: ``n -> [Example]`` training prompts with answers (advances a cursor).
      encode: text -> prompt token ids.
      decode: response token ids -> text (special tokens dropped).
      reward_fn: ``(response text, answer) -> float``.
      eval_examples: held-out examples evaluated every ``data.eval_every`` steps (may be empty).
      cursor: ``() -> dict`` the data position saved with checkpoints (JSON).
    """

    next_batch: Callable[[int], list]
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    reward_fn: Callable[[str, str], float]
    eval_examples: list = dataclasses.field(default_factory=list)
    cursor: Callable[[], dict] = dict


def rl_step(step: int, state: TrainState, *, cfg, task: Task, engine: Generator, train_step: Callable,
            logprob_fn: Callable, model_config: ModelConfig) -> tuple[TrainState, dict[str, float]]:
    """One RL step through every stage; returns the new state and the step's metrics.

    With ``cfg.algorithm.estimator = GAE`` the state's params must carry a value head
    (``trainer.with_value_head``) and ``logprob_fn`` must return values too
    (``trainer.make_logprob_value_fn``); the value metrics come as ``train/value_*``."""
    alg = cfg.algorithm
    if alg.estimator is AdvantageEstimator.GAE and not has_value_head(state.params):
        raise ValueError("algorithm.estimator GAE trains a value head: build the state from "
                         "trainer.with_value_head(params, model_config) and use trainer.make_logprob_value_fn")
    examples = task.next_batch(cfg.data.prompts_per_step)
    prompt_ids = [task.encode(e.prompt) for e in examples]
    ro = rollout(engine, prompt_ids, n_samples=cfg.rollout.n_samples, sampling=cfg.rollout.sampling,
                 step=step, seed=cfg.seed)
    if cfg.rollout.sleep_while_training:
        # the KV pool's memory and the generator's weight copy go to the trainer; sync_weights below
        # hands the new weights over and the next generate allocates the pool again
        engine.sleep(weights=True)
    rewards, _ = score(ro, [e.answer for e in examples], task.reward_fn, task.decode)
    penalty, kept = overlong_shaping(ro, alg, cfg.rollout.max_new_tokens)
    batch = build_batch(ro, rewards + penalty, estimator=alg.estimator)
    batch, t_lp = timed(with_trainer_logprobs, batch, logprob_fn, state.params, gamma=alg.gamma, lam=alg.lam,
                        whiten_advantages=alg.whiten_advantages)
    if alg.overlong_filter:
        batch = batch.replace(loss_mask=batch.loss_mask * jnp.asarray(kept, batch.loss_mask.dtype)[:, None])
    (state, train_metrics), t_update = timed(train_step, state, batch)
    calib = {}
    if cfg.precision.kv_calibration is KvCalibration.TRAINER:
        # the calibration batch: the step's own prompts + responses (the KV the next rollout will resemble)
        n = min(len(ro.prompts), 64)
        lengths = np.array([len(p) + int(r) for p, r in zip(ro.prompts[:n], ro.batch.lengths[:n])], np.int32)
        calib = dict(calibration_tokens=batch.tokens[:n], calibration_lengths=lengths)
    t_sync = sync_weights(engine, model_params(state.params), model_config=model_config,
                          dtype=cfg.trainer.compute_dtype.value, precision=cfg.precision.rollout, kv_calibration=cfg.precision.kv_calibration, **calib)
    groups = rewards.reshape(-1, cfg.rollout.n_samples)
    metrics = {"reward/mean": float(rewards.mean()), "reward/accuracy": float((rewards > 0.5).mean()),
               "reward/solve_all_frac": float((groups > 0.5).all(1).mean()),
               "reward/solve_none_frac": float((groups <= 0.5).all(1).mean()),
               **ro.metrics(), "time/trainer_logprobs_s": t_lp, "time/update_s": t_update, "time/weight_sync_s": t_sync}
    if alg.overlong_buffer:
        metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
    if alg.overlong_filter:
        metrics["rollout/overlong_filtered_frac"] = float(1.0 - kept.mean())
    metrics.update({f"train/{k}" if "/" not in k else k: float(np.asarray(v)) for k, v in train_metrics.items()})
    return state, metrics


def run(cfg, *, state: TrainState, task: Task, engine: Generator, train_step: Callable, logprob_fn: Callable,
        model_config: ModelConfig, logger: MetricsLogger, start_step: int = 0,
        checkpointer: Any = None, eval_sampling: Callable[[int], Any] | None = None) -> TrainState:
    """``cfg.data.steps`` RL steps from ``start_step`` (evaluation every ``data.eval_every`` steps and
    at the end; checkpoints every ``logging.checkpoint_every``), metrics to ``logger``."""
    def do_eval(step: int) -> None:
        if not task.eval_examples:
            return
        ids = [task.encode(e.prompt) for e in task.eval_examples]
        m = evaluate(engine, ids, [e.answer for e in task.eval_examples], reward_fn=task.reward_fn,
                     decode=task.decode, sampling=eval_sampling or cfg.rollout.sampling, k=cfg.data.eval_samples,
                     seed=cfg.seed)
        logger.log(step, m)
        bar.write(f"step {step}: eval accuracy {m['eval/accuracy']:.3f} (avg@{cfg.data.eval_samples})")

    bar = tqdm(range(start_step, cfg.data.steps), desc="RL", disable=not cfg.logging.progress, dynamic_ncols=True)
    if start_step == 0 and cfg.data.eval_every:
        do_eval(0)
    for step in bar:
        state, m = rl_step(step, state, cfg=cfg, task=task, engine=engine, train_step=train_step,
                           logprob_fn=logprob_fn, model_config=model_config)
        logger.log(step + 1, m)
        bar.set_postfix(reward=f"{m['reward/mean']:.2f}", kl=f"{m.get('mismatch/kl_k3', float('nan')):.1e}",
                        tok_s=f"{m['rollout/tokens_per_s']:.0f}")
        done = step + 1
        if cfg.data.eval_every and (done % cfg.data.eval_every == 0 or done == cfg.data.steps):
            do_eval(done)
        if checkpointer is not None and cfg.logging.checkpoint_every and (
                done % cfg.logging.checkpoint_every == 0 or done == cfg.data.steps):
            checkpointer.save(state, {"step": done, **task.cursor()}, step=done)
    return state
