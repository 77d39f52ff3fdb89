"""The "update" stage of the RL loop: one jitted, donated ``train_step(state, batch) -> (state, metrics)``.

Shapes: ``B`` sequences, ``T`` tokens (prompt + response, right-padded), ``V`` vocabulary,
``M`` micro-batches. The RL maths (clipped surrogate, KL, corrections, metrics) come from
:mod:`fp8rl_jax.rl.algos`; this module only wires them to the model and the optimizer.

Design notes
------------
* **One state pytree.** :class:`TrainState` holds ``step``, ``params`` (an ``nnx.State`` of
  float32 master weights), ``opt_state`` (optax) and ``rng``; ``train_step`` maps it to a new
  one and is jitted with the state donated (:func:`make_train_step`). Everything static (model
  config, matmul policy, trainer config, optimizer) is bound by ``functools.partial``, so an
  FP8 training policy (a ``MatmulPolicy`` with a ``custom_vjp`` dot) plugs in unchanged.
* **FP32 master weights, BF16 compute.** The loss casts the float32 parameters to
  ``TrainerConfig.compute_dtype`` before the forward; the cast is differentiable, so gradients,
  their accumulation, clipping and AdamW all run in float32. The policy's compute dtype must
  match (checked), so activations and weights agree.
* **Token alignment.** ``logp[:, t] = log p(tokens[t] | tokens[:t])`` from one full-sequence
  forward; ``logp[:, 0] = 0`` and position 0 is never trained (it has no context; its
  ``loss_mask`` entry is ignored). ``old_logprobs``, ``rollout_logprobs``, ``ref_logprobs`` and
  ``advantages`` use the same alignment. Right padding needs no attention mask: a causal
  model never lets a real token see a later padded one.
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
  unchanged up to rounding.
* **Entropy** is computed for the metrics by default (a ``[B, T, V]`` float32 softmax, under
  ``stop_gradient`` unless ``entropy_coef != 0``; ``LossConfig.entropy_metric = False`` skips it).
  The target logprob itself needs only the log-sum-exp over ``V``, not a full ``log_softmax``.
* **Schedule convention.** Update ``k`` (0-based, ``= state.step``) uses
  ``lr_k = lr * min(1, (k + 1) / W)`` during warmup (the first update is not wasted on
  ``lr = 0``), then constant ``lr`` or cosine from ``lr`` to ``min_lr_ratio * lr`` over
  ``total_steps - W`` updates, flat afterwards.
* **Weight decay** (decoupled, AdamW) applies to matrices only (``ndim >= 2``: linear weights,
  embeddings, experts), not to the RMSNorm gains.

* **MoE routing replay.** ``TrainBatch.routing`` (``[B, T, L_moe, k]`` int32, recorded by the
  generator, ``-1`` = not recorded) makes every trainer forward of the batch (``old_logprobs``
  via :func:`trainer_logprobs` and the loss) send each token through the experts the rollout
  chose; the router's softmax still weights them and receives the gradient
  (``fp8rl_jax.models.qwen3.forward_with_routing``). Router disagreement (top-k flips between
  FP8 rollout and BF16 trainer) then no longer adds to the mismatch the correction must absorb.
  ``routing=None`` (the default) routes by top-k as before.

* **PPO value head on the shared trunk.** For GAE, ``TrainState.params`` is a
  :class:`PolicyValueParams` ``(model, value_head)``: ``model`` the unchanged ``nnx.State`` of the
  Qwen3 model (the generator's weights, :func:`model_params`), ``value_head`` a scalar linear head
  ``{"kernel": [D, 1], "bias": []}`` (float32, zero-initialized: ``V = 0`` at first and the value
  loss sends no gradient into the trunk on the first update) reading the final post-norm hidden
  state of the same forward that gives the logprobs (``models.Qwen3.hidden_states``). One
  optimizer and one gradient clip cover both (shared actor-critic); GRPO keeps plain model params
  and nothing about it changes. **Value alignment** follows the logprobs:
  ``values[:, t] = head(h[:, t - 1])``, the hidden state that predicts ``tokens[t]``, i.e. the
  value of the prefix ``tokens[:t]`` before token ``t`` is emitted; ``values[:, 0] = 0``. So
  ``TrainBatch.values``, ``returns`` and ``advantages`` at entry ``t`` all belong to action ``t``.
  The head runs in float32 on the (compute-dtype) hidden state.
* **Value loss** (:func:`algos.value_loss`, clipped as in PPO/verl) is added as
  ``vf_coef * value_loss`` when ``TrainBatch.returns`` is given, aggregated with the same
  ``LossAgg``, mask and denominator as the policy loss, so micro-batch accumulation stays exact.

* **Chunked vocabulary projection.** ``TrainerConfig.logits_chunk`` positions at a time
  (:func:`head_logprobs`, rematerialized in the backward): ``[B, T, V]`` float32 logits with
  Qwen3's 152k vocabulary are ~600 KB per token, and several copies of them ran a Qwen3-1.7B
  update out of memory on the H200 at 8 x 1536 tokens per micro-batch.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from fp8rl_jax.models import MatmulPolicy, ModelConfig, bind
from fp8rl_jax.rl.algos import (
    Correction,
    KLEstimator,
    LossAgg,
    aggregate_loss,
    entropy_from_logits,
    kl_penalty,
    mismatch_metrics,
    policy_loss,
    rollout_correction_weights,
    value_loss,
)

Array = jax.Array
Metrics = dict[str, Array]


# --------------------------------------------------------------------------- configs


class Schedule(enum.Enum):
    """Learning-rate shape after the linear warmup."""

    CONSTANT = "constant"
    COSINE = "cosine"


class ComputeDtype(enum.Enum):
    """Dtype of the forward/backward compute (parameters stay float32 master weights)."""

    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"


def _check_enum(name: str, value: Any, cls: type[enum.Enum]) -> None:
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be a {cls.__name__}, got {type(value).__name__} {value!r}")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup, a constant or cosine schedule and global-norm clipping."""

    lr: float = 1e-6
    warmup_steps: int = 0  # W
    schedule: Schedule = Schedule.CONSTANT
    total_steps: int | None = None  # needed by COSINE: the schedule reaches min_lr at this update
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0  # global-norm clipping; None disables it

    def __post_init__(self) -> None:
        _check_enum("schedule", self.schedule, Schedule)
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.schedule is Schedule.COSINE and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise ValueError(f"Schedule.COSINE needs total_steps > warmup_steps = {self.warmup_steps}, "
                             f"got total_steps={self.total_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not (0.0 <= self.b1 < 1.0 and 0.0 <= self.b2 < 1.0):
            raise ValueError(f"b1 and b2 must be in [0, 1), got b1={self.b1}, b2={self.b2}")
        if not self.eps > 0 or self.weight_decay < 0:
            raise ValueError(f"eps must be > 0 and weight_decay >= 0, got eps={self.eps}, "
                             f"weight_decay={self.weight_decay}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The RL loss: clipped surrogate + ``kl_coef`` KL - ``entropy_coef`` entropy (+ ``vf_coef`` value
    loss for PPO with a value head), with rollout correction.

    Clipping, dual clip and aggregation as in :func:`algos.policy_loss`; the correction and its
    thresholds as in :func:`algos.rollout_correction_weights` (``correction`` may be one
    ``Correction`` or a tuple of them, multiplied). The default token TIS with cap 2 is
    harmless when the rollout runs in the training precision (ratios ~1) and corrects FP8
    rollouts.
    """

    clip_low: float = 0.2
    clip_high: float = 0.28  # DAPO clip-higher
    dual_clip: float | None = None  # c > 1 bounds negative-advantage token losses at c |A|
    agg: LossAgg = LossAgg.TOKEN_MEAN
    kl_coef: float = 0.0  # > 0 needs TrainBatch.ref_logprobs
    kl_estimator: KLEstimator = KLEstimator.K3
    entropy_coef: float = 0.0
    entropy_metric: bool = True  # False (with entropy_coef 0) skips the [B, T, V] entropy computation
    correction: Correction | tuple[Correction, ...] = Correction.TOKEN_TIS
    tis_cap: float = 2.0
    mis_low: float = 0.5
    mis_high: float = 5.0
    geo_low: float = 0.99
    geo_high: float = 1.01
    reject_kl_estimator: KLEstimator = KLEstimator.K3  # for the KL-rejection corrections (K2 or K3)
    reject_kl_threshold: float = 0.1
    vf_coef: float = 0.5  # weight of the value loss (only with TrainBatch.returns, i.e. PPO + GAE)
    value_clip: float | None = 0.5  # eps_v of the clipped value loss (verl's cliprange_value); None: unclipped

    def __post_init__(self) -> None:
        _check_enum("agg", self.agg, LossAgg)
        _check_enum("kl_estimator", self.kl_estimator, KLEstimator)
        _check_enum("reject_kl_estimator", self.reject_kl_estimator, KLEstimator)
        for c in self.corrections:
            _check_enum("correction", c, Correction)
        if not 0.0 <= self.clip_low < 1.0 or self.clip_high < 0.0:
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={self.clip_low}, "
                             f"clip_high={self.clip_high}")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1 or None, got {self.dual_clip}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if not self.tis_cap > 0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")
        if not 0 < self.mis_low < self.mis_high:
            raise ValueError(f"need 0 < mis_low < mis_high, got [{self.mis_low}, {self.mis_high}]")
        if not 0 < self.geo_low < self.geo_high:
            raise ValueError(f"need 0 < geo_low < geo_high, got [{self.geo_low}, {self.geo_high}]")
        if self.reject_kl_estimator not in (KLEstimator.K2, KLEstimator.K3):
            raise ValueError(f"reject_kl_estimator must be K2 or K3, got {self.reject_kl_estimator!r}")
        if not self.vf_coef >= 0:
            raise ValueError(f"vf_coef must be >= 0, got {self.vf_coef}")
        if self.value_clip is not None and not self.value_clip > 0:
            raise ValueError(f"value_clip must be > 0 or None, got {self.value_clip}")

    @property
    def corrections(self) -> tuple[Correction, ...]:
        c = self.correction
        return (c,) if isinstance(c, Correction) else tuple(c)


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Everything static about a train step besides the model and the policy."""

    loss: LossConfig = LossConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    micro_batches: int = 1  # M: B must be a multiple; gradients are accumulated exactly
    compute_dtype: ComputeDtype = ComputeDtype.BFLOAT16
    remat: bool = False  # recompute each decoder layer in the backward pass
    logits_chunk: int | None = 1024  # LM head + log-softmax over this many positions at a time (None: all)

    def __post_init__(self) -> None:
        _check_enum("compute_dtype", self.compute_dtype, ComputeDtype)
        if self.logits_chunk is not None and not (isinstance(self.logits_chunk, int) and self.logits_chunk >= 1):
            raise ValueError(f"logits_chunk must be a positive int or None, got {self.logits_chunk!r}")
        if not isinstance(self.loss, LossConfig) or not isinstance(self.optimizer, OptimizerConfig):
            raise TypeError(f"loss must be a LossConfig and optimizer an OptimizerConfig, got "
                            f"{type(self.loss).__name__} and {type(self.optimizer).__name__}")
        if not (isinstance(self.micro_batches, int) and self.micro_batches >= 1):
            raise ValueError(f"micro_batches must be a positive int, got {self.micro_batches!r}")


# --------------------------------------------------------------------------- optimizer


def lr_schedule(cfg: OptimizerConfig) -> Callable[[Array | int], Array]:
    """``step -> lr`` (float32) of update ``step`` (0-based); see the module docstring."""
    lr, W = cfg.lr, cfg.warmup_steps

    def schedule(step):
        k = jnp.asarray(step, jnp.float32)
        warm = jnp.minimum(1.0, (k + 1.0) / W) if W > 0 else 1.0
        if cfg.schedule is Schedule.CONSTANT:
            after = jnp.float32(lr)
        else:
            p = jnp.clip((k - W) / (cfg.total_steps - W), 0.0, 1.0)
            after = lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + jnp.cos(math.pi * p)))
        return jnp.where(k < W, lr * warm, after).astype(jnp.float32)

    return schedule


