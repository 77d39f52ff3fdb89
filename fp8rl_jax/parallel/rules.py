"""Logical axes of every parameter, and the presets that map them onto the mesh.

Design note
-----------
* **Logical axes from the path.** Every parameter dimension is named in the model's one-letter
  vocabulary (``fp8rl_jax.models.config``): ``V`` vocab, ``D`` model dim, ``F`` dense FFN, ``I``
  expert FFN, ``E`` experts, ``H`` head dim, and the fused projection dims ``NH`` (``N`` query
  heads x ``H``, head-major, as in ``q_proj`` ``[N*H, D]``) and ``KH`` (``K`` kv heads x ``H``).
  The names come from the parameter path through one declarative table, ``PARAM_AXES`` (keyed by
  the path without the layer index), the sharding twin of ``checkpoint.param_table``; a path the
  table does not know, or a shape that disagrees with the config, raises ``ShardingError``, so a
  new parameter cannot silently stay unsharded. An FP8 ``QuantizedWeight`` leaf gets the axes of
  the weight it replaces on both ``q`` and ``scale_inv`` (whose last two dims count blocks).
* **Rules, then FSDP.** A preset is a ``ShardingRules``: fixed logical -> mesh assignments first
  (Megatron tensor parallelism: ``NH``/``KH``/``F``/``I``/``V`` over ``tensor``, so q/k/v/gate/up
  and the lm_head are column-parallel and o/down row-parallel; expert parallelism: ``E`` over
  ``expert``), then, with ``fsdp``, each array's largest dimension not sharded yet that divides the
  ``fsdp`` axis (ties broken by ``FSDP_PRIORITY``). Rules combine with ``|`` (FSDP + TP, EP + FSDP).
  The ``data`` axis never shards a parameter; batches split over every axis but ``tensor``.
* **Divisibility units.** A dimension of size ``n`` split over ``m`` devices needs
  ``n % (m * u) == 0`` for its unit ``u``: whole heads (``u = H``) for ``NH``/``KH`` under the fixed
  rules, so a tensor shard holds complete heads (``N % m == 0``); the FP8 block for the last two
  dims of a ``QuantizedWeight``, so every ``scale_inv`` entry belongs to exactly one shard, ``q``
  and ``scale_inv`` get the same spec, and re-quantizing a shard needs nothing from its
  neighbours; 1 otherwise. A rule that cannot be honoured falls back to replication along that
  mesh axis. Each fallback is a ``Fallback`` record in the plan and one ``ShardingFallbackWarning``
  (or a ``ShardingError`` with ``strict=True``) naming the parameter, its shape, the logical axis
  and the mesh axis. Example: Qwen3-30B-A3B has ``K = 4`` kv heads, so ``tensor = 8`` replicates
  k/v_proj (what Megatron does too) and says so.
* **Optimizer state follows the parameters.** Any optimizer-state leaf whose key path ends with
  a parameter's key path and has its shape (Adam's ``mu``/``nu``, whatever the optax chain nests
  them in) gets that parameter's spec; every other leaf (counts, schedule state) is replicated.
* Specs are computed from axis sizes alone (``MeshConfig`` or a ``Mesh``), so full-size plans are
  checked with ``jax.eval_shape`` parameters and no devices.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import warnings
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.qwen3 import abstract_params
from fp8rl_jax.numerics.fp8 import QuantizedWeight
from fp8rl_jax.parallel.mesh import MeshAxis, MeshConfig, mesh_sizes

LogicalAxes = tuple[str, ...]

# The logical axis names (one letter, or two for a fused heads x head-dim projection dim).
LOGICAL_AXES = ("V", "D", "F", "I", "E", "H", "NH", "KH")

# Parameter path (without "layers", i) -> logical axes of its dims. Weights are [out, in] (HF).
PARAM_AXES: dict[tuple[str, ...], LogicalAxes] = {
    ("embed_tokens", "weight"): ("V", "D"),
    ("lm_head", "weight"): ("V", "D"),
    ("norm", "weight"): ("D",),
    ("input_layernorm", "weight"): ("D",),
    ("post_attention_layernorm", "weight"): ("D",),
    ("self_attn", "q_proj", "weight"): ("NH", "D"),
    ("self_attn", "k_proj", "weight"): ("KH", "D"),
    ("self_attn", "v_proj", "weight"): ("KH", "D"),
    ("self_attn", "o_proj", "weight"): ("D", "NH"),
    ("self_attn", "q_norm", "weight"): ("H",),
    ("self_attn", "k_norm", "weight"): ("H",),
    ("mlp", "gate_proj", "weight"): ("F", "D"),
    ("mlp", "up_proj", "weight"): ("F", "D"),
    ("mlp", "down_proj", "weight"): ("D", "F"),
    ("mlp", "gate", "weight"): ("E", "D"),  # the MoE router
    ("mlp", "experts", "gate_proj"): ("E", "I", "D"),
    ("mlp", "experts", "up_proj"): ("E", "I", "D"),
    ("mlp", "experts", "down_proj"): ("E", "D", "I"),
}

# FSDP picks the largest divisible dimension; among equal sizes, the first in this order.
FSDP_PRIORITY: tuple[str, ...] = ("E", "V", "F", "I", "NH", "KH", "D", "H")
# Fused dims that a fixed rule may only split between whole heads.
_HEAD_MAJOR = ("NH", "KH")


class ShardingError(ValueError):
    """A parameter the rules cannot place: unknown path, wrong shape, or (strict) a fallback."""


class ShardingFallbackWarning(UserWarning):
    """Some rule could not be honoured and a dimension was replicated instead (see ``Fallback``)."""


def _dotted(path: tuple) -> str:
    return "/".join(str(p) for p in path)


def logical_axes(path: tuple) -> LogicalAxes:
    """The logical axes of the parameter at ``path`` (e.g. ``("layers", 3, "self_attn", "q_proj",
    "weight")`` -> ``("NH", "D")``)."""
    path = tuple(path)
    key = tuple(str(p) for p in (path[2:] if path and path[0] == "layers" else path))
    try:
        return PARAM_AXES[key]
    except KeyError:
        raise ShardingError(f"parameter {_dotted(path)} has no logical axes: add {key} to "
                            f"fp8rl_jax.parallel.rules.PARAM_AXES") from None


def axis_sizes(config: ModelConfig) -> dict[str, int]:
    """Size of every logical axis for ``config``."""
    N, K, H = config.num_heads, config.num_kv_heads, config.head_dim
    return {"V": config.vocab_size, "D": config.hidden_size, "F": config.intermediate_size,
            "I": config.moe_intermediate_size, "E": config.num_experts, "H": H, "NH": N * H, "KH": K * H}


@dataclasses.dataclass(frozen=True)
class ParamAxes:
    """One parameter's path, shape and logical axes (one row of :func:`param_axes`)."""

    path: tuple[str | int, ...]
    shape: tuple[int, ...]
    axes: LogicalAxes


