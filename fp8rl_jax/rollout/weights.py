"""Weight updates of the engine: the trainer's params -> the generator's layout and precision.

`WeightSync` checks the incoming params against the model (shapes, once per input signature), fuses
projections (q/k/v as one GEMM, MLP gate/up as one; ``EngineConfig.fuse_projections``), quantizes
to block FP8 for W8A8, and with a tensor mesh reshards them onto the engine's mesh first (one jitted
program for every array) and quantizes each shard where it lives (block-aligned specs: no collective,
bitwise equal to unsharded). `generator_policy` is the matching matmul policy.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

import jax
from flax import nnx

from fp8rl_jax.models import DensePolicy, ModelConfig, abstract_params
from fp8rl_jax.models.fusion import concat_parts, fuse_params
from fp8rl_jax.models.policy import Kernels
from fp8rl_jax.numerics.fp8 import QuantizedWeight
from fp8rl_jax.parallel import ShardingPreset, param_shardings, plan_params
from fp8rl_jax.quant.policy import LayerPolicy, W8A8Policy, WeightSharding, quantize_params, quantizing_concat
from fp8rl_jax.rollout.config import EngineConfig

PRESET = ShardingPreset.TENSOR_PARALLEL  # the layout of a tensor-parallel engine's params


def generator_policy(config: EngineConfig, mesh: jax.sharding.Mesh | None = None, params: Any = None) -> Any:
    """The engine's matmul policy: W8A8 (block-FP8 weights) or dense in ``config.dtype``. On one device the
    BF16 MoE experts run the Pallas grouped GEMM and the norms the add + RMSNorm kernel (XLA cannot
    partition a Pallas call, so a sharded engine keeps the jnp ops); with a mesh, W8A8's Pallas GEMMs run per
    weight shard of ``params`` (``shard_map``), as XLA would gather their operands."""
    if not config.precision.fp8_weights:
        one = Kernels.AUTO if mesh is None else Kernels.REFERENCE
        return DensePolicy(config.dtype, ragged_kernels=one, fused_cast=config.fused_cast, norm_kernels=one)
    policy = W8A8Policy(config.dtype, group_size=config.fp8_block[1], gemm=config.fp8_gemm,
                        fused_cast=config.fused_cast)
    if mesh is not None and params is not None:
        policy = dataclasses.replace(policy, sharding=WeightSharding.of_params(params, mesh))
    return policy


class WeightSync:
    """Turns the trainer's params into the generator's (module note); ``last_sync`` and ``reshard_path``
    describe the last update on a mesh."""

    def __init__(self, model_config: ModelConfig, config: EngineConfig, mesh: jax.sharding.Mesh | None = None):
        self.model_config = model_config
        self.mesh = mesh
        fp8 = config.precision.fp8_weights
        self.fused = config.fuse_projections if config.fuse_projections is not None else mesh is None
        if self.fused and mesh is not None:
            raise ValueError("EngineConfig.fuse_projections is for one device: tensor parallelism splits q/k/v by "
                             "heads, not their concatenation")
        # FP8 quantization and/or fusion (None: params are used as given)
        self.prepare = prepare_fn(model_config, tuple(config.fp8_block), fp8, self.fused,
                                  experts=fp8 or config.fuse_projections is True)
        if self.prepare is not None and mesh is None:  # (a mesh's prepare runs per shard, on local shapes)
            self.prepare = checked_prepare(self.prepare, model_config)
        self._sharded_quantize = None  # with a mesh: `prepare` jitted to the generator's layout
        self._reshard = None  # with a mesh: (params key, shardings, jitted reshard into the generator's layout)
        self.reshard_path = ""  # with a mesh: how the last update moved the params ("jit" or "device_put")
        self.last_sync: dict[str, float] = {}  # with a mesh: seconds of the last update's reshard and quantize

    @property
    def replaces(self) -> bool:
        """Whether the generator's params are a new copy built on one device: the caller drops the previous
        copy first (peak memory: one copy, not two)."""
        return self.mesh is None and self.prepare is not None

    def __call__(self, params: Any) -> Any:
        """The generator's params for ``params`` (``ValueError`` on a parameter missing or misshapen)."""
        if self.mesh is not None:
            return self._sharded(params)
        if self.prepare is None:
            check_params(self.model_config, params)
            return params
        return self.prepare(params)  # checks the params when it traces a new signature

    def _sharded(self, params: Any) -> Any:
        t0 = time.perf_counter()
        key = jax.tree.structure(params), tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(params))
        if self._reshard is None or self._reshard[0] != key:
            check_params(self.model_config, params)  # once per signature, before the weights are replaced
            shardings = param_shardings(params, self.model_config, self.mesh, PRESET)
            # one compiled program moves every array (device_put reshards leaf by leaf: one
            # transfer program per array, ~400 for a Qwen3)
            self._reshard = key, shardings, jax.jit(lambda p: p, out_shardings=shardings)
        _, shardings, reshard = self._reshard
        self.reshard_path = "jit" if on_devices(params, set(self.mesh.devices.flat)) else "device_put"
        if self.reshard_path == "jit":
            placed = jax.block_until_ready(reshard(params))
        else:  # host arrays, or arrays on other devices: transferred leaf by leaf
            placed = jax.block_until_ready(jax.device_put(params, shardings))
        t1 = time.perf_counter()
        out = placed
        if self.prepare is not None:
            if self._sharded_quantize is None:  # built once: the output layout is the generator's
                self._sharded_quantize = shard_local_quantize(self.prepare, placed, self.model_config, self.mesh)
            out = jax.block_until_ready(self._sharded_quantize(placed))
        self.last_sync = {"reshard_s": t1 - t0, "quantize_s": time.perf_counter() - t1}
        return out


