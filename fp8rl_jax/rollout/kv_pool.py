"""The engine's KV pool on the device: sizing, allocation, sleep/wake, FP8 scales, swap space.

- One ``PagedKVCache`` whose rows are ``max_slots`` decode slots sharing ``num_pages`` pages
  (`fp8rl_jax.rollout.pages.PageTable` says which slot holds which). Its size is ``num_pages``, else
  ``kv_budget_gib`` per device, else ``kv_budget_fraction`` of the device memory the weights leave.
  With a tensor mesh the pools are split over their kv-head axis (`head_sharding`), so the pool holds
  ``tensor`` times the pages of the per-device budget.
- Sleep/wake: the pool holds nothing between generates, so `KvPool.sleep` frees it (e.g. while a
  colocated trainer runs) and `KvPool.wake` allocates it again at the same shape (no recompile),
  keeping the FP8 KV scales.
- Swap space (``swap_space_gib``): a preempted sequence's pages are copied to host memory (pinned where
  the backend has it, asynchronously) in chunks of ``SWAP_CHUNK_PAGES`` and copied back into fresh pages
  when it is readmitted, instead of a prefill recomputing its context (vLLM's swap preemption). The
  space is pinned once, up front (`KvPool.reserve_swap_space`): XLA's pinned-host allocator grows by
  doubling regions, and pinning each new one inside a run stalls it.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.models import HeadSharding, ModelConfig, PagedKVCache
from fp8rl_jax.parallel import MeshAxis
from fp8rl_jax.rollout.config import EngineConfig
from fp8rl_jax.rollout.programs import place

SWAP_CHUNK_PAGES = 32  # pages per swap copy (one compiled gather and one scatter; a sequence takes several)
SWAP_RESERVE_BLOCK = 256 * 2**20  # bytes per block `KvPool.reserve_swap_space` pins


def head_sharding(mesh: jax.sharding.Mesh, cfg: ModelConfig) -> HeadSharding:
    """The tensor axis of a generator mesh, checked: whole query and kv heads per device, and no
    other axis of size > 1 (data-parallel replicas are separate engines)."""
    axis = MeshAxis.TENSOR.value
    if axis not in mesh.shape:
        raise ValueError(f"a generator mesh needs a {axis!r} axis; got axes {dict(mesh.shape)}")
    others = {a: n for a, n in mesh.shape.items() if a != axis and n > 1}
    if others:
        raise ValueError(f"a generator mesh shards over {axis!r} only; got {others} as well (data-parallel "
                         f"rollout = one engine per replica, each on its own sub-mesh)")
    tp = mesh.shape[axis]
    if cfg.num_heads % tp or cfg.num_kv_heads % tp:
        raise ValueError(f"tensor = {tp} must divide the query heads ({cfg.num_heads}) and the kv heads "
                         f"({cfg.num_kv_heads}): each device holds whole heads and their KV")
    return HeadSharding(mesh, axis)


@jax.jit
def gather_pages_jit(k_pages, v_pages, ids):
    """Pages ``ids`` of every layer's K and V pools: ``[L, len(ids), page_size, K, H]`` each (swap-out)."""
    return jnp.stack([kp[ids] for kp in k_pages]), jnp.stack([vp[ids] for vp in v_pages])


@functools.partial(jax.jit, donate_argnums=(0,))
def scatter_pages_jit(cache, ids, k, v):
    """`gather_pages_jit`'s inverse into ``cache``'s pools (swap-in); ids out of range are dropped."""
    return cache.replace(k_pages=tuple(kp.at[ids].set(k[i], mode="drop") for i, kp in enumerate(cache.k_pages)),
                         v_pages=tuple(vp.at[ids].set(v[i], mode="drop") for i, vp in enumerate(cache.v_pages)))


def pinned_host(devices) -> bool:
    """Whether every device of ``devices`` has pinned host memory (the swap copies' destination)."""
    return all("pinned_host" in {m.kind for m in d.addressable_memories()} for d in devices)


def to_host(x: jax.Array) -> Any:
    """``x`` copied to host memory: a pinned-host jax.Array where the backend has that memory (the copy runs
    asynchronously, after the program that makes ``x``), else a NumPy array."""
    if pinned_host(x.sharding.device_set):
        return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
    return np.asarray(x)


def to_device(x: Any) -> Any:
    """`to_host`'s copy back to device memory (NumPy arrays as they are: the program places them)."""
    if isinstance(x, jax.Array):
        return jax.device_put(x, x.sharding.with_memory_kind("device"))
    return x


