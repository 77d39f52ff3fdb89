"""The RL run's configuration: one frozen dataclass tree, command-line overrides, sweeps.

``RLConfig`` holds everything a run needs, by section:

    model      ModelConfig (architecture; presets in ``configs/models.py``)
    rollout    RolloutConfig: samples per prompt, sampling, backend; ``rollout.engine`` is the JAX
               engine's whole ``EngineConfig`` (sizing, buckets, swap space, routing recording...)
    algorithm  AlgorithmConfig: advantage estimator (GRPO, Dr.GRPO, PPO's GAE with a value head,
               gamma, lambda) + the loss (``LossConfig``: clipping, aggregation, KL, entropy,
               value loss, rollout correction)
    optimizer  OptimizerConfig: AdamW, schedule, clipping
    trainer    TrainConfig: micro-batches, compute dtype, remat
    precision  PrecisionConfig: rollout FP8 mode, FP8 KV calibration side, FP8 training
    data       DataConfig: prompts per step, steps, evaluation cadence, seeds
    logging    LoggingConfig: output folder, JSONL / TensorBoard / plot, progress bars
    parallel   ParallelConfig: the device mesh of the trainer and the generator's replicas

Presets are module constants in ``configs/``; variants come from ``dataclasses.replace`` or from
``override(cfg, ["rollout.temperature=0.7", "rollout.engine.swap_space_gib=4"])``, which parses
each value by the field's declared type (int, float, bool, str, enums by value or name, tuples as
``1,2``, ``None`` for optional fields) and re-runs every section's validation, so a bad value or
an unknown key fails at start, naming the key (and, for an unknown one, the valid keys nearest
to it). An experiment's config that holds an ``RLConfig`` takes the same keys (its own fields go
by their names). ``sweep(cfg, {"precision.rollout": ["none", "all"]})`` yields the cross product
for notebooks; ``config_keys(cfg)`` lists every key.

Where an RL-level value and an engine field must agree, the RL level sets it
(``ENGINE_FIELDS_FROM_RL``: the rollout precision, the KV calibration side and the compute dtype,
which the vLLM backend and the trainer use too) and ``RLConfig`` validates the rest
(``max_new_tokens`` below ``engine.max_seq_len``, which the model's positions bound; routing
recording only for MoE models on the JAX engine).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import itertools
import types
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from fp8rl_jax.fields import check_field_types
from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.policy import DensePolicy, Fp8Mode, MatmulPolicy
from fp8rl_jax.models.qwen3 import moe_layers
from fp8rl_jax.parallel.mesh import MeshConfig
from fp8rl_jax.quant.training import Fp8TrainPolicy
from fp8rl_jax.rl.algos import AdvantageEstimator
from fp8rl_jax.rl.trainer import ComputeDtype, LossConfig, OptimizerConfig, TrainerConfig
from fp8rl_jax.rollout.config import EngineConfig, KvCalibration
from fp8rl_jax.rollout.sampling import SamplingConfig


class ConfigError(ValueError):
    """A configuration value or override that cannot be used; the message names the field."""


class RolloutBackend(enum.Enum):
    """Which generator samples the rollouts (``fp8rl_jax.rl.generator.make_generator``)."""

    JAX = "jax"  # our JaxEngine (the default)
    VLLM = "vllm"  # vLLM 0.26 in this process (the fp8rl_jax[vllm] extra; one GPU)


# The rollout section's default engine: EngineConfig's defaults but for a wider decode batch and
# prefill call (an RL step generates prompts_per_step x n_samples sequences at once).
DEFAULT_ENGINE = EngineConfig(max_slots=64, prefill_batch=16)

# Engine fields the RL level sets (they apply to either backend, or must match the trainer):
# engine field -> (the RL field to set instead, its value as the engine takes it).
ENGINE_FIELDS_FROM_RL: dict[str, tuple[str, Any]] = {
    "precision": ("precision.rollout", lambda c: c.precision.rollout),
    "kv_calibration": ("precision.kv_calibration", lambda c: c.precision.kv_calibration),
    "dtype": ("trainer.compute_dtype", lambda c: c.trainer.compute_dtype.value),
}


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Generation settings: ``n_samples`` responses per prompt (a GRPO group), sampled at
    ``temperature`` / ``top_p`` / ``top_k`` up to ``max_new_tokens``, by the JAX engine configured
    by ``engine`` (``backend=jax``; every ``EngineConfig`` field: sizing, buckets, swap space,
    routing recording, GEMM choices) or by vLLM with ``vllm_memory`` of the GPU beside JAX's
    ``jax_memory`` (``backend=vllm``, which takes only ``engine.max_seq_len`` as its
    ``max_model_len``).

    ``engine.precision``, ``engine.kv_calibration`` and ``engine.dtype`` are set by the RL level
    (``precision.rollout``, ``precision.kv_calibration``, ``trainer.compute_dtype``: both backends
    and the trainer use them): leave them at their defaults here (or repeat the RL values);
    ``RLConfig.engine_config()`` returns the engine's config with them filled in."""

    n_samples: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 1024
    # free the generator's KV pool and weight copy after each rollout, for the trainer's step
    # (Generator.sleep(weights=True)); the weight sync hands new weights over and the next rollout
    # allocates the pool again (same shape: no recompile). On by default: trainer and generator
    # share the devices, and neither needs the other's memory while it runs
    sleep_while_training: bool = True
    backend: RolloutBackend = RolloutBackend.JAX
    engine: EngineConfig = DEFAULT_ENGINE
    vllm_memory: float = 0.45  # backend vllm: vLLM's gpu_memory_utilization (weights, activations, KV)
    jax_memory: float = 0.45  # backend vllm: XLA_PYTHON_CLIENT_MEM_FRACTION (the trainer), set at start
    vllm_enforce_eager: bool = False  # backend vllm: no CUDA graphs (faster start, slower decode)

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("n_samples", "max_new_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"rollout.{name} must be an int >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.engine, EngineConfig):
            raise ConfigError(f"rollout.engine must be an EngineConfig, got {type(self.engine).__name__}")
        if self.max_new_tokens >= self.engine.max_seq_len:
            raise ConfigError(f"rollout.max_new_tokens = {self.max_new_tokens} leaves no room for a prompt under "
                              f"rollout.engine.max_seq_len = {self.engine.max_seq_len}: raise "
                              "rollout.engine.max_seq_len or lower rollout.max_new_tokens")
        if not (0 < self.vllm_memory < 1 and 0 < self.jax_memory < 1):
            raise ConfigError(f"rollout.vllm_memory and rollout.jax_memory must be in (0, 1), got {self.vllm_memory}, "
                              f"{self.jax_memory}")
        if self.backend is RolloutBackend.VLLM and self.vllm_memory + self.jax_memory > 0.95:
            raise ConfigError(f"rollout.vllm_memory + rollout.jax_memory = {self.vllm_memory + self.jax_memory:.2f} "
                              "leaves less than 5% of the GPU for CUDA contexts and workspaces: lower one of them")
        if self.backend is RolloutBackend.VLLM and self.engine.record_routing:
            raise ConfigError("rollout.engine.record_routing (MoE routing replay) needs rollout.backend=jax: the vLLM "
                              "backend does not record the experts it routes to (set "
                              "rollout.engine.record_routing=false to run without replay)")
        try:
            self.sampling(0)
        except ValueError as e:
            raise ConfigError(f"rollout: {e}") from None

    def sampling(self, seed: int, stop_token_ids: Sequence[int] = ()) -> SamplingConfig:
        """The ``SamplingConfig`` of one rollout sample with sampling seed ``seed``."""
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

    DAPO's overlong handling: ``overlong_buffer`` > 0 adds the soft overlong punishment
    (``algos.overlong_penalty``: 0 until ``rollout.max_new_tokens - overlong_buffer`` tokens, then
    linear down to ``-overlong_penalty`` at the cap) to every response's reward before the advantages;
    ``overlong_filter`` masks truncated responses (no EOS within the cap) out of the loss. Reward metrics
    report the outcome reward, unshaped.
    """

    estimator: AdvantageEstimator = AdvantageEstimator.GRPO
    loss: LossConfig = LossConfig()
    gamma: float = 1.0  # GAE discount
    lam: float = 1.0  # GAE lambda
    whiten_advantages: bool = True  # GAE: (A - mean) / std over the batch's response tokens
    overlong_buffer: int = 0  # tokens before rollout.max_new_tokens over which the length penalty grows (0: off)
    overlong_penalty: float = 1.0  # the length penalty at rollout.max_new_tokens
    overlong_filter: bool = False  # truncated responses are masked out of the loss

    def __post_init__(self) -> None:
        check_field_types(self)
        if not isinstance(self.estimator, AdvantageEstimator):
            raise ConfigError(f"algorithm.estimator must be an AdvantageEstimator, got {self.estimator!r}")
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"algorithm.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.estimator is AdvantageEstimator.GAE and not self.loss.vf_coef > 0:
            raise ConfigError("algorithm.estimator gae trains a value head through algorithm.loss.vf_coef, "
                              f"which must be > 0, got {self.loss.vf_coef}")
        if self.overlong_buffer < 0 or not self.overlong_penalty >= 0:
            raise ConfigError(f"algorithm.overlong_buffer must be >= 0 and algorithm.overlong_penalty >= 0, got "
                              f"{self.overlong_buffer} and {self.overlong_penalty}")

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
    logits_chunk: int | None = 1024  # LM head + log-softmax this many tokens at a time (trainer.head_logprobs)
    offload_optimizer: bool = False  # AdamW's moments in host memory, streamed a layer at a time (one device)

    def __post_init__(self) -> None:
        check_field_types(self)


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """Rollout precision (``Fp8Mode``: none | w8a8 | kv | all), where FP8 KV scales come from after
    each weight sync, and whether the trainer's own GEMMs run in FP8 (end-to-end FP8)."""

    rollout: Fp8Mode = Fp8Mode.ALL
    kv_calibration: KvCalibration = KvCalibration.INFERENCE
    train_fp8: bool = False

    def __post_init__(self) -> None:
        check_field_types(self)


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
        check_field_types(self)
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
        check_field_types(self)
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise ConfigError(f"logging.checkpoint_every must be >= 0 and logging.keep_checkpoints >= 1, got "
                              f"{self.checkpoint_every} and {self.keep_checkpoints}")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How a run spreads over its devices (every local device; every host's under ``jax.distributed``).

    The trainer's state lives on a ``data x fsdp x expert x tensor`` mesh (``parallel.mesh``) with the
    sharding rules its sizes call for (:meth:`mesh_config`); the generator runs as engine replicas
    over the same devices, each ``generator_tensor`` devices wide, and sleeps while the trainer
    steps (``rollout.sleep_while_training``).

    Attributes:
      data, expert, tensor: mesh axis sizes (``parallel.mesh.MeshConfig``).
      fsdp: the FSDP axis size; 0 (the default): every device the other axes leave, so a run uses
        all its devices with no flag.
      generator_tensor: devices per engine replica (tensor parallel inside a replica).
    """

    data: int = 1
    fsdp: int = 0
    expert: int = 1
    tensor: int = 1
    generator_tensor: int = 1

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("data", "expert", "tensor", "generator_tensor"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.fsdp < 0:
            raise ConfigError(f"parallel.fsdp must be >= 0 (0: the devices the other axes leave), got {self.fsdp!r}")

    def mesh_config(self, devices: int) -> MeshConfig:
        """The trainer's mesh over ``devices`` devices; a ``ConfigError`` when the sizes do not multiply to it."""
        fixed = self.data * self.expert * self.tensor * (self.fsdp or 1)
        if self.fsdp == 0 and devices % fixed == 0:
            fsdp = devices // fixed
        elif fixed == devices:
            fsdp = self.fsdp or 1
        else:
            raise ConfigError(f"parallel: data {self.data} x fsdp {self.fsdp or 'auto'} x expert {self.expert} x tensor "
                              f"{self.tensor} does not fit {devices} devices; set parallel.* so that the product is "
                              f"{devices} (parallel.fsdp=0 fills in the rest)")
        if devices % self.generator_tensor:
            raise ConfigError(f"parallel.generator_tensor = {self.generator_tensor} does not divide the {devices} devices")
        return MeshConfig(data=self.data, fsdp=fsdp, expert=self.expert, tensor=self.tensor)

    def generator_replicas(self, devices: int) -> int:
        """How many engine replicas the generator runs on ``devices`` devices (``generator_tensor`` each)."""
        if devices % self.generator_tensor:
            raise ConfigError(f"parallel.generator_tensor = {self.generator_tensor} does not divide the {devices} "
                              "devices")
        return devices // self.generator_tensor


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
    parallel: ParallelConfig = ParallelConfig()
    seed: int = 0

    def __post_init__(self) -> None:
        check_field_types(self)
        engine = self.rollout.engine
        if self.algorithm.overlong_buffer > self.rollout.max_new_tokens:
            raise ConfigError(f"algorithm.overlong_buffer = {self.algorithm.overlong_buffer} exceeds "
                              f"rollout.max_new_tokens = {self.rollout.max_new_tokens} (the penalty grows over the "
                              "last overlong_buffer tokens before the cap): lower algorithm.overlong_buffer, 0 to "
                              "turn it off")
        if engine.max_seq_len > self.model.max_position_embeddings:
            raise ConfigError(f"rollout.engine.max_seq_len = {engine.max_seq_len} exceeds the model's "
                              f"max_position_embeddings = {self.model.max_position_embeddings}")
        if engine.record_routing and not moe_layers(self.model):
            raise ConfigError("rollout.engine.record_routing (MoE routing replay) needs an MoE model; this model has "
                              "no MoE layer (model.num_experts = 0): set rollout.engine.record_routing=false")
        default = EngineConfig()
        for name, (rl_field, value) in ENGINE_FIELDS_FROM_RL.items():
            got, want = getattr(engine, name), value(self)
            if got != want and got != getattr(default, name):
                raise ConfigError(f"rollout.engine.{name} = {_show(got)} disagrees with {rl_field} = {_show(want)}, "
                                  f"which sets it: set {rl_field} instead")
        batch = self.data.prompts_per_step * self.rollout.n_samples
        if batch % self.trainer.micro_batches:
            raise ConfigError(f"trainer.micro_batches = {self.trainer.micro_batches} must divide the batch "
                              f"data.prompts_per_step x rollout.n_samples = {batch}")

    def trainer_config(self) -> TrainerConfig:
        """The trainer's static configuration (loss, optimizer, micro-batches, dtype, remat)."""
        return TrainerConfig(loss=self.algorithm.loss, optimizer=self.optimizer,
                             micro_batches=self.trainer.micro_batches, compute_dtype=self.trainer.compute_dtype,
                             remat=self.trainer.remat, logits_chunk=self.trainer.logits_chunk,
                             offload_optimizer=self.trainer.offload_optimizer)

    def train_policy(self) -> MatmulPolicy:
        """The trainer's matmul policy: FP8 GEMMs forward and backward with ``precision.train_fp8``
        (``fp8rl_jax.quant.training.Fp8TrainPolicy``), else dense in the compute dtype."""
        dtype = self.trainer.compute_dtype.value
        if self.precision.train_fp8:
            return Fp8TrainPolicy.for_model(self.model, dtype)
        return DensePolicy(dtype)

    def engine_config(self) -> EngineConfig:
        """The JAX engine's config: ``rollout.engine`` with the fields the RL level sets
        (``ENGINE_FIELDS_FROM_RL``: rollout precision, KV calibration side, compute dtype) filled in."""
        return dataclasses.replace(self.rollout.engine,
                                   **{name: value(self) for name, (_, value) in ENGINE_FIELDS_FROM_RL.items()})

    @property
    def out_dir(self) -> Path:
        return Path(self.logging.out_dir)


# ------------------------------------------------------------------------------------ overrides


def _show(value: Any) -> str:
    return str(value.value) if isinstance(value, enum.Enum) else repr(value)


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
        if args and args[-1] is not Ellipsis and len(items) != len(args):
            raise ConfigError(f"{where}: {text!r} is not a tuple of {len(args)} values (e.g. 1,2)")
        inner = list(args[:-1] if args and args[-1] is Ellipsis else args) or [str]
        return tuple(_parse(t, inner[min(i, len(inner) - 1)], where) for i, t in enumerate(items))
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


def config_keys(cfg: Any, prefix: str = "") -> list[str]:
    """Every settable dotted key of a config tree (leaf fields; nested dataclasses are descended)."""
    keys = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            keys += config_keys(value, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _rl_field(cfg: Any) -> str | None:
    """The field of an experiment's config that holds its ``RLConfig`` (None for an RLConfig itself)."""
    if isinstance(cfg, RLConfig):
        return None
    return next((f.name for f in dataclasses.fields(cfg) if isinstance(getattr(cfg, f.name), RLConfig)), None)


def _path(cfg: Any, key: str, where: str) -> list[str]:
    """``key`` as a field path into ``cfg``. Keys are the same everywhere: an RL key
    (``rollout.n_samples``) sets the RL config also inside an experiment's config, whose own fields
    go by their names (``sft_steps``); the full path (``rl.rollout.n_samples``) works too."""
    path = key.strip().split(".")
    rl = _rl_field(cfg)
    own = {f.name for f in dataclasses.fields(cfg)}
    if rl is not None and path[0] not in own and path[0] in {f.name for f in dataclasses.fields(RLConfig)}:
        path = [rl, *path]
    rl_path = path[1:] if rl is not None and path[0] == rl else path
    if rl is not None or isinstance(cfg, RLConfig):
        if len(rl_path) == 3 and rl_path[:2] == ["rollout", "engine"] and rl_path[2] in ENGINE_FIELDS_FROM_RL:
            raise ConfigError(f"{where}: the engine's {rl_path[2]} is set by "
                              f"{ENGINE_FIELDS_FROM_RL[rl_path[2]][0]}: set that instead")
    return path


def _unknown(cfg: Any, key: str, where: str) -> ConfigError:
    """The error for a key that names no field, with the valid keys nearest to it."""
    rl = _rl_field(cfg)
    keys = config_keys(cfg)
    if rl is not None:  # RL keys go without the prefix
        keys = [k[len(rl) + 1:] if k.startswith(f"{rl}.") else k for k in keys]
    keys = [k for k in keys if not (k.startswith("rollout.engine.") and k[15:] in ENGINE_FIELDS_FROM_RL)]  # RL-set
    key = key.strip()
    if rl is not None and key.startswith(f"{rl}."):
        key = key[len(rl) + 1:]
    leaf = key.rsplit(".", 1)[-1]
    near = [k for k in keys if k.rsplit(".", 1)[-1] == leaf] or difflib.get_close_matches(key, keys, n=3, cutoff=0.8)
    parent = key.rsplit(".", 1)[0] + "." if "." in key else ""
    siblings = sorted({k[len(parent):].split(".", 1)[0] for k in keys if k.startswith(parent)})
    hint = f"did you mean {' or '.join(near)}? " if near else ""
    where_ = f"{parent[:-1]} has" if parent and siblings else "valid keys start with"
    if not siblings:
        siblings = sorted({k.split(".", 1)[0] for k in keys})
    return ConfigError(f"{where}: unknown key {key!r}; {hint}{where_} {', '.join(siblings)}")


class _UnknownField(Exception):
    pass


def _set(obj: Any, path: Sequence[str], value: Any, where: str) -> Any:
    """``obj`` with the field at ``path`` replaced; a ``str`` value for a field of another type is
    parsed by the field's declared type (the command-line form); validation errors name ``where``."""
    if not dataclasses.is_dataclass(obj):
        raise _UnknownField
    name = path[0]
    types_ = typing.get_type_hints(type(obj))
    if name not in types_ or name not in {f.name for f in dataclasses.fields(obj)}:
        raise _UnknownField
    if len(path) > 1:
        value = _set(getattr(obj, name), path[1:], value, where)
    elif dataclasses.is_dataclass(getattr(obj, name)) and isinstance(value, str):
        raise ConfigError(f"{where}: is a section; set one of its fields ({where.split()[-1]}.FIELD=VALUE)")
    elif isinstance(value, str) and types_[name] is not str:
        value = _parse(value, types_[name], where)
    try:
        return dataclasses.replace(obj, **{name: value})
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where}: {e}") from None


def set_field(cfg: Any, key: str, value: Any, where: str | None = None) -> Any:
    """``cfg`` with the field at dotted ``key`` set to ``value`` (a string is parsed by the field's
    type); every section on the way is validated again. Raises ``ConfigError`` naming the key."""
    where = where or f"--set {key.strip()}"
    try:
        return _set(cfg, _path(cfg, key, where), value, where)
    except _UnknownField:
        raise _unknown(cfg, key, where) from None


def override(cfg: Any, assignments: Iterable[str]) -> Any:
    """Applies ``key=value`` assignments (``rollout.temperature=0.7``,
    ``rollout.engine.swap_space_gib=4``; see ``_path`` for experiment configs); the last one of a
    key wins. Their order does not matter otherwise: one that fails a check across fields (e.g.
    ``rollout.backend=vllm`` before ``rollout.engine.record_routing=false``) is retried after the
    others, and the first error raised when no assignment goes through."""
    last: dict[str, str] = {}
    for a in assignments:
        if "=" not in a:
            raise ConfigError(f"override {a!r} is not of the form section.field=value")
        key, text = a.split("=", 1)
        last.pop(key.strip(), None)
        last[key.strip()] = text.strip()
    pending = list(last.items())
    while pending:
        failed = []
        for key, text in pending:
            try:
                cfg = set_field(cfg, key, text)
            except ConfigError as e:
                failed.append((key, text, e))
        if len(failed) == len(pending):
            raise failed[0][2]
        pending = [(key, text) for key, text, _ in failed]
    return cfg


def sweep(cfg: Any, grid: Mapping[str, Sequence[Any]]) -> Iterator[Any]:
    """Every combination of ``grid`` (``{"section.field": [values...]}``) applied to ``cfg``;
    values may be strings (parsed like overrides) or already typed."""
    keys = list(grid)
    for combo in itertools.product(*(grid[k] for k in keys)):
        c = cfg
        for k, v in zip(keys, combo):
            c = set_field(c, k, v, f"sweep {k}")
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