def _decay_mask(params):
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """``clip_by_global_norm(max_grad_norm)`` then AdamW on :func:`lr_schedule`:
    ``g <- g min(1, c / ||g||)``; ``m, v`` Adam moments with bias correction;
    ``p <- p - lr_k (m_hat / (sqrt(v_hat) + eps) + wd p)`` (``wd`` on matrices only)."""
    adamw = optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        mask=_decay_mask)
    if cfg.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)


# --------------------------------------------------------------------------- value head


@flax.struct.dataclass
class PolicyValueParams:
    """Trainer parameters for PPO with a value head on the shared trunk.

    Attributes:
      model: ``nnx.State`` of the Qwen3 model, exactly what GRPO trains and what the generator
        receives (:func:`model_params`; ``loop.sync_weights`` strips the head).
      value_head: ``{"kernel": [D, 1], "bias": []}``: ``V = h @ kernel + bias`` on the final
        post-norm hidden state ``h`` (:func:`token_values`), outside the model's State so the
        model definition stays the generator's.
    """

    model: nnx.State
    value_head: dict[str, Array]


def init_value_head(config: ModelConfig, key: Array | None = None, scale: float = 0.0) -> dict[str, Array]:
    """A float32 value head for ``config``: ``kernel [D, 1] ~ scale * N(0, 1 / D)`` (zeros with the
    default ``scale = 0``, or without ``key``), ``bias [] = 0``."""
    D = config.hidden_size
    if key is None or scale == 0:
        kernel = jnp.zeros((D, 1), jnp.float32)
    else:
        kernel = (scale / math.sqrt(D)) * jax.random.normal(key, (D, 1), jnp.float32)
    return {"kernel": kernel, "bias": jnp.zeros((), jnp.float32)}