def _check_shape(path: tuple, shape: tuple[int, ...], axes: LogicalAxes, sizes: Mapping[str, int]) -> None:
    want = tuple(sizes[a] for a in axes)
    if tuple(shape) != want:
        raise ShardingError(f"parameter {_dotted(path)} has shape {tuple(shape)}, but its logical axes {axes} "
                            f"are {want} for this ModelConfig (wrong config, or PARAM_AXES is out of date)")


def param_axes(config: ModelConfig) -> list[ParamAxes]:
    """The logical axes of every parameter of ``config`` (shapes checked against the config)."""
    sizes, rows = axis_sizes(config), []
    for path, var in nnx.to_flat_state(abstract_params(config)):
        shape, axes = tuple(var.get_value().shape), logical_axes(tuple(path))
        _check_shape(tuple(path), shape, axes, sizes)
        rows.append(ParamAxes(tuple(path), shape, axes))
    return rows


# ------------------------------------------------------------------------------------ rules


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """How logical axes go onto the mesh.

    Attributes:
      fixed: ``(logical axis, mesh axis)`` pairs applied first (at most one per logical axis).
      fsdp: then shard each array's largest remaining divisible dimension over ``MeshAxis.FSDP``.
    """

    fixed: tuple[tuple[str, MeshAxis], ...] = ()
    fsdp: bool = False

    def __post_init__(self) -> None:
        seen = set()
        for pair in self.fixed:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise TypeError(f"ShardingRules.fixed entries must be (logical axis, MeshAxis) pairs, got {pair!r}")
            axis, mesh_axis = pair
            if axis not in LOGICAL_AXES:
                raise ValueError(f"unknown logical axis {axis!r}; known: {LOGICAL_AXES}")
            if not isinstance(mesh_axis, MeshAxis):
                raise TypeError(f"mesh axis for {axis!r} must be a MeshAxis, got {mesh_axis!r}")
            if mesh_axis in (MeshAxis.DATA, MeshAxis.FSDP):
                raise ValueError(f"{mesh_axis} cannot be a fixed rule ('data' never shards parameters; "
                                 f"use fsdp=True for 'fsdp')")
            if axis in seen:
                raise ValueError(f"logical axis {axis!r} has two fixed rules")
            seen.add(axis)

    def mesh_axis(self, axis: str) -> MeshAxis | None:
        return dict(self.fixed).get(axis)

    def __or__(self, other: ShardingRules) -> ShardingRules:
        return ShardingRules(fixed=self.fixed + other.fixed, fsdp=self.fsdp or other.fsdp)


