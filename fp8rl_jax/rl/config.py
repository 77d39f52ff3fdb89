"""The RL run's configuration: one frozen dataclass tree, command-line overrides, sweeps.

``RLConfig`` holds everything a run needs, by section:

    model      ModelConfig (architecture; presets in ``configs/models.py``)
    rollout    RolloutConfig: samples per prompt, sampling, engine sizing
    algorithm  AlgorithmConfig: advantage estimator (GRPO, Dr.GRPO, PPO's GAE with a value head,
               gamma, lambda) + the loss (``LossConfig``: clipping, aggregation, KL, entropy,
               value loss, rollout correction)
    optimizer  OptimizerConfig: AdamW, schedule, clipping
    trainer    TrainConfig: micro-batches, compute dtype, remat
    precision  PrecisionConfig: rollout FP8 mode, FP8 KV calibration side, FP8 training
    data       DataConfig: prompts per step, steps, evaluation cadence, seeds
    logging    LoggingConfig: output folder, JSONL / TensorBoard / plot, progress bars

Presets are module constants in ``configs/``; variants come from ``dataclasses.replace`` or
from ``override(cfg, ["rollout.temperature=0.7", "precision.rollout=all"])``, which parses each
value by the field's declared type (int, float, bool, str, enums by value or name, tuples,
``None`` for optional fields) and re-runs every section's validation, so a bad value fails at
start with the field's name. ``sweep(cfg, {"precision.rollout": ["none", "all"]})`` yields the
cross product for notebooks.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import types
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.policy import DensePolicy, Fp8Mode, MatmulPolicy
from fp8rl_jax.rl.algos import AdvantageEstimator
from fp8rl_jax.rl.trainer import ComputeDtype, LossConfig, OptimizerConfig, TrainerConfig
from fp8rl_jax.rollout.config import EngineConfig, KvCalibration
from fp8rl_jax.rollout.sampling import Draw, SamplingConfig


class ConfigError(ValueError):
    """A configuration value or override that cannot be used; the message names the field."""


class RolloutBackend(enum.Enum):
    """Which generator samples the rollouts (``fp8rl_jax.rl.generator.make_generator``)."""

    JAX = "jax"  # our JaxEngine (the default)
    VLLM = "vllm"  # vLLM 0.26 in this process (the fp8rl_jax[vllm] extra; one GPU)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Generation settings: ``n_samples`` responses per prompt (a GRPO group), sampled at
    ``temperature`` / ``top_p`` / ``top_k`` up to ``max_new_tokens``, on a JAX engine with
    ``max_slots`` decode slots, ``page_size``-token KV pages and a KV budget of ``kv_budget_gib``
    (``backend=jax``), or on vLLM with ``vllm_memory`` of the GPU beside JAX's ``jax_memory``
    (``backend=vllm``; the engine sizing fields do not apply to it)."""

    n_samples: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 1024
    max_seq_len: int = 4096
    max_slots: int = 64
    page_size: int = 16
    kv_budget_gib: float = 1.0
    kv_budget_fraction: float = 0.0  # > 0: this fraction of the device memory left after the weights (GPU)
    steps_per_call: int = 8
    prefill_batch: int = 16
    stall_timeout_s: float = 0.0  # > 0: exit (code 3) when generation stops progressing this long
    sampling_draw: Draw = Draw.INVERSE_CDF  # the JAX engine's draw (EngineConfig.sampling_draw): gumbel | inverse_cdf
    # free the engine's KV pool and weight copy after each rollout, for the trainer's step
    # (JaxEngine.sleep(weights=True)); the weight sync hands new weights over and the next rollout
    # allocates the pool again (same shape: no recompile)
    sleep_while_training: bool = False
    backend: RolloutBackend = RolloutBackend.JAX
    vllm_memory: float = 0.45  # backend vllm: vLLM's gpu_memory_utilization (weights, activations, KV)
    jax_memory: float = 0.45  # backend vllm: XLA_PYTHON_CLIENT_MEM_FRACTION (the trainer), set at start
    vllm_enforce_eager: bool = False  # backend vllm: no CUDA graphs (faster start, slower decode)

    def __post_init__(self) -> None:
        for name in ("n_samples", "max_new_tokens", "max_seq_len", "max_slots", "page_size", "steps_per_call",
                     "prefill_batch"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"rollout.{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.kv_budget_gib <= 0:
            raise ConfigError(f"rollout.kv_budget_gib must be > 0, got {self.kv_budget_gib}")
        if not 0 <= self.kv_budget_fraction <= 1:
            raise ConfigError(f"rollout.kv_budget_fraction must be in [0, 1], got {self.kv_budget_fraction}")
        if not self.stall_timeout_s >= 0:
            raise ConfigError(f"rollout.stall_timeout_s must be >= 0 (0: off), got {self.stall_timeout_s}")
        if not (0 < self.vllm_memory < 1 and 0 < self.jax_memory < 1):
            raise ConfigError(f"rollout.vllm_memory and rollout.jax_memory must be in (0, 1), got {self.vllm_memory}, "
                              f"{self.jax_memory}")
        if self.backend is RolloutBackend.VLLM and self.vllm_memory + self.jax_memory > 0.95:
            raise ConfigError(f"rollout.vllm_memory + rollout.jax_memory = {self.vllm_memory + self.jax_memory:.2f} "
                              "leaves less than 5% of the GPU for CUDA contexts and workspaces: lower one of them")
        try:
            self.sampling(0)
        except ValueError as e:
            raise ConfigError(f"rollout: {e}") from None


    def sampling(self, seed: int, stop_token_ids: Sequence[int] = ()) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_tokens=self.max_new_tokens, stop_token_ids=tuple(stop_token_ids), seed=seed)


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """How advantages are estimated and what loss they feed.

    ``estimator = gae`` is PPO with a value head on the policy's trunk (``trainer.PolicyValueParams``):
    the outcome reward goes on the last response token (``algos.outcome_to_token_rewards``), the
    trainer's forward gives ``V_old``, and ``algos.gae_advantages`` with ``gamma`` / ``lam`` gives
    advantages and returns; ``whiten_advantages`` then normalizes the advantages to mean 0, std 1
    over the batch's response tokens (PPO's whitening). The value loss weight and clip are
    ``loss.vf_coef`` / ``loss.value_clip``. ``gamma``, ``lam`` and ``whiten_advantages`` are unused
    by the GRPO estimators.
    """

    estimator: AdvantageEstimator = AdvantageEstimator.GRPO
    loss: LossConfig = LossConfig()
    gamma: float = 1.0  # GAE discount
    lam: float = 1.0  # GAE lambda
    whiten_advantages: bool = True  # GAE: (A - mean) / std over the batch's response tokens

    def __post_init__(self) -> None:
        if not isinstance(self.estimator, AdvantageEstimator):
            raise ConfigError(f"algorithm.estimator must be an AdvantageEstimator, got {self.estimator!r}")
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"algorithm.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.estimator is AdvantageEstimator.GAE and not self.loss.vf_coef > 0:
            raise ConfigError("algorithm.estimator gae trains a value head through algorithm.loss.vf_coef, "
                              f"which must be > 0, got {self.loss.vf_coef}")

    @property
    def uses_value_head(self) -> bool:
        """Whether the trainer needs a value head (``trainer.with_value_head``): GAE only."""
        return self.estimator is AdvantageEstimator.GAE


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The static parts of a train step besides loss and optimizer (``TrainerConfig``)."""

    micro_batches: int = 1
    compute_dtype: ComputeDtype = ComputeDtype.BFLOAT16
    remat: bool = False
    logits_chunk: int | None = 1024  # LM head + log-softmax this many positions at a time (trainer.head_logprobs)


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """Rollout precision (``Fp8Mode``: none | w8a8 | kv | all), where FP8 KV scales come from after
    each weight sync, and whether the trainer's own GEMMs run in FP8 (end-to-end FP8)."""

    rollout: Fp8Mode = Fp8Mode.ALL
    kv_calibration: KvCalibration = KvCalibration.INFERENCE
    train_fp8: bool = False


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Which prompts, how many per step, for how long; evaluation cadence."""

    train_path: str | None = None  # jsonl / parquet of prompts with answers (None: the script's built-in task)
    eval_path: str | None = None
    prompts_per_step: int = 32
    steps: int = 100
    eval_every: int = 10  # 0: never
    eval_samples: int = 1  # k samples per evaluation prompt (mean accuracy over k)
    eval_prompts: int = 0  # 0: all
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "steps", "eval_samples"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"data.{name} must be an int >= 1, got {getattr(self, name)!r}")
        for name in ("eval_every", "eval_prompts"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ConfigError(f"data.{name} must be an int >= 0, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Where metrics go: ``out_dir/metrics.jsonl`` always; TensorBoard event files and a PNG
    plot when asked (and the packages are installed); progress bars on a terminal."""

    out_dir: str = "runs/rl"
    tensorboard: bool = True
    plot: bool = True
    progress: bool = True
    checkpoint_every: int = 0  # 0: no checkpoints
    keep_checkpoints: int = 2

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise ConfigError(f"logging.checkpoint_every must be >= 0 and logging.keep_checkpoints >= 1, got "
                              f"{self.checkpoint_every} and {self.keep_checkpoints}")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """One RL run. Sections as in the module docstring; ``seed`` seeds params init and sampling."""

    model: ModelConfig
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    trainer: TrainConfig = TrainConfig()
    precision: PrecisionConfig = PrecisionConfig()
    data: DataConfig = DataConfig()
    logging: LoggingConfig = LoggingConfig()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rollout.max_seq_len > self.model.max_position_embeddings:
            raise ConfigError(f"rollout.max_seq_len = {self.rollout.max_seq_len} exceeds the model's "
                              f"max_position_embeddings = {self.model.max_position_embeddings}")
        batch = self.data.prompts_per_step * self.rollout.n_samples
        if batch % self.trainer.micro_batches:
            raise ConfigError(f"trainer.micro_batches = {self.trainer.micro_batches} must divide the batch "
                              f"data.prompts_per_step x rollout.n_samples = {batch}")

    def trainer_config(self) -> TrainerConfig:
        return TrainerConfig(loss=self.algorithm.loss, optimizer=self.optimizer,
                             micro_batches=self.trainer.micro_batches, compute_dtype=self.trainer.compute_dtype,
                             remat=self.trainer.remat, logits_chunk=self.trainer.logits_chunk)

    def train_policy(self) -> MatmulPolicy:
        """The trainer's matmul policy: FP8 GEMMs forward and backward with ``precision.train_fp8``
        (``fp8rl_jax.quant.training.Fp8TrainPolicy``), else dense in the compute dtype."""
        dtype = self.trainer.compute_dtype.value
        if self.precision.train_fp8:
            from fp8rl_jax.quant.training import Fp8TrainPolicy

            return Fp8TrainPolicy.for_model(self.model, dtype)
        return DensePolicy(dtype)

    def engine_config(self) -> EngineConfig:
        r = self.rollout
        return EngineConfig(max_slots=r.max_slots, page_size=r.page_size, kv_budget_gib=r.kv_budget_gib,
                            kv_budget_fraction=r.kv_budget_fraction,
                            max_seq_len=r.max_seq_len, steps_per_call=r.steps_per_call,
                            prefill_batch=r.prefill_batch, precision=self.precision.rollout,
                            dtype=self.trainer.compute_dtype.value, kv_calibration=self.precision.kv_calibration,
                            stall_timeout_s=r.stall_timeout_s, sampling_draw=r.sampling_draw)

    @property
    def out_dir(self) -> Path:
        return Path(self.logging.out_dir)