def with_value_head(params: nnx.State, config: ModelConfig, key: Array | None = None,
                    scale: float = 0.0) -> PolicyValueParams:
    """``PolicyValueParams(params, init_value_head(config, key, scale))`` (``params`` untouched)."""
    if isinstance(params, PolicyValueParams):
        raise TypeError("params already carry a value head")
    return PolicyValueParams(model=params, value_head=init_value_head(config, key, scale))


def model_params(params: Any) -> nnx.State:
    """The model's parameters: ``params.model`` of a :class:`PolicyValueParams`, else ``params``
    itself (GRPO). What the generator and every logprob-only forward take."""
    return params.model if isinstance(params, PolicyValueParams) else params


def has_value_head(params: Any) -> bool:
    return isinstance(params, PolicyValueParams)


def token_values(value_head: dict[str, Array], hidden: Array) -> Array:
    """``values [B, T]`` float32 from final hidden states ``hidden [B, T, D]``, aligned with the
    logprobs: ``values[:, t] = hidden[:, t - 1] @ kernel + bias`` (the state that predicts
    ``tokens[t]``), ``values[:, 0] = 0``. The head runs in float32 (highest matmul precision)."""
    k = jnp.asarray(value_head["kernel"], jnp.float32)
    if k.shape != (jnp.shape(hidden)[-1], 1):
        raise ValueError(f"value_head kernel must have shape [D, 1] = {(jnp.shape(hidden)[-1], 1)}, got {k.shape}")
    v = jnp.einsum("btd,d->bt", hidden[:, :-1].astype(jnp.float32), k[:, 0], precision=jax.lax.Precision.HIGHEST)
    v = v + jnp.asarray(value_head["bias"], jnp.float32)
    return jnp.pad(v, ((0, 0), (1, 0)))