TENSOR_RULES = ShardingRules(fixed=tuple((a, MeshAxis.TENSOR) for a in ("NH", "KH", "F", "I", "V")))
EXPERT_RULES = ShardingRules(fixed=(("E", MeshAxis.EXPERT),))
FSDP_RULES = ShardingRules(fsdp=True)


class ShardingPreset(enum.Enum):
    """Named layouts (combine their ``rules`` with ``|`` for hybrids such as FSDP + TP)."""

    DATA_PARALLEL = "data_parallel"  # parameters and optimizer state replicated
    FSDP = "fsdp"  # parameters and optimizer state split over 'fsdp', gathered per use
    TENSOR_PARALLEL = "tensor_parallel"  # heads / FFN / vocab over 'tensor' (Megatron)
    EXPERT_PARALLEL = "expert_parallel"  # MoE experts over 'expert'

    @property
    def rules(self) -> ShardingRules:
        return {ShardingPreset.DATA_PARALLEL: ShardingRules(), ShardingPreset.FSDP: FSDP_RULES,
                ShardingPreset.TENSOR_PARALLEL: TENSOR_RULES, ShardingPreset.EXPERT_PARALLEL: EXPERT_RULES}[self]


def as_rules(preset: ShardingPreset | ShardingRules) -> ShardingRules:
    if isinstance(preset, ShardingPreset):
        return preset.rules
    if isinstance(preset, ShardingRules):
        return preset
    raise TypeError(f"preset must be a ShardingPreset or ShardingRules, got {type(preset).__name__} {preset!r}")