def on_devices(params: Any, devices: set) -> bool:
    """Whether every leaf is a jax.Array living only on ``devices`` (a jitted reshard can take it)."""
    leaves = jax.tree.leaves(params)
    return bool(leaves) and all(isinstance(x, jax.Array) and x.sharding.device_set <= devices for x in leaves)


def shard_local_quantize(quantize: Callable[[Any], Any], placed: Any, model_config: ModelConfig,
                         mesh: jax.sharding.Mesh) -> Callable[[Any], Any]:
    """``quantize`` (params -> params with ``QuantizedWeight``s) jitted to the generator's layout.

    Where every quantized weight keeps its dense spec (block-aligned shards: the TP preset on
    Qwen3 shapes), it runs per shard under ``shard_map``: the Pallas quantization kernel (the GPU
    path) is a custom call XLA cannot partition, so a plain sharded jit would all-gather every
    weight to every device, quantize all of it there and keep one slice. Otherwise (a spec that
    only the FP8 blocks change) the plain jit with output shardings."""
    abstract = jax.eval_shape(quantize, placed)
    in_specs = plan_params(placed, model_config, mesh, PRESET).specs
    out_specs = plan_params(abstract, model_config, mesh, PRESET).specs
    ins = dict(nnx.to_flat_state(in_specs))
    aligned = all(
        (o.q == o.scale_inv == ins[path].get_value()) if isinstance(o, QuantizedWeight) else o == ins[path].get_value()
        for path, var in nnx.to_flat_state(out_specs) for o in [var.get_value()])
    if not aligned:
        return jax.jit(quantize, out_shardings=param_shardings(abstract, model_config, mesh, PRESET))
    return jax.jit(jax.shard_map(quantize, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs, check_vma=False))


@functools.lru_cache(maxsize=32)
def _param_shapes(model_config: ModelConfig) -> dict[tuple, tuple[int, ...]]:
    return {tuple(p): tuple(v.get_value().shape) for p, v in nnx.to_flat_state(abstract_params(model_config))}


def check_params(model_config: ModelConfig, params: Any) -> None:
    """The input check of a weight update (shapes only, host values or tracers): an ``nnx.State`` must hold
    every parameter of ``model_config`` in the Hugging Face layout (dense of any float dtype, or FP8
    ``QuantizedWeight``), else a ``ValueError`` names the first one missing or misshapen. Flattening the
    State costs milliseconds at 8B scale, so the jitted paths run it once per input signature
    (`checked_prepare`, the mesh's reshard), not on every sync. Other pytrees pass as given."""
    if not isinstance(params, nnx.State):
        return
    got = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(params)}
    for path, shape in _param_shapes(model_config).items():
        name = ".".join(map(str, path))
        if path not in got:
            raise ValueError(f"update_weights: parameter {name} is missing (expected shape {shape})")
        have = tuple(getattr(got[path], "shape", ()))
        if have != shape:
            raise ValueError(f"update_weights: parameter {name} has shape {have}, the model expects {shape}")


@functools.lru_cache(maxsize=32)
def checked_prepare(prepare: Callable[[Any], Any], model_config: ModelConfig) -> Callable[[Any], Any]:
    """``prepare`` jitted behind `check_params`, which runs at trace time: once per input signature, and
    again for any params of another structure or shape."""

    def run(params):
        check_params(model_config, params)
        return prepare(params)

    return jax.jit(run)


@functools.lru_cache(maxsize=32)
def prepare_fn(model_config: ModelConfig, block: tuple[int, int], fp8: bool, fused: bool, experts: bool = True):
    """The trainer's params -> the generator's layout (FP8 quantization and/or projection fusion), jitted once
    per setting and shared by engines (None: params are used as given). ``experts``: fuse the MoE experts'
    gate/up too (else only q/k/v and the dense MLPs' gate/up)."""
    layer_policy = LayerPolicy(block_size=block)
    quantize = functools.partial(quantize_params, config=model_config, layer_policy=layer_policy)
    if fp8 and fused:  # the fused parts quantized straight into their concatenation (no copy)
        concat = functools.partial(quantizing_concat, config=model_config, layer_policy=layer_policy)
        return jax.jit(lambda p: quantize(fuse_params(p, concat=concat)))
    if fp8:
        return jax.jit(quantize)
    if not fused:
        return None
    return jax.jit(fuse_params if experts else functools.partial(fuse_params, concat=_dense_concat))


def _dense_concat(parts: list, paths: list) -> Any:
    """`fuse_params`' concat that keeps the MoE experts' gate/up separate."""
    return None if "experts" in paths[0] else concat_parts(parts)