# --------------------------------------------------------------------------- state and batch


@flax.struct.dataclass
class TrainState:
    """The whole trainer state; ``train_step`` maps it to a new one.

    Attributes:
      step: int32 scalar, updates done so far (the next update uses ``lr_schedule(step)``).
      params: ``nnx.State`` of float32 master weights (paths as in ``fp8rl_jax.models``), or a
        :class:`PolicyValueParams` (model + value head) for PPO with GAE.
      opt_state: the optax state of the optimizer the step was built with.
      rng: uint32 [2] raw PRNG key, split once per update (reserved for stochastic steps).
    """

    step: Array
    params: nnx.State
    opt_state: optax.OptState
    rng: Array


def init_train_state(params: nnx.State, optimizer: optax.GradientTransformation, rng: Array) -> TrainState:
    """A fresh state: ``params`` copied as float32 master weights (bf16 checkpoints welcome; the
    state never aliases ``params``, so donating it to a train step leaves ``params`` usable), the
    optimizer initialized on them, ``step = 0``; ``rng`` is a typed or raw key."""
    params = jax.tree.map(lambda p: jnp.array(p, jnp.float32 if jnp.issubdtype(p.dtype, jnp.floating) else p.dtype,
                                              copy=True), params)
    if jnp.issubdtype(jnp.asarray(rng).dtype, jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    rng = jnp.asarray(rng, jnp.uint32)
    if rng.shape != (2,):
        raise ValueError(f"rng must be a typed key or a raw uint32 [2] key, got shape {rng.shape}")
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params), rng=rng)