# ------------------------------------------------------------------------------------ specs


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A rule that could not be honoured: ``param`` dimension ``axis`` stays whole along ``mesh_axis``."""

    param: str
    shape: tuple[int, ...]
    axis: str  # the logical axis ("*" for FSDP: no dimension fits)
    mesh_axis: MeshAxis
    mesh_size: int
    reason: str

    def message(self) -> str:
        what = "no dimension" if self.axis == "*" else f"logical axis {self.axis!r}"
        return (f"{self.param} {self.shape}: {what} cannot be split over mesh axis '{self.mesh_axis.value}' "
                f"of size {self.mesh_size} ({self.reason}); replicated along it")


def spec_for(name: str, shape: tuple[int, ...], axes: LogicalAxes, sizes: Mapping[MeshAxis, int],
             rules: ShardingRules, *, units: Mapping[str, int] | None = None,
             block: tuple[int, int] | None = None) -> tuple[P, tuple[Fallback, ...]]:
    """The ``PartitionSpec`` of one array of logical ``axes`` under ``rules``, and its fallbacks.

    ``units``: the divisibility unit of a logical axis under the fixed rules (``{"NH": H, "KH": H}``
    keeps heads whole); ``block``: the FP8 block of a ``QuantizedWeight`` (last two dims).
    """
    shape, units = tuple(shape), units or {}
    if len(shape) != len(axes):
        raise ShardingError(f"{name}: shape {shape} has {len(shape)} dims but logical axes {axes} name {len(axes)}")
    nd = len(shape)
    entries: list[str | None] = [None] * nd
    used: set[MeshAxis] = set()
    fallbacks: list[Fallback] = []

    def unit(d: int, fixed: bool) -> tuple[int, str]:
        u, why = (units.get(axes[d], 1), f"whole heads of {units.get(axes[d], 1)}") if fixed else (1, "")
        if block is not None and d >= nd - 2:
            b = block[d - (nd - 2)]
            u, why = math.lcm(u, b), (why + " and " if why else "") + f"whole FP8 blocks of {b}"
        return u, why

    for d, axis in enumerate(axes):
        mesh_axis = rules.mesh_axis(axis)
        if mesh_axis is None or sizes[mesh_axis] == 1:
            continue
        m = sizes[mesh_axis]
        u, why = unit(d, True)
        if mesh_axis in used:
            fallbacks.append(Fallback(name, shape, axis, mesh_axis, m, "the mesh axis already splits another dim"))
        elif shape[d] % (m * u):
            need = f"a multiple of {m} x {u}: each shard must hold {why}" if u > 1 else f"a multiple of {m}"
            fallbacks.append(Fallback(name, shape, axis, mesh_axis, m, f"size {shape[d]} is not {need}"))
        else:
            entries[d] = mesh_axis.value
            used.add(mesh_axis)
    m = sizes[MeshAxis.FSDP]
    if rules.fsdp and m > 1 and MeshAxis.FSDP not in used and nd:
        fits = [d for d in range(nd) if entries[d] is None and shape[d] % (m * unit(d, False)[0]) == 0]
        if fits:
            d = max(fits, key=lambda d: (shape[d], -FSDP_PRIORITY.index(axes[d])))
            entries[d] = MeshAxis.FSDP.value
        else:
            blocks = "" if block is None else f" in whole FP8 blocks {block}"
            fallbacks.append(Fallback(name, shape, "*", MeshAxis.FSDP, m,
                                      f"no free dimension is a multiple of {m}{blocks}"))
    return P(*entries), tuple(fallbacks)


def _report(fallbacks: tuple[Fallback, ...], strict: bool) -> None:
    if not fallbacks:
        return
    lines = "\n  ".join(f.message() for f in fallbacks)
    if strict:
        raise ShardingError(f"{len(fallbacks)} sharding rule(s) cannot be honoured (strict=True):\n  {lines}")
    warnings.warn(ShardingFallbackWarning(f"{len(fallbacks)} sharding rule(s) fell back to replication:\n  {lines}"),
                  stacklevel=3)


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Partition specs for a params pytree and what could not be honoured.

    Attributes:
      specs: the params ``nnx.State`` with a ``PartitionSpec`` per array leaf (a
        ``QuantizedWeight(q=spec, scale_inv=spec)`` for an FP8 weight).
      fallbacks: every rule replaced by replication (empty when the layout is exactly the preset's).
    """

    specs: nnx.State
    fallbacks: tuple[Fallback, ...]

    def shardings(self, mesh: Mesh) -> nnx.State:
        """``specs`` as ``NamedSharding``s on ``mesh`` (for ``jax.jit`` / ``jax.device_put``)."""
        return named_shardings(self.specs, mesh)


