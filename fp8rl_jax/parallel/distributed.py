"""Multi-host start: ``jax.distributed.initialize`` from the usual environment variables.

Every host runs the same script; the processes find each other through one coordinator, then
``jax.devices()`` lists every GPU of every host and a ``Mesh`` over them (``make_mesh``) spans the
cluster, so the sharded train step and generator run unchanged. Where the settings come from, in
order (the first complete source wins):

1. JAX's own variables: ``JAX_COORDINATOR_ADDRESS`` (host:port of process 0),
   ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` (optional ``JAX_LOCAL_DEVICE_IDS``, read by JAX);
2. torchrun-style variables: ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``;
3. a cluster JAX detects itself (SLURM, Open MPI, Kubernetes, ...): ``jax.distributed.initialize()``
   with no arguments reads it (``SLURM_JOB_ID``, ``OMPI_COMM_WORLD_SIZE``, ...);
4. nothing: one process, nothing to initialize.

A two-host example (two machines with 8 GPUs each, host A reachable as ``10.0.0.1``)::

    # on host A                                   # on host B
    JAX_COORDINATOR_ADDRESS=10.0.0.1:1234 \\       JAX_COORDINATOR_ADDRESS=10.0.0.1:1234 \\
    JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 \\        JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=1 \\
    python experiments/aime24_qwen3_8b.py ...     python experiments/aime24_qwen3_8b.py ...

``initialize_distributed`` must run before anything touches a JAX device.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import jax

_CLUSTER_HINTS = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "KUBERNETES_SERVICE_HOST", "MPI_LOCALNRANKS")


class DistributedConfigError(ValueError):
    """The environment names a multi-process run incompletely or inconsistently."""


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """What ``initialize_distributed`` passes to ``jax.distributed.initialize`` (``source`` says
    where it came from; ``None`` fields are left to JAX's cluster detection)."""

    source: str  # "jax", "torchrun", "cluster" or "single"
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise DistributedConfigError(f"{name}={env[name]!r} is not an integer") from None


def settings_from_env(env: Mapping[str, str] | None = None) -> DistributedSettings:
    """The multi-process settings the environment describes (no side effects; see the module note)."""
    env = os.environ if env is None else env
    jax_vars = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    torch_vars = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
    if any(v in env for v in jax_vars[1:]):
        missing = [v for v in jax_vars if v not in env]
        if missing:
            raise DistributedConfigError(f"a multi-process run via JAX variables needs {', '.join(jax_vars)}; "
                                         f"missing {', '.join(missing)}")
        s = DistributedSettings("jax", env["JAX_COORDINATOR_ADDRESS"], _int(env, "JAX_NUM_PROCESSES"),
                                _int(env, "JAX_PROCESS_ID"))
    elif "WORLD_SIZE" in env and "RANK" in env:
        missing = [v for v in torch_vars if v not in env]
        if missing:
            raise DistributedConfigError(f"torchrun-style variables need {', '.join(torch_vars)}; missing "
                                         f"{', '.join(missing)}")
        s = DistributedSettings("torchrun", f"{env['MASTER_ADDR']}:{_int(env, 'MASTER_PORT')}",
                                _int(env, "WORLD_SIZE"), _int(env, "RANK"))
    elif any(v in env for v in _CLUSTER_HINTS):
        return DistributedSettings("cluster")
    else:
        return DistributedSettings("single")
    if s.num_processes < 1 or not 0 <= s.process_id < s.num_processes:
        raise DistributedConfigError(f"process id {s.process_id} is not in [0, {s.num_processes}) ({s.source} variables)")
    if ":" not in s.coordinator_address:
        raise DistributedConfigError(f"coordinator address {s.coordinator_address!r} must be host:port")
    return s


def initialize_distributed(env: Mapping[str, str] | None = None) -> DistributedSettings:
    """Starts JAX's multi-process runtime when the environment describes one (module note); a
    single process is left alone. Returns the settings used. Call it first, before any device use."""
    s = settings_from_env(env)
    if s.source == "single" or (s.source != "cluster" and s.num_processes == 1):
        return s
    if s.source == "cluster":
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator_address=s.coordinator_address, num_processes=s.num_processes,
                                   process_id=s.process_id)
    return s


__all__ = ["DistributedConfigError", "DistributedSettings", "initialize_distributed", "settings_from_env"]
