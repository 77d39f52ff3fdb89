"""The trainer's static configuration: loss, optimizer, micro-batching, compute dtype.

Everything here is bound into the jitted step by ``functools.partial`` (hashable frozen
dataclasses), so a change of any field recompiles; nothing here is traced.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from fp8rl_jax.fields import check_field_types
from fp8rl_jax.rl.algos import Correction, KLEstimator, LossAgg


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
        check_field_types(self)
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
    correction_normalize: bool = False  # the correction weights divided by their batch mean (mean 1)
    vf_coef: float = 0.5  # weight of the value loss (only with TrainBatch.returns, i.e. PPO + GAE)
    value_clip: float | None = 0.5  # eps_v of the clipped value loss (verl's cliprange_value); None: unclipped

    def __post_init__(self) -> None:
        check_field_types(self)
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
    logits_chunk: int | None = 1024  # LM head + log-softmax over this many tokens at a time (None: all)
    offload_optimizer: bool = False  # AdamW's moments in host memory, streamed a layer at a time (rl.offload)

    def __post_init__(self) -> None:
        check_field_types(self)
        _check_enum("compute_dtype", self.compute_dtype, ComputeDtype)
        if self.logits_chunk is not None and not (isinstance(self.logits_chunk, int) and self.logits_chunk >= 1):
            raise ValueError(f"logits_chunk must be a positive int or None, got {self.logits_chunk!r}")
        if not isinstance(self.loss, LossConfig) or not isinstance(self.optimizer, OptimizerConfig):
            raise TypeError(f"loss must be a LossConfig and optimizer an OptimizerConfig, got "
                            f"{type(self.loss).__name__} and {type(self.optimizer).__name__}")
        if not (isinstance(self.micro_batches, int) and self.micro_batches >= 1):
            raise ValueError(f"micro_batches must be a positive int, got {self.micro_batches!r}")


__all__ = ["ComputeDtype", "LossConfig", "OptimizerConfig", "Schedule", "TrainerConfig"]