# ------------------------------------------------------------------------------------ overrides


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _parse(text: str, tp: Any, where: str) -> Any:
    """``text`` as a value of the annotated type ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if text.lower() == "none" and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _parse(text, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError("; ".join(errors))
    if origin is tuple:
        items = [t for t in (s.strip() for s in text.strip("()[]").split(",")) if t]
        inner = args[0] if args else str
        return tuple(_parse(t, inner, where) for t in items)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        for m in tp:
            if text in (m.value, m.name) or text.lower() in (str(m.value).lower(), m.name.lower()):
                return m
        raise ConfigError(f"{where}: {text!r} is not one of {[m.value for m in tp]}")
    if tp is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: {text!r} is not a bool (true/false)")
    if tp in (int, float, str):
        try:
            return tp(text)
        except ValueError:
            raise ConfigError(f"{where}: {text!r} is not a valid {tp.__name__}") from None
    raise ConfigError(f"{where}: fields of type {tp} cannot be set from the command line")


def _set(obj: Any, path: Sequence[str], value: Any, where: str) -> Any:
    """``obj`` with the field at ``path`` replaced; a ``str`` value for a field of another type is
    parsed by the field's declared type (the command-line form); validation errors name ``where``."""
    if not dataclasses.is_dataclass(obj):
        raise ConfigError(f"{where}: {type(obj).__name__} has no fields")
    name = path[0]
    types_ = _field_types(type(obj))
    if name not in types_:
        raise ConfigError(f"{where}: unknown field {name!r}; {type(obj).__name__} has {sorted(types_)}")
    if len(path) > 1:
        value = _set(getattr(obj, name), path[1:], value, where)
    elif isinstance(value, str) and types_[name] is not str:
        value = _parse(value, types_[name], where)
    try:
        return dataclasses.replace(obj, **{name: value})
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where}: {e}") from None


def override(cfg: RLConfig, assignments: Iterable[str]) -> RLConfig:
    """Applies ``section.field=value`` assignments (nested fields with more dots) in order."""
    for a in assignments:
        if "=" not in a:
            raise ConfigError(f"override {a!r} is not of the form section.field=value")
        key, text = a.split("=", 1)
        cfg = _set(cfg, key.strip().split("."), text.strip(), f"--set {key.strip()}")
    return cfg


def sweep(cfg: RLConfig, grid: Mapping[str, Sequence[Any]]) -> Iterator[RLConfig]:
    """Every combination of ``grid`` (``{"section.field": [values...]}``) applied to ``cfg``;
    values may be strings (parsed like overrides) or already typed."""
    keys = list(grid)
    for combo in itertools.product(*(grid[k] for k in keys)):
        c = cfg
        for k, v in zip(keys, combo):
            c = _set(c, k.split("."), v, f"sweep {k}")
        yield c


def to_dict(cfg: Any) -> Any:
    """A JSON-ready view of a config tree (enums by value, tuples as lists)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, enum.Enum):
        return cfg.value
    if isinstance(cfg, (tuple, list, frozenset, set)):
        return [to_dict(x) for x in cfg]
    return cfg
