"""One Qwen3 / Qwen3-MoE model definition shared by the trainer and the generator."""

from fp8rl_jax.models.calibration import calibrate_kv_scales, calibrate_kv_scales_jit, calibration_batch
from fp8rl_jax.models.config import ConfigError, ModelConfig
from fp8rl_jax.models.kv_cache import HeadSharding, KVCache, PagedKVCache
from fp8rl_jax.models.policy import DensePolicy, Fp8Mode, MatmulPolicy, Proj, Site
from fp8rl_jax.models.qwen3 import (
    Qwen3,
    abstract_params,
    bind,
    count_params,
    forward,
    graphdef,
    init_params,
)

__all__ = [
    "ConfigError",
    "DensePolicy",
    "Fp8Mode",
    "HeadSharding",
    "KVCache",
    "PagedKVCache",
    "MatmulPolicy",
    "ModelConfig",
    "Proj",
    "Qwen3",
    "Site",
    "abstract_params",
    "bind",
    "calibrate_kv_scales",
    "calibrate_kv_scales_jit",
    "calibration_batch",
    "count_params",
    "forward",
    "graphdef",
    "init_params",
]