class KvPool:
    """The paged KV cache of one engine (module note). ``cache`` is None while asleep."""

    def __init__(self, model_config: ModelConfig, config: EngineConfig, max_seq_len: int,
                 mesh: jax.sharding.Mesh | None = None, heads: HeadSharding | None = None,
                 device: jax.Device | None = None):
        self.model_config = model_config
        self.device = device
        self.config = config
        self.mesh = mesh
        self.heads = heads
        c = model_config
        self.kv_dtype = jnp.dtype(jnp.float8_e4m3fn) if config.fp8_kv else jnp.dtype(config.dtype)
        self.bytes_per_page = 2 * c.num_layers * config.page_size * c.num_kv_heads * c.head_dim * self.kv_dtype.itemsize
        tp = heads.size if heads is not None else 1  # the budget is per device; a page's heads are split
        budget = self.budget_bytes()
        self.num_pages = config.num_pages or int(budget * tp // self.bytes_per_page)
        if self.num_pages < 1:
            raise ValueError(f"a KV budget of {budget / 2**30:.3g} GiB holds no page of {self.bytes_per_page} bytes")
        self.max_pages = math.ceil(max_seq_len / config.page_size)
        self.cache: PagedKVCache | None = None
        # while asleep: what the pool's next allocation keeps (scales, kernel choice)
        self._slept = dict(kernels=None, k_scale=None, v_scale=None)
        self.swap_bytes = 0  # host bytes held by swapped-out sequences
        self.swap_reserve_s: float | None = None  # seconds `reserve_swap_space` took (None: not yet run)

    @property
    def devices(self) -> list:
        """The devices the pool lives on (the mesh's, or its one device: by default the first)."""
        return list(self.mesh.devices.flat) if self.mesh is not None else [self.device or jax.devices()[0]]

    def budget_bytes(self) -> float:
        """Per-device KV bytes: ``kv_budget_gib``, or ``kv_budget_fraction`` of the memory the allocator can
        still give (its limit minus what is in use, the weights included) on the pool's device with the
        least of it."""
        frac = self.config.kv_budget_fraction
        if not frac:
            return self.config.kv_budget_gib * 2**30
        free = []
        for d in self.devices:
            stats = d.memory_stats() if hasattr(d, "memory_stats") else None
            if not stats or "bytes_limit" not in stats:
                raise ValueError(f"EngineConfig.kv_budget_fraction needs a backend that reports device memory "
                                 f"({d.platform} does not); size the pool in GiB instead: kv_budget_fraction=0 and "
                                 f"kv_budget_gib=...")
            free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
        return frac * min(free)

    @property
    def nbytes(self) -> int:
        """Device bytes of the pool when allocated (all devices of the mesh together)."""
        return self.num_pages * self.bytes_per_page

    def put(self, tree: Any) -> Any:
        return place(tree, self.mesh, self.device)

    def wake(self) -> None:
        """Allocates the pool (a no-op when allocated). Raises a ``RuntimeError`` that names its size when the
        device cannot hold it; the pool then stays asleep and can be woken later."""
        if self.cache is not None:
            return
        c, cfg = self.model_config, self.config
        try:
            # one device: committed to it, like every input the programs take (`programs.place`)
            cache = PagedKVCache.init(c.num_layers, self.num_pages, cfg.page_size, c.num_kv_heads, c.head_dim,
                                      cfg.max_slots, self.max_pages, self.kv_dtype, kernels=self._slept["kernels"],
                                      heads=self.heads, device=(self.device or jax.devices()[0]) if self.heads is None else None)
        except Exception as e:  # XLA's resource-exhausted error: say what did not fit
            if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                raise
            raise RuntimeError(f"JaxEngine.wake: the KV pool ({self.num_pages} pages, "
                               f"{self.nbytes / 2**30:.2f} GiB) does not fit in device memory now; free "
                               f"memory (e.g. the trainer's step buffers) and call wake() again") from e
        if self.mesh is not None:  # as the programs return them
            cache = cache.replace(page_table=self.put(cache.page_table), lengths=self.put(cache.lengths),
                                  k_scale=self.put(cache.k_scale), v_scale=self.put(cache.v_scale))
        if self._slept["k_scale"] is not None:
            cache = cache.replace(k_scale=self._slept["k_scale"], v_scale=self._slept["v_scale"])
        self.cache = cache
        self._slept = dict(kernels=None, k_scale=None, v_scale=None)

    def sleep(self) -> None:
        """Frees the pool's device buffers, keeping its scales and kernel choice for the next `wake`."""
        if self.cache is None:
            return
        c = self.cache
        self._slept = dict(kernels=c.kernels, k_scale=c.k_scale, v_scale=c.v_scale)
        for a in (*c.k_pages, *c.v_pages, c.page_table, c.lengths):
            a.delete()
        self.cache = None

    def set_scales(self, k_scale: Any, v_scale: Any) -> None:
        """FP8 K/V scales ([L] float32 each, finite and positive), copied and placed as the cache is; while
        asleep the next allocation takes them."""
        L = self.model_config.num_layers
        # copies: the cache is donated to the programs, and the caller keeps its arrays
        k_scale, v_scale = jnp.array(k_scale, jnp.float32, copy=True), jnp.array(v_scale, jnp.float32, copy=True)
        k_scale, v_scale = self.put((k_scale, v_scale))
        if k_scale.shape != (L,) or v_scale.shape != (L,):
            raise ValueError(f"KV scales must have shape ({L},), got {k_scale.shape} and {v_scale.shape}")
        if not (bool(jnp.all(jnp.isfinite(k_scale)) & jnp.all(k_scale > 0))
                and bool(jnp.all(jnp.isfinite(v_scale)) & jnp.all(v_scale > 0))):
            raise ValueError("KV scales must be finite and positive")
        if self.cache is None:
            self._slept.update(k_scale=k_scale, v_scale=v_scale)
        else:
            self.cache = self.cache.replace(k_scale=k_scale, v_scale=v_scale)

    # ----------------------------------------------------------------------- swap space

    def reserve_swap_space(self) -> float:
        """Pins ``swap_space_gib`` of host memory once per pool (a no-op without swap space, where the devices
        have no pinned host memory, or after the first call) and returns the seconds it took. The blocks are
        released at once: XLA's pinned-host allocator keeps the regions it grew and carves the swap copies
        from them later. Raises a ``RuntimeError`` naming ``swap_space_gib`` when the host cannot pin that much."""
        if self.swap_reserve_s is not None:
            return 0.0
        t0 = time.perf_counter()
        gib = self.config.swap_space_gib
        devices = self.devices
        if gib > 0 and pinned_host(devices):
            per_device = math.ceil(gib * 2**30 / len(devices))
            blk = min(SWAP_RESERVE_BLOCK, per_device)
            held = []
            try:
                for d in devices:
                    x = jax.device_put(np.zeros((blk,), np.uint8), d)
                    held += [to_host(x) for _ in range(math.ceil(per_device / blk))]
                    jax.block_until_ready(held)
            except Exception as e:  # XLA's resource-exhausted error: say which setting asked for it
                raise RuntimeError(f"JaxEngine: cannot pin EngineConfig.swap_space_gib = {gib} GiB of host memory "
                                   f"for swap preemption ({e}); lower it, or 0 to recompute preempted "
                                   f"sequences") from e
            finally:
                for h in held:
                    h.delete()
        self.swap_reserve_s = time.perf_counter() - t0
        return self.swap_reserve_s

    def swap_out(self, page_ids: list[int], tokens: int) -> tuple | None:
        """Copies the first ``tokens`` cached tokens (in pages ``page_ids``) to host memory and returns the copy
        (``(chunks, tokens, host bytes)``, for `swap_in`), or None when the swap space has no room (the
        sequence is then recomputed). The gathers are dispatched after every device call so far, so the
        pages may be reused as soon as this returns."""
        cfg, c = self.config, self.model_config
        n = math.ceil(tokens / cfg.page_size)
        copied = math.ceil(n / SWAP_CHUNK_PAGES) * SWAP_CHUNK_PAGES  # pages the chunked copies hold
        nbytes = 2 * c.num_layers * copied * cfg.page_size * c.num_kv_heads * c.head_dim * self.kv_dtype.itemsize
        if tokens <= 0 or self.swap_bytes + nbytes > cfg.swap_space_gib * 2**30:
            return None
        chunks = []
        for start in range(0, n, SWAP_CHUNK_PAGES):
            ids = np.zeros((SWAP_CHUNK_PAGES,), np.int32)  # padding gathers page 0; swap-in drops it
            part = page_ids[start : min(start + SWAP_CHUNK_PAGES, n)]
            ids[: len(part)] = part
            k, v = gather_pages_jit(self.cache.k_pages, self.cache.v_pages, self.put(ids))
            chunks.append((to_host(k), to_host(v)))
        self.swap_bytes += nbytes
        return chunks, tokens, nbytes

    def swap_in(self, swapped: tuple, page_ids: list[int]) -> int:
        """Copies `swap_out`'s copy back into pages ``page_ids`` (which cover its tokens); returns the tokens."""
        chunks, tokens, nbytes = swapped
        n = math.ceil(tokens / self.config.page_size)
        for i, (k, v) in enumerate(chunks):
            ids = np.full((SWAP_CHUNK_PAGES,), self.num_pages, np.int32)  # out of range: dropped
            part = page_ids[i * SWAP_CHUNK_PAGES : min((i + 1) * SWAP_CHUNK_PAGES, n)]
            ids[: len(part)] = part
            self.cache = scatter_pages_jit(self.cache, self.put(ids), to_device(k), to_device(v))
        self.swap_bytes -= nbytes
        return tokens

    def warm_swap_copies(self) -> PagedKVCache:
        """Runs swap's copy programs once (the scatter writes nothing: its ids are out of range), so that they
        compile outside a generate; returns the cache to wait on."""
        k, v = gather_pages_jit(self.cache.k_pages, self.cache.v_pages,
                                self.put(np.zeros((SWAP_CHUNK_PAGES,), np.int32)))
        k, v = to_device(to_host(k)), to_device(to_host(v))
        self.cache = scatter_pages_jit(self.cache, self.put(np.full((SWAP_CHUNK_PAGES,), self.num_pages, np.int32)),
                                       k, v)
        return self.cache