@flax.struct.dataclass
class TrainBatch:
    """One RL update's data; every ``[B, T]`` field uses the token alignment of ``tokens``.

    Attributes:
      tokens: [B, T] int32, prompt + response token ids, right-padded (any valid id as padding).
      loss_mask: [B, T], 1 on the response tokens to train, 0 on prompt and padding. The entry
        for ``t`` means "the logprob of ``tokens[t]`` given ``tokens[:t]``"; column 0 is ignored.
      advantages: [B, T] float, advantage of each trained token (e.g. ``compute_advantages``).
      old_logprobs: [B, T] float, trainer-side ``log pi_old(tokens[t] | tokens[:t])`` of the
        parameters that produced the rollout (:func:`trainer_logprobs`), the PPO ratio's denominator.
      rollout_logprobs: [B, T] float, the generator's logprobs of the same tokens (FP8 rollout),
        for the rollout correction and the mismatch metrics.
      ref_logprobs: [B, T] float or None, reference-policy logprobs for the KL penalty.
      routing: [B, T, L_moe, k] int32 or None: MoE routing replay, the experts the generator chose
        for ``tokens[b, t]`` in each MoE layer (``RolloutBatch.routing``, aligned by
        ``loop.build_batch``); ``-1`` (padding, unrecorded) lets the router's top-k decide. None
        (the default) routes by top-k.
      values: [B, T] float or None: ``V_old``, the value of the parameters that produced the
        rollout (:func:`trainer_logprobs_and_values`), for the clipped value loss. Entry ``t`` is
        the value of the prefix ``tokens[:t]`` (from the hidden state at ``t - 1``, the one that
        predicts ``tokens[t]``), the alignment of the logprobs.
      returns: [B, T] float or None: value targets ``R = A + V_old`` (:func:`algos.gae_advantages`).
        When given, the loss adds ``vf_coef * value_loss`` and the params need a value head. None
        (GRPO) leaves the loss as it was.
      token_rewards: [B, T] float or None: per-token rewards, the GAE input
        (:func:`algos.outcome_to_token_rewards`, filled by ``loop.build_batch``); not read by the loss.
    """

    tokens: Array
    loss_mask: Array
    advantages: Array
    old_logprobs: Array
    rollout_logprobs: Array
    ref_logprobs: Array | None = None
    routing: Array | None = None
    values: Array | None = None
    returns: Array | None = None
    token_rewards: Array | None = None


def check_batch(batch: TrainBatch, micro_batches: int = 1) -> tuple[int, int]:
    """Shape checks (trace-time; no values are read); returns ``(B, T)``."""
    if not isinstance(batch, TrainBatch):
        raise TypeError(f"batch must be a TrainBatch, got {type(batch).__name__}")
    shape = jnp.shape(batch.tokens)
    if len(shape) != 2 or not jnp.issubdtype(jnp.result_type(batch.tokens), jnp.integer):
        raise ValueError(f"tokens must be an integer [B, T] array, got shape {shape} dtype "
                         f"{jnp.result_type(batch.tokens)}")
    B, T = shape
    if T < 2:
        raise ValueError(f"tokens need T >= 2 (position 0 has no logprob), got T = {T}")
    for f in dataclasses.fields(batch):
        x = getattr(batch, f.name)
        if f.name == "routing" and x is not None:
            if len(jnp.shape(x)) != 4 or jnp.shape(x)[:2] != shape or not jnp.issubdtype(jnp.result_type(x),
                                                                                          jnp.integer):
                raise ValueError(f"TrainBatch.routing must be an integer [B, T, L_moe, top_k] array with "
                                 f"[B, T] = {shape}, got shape {jnp.shape(x)} dtype {jnp.result_type(x)}")
            continue
        if f.name != "tokens" and x is not None and jnp.shape(x) != shape:
            raise ValueError(f"TrainBatch.{f.name} has shape {jnp.shape(x)}, expected [B, T] = {shape} like tokens")
    if B % micro_batches:
        raise ValueError(f"micro_batches = {micro_batches} does not divide the batch size B = {B}")
    return B, T


