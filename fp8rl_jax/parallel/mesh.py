"""The device mesh: four named axes, their sizes in one frozen config, built in one place.

Axes (``MeshAxis``), outermost first: ``data`` (replicas: parameters replicated, batch split),
``fsdp`` (batch split *and* parameters / optimizer state split, gathered per use), ``expert``
(MoE experts split; acts as a data axis for everything else) and ``tensor`` (Megatron tensor
parallelism: heads, FFN and vocabulary split; every device of a tensor group sees the same tokens).
``tensor`` is innermost so that a tensor group is made of neighbouring devices (one NVLink
island on a multi-GPU host); ``data`` is outermost so that replicas span hosts.

All four axes always exist (size 1 when unused), so partition specs may name any of them and a
preset runs unchanged on a mesh that does not use one of its axes. Axis types are
``AxisType.Auto``: shardings enter through ``jax.jit`` in/out shardings and ``jax.device_put``
and XLA's sharding propagation (GSPMD) places everything in between.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fp8rl_jax.fields import check_field_types


class MeshAxis(enum.Enum):
    """The mesh axes; ``.value`` is the name used in ``PartitionSpec``s."""

    DATA = "data"
    FSDP = "fsdp"
    EXPERT = "expert"
    TENSOR = "tensor"


# Mesh order, outermost first.
MESH_AXES: tuple[MeshAxis, ...] = (MeshAxis.DATA, MeshAxis.FSDP, MeshAxis.EXPERT, MeshAxis.TENSOR)
# The axes a batch's B dimension is split over: every axis but tensor.
BATCH_AXES: tuple[MeshAxis, ...] = (MeshAxis.DATA, MeshAxis.FSDP, MeshAxis.EXPERT)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the four mesh axes; their product is the number of devices.

    Examples: 8 GPUs data-parallel ``MeshConfig(data=8)``; FSDP over 4 with 2 replicas
    ``MeshConfig(data=2, fsdp=4)``; tensor parallel 2 inside 4 replicas ``MeshConfig(data=4, tensor=2)``.
    """

    data: int = 1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        check_field_types(self)
        for axis in MESH_AXES:
            v = getattr(self, axis.value)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ValueError(f"MeshConfig.{axis.value} must be a positive int, got {v!r}")

    @property
    def size(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def sizes(self) -> dict[MeshAxis, int]:
        return {axis: getattr(self, axis.value) for axis in MESH_AXES}

    @property
    def batch_shards(self) -> int:
        """How many ways a batch is split (product of ``BATCH_AXES``)."""
        return math.prod(self.sizes[a] for a in BATCH_AXES)


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The ``jax.sharding.Mesh`` of ``config`` over ``devices`` (default: all of ``jax.devices()``;
    their number must equal ``config.size``)."""
    if not isinstance(config, MeshConfig):
        raise TypeError(f"config must be a MeshConfig, got {type(config).__name__}")
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) != config.size:
        raise ValueError(f"{config} needs {config.size} devices (the product of its axis sizes), got {len(devices)}; "
                         f"pass devices=... to use a subset")
    return jax.make_mesh(tuple(config.sizes[a] for a in MESH_AXES), tuple(a.value for a in MESH_AXES),
                         axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def mesh_sizes(mesh: Mesh | MeshConfig) -> dict[MeshAxis, int]:
    """Axis sizes of a mesh built by :func:`make_mesh` (or of a ``MeshConfig``: specs need no devices)."""
    if isinstance(mesh, MeshConfig):
        return mesh.sizes
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or a MeshConfig, got {type(mesh).__name__}")
    shape = dict(mesh.shape)
    missing = [a.value for a in MESH_AXES if a.value not in shape]
    extra = sorted(set(shape) - {a.value for a in MESH_AXES})
    if missing or extra:
        raise ValueError(f"mesh axes {tuple(shape)} are not the fp8rl_jax axes {tuple(a.value for a in MESH_AXES)} "
                         f"(missing {missing}, unknown {extra}); build the mesh with make_mesh(MeshConfig(...))")
    return {a: int(shape[a.value]) for a in MESH_AXES}


def batch_spec() -> P:
    """``B`` (dim 0) over every mesh axis but ``tensor``; the other dims whole."""
    return P(tuple(a.value for a in BATCH_AXES))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The sharding of a batch's arrays on ``mesh``: :func:`batch_spec`."""
    mesh_sizes(mesh)
    return NamedSharding(mesh, batch_spec())


def batch_shards(mesh: Mesh) -> int:
    """How many ways a batch is split on ``mesh`` (product of ``BATCH_AXES``)."""
    sizes = mesh_sizes(mesh)
    return math.prod(sizes[a] for a in BATCH_AXES)
