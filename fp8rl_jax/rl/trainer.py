"""The "update" stage of the RL loop: one jitted, donated ``train_step(state, batch) -> (state, metrics)``.

Shapes: ``B`` sequences, ``T`` tokens (prompt + response, right-padded), ``V`` vocabulary,
``M`` micro-batches. The RL maths (clipped surrogate, KL, corrections, metrics) come from
:mod:`fp8rl_jax.rl.algos`; this module only wires them to the model and the optimizer. Its
parts: the static configs (:mod:`~fp8rl_jax.rl.trainer_config`), the optimizer
(:mod:`~fp8rl_jax.rl.optimizer`), the state and batch pytrees (:mod:`~fp8rl_jax.rl.state`) and the
logprob forward (:mod:`~fp8rl_jax.rl.logprobs`), all re-exported here.

Design notes
------------
* **One state pytree.** ``train_step`` maps a :class:`TrainState` to a new one and is jitted with
  the state donated (:func:`make_train_step`). Everything static (model config, matmul policy,
  trainer config, optimizer) is bound by ``functools.partial``, so an FP8 training policy (a
  ``MatmulPolicy`` with a ``custom_vjp`` dot) plugs in unchanged.
* **FP32 master weights, BF16 compute.** The loss casts the float32 parameters to
  ``TrainerConfig.compute_dtype`` before the forward; the cast is differentiable, so gradients,
  their accumulation, clipping and AdamW all run in float32.
* **Exact micro-batch accumulation.** The loss denominator (real tokens for ``TOKEN_MEAN``,
  non-empty sequences for the ``SEQ_*`` modes) is computed once on the whole batch and passed
  to every micro-batch, so the sum of micro-batch gradients *is* the whole-batch gradient
  (averaging micro-batch means instead weights micro-batches with few tokens too much). The
  rollout-correction weights and mismatch metrics do not depend on the parameters and are
  computed once on the whole batch; a ``lax.scan`` over the ``M`` micro-batches accumulates
  float32 gradients and token-sum statistics, divided by the global counts at the end, so
  every metric also equals its whole-batch value.
* **Padding contributes nothing.** Every token term goes through ``algos`` (which replaces
  padded inputs by 0 with ``jnp.where``, NaN included), rows without real tokens count in no
  denominator; padding a batch with fully masked rows or columns leaves loss and gradients
  unchanged up to rounding. Position 0 is never trained (its ``loss_mask`` entry is ignored).
* **Entropy** is computed for the metrics by default (a ``[B, T, V]`` float32 softmax, under
  ``stop_gradient`` unless ``entropy_coef != 0``; ``LossConfig.entropy_metric = False`` skips it).
  The target logprob itself needs only the log-sum-exp over ``V``, not a full ``log_softmax``.
* **MoE routing replay.** ``TrainBatch.routing`` makes every trainer forward of the batch
  (``old_logprobs`` via :func:`trainer_logprobs` and the loss) send each token through the experts
  the rollout chose, so router disagreement (top-k flips between FP8 rollout and BF16 trainer) no
  longer adds to the mismatch the correction must absorb.
* **Value loss** (:func:`algos.value_loss`, clipped as in PPO/verl) is added as
  ``vf_coef * value_loss`` when ``TrainBatch.returns`` is given (params with a value head,
  :class:`PolicyValueParams`), aggregated with the same ``LossAgg``, mask and denominator as the
  policy loss, so micro-batch accumulation stays exact.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from fp8rl_jax.models import MatmulPolicy, ModelConfig
from fp8rl_jax.rl.algos import (
    LossAgg,
    aggregate_loss,
    kl_penalty,
    mismatch_metrics,
    policy_loss,
    rollout_correction_weights,
    value_loss,
)
from fp8rl_jax.rl.logprobs import (
    _check_static,
    _compute_params,
    head_logprobs,
    make_logprob_fn,
    make_logprob_value_fn,
    token_logprobs,
    token_logprobs_and_values,
    trainer_logprobs,
    trainer_logprobs_and_values,
)
from fp8rl_jax.rl.optimizer import lr_schedule, make_optimizer
from fp8rl_jax.rl.state import (
    PolicyValueParams,
    TrainBatch,
    TrainState,
    check_batch,
    has_value_head,
    init_train_state,
    init_value_head,
    model_params,
    token_values,
    with_value_head,
)
from fp8rl_jax.rl.trainer_config import ComputeDtype, LossConfig, OptimizerConfig, Schedule, TrainerConfig

Array = jax.Array
Metrics = dict[str, Array]


def _loss_mask(loss_mask: Array) -> Array:
    m = jnp.asarray(loss_mask) != 0
    return m & (jnp.arange(m.shape[1]) > 0)[None, :]


def loss_denominator(loss_mask: Array, agg: LossAgg) -> Array:
    """The whole batch's ``D`` (:func:`algos.aggregate_loss`): real trained tokens for
    ``TOKEN_MEAN``, non-empty rows for the ``SEQ_*`` modes (at least 1)."""
    m = _loss_mask(loss_mask)
    count = jnp.sum(m) if agg is LossAgg.TOKEN_MEAN else jnp.sum(jnp.any(m, axis=1))
    return jnp.maximum(count, 1).astype(jnp.float32)


_TOKEN_MEANS = ("clip_frac", "clip_frac_low", "clip_frac_high", "dual_clip_frac", "approx_kl", "approx_kl_k3",
                "ratio_mean")


def _micro_loss(params, batch: TrainBatch, weights: Array, denominator: Array, *, model_config: ModelConfig,
                policy: MatmulPolicy, trainer_config: TrainerConfig) -> tuple[Array, Metrics]:
    """Loss of (part of) a batch with a fixed denominator, and its statistics as sums over
    real tokens (``*_sum``), loss terms (additive over micro-batches) and maxima."""
    lc = trainer_config.loss
    m = _loss_mask(batch.loss_mask)
    with_entropy = bool(lc.entropy_coef) or lc.entropy_metric
    p = _compute_params(params, trainer_config)
    kw = {"config": model_config, "policy": policy, "with_entropy": with_entropy, "remat": trainer_config.remat,
          "routing": batch.routing, "logits_chunk": trainer_config.logits_chunk}
    if batch.returns is not None:
        logp, ent, values = token_logprobs_and_values(p, batch.tokens, **kw)
    else:
        logp, ent = token_logprobs(p, batch.tokens, **kw)
    pg, pm = policy_loss(logp, batch.old_logprobs, batch.advantages, m, clip_low=lc.clip_low,
                         clip_high=lc.clip_high, dual_clip=lc.dual_clip, agg=lc.agg, weights=weights,
                         denominator=denominator)
    n = jnp.sum(m).astype(jnp.float32)
    stats = {f"{k}_sum": pm[k] * n for k in _TOKEN_MEANS}
    stats["ratio_max"] = pm["ratio_max"]
    loss = pg
    stats["pg_loss"] = pg
    if with_entropy:
        if lc.entropy_coef == 0:
            ent = jax.lax.stop_gradient(ent)
        ent_term = aggregate_loss(ent, m, lc.agg, denominator=denominator)
        stats["entropy_sum"] = jax.lax.stop_gradient(jnp.sum(jnp.where(m, ent, 0.0)))
        stats["entropy_loss"] = ent_term
        loss = loss - lc.entropy_coef * ent_term
    if batch.ref_logprobs is not None:
        kl = kl_penalty(logp, jax.lax.stop_gradient(batch.ref_logprobs), lc.kl_estimator, m)
        kl_term = aggregate_loss(kl, m, lc.agg, denominator=denominator)
        stats |= {"kl_loss": kl_term, "kl_sum": jax.lax.stop_gradient(jnp.sum(kl))}
        if lc.kl_coef:
            loss = loss + lc.kl_coef * kl_term
    if batch.returns is not None:
        vf, vm = value_loss(values, batch.values, batch.returns, m, clip=lc.value_clip, agg=lc.agg,
                            denominator=denominator)
        loss = loss + lc.vf_coef * vf
        v = jax.lax.stop_gradient(jnp.where(m, values, 0.0))
        ret = jnp.where(m, batch.returns, 0.0).astype(jnp.float32)
        err = jnp.where(m, ret - v, 0.0)
        stats |= {"value_loss": vf, "value_clip_frac_sum": vm["clip_frac"] * n, "value_mean_sum": jnp.sum(v),
                  "return_mean_sum": jnp.sum(ret), "_return_sq_sum": jnp.sum(ret * ret),
                  "_value_err_sum": jnp.sum(err), "_value_err_sq_sum": jnp.sum(err * err)}
    stats["loss"] = loss
    return loss, jax.tree.map(jax.lax.stop_gradient, stats)


def _correction(batch: TrainBatch, lc: LossConfig) -> tuple[Array, Metrics]:
    m = _loss_mask(batch.loss_mask)
    w, cm = rollout_correction_weights(batch.old_logprobs, batch.rollout_logprobs, m, lc.corrections,
                                       tis_cap=lc.tis_cap, mis_low=lc.mis_low, mis_high=lc.mis_high,
                                       geo_low=lc.geo_low, geo_high=lc.geo_high,
                                       kl_estimator=lc.reject_kl_estimator, kl_threshold=lc.reject_kl_threshold,
                                       normalize=lc.correction_normalize)
    metrics = {f"correction/{k}": v for k, v in cm.items()}
    metrics["correction/truncated_frac"] = cm["capped_frac"]
    metrics["correction/masked_frac"] = jnp.where(jnp.any(m), 1.0 - cm["token_kept_frac"], 0.0)
    mm = mismatch_metrics(batch.old_logprobs, batch.rollout_logprobs, m)
    metrics |= {f"mismatch/{k}": v for k, v in mm.items()}
    return w, metrics


def _finalize(stats: Metrics, n_tokens: Array) -> Metrics:
    n = jnp.maximum(n_tokens, 1.0)
    out = {k: v for k, v in stats.items() if not k.endswith("_sum")}
    out |= {k[: -len("_sum")]: v / n for k, v in stats.items() if k.endswith("_sum")}
    if "_value_err" in out:
        # value_explained_var = 1 - Var(R - V) / (Var(R) + 1e-5) over the batch's trained tokens
        # (algos.explained_variance), from token sums so that micro-batches add up exactly.
        var_r = jnp.maximum(out.pop("_return_sq") - out["return_mean"] ** 2, 0.0)
        e = out.pop("_value_err")
        var_e = jnp.maximum(out.pop("_value_err_sq") - e * e, 0.0)
        out["value_explained_var"] = jnp.where(n_tokens > 0, 1.0 - var_e / (var_r + 1e-5), 0.0)
    return out


def _static_checks(batch, params, policy, trainer_config):
    _check_static(params, policy, trainer_config)
    check_batch(batch, trainer_config.micro_batches)
    if trainer_config.loss.kl_coef and batch.ref_logprobs is None:
        raise ValueError(f"LossConfig.kl_coef = {trainer_config.loss.kl_coef} needs TrainBatch.ref_logprobs")
    if batch.returns is not None:
        if not isinstance(params, PolicyValueParams):
            raise ValueError("TrainBatch.returns (the value loss) needs params with a value head: "
                             "init_train_state(with_value_head(params, model_config), ...)")
        if trainer_config.loss.value_clip is not None and batch.values is None:
            raise ValueError(f"LossConfig.value_clip = {trainer_config.loss.value_clip} needs TrainBatch.values "
                             f"(V_old, trainer_logprobs_and_values); set value_clip=None for an unclipped loss")


def loss_fn(params: nnx.State, batch: TrainBatch, *, model_config: ModelConfig, policy: MatmulPolicy,
            trainer_config: TrainerConfig) -> tuple[Array, Metrics]:
    """Whole-batch RL loss in one forward (no micro-batching), differentiable in ``params``::

        loss = policy_loss(logp, old, A, w) + kl_coef * KL(logp, ref) - entropy_coef * H
               [+ vf_coef * value_loss(V, V_old, R)]          (TrainBatch.returns given)

    each term aggregated by ``LossConfig.agg`` over the trained tokens, ``w`` the rollout
    correction of ``(old_logprobs, rollout_logprobs)``, ``V`` the value head on the same forward
    (:func:`token_logprobs_and_values`). Returns the loss and its metrics."""
    _static_checks(batch, params, policy, trainer_config)
    w, metrics = _correction(batch, trainer_config.loss)
    den = loss_denominator(batch.loss_mask, trainer_config.loss.agg)
    loss, stats = _micro_loss(params, batch, w, den, model_config=model_config, policy=policy,
                              trainer_config=trainer_config)
    n = jnp.sum(_loss_mask(batch.loss_mask)).astype(jnp.float32)
    return loss, metrics | _finalize(stats, n) | {"tokens": n}


def compute_grads(params: nnx.State, batch: TrainBatch, *, model_config: ModelConfig, policy: MatmulPolicy,
                  trainer_config: TrainerConfig) -> tuple[nnx.State, Metrics]:
    """float32 gradients of :func:`loss_fn` over the whole batch, accumulated over
    ``trainer_config.micro_batches`` micro-batches by ``lax.scan`` (exact: see the module docstring)."""
    _static_checks(batch, params, policy, trainer_config)
    M = trainer_config.micro_batches
    B = jnp.shape(batch.tokens)[0]
    w, metrics = _correction(batch, trainer_config.loss)
    den = loss_denominator(batch.loss_mask, trainer_config.loss.agg)
    grad_fn = jax.grad(functools.partial(_micro_loss, model_config=model_config, policy=policy,
                                         trainer_config=trainer_config), has_aux=True)

    def split(x):  # [B, ...] -> [M, B / M, ...]
        return x.reshape(M, B // M, *x.shape[1:])

    def body(g_acc, xs):
        g, stats = grad_fn(params, *xs, den)
        return jax.tree.map(jnp.add, g_acc, g), stats

    grads, stats = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), (jax.tree.map(split, batch), split(w)))
    # Per-micro-batch statistics [M]: sums and loss terms add up, maxima take the max (an empty
    # micro-batch reports 0, below any ratio).
    stats = {k: jnp.max(v) if k.endswith("_max") else jnp.sum(v) for k, v in stats.items()}
    n = jnp.sum(_loss_mask(batch.loss_mask)).astype(jnp.float32)
    return grads, metrics | _finalize(stats, n) | {"tokens": n}


def train_step(state: TrainState, batch: TrainBatch, *, model_config: ModelConfig, policy: MatmulPolicy,
               trainer_config: TrainerConfig, optimizer: optax.GradientTransformation) -> tuple[TrainState, Metrics]:
    """One optimizer update on ``batch``: accumulated gradients, clipping + AdamW, ``step + 1``.

    Metrics: ``loss``, ``pg_loss``, ``entropy_loss`` (aggregated like the loss), ``kl_loss``
    (with ref logprobs), the token means ``clip_frac*``, ``dual_clip_frac``, ``approx_kl*``,
    ``ratio_mean``, ``entropy`` (unless ``entropy_metric`` is off), ``kl``; ``ratio_max``,
    ``grad_norm`` (before clipping), ``lr`` (of this update, from ``trainer_config.optimizer``),
    ``tokens``, ``correction/*`` (incl. ``truncated_frac`` and ``masked_frac``) and
    ``mismatch/*`` (:func:`algos.mismatch_metrics` of old vs rollout logprobs on trained tokens).
    With ``TrainBatch.returns`` (PPO + GAE): ``value_loss`` (aggregated like the loss, before
    ``vf_coef``), and over the trained tokens ``value_clip_frac``, ``value_mean``, ``return_mean``
    and ``value_explained_var`` (``1 - Var(R - V) / (Var(R) + 1e-5)``), ``V`` the values before
    this update.
    """
    grads, metrics, rng = step_gradients(state, batch, model_config=model_config, policy=policy,
                                         trainer_config=trainer_config)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new = state.replace(step=state.step + 1, params=params, opt_state=opt_state, rng=rng)
    return new, metrics


def step_gradients(state: TrainState, batch: TrainBatch, *, model_config: ModelConfig, policy: MatmulPolicy,
                   trainer_config: TrainerConfig) -> tuple[nnx.State, Metrics, Array]:
    """What a train step computes before its optimizer update: the accumulated gradients, the metrics with
    ``grad_norm`` (before clipping) and this update's ``lr``, and the next ``rng`` (``train_step``, and
    ``rl.offload``'s streamed update)."""
    grads, metrics = compute_grads(state.params, batch, model_config=model_config, policy=policy,
                                   trainer_config=trainer_config)
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["lr"] = lr_schedule(trainer_config.optimizer)(state.step)
    rng, _ = jax.random.split(state.rng)
    return grads, metrics, rng


# Compiler options of every train step: without XLA's latency-hiding scheduler on the GPU, which moves each
# layer's rematerialized forward in the micro-batch loop ahead of the backward that needs it and so keeps every
# layer's activations alive at once (docs/memory.md, "The train step's compiler options").
TRAIN_STEP_COMPILER_OPTIONS = {"xla_gpu_enable_latency_hiding_scheduler": False}


def make_train_step(model_config: ModelConfig, policy: MatmulPolicy, trainer_config: TrainerConfig,
                    optimizer: optax.GradientTransformation | None = None
                    ) -> Callable[[TrainState, TrainBatch], tuple[TrainState, Metrics]]:
    """``train_step`` with everything static bound, jitted with the state donated (do not use
    a state after passing it in). ``optimizer`` defaults to ``make_optimizer(trainer_config.optimizer)``;
    build the state with the same one."""
    if trainer_config.offload_optimizer:
        raise ValueError("trainer_config.offload_optimizer keeps AdamW's moments in host memory, which this step "
                         "does not stream: use fp8rl_jax.rl.offload.make_step")
    if optimizer is None:
        optimizer = make_optimizer(trainer_config.optimizer)
    fn = functools.partial(train_step, model_config=model_config, policy=policy, trainer_config=trainer_config,
                           optimizer=optimizer)
    return jax.jit(fn, donate_argnums=0, compiler_options=TRAIN_STEP_COMPILER_OPTIONS)


__all__: Sequence[str] = (
    "ComputeDtype",
    "LossConfig",
    "OptimizerConfig",
    "TRAIN_STEP_COMPILER_OPTIONS",
    "PolicyValueParams",
    "Schedule",
    "TrainBatch",
    "TrainState",
    "TrainerConfig",
    "check_batch",
    "compute_grads",
    "has_value_head",
    "init_train_state",
    "init_value_head",
    "loss_denominator",
    "loss_fn",
    "lr_schedule",
    "make_logprob_fn",
    "make_logprob_value_fn",
    "make_optimizer",
    "make_train_step",
    "model_params",
    "head_logprobs",
    "token_logprobs",
    "token_logprobs_and_values",
    "token_values",
    "train_step",
    "trainer_logprobs",
    "trainer_logprobs_and_values",
    "with_value_head",
)