# --------------------------------------------------------------------------- logprobs and loss


def token_logprobs(params: nnx.State, tokens: Array, *, config: ModelConfig, policy: MatmulPolicy,
                   with_entropy: bool = False, remat: bool = False, routing: Array | None = None,
                   logits_chunk: int | None = None) -> tuple[Array, Array | None]:
    """``(logp, entropy)``: ``logp[b, t] = log p(tokens[b, t] | tokens[b, :t])`` ``[B, T]`` float32
    from one full-sequence forward, ``logp[:, 0] = 0``; ``entropy[b, t]`` is the entropy of the
    distribution that predicts position ``t`` (None unless ``with_entropy``). ``params`` are used
    as given (cast them first for BF16 compute, as :func:`trainer_logprobs` does). ``routing``
    [B, T, L_moe, k] int32 replays MoE expert choices (``TrainBatch.routing``). ``logits_chunk``:
    the LM head and log-softmax run over that many positions at a time, rematerialized in the
    backward pass (:func:`head_logprobs`), so ``[B, T, V]`` float32 logits never exist at once."""
    logp, ent, _ = _logprobs_and_hidden(model_params(params), tokens, config=config, policy=policy,
                                        with_entropy=with_entropy, remat=remat, routing=routing,
                                        logits_chunk=logits_chunk)
    return logp, ent


