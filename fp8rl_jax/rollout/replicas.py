"""Data-parallel rollout: one ``Generator`` over several JAX engines, one per device group.

Design note
-----------
A multi-GPU RL run colocates its generator with the trainer: every device holds a shard of the
train state and, between train steps, one engine replica with a full copy of the generator's
weights (FP8 for W8A8) and its own KV pool. ``EngineReplicas`` is that generator:

* **Requests split in order.** ``generate`` gives replica ``r`` the ``r``-th contiguous slice of the
  requests (sizes differ by at most one) and concatenates the outputs in request order. Sampling
  keys depend only on (request seed, position) and every row of the programs is computed on its own,
  so the tokens are those one engine would give for the same requests.
* **One set of FP8 KV scales.** Inference-side calibration runs once, on the first prompts of the
  whole call (replica 0 measures, every replica gets the scales), as one engine would calibrate;
  per-replica calibration would give each replica other scales and other tokens.
* **Threads, not processes.** Each replica's host loop runs in a thread of this process; JAX
  releases the GIL while it waits on a device, so the replicas decode concurrently. A replica is
  pinned to its devices (``JaxEngine(device=...)`` or a tensor-parallel ``mesh``), so nothing it
  allocates lands on another replica's device.
* **Weights from any layout.** ``update_weights`` takes the trainer's params in whatever sharding
  the trainer left them (FSDP, tensor-parallel) and each replica moves them onto its devices
  before re-quantizing there (``JaxEngine.update_weights``).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from fp8rl_jax.rollout.base import RolloutBatch
from fp8rl_jax.rollout.config import KvCalibration
from fp8rl_jax.rollout.engine import JaxEngine


def split_evenly(n: int, parts: int) -> list[range]:
    """``parts`` contiguous index ranges covering ``range(n)``, sizes differing by at most one (the
    first ``n % parts`` one longer)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for r in range(parts):
        size = base + (r < extra)
        out.append(range(start, start + size))
        start += size
    return out


def concat_batches(batches: Sequence[RolloutBatch]) -> RolloutBatch:
    """The rows of ``batches`` in order, as one batch (tokens / logprobs right-padded to the widest,
    routing padded with -1; preemption and routing counters summed)."""
    width = max(b.tokens.shape[1] for b in batches)

    def pad(x: np.ndarray, value: Any, axis: int, size: int) -> np.ndarray:
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, size - x.shape[axis])
        return np.pad(x, widths, constant_values=value)

    routing = None
    if any(b.routing is not None for b in batches):
        if not all(b.routing is not None for b in batches):
            raise ValueError("either every replica records routing or none does")
        S = max(b.routing.shape[1] for b in batches)
        routing = np.concatenate([pad(b.routing, -1, 1, S) for b in batches])
    return RolloutBatch(tokens=np.concatenate([pad(b.tokens, 0, 1, width) for b in batches]),
                        logprobs=np.concatenate([pad(b.logprobs, 0.0, 1, width) for b in batches]),
                        lengths=np.concatenate([b.lengths for b in batches]),
                        finish_reasons=[f for b in batches for f in b.finish_reasons],
                        preemptions=sum(b.preemptions for b in batches), routing=routing,
                        routing_recompute_mismatches=sum(b.routing_recompute_mismatches for b in batches))


class EngineReplicas:
    """A ``Generator`` made of ``JaxEngine`` replicas that split each call's requests (module note).

    Attributes:
      engines: the replicas, in the order their slices of the requests come.
    """

    def __init__(self, engines: Sequence[JaxEngine]):
        if not engines:
            raise ValueError("EngineReplicas needs at least one engine")
        devices = [self._devices(e) for e in engines]
        flat = [d for ds in devices for d in ds]
        if len(set(flat)) != len(flat):
            raise ValueError(f"engine replicas must not share devices, got {devices}")
        self.engines = list(engines)
        self._pool = concurrent.futures.ThreadPoolExecutor(len(self.engines), thread_name_prefix="replica")

    @staticmethod
    def _devices(engine: JaxEngine) -> list:
        if engine.mesh is not None:
            return list(engine.mesh.devices.flat)
        return [engine.device or jax.devices()[0]]

    @classmethod
    def build(cls, model_config, params: Any, config, device_groups: Sequence[Sequence[jax.Device]], *,
              make_mesh=None, asleep: bool = False) -> EngineReplicas:
        """One engine per device group: a single-device engine for a group of one, else a tensor-parallel
        engine on ``make_mesh(group)``."""
        engines = []
        for group in device_groups:
            if len(group) == 1:
                engines.append(JaxEngine(model_config, params, config, device=group[0], asleep=asleep))
            else:
                if make_mesh is None:
                    raise ValueError("device groups of several devices need make_mesh (a tensor-parallel mesh per group)")
                engines.append(JaxEngine(model_config, params, config, mesh=make_mesh(group), asleep=asleep))
        return cls(engines)

    def _each(self, fn, which: Sequence[int] | None = None, args: Sequence[Any] | None = None) -> list:
        """``fn(engine)`` (or ``fn(engine, arg)``) for the engines ``which`` (default: all), one thread each."""
        which = range(len(self.engines)) if which is None else which
        futures = [self._pool.submit(fn, self.engines[i], *(() if args is None else (args[j],)))
                   for j, i in enumerate(which)]
        return [f.result() for f in futures]

    # ----------------------------------------------------------------------- Generator

    @property
    def params(self) -> Any:
        """Every replica's weights (a list; None when any replica holds none)."""
        ps = [e.params for e in self.engines]
        return None if any(p is None for p in ps) else ps

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Any) -> RolloutBatch:
        """Generates for every prompt; replica ``r`` takes the ``r``-th contiguous slice of them."""
        prompts = list(prompts)
        samplings = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        if len(samplings) != len(prompts):
            raise ValueError(f"{len(samplings)} sampling configs for {len(prompts)} prompts")
        self._ensure_kv_scales(prompts)
        parts = split_evenly(len(prompts), len(self.engines))
        busy = [i for i, p in enumerate(parts) if len(p)]
        outs = self._each(lambda e, p: e.generate([prompts[j] for j in p], [samplings[j] for j in p]), busy,
                          [parts[i] for i in busy])
        return concat_batches(outs)

    def _ensure_kv_scales(self, prompts: list) -> None:
        first = self.engines[0]
        if not first.config.fp8_kv or all(e.kv_scales_fresh for e in self.engines):
            return
        if first.config.kv_calibration is KvCalibration.TRAINER:
            raise RuntimeError("FP8 KV scales are stale after update_weights: with trainer-side calibration the "
                               "trainer must call calibrate_kv_scales and set_kv_scales first")
        self.set_kv_scales(*jax.device_get(first.measure_kv_scales(prompts)))

    def update_weights(self, params: Any) -> None:
        """Every replica takes ``params`` (any layout) onto its devices and re-quantizes them there."""
        self._each(lambda e: e.update_weights(params))

    def set_kv_scales(self, k_scale: Any, v_scale: Any) -> None:
        k, v = jax.device_get((k_scale, v_scale))
        for e in self.engines:
            e.set_kv_scales(k, v)

    def sleep(self, weights: bool = False) -> None:
        for e in self.engines:
            e.sleep(weights=weights)

    def wake(self) -> None:
        self._each(lambda e: e.wake())

    def close(self) -> None:
        """Stops the replicas' threads (the engines stay usable one by one)."""
        self._pool.shutdown(wait=True)