def plan_params(params: nnx.State, config: ModelConfig, mesh: Mesh | MeshConfig,
                preset: ShardingPreset | ShardingRules, *, strict: bool = False) -> ShardingPlan:
    """Specs of every parameter of ``params`` (arrays, ``jax.ShapeDtypeStruct``s or
    ``QuantizedWeight``s) under ``preset``. Fallbacks warn (``ShardingFallbackWarning``) or, with
    ``strict``, raise ``ShardingError``."""
    sizes, rules = mesh_sizes(mesh), as_rules(preset)
    letters = axis_sizes(config)
    units = {a: config.head_dim for a in _HEAD_MAJOR}
    out, fallbacks = [], []
    for path, var in nnx.to_flat_state(params):
        path, value = tuple(path), var.get_value()
        axes, name = logical_axes(path), _dotted(path)
        if isinstance(value, QuantizedWeight):
            _check_shape(path, value.shape, axes, letters)
            lead, (n, k), (bn, bk) = value.shape[:-2], value.shape[-2:], value.block_size
            want = (*lead, -(-n // bn), -(-k // bk))
            if tuple(value.scale_inv.shape) != want:
                raise ShardingError(f"{name}: scale_inv shape {tuple(value.scale_inv.shape)} does not match q "
                                    f"{value.shape} in blocks {value.block_size} (expected {want})")
            spec, fb = spec_for(name, value.shape, axes, sizes, rules, units=units, block=value.block_size)
            leaf: Any = QuantizedWeight(q=spec, scale_inv=spec, block_size=value.block_size)
        else:
            _check_shape(path, tuple(value.shape), axes, letters)
            leaf, fb = spec_for(name, tuple(value.shape), axes, sizes, rules, units=units)
        fallbacks.extend(fb)
        out.append((path, var.replace(leaf)))
    fallbacks = tuple(fallbacks)
    _report(fallbacks, strict)
    return ShardingPlan(nnx.from_flat_state(out), fallbacks)


def named_shardings(specs: Any, mesh: Mesh) -> Any:
    """A pytree of ``PartitionSpec``s as ``NamedSharding``s on ``mesh``."""
    mesh_sizes(mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def param_shardings(params: nnx.State, config: ModelConfig, mesh: Mesh, preset: ShardingPreset | ShardingRules,
                    *, strict: bool = False) -> nnx.State:
    """``NamedSharding`` of every parameter (the pytree of ``params``, QuantizedWeights included)."""
    return plan_params(params, config, mesh, preset, strict=strict).shardings(mesh)


def shard_params(params: nnx.State, config: ModelConfig, mesh: Mesh, preset: ShardingPreset | ShardingRules,
                 *, strict: bool = False) -> nnx.State:
    """``params`` placed on ``mesh`` under ``preset`` (``jax.device_put``; the input stays valid)."""
    return jax.device_put(params, param_shardings(params, config, mesh, preset, strict=strict))


def follow_params(tree: Any, params: nnx.State, param_specs: nnx.State) -> Any:
    """Specs for a pytree holding params-shaped copies (an optax state): a leaf whose key path ends
    with a parameter's key path and whose shape is that parameter's gets its spec; every other
    leaf is replicated (``P()``)."""
    index = {}
    for (kp, p), spec in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(
            param_specs, is_leaf=lambda x: isinstance(x, P)), strict=True):
        index[tuple(kp)] = (tuple(jax.numpy.shape(p)), spec)

    def spec_of(kp, leaf):
        kp, shape = tuple(kp), tuple(jax.numpy.shape(leaf))
        for start in range(len(kp)):
            hit = index.get(kp[start:])
            if hit is not None and hit[0] == shape:
                return hit[1]
        return P()

    return jax.tree_util.tree_map_with_path(spec_of, tree)