def head_logprobs(logits_fn: Callable[[Array], Array], hidden: Array, targets: Array, *, with_entropy: bool = False,
                  chunk: int | None = None) -> tuple[Array, Array | None]:
    """``logp[b, s] = log softmax(logits_fn(hidden[b, s]))[targets[b, s]]`` ``[B, S]`` float32 (and
    the entropy of that distribution when ``with_entropy``), computed ``chunk`` positions at a
    time when ``S > chunk``.

    The vocabulary projection dominates activation memory at RL lengths: Qwen3's 152k-entry
    vocabulary makes ``[B, S, V]`` float32 logits ~600 KB per token, and autodiff keeps several
    such tensors (logits, softmax, their cotangents). Chunked, the forward holds one
    ``[B, chunk, V]`` block at a time and ``jax.checkpoint`` makes the backward recompute each
    chunk's logits from ``hidden`` instead of storing them: peak memory falls from
    ``O(S V)`` to ``O(chunk V)`` for one extra LM-head GEMM. Each position's result is the same
    math as the unchunked path (rows of a GEMM are independent), up to the GEMM's summation order."""
    B, S = targets.shape

    def block(h, t):
        z = logits_fn(h).astype(jnp.float32)
        lp = jnp.take_along_axis(z, t[..., None].astype(jnp.int32), axis=-1)[..., 0] - jax.nn.logsumexp(z, axis=-1)
        return lp, (entropy_from_logits(z) if with_entropy else jnp.zeros_like(lp))

    if chunk is None or S <= chunk:
        lp, ent = block(hidden, targets)
    else:
        n = -(-S // chunk)
        pad = n * chunk - S
        h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(B, n, chunk, -1).swapaxes(0, 1)
        t = jnp.pad(targets, ((0, 0), (0, pad))).reshape(B, n, chunk).swapaxes(0, 1)
        lp, ent = jax.lax.map(jax.checkpoint(lambda ht: block(*ht)), (h, t))
        lp, ent = (x.swapaxes(0, 1).reshape(B, n * chunk)[:, :S] for x in (lp, ent))
    return lp, (ent if with_entropy else None)


def _logprobs_and_hidden(params, tokens, *, config, policy, with_entropy, remat, routing, logits_chunk=None):
    model = bind(params, config, policy)
    hidden, _ = model.hidden_states(tokens, remat=remat, routing=routing)
    # position t-1 predicts token t
    logp, ent = head_logprobs(model.logits, hidden[:, :-1], tokens[:, 1:], with_entropy=with_entropy,
                              chunk=logits_chunk)
    pad = functools.partial(jnp.pad, pad_width=((0, 0), (1, 0)))
    return pad(logp), (pad(ent) if with_entropy else None), hidden


def token_logprobs_and_values(params: PolicyValueParams, tokens: Array, *, config: ModelConfig,
                              policy: MatmulPolicy, with_entropy: bool = False, remat: bool = False,
                              routing: Array | None = None, logits_chunk: int | None = None
                              ) -> tuple[Array, Array | None, Array]:
    """``(logp, entropy, values)`` from one full-sequence forward: :func:`token_logprobs` of
    ``params.model`` and :func:`token_values` of ``params.value_head`` on the same final hidden
    states (entry ``t`` of both belongs to ``tokens[t]``; ``values[:, 0] = 0``)."""
    if not isinstance(params, PolicyValueParams):
        raise TypeError(f"token_logprobs_and_values needs PolicyValueParams (with_value_head), "
                        f"got {type(params).__name__}")
    logp, ent, hidden = _logprobs_and_hidden(params.model, tokens, config=config, policy=policy,
                                             with_entropy=with_entropy, remat=remat, routing=routing,
                                             logits_chunk=logits_chunk)
    return logp, ent, token_values(params.value_head, hidden)


def _compute_params(params: Any, cfg: TrainerConfig) -> Any:
    """The model params cast to the compute dtype (differentiably); a value head stays float32."""
    dt = jnp.dtype(cfg.compute_dtype.value)
    cast = jax.tree.map(lambda p: p.astype(dt) if jnp.issubdtype(p.dtype, jnp.floating) else p, model_params(params))
    return params.replace(model=cast) if isinstance(params, PolicyValueParams) else cast


def _check_static(params: nnx.State, policy: MatmulPolicy, cfg: TrainerConfig) -> None:
    if not isinstance(cfg, TrainerConfig):
        raise TypeError(f"trainer_config must be a TrainerConfig, got {type(cfg).__name__}")
    if jnp.dtype(policy.compute_dtype) != jnp.dtype(cfg.compute_dtype.value):
        raise ValueError(f"policy compute dtype {jnp.dtype(policy.compute_dtype).name} differs from "
                         f"TrainerConfig.compute_dtype {cfg.compute_dtype}; use e.g. DensePolicy"
                         f"({cfg.compute_dtype.value!r})")
    bad = [jax.tree_util.keystr(k) for k, p in jax.tree_util.tree_leaves_with_path(params)
           if jnp.issubdtype(p.dtype, jnp.floating) and p.dtype != jnp.float32]
    if bad:
        raise ValueError(f"trainer params must be float32 master weights (init_train_state upcasts); "
                         f"not float32: {bad[:3]}{' ...' if len(bad) > 3 else ''}")


def trainer_logprobs(params: nnx.State, tokens: Array, *, model_config: ModelConfig, policy: MatmulPolicy,
                     trainer_config: TrainerConfig, routing: Array | None = None) -> Array:
    """``[B, T]`` trainer-side logprobs with the loss's exact numerics (same parameter cast,
    same micro-batch shapes): what ``TrainBatch.old_logprobs`` should hold, so that the first
    update on a fresh rollout starts at ratio 1. ``routing``: ``TrainBatch.routing`` (replay).
    A value head in ``params`` is ignored (:func:`trainer_logprobs_and_values` uses it)."""
    _check_static(params, policy, trainer_config)
    p = _compute_params(model_params(params), trainer_config)
    fn = functools.partial(token_logprobs, config=model_config, policy=policy,
                           logits_chunk=trainer_config.logits_chunk)
    return _micro_map(lambda t, r: fn(p, t, routing=r)[0], tokens, routing, trainer_config.micro_batches)


def trainer_logprobs_and_values(params: PolicyValueParams, tokens: Array, *, model_config: ModelConfig,
                                policy: MatmulPolicy, trainer_config: TrainerConfig,
                                routing: Array | None = None) -> tuple[Array, Array]:
    """``(logprobs [B, T], values [B, T])`` from one forward per micro-batch, with the loss's
    exact numerics (:func:`trainer_logprobs`): ``old_logprobs`` and ``V_old`` (``TrainBatch.values``)
    of the parameters that produced a rollout. Alignment as :func:`token_values`."""
    _check_static(params, policy, trainer_config)
    if not isinstance(params, PolicyValueParams):
        raise TypeError(f"trainer_logprobs_and_values needs PolicyValueParams (with_value_head), "
                        f"got {type(params).__name__}")
    p = _compute_params(params, trainer_config)

    def fn(t, r):
        logp, _, v = token_logprobs_and_values(p, t, config=model_config, policy=policy, routing=r,
                                               logits_chunk=trainer_config.logits_chunk)
        return logp, v

    return _micro_map(fn, tokens, routing, trainer_config.micro_batches)


def _micro_map(fn: Callable, tokens: Array, routing: Array | None, M: int) -> Any:
    """``fn(tokens, routing)`` over ``M`` micro-batches by ``lax.map``, outputs reshaped to ``[B, ...]``."""
    if jnp.ndim(tokens) != 2:
        raise ValueError(f"tokens must have shape [B, T], got {jnp.shape(tokens)}")
    B, T = jnp.shape(tokens)
    if B % M:
        raise ValueError(f"micro_batches = {M} does not divide the batch size B = {B}")
    if routing is None:
        out = jax.lax.map(lambda t: fn(t, None), tokens.reshape(M, B // M, T))
    else:
        if jnp.ndim(routing) != 4 or jnp.shape(routing)[:2] != (B, T):
            raise ValueError(f"routing must have shape [B, T, L_moe, top_k] with [B, T] = {(B, T)}, "
                             f"got {jnp.shape(routing)}")
        out = jax.lax.map(lambda tr: fn(tr[0], tr[1]),
                          (tokens.reshape(M, B // M, T), routing.reshape(M, B // M, *jnp.shape(routing)[1:])))
    return jax.tree.map(lambda x: x.reshape(B, *x.shape[2:]), out)


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
                                       kl_estimator=lc.reject_kl_estimator, kl_threshold=lc.reject_kl_threshold)
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
    grads, metrics = compute_grads(state.params, batch, model_config=model_config, policy=policy,
                                   trainer_config=trainer_config)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    rng, _ = jax.random.split(state.rng)
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["lr"] = lr_schedule(trainer_config.optimizer)(state.step)
    new = state.replace(step=state.step + 1, params=params, opt_state=opt_state, rng=rng)
    return new, metrics


def make_train_step(model_config: ModelConfig, policy: MatmulPolicy, trainer_config: TrainerConfig,
                    optimizer: optax.GradientTransformation | None = None
                    ) -> Callable[[TrainState, TrainBatch], tuple[TrainState, Metrics]]:
    """``train_step`` with everything static bound, jitted with the state donated (do not use
    a state after passing it in). ``optimizer`` defaults to ``make_optimizer(trainer_config.optimizer)``;
    build the state with the same one."""
    if optimizer is None:
        optimizer = make_optimizer(trainer_config.optimizer)
    fn = functools.partial(train_step, model_config=model_config, policy=policy, trainer_config=trainer_config,
                           optimizer=optimizer)
    return jax.jit(fn, donate_argnums=0)


def make_logprob_fn(model_config: ModelConfig, policy: MatmulPolicy, trainer_config: TrainerConfig
                    ) -> Callable[..., Array]:
    """Jitted :func:`trainer_logprobs` ``(params, tokens, routing=None) -> [B, T]`` (for
    ``old_logprobs``; ``routing`` replays MoE expert choices)."""
    return jax.jit(functools.partial(trainer_logprobs, model_config=model_config, policy=policy,
                                     trainer_config=trainer_config))


def make_logprob_value_fn(model_config: ModelConfig, policy: MatmulPolicy, trainer_config: TrainerConfig
                          ) -> Callable[..., tuple[Array, Array]]:
    """Jitted :func:`trainer_logprobs_and_values` ``(params, tokens, routing=None) -> (logp, values)``
    (``old_logprobs`` and ``V_old`` from one forward; params with a value head)."""
    return jax.jit(functools.partial(trainer_logprobs_and_values, model_config=model_config, policy=policy,
                                     trainer_config=trainer_config))


__all__: Sequence[str] = (
    "ComputeDtype",
    "LossConfig",
    "OptimizerConfig",
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
