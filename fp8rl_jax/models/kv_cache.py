"""KV caches for the cached forward of the one model: contiguous and paged, BF16 or FP8.

Contract shared by every cache (what ``Qwen3`` relies on):
- ``lengths`` [B] int32: tokens already in the cache per row, i.e. the next write position;
- ``attend(layer, q, k, v, num_new)``: writes the T new keys/values of row b (after k-norm and
  RoPE) at positions ``lengths[b] .. lengths[b] + T - 1`` and returns the attention of q
  [B, T, N, H] over the row's cache, query t seeing keys ``j <= lengths[b] + t``, plus the
  cache with that layer updated. Only the first ``num_new[b]`` tokens of a row are real;
- ``advance(num_new)``: counts them as written (the model calls it after the last layer).

``KVCache`` keeps [B, S, K, H] buffers per layer (simple, for tests and small batches).
``PagedKVCache`` keeps a pool of fixed-size pages per layer, [P, page_size, K, H], and a page
table [B, max_pages] per row: the rollout engine's layout, where finished sequences free pages
and new ones take them. Padded tokens (``t >= num_new[b]``) are never written there, since a
row's page past its length may not be allocated yet and could belong to another sequence.

FP8 KV (``PagedKVCache`` with a float8_e4m3fn pool): K and V are stored as E4M3 with one float32
scale per layer and tensor (``k_scale``/``v_scale``, dequantization multipliers), written with a
saturating cast of ``x * (1 / scale)`` and read back as ``q8 * scale`` in the compute dtype. The
attention itself then runs on dequantized values with float32 logits, softmax and PV
accumulation, so FP8 costs storage precision only: there is no low-precision accumulation whose
error would grow with context length. The scales are part of the cache pytree, so a
recalibration (after every weight update) replaces them like any other state.

Read path (``PagedKVCache.kernels``, a static field, ``Kernels.AUTO`` by default): a decode step
(T == 1) runs the Pallas paged-attention kernel (``pallas_kernels.paged_attention``) on a GPU
backend: it reads only the pages below each row's length, applies the FP8 scales in-kernel and
keeps logits, softmax and PV in float32 (power-of-two page sizes and head dims >= 16; other
shapes keep the reference under AUTO). A prefill or recompute chunk (T > 1) runs, under the same
rule, the Pallas prefill kernel (``pallas_kernels.prefill_attention``): flash-attention over the
row's pages with causal masking from ``lengths``, only the pages below each row's valid end read,
FP8 scales in-kernel, online softmax in float32 (its padded query rows are zero). Elsewhere the
pure-jnp reference gathers the row's pages and runs ``dot_attention``: CPU results are exactly
the reference's. ``Kernels.PALLAS`` forces the kernels (interpret mode off the GPU: tests);
``Kernels.REFERENCE`` never uses them.

Write path: a decode step that runs the decode kernel also writes its token's key and value with
the Pallas write kernel (``pallas_kernels.kv_write``: one program per row, pools aliased in place,
FP8 cast in-kernel, bitwise the scatter), where XLA's scatter costs milliseconds per decode step
at Qwen3-8B size. Prefill chunks keep the scatter.

Tensor parallelism (``PagedKVCache.heads``, a static ``HeadSharding``, None on one device): the
pools are sharded over their kv-head axis K on one mesh axis (the generator's tensor axis), the
way the column-parallel q/k/v projections split heads, so each device stores and reads only its
own heads' KV. Attention is independent per head (GQA groups never straddle shards when both N
and K divide by the axis size), so the Pallas kernels run per shard under ``shard_map`` with q,
the pools and the output split on heads and the page table, lengths and scales replicated: no
collective. The jnp reference path needs nothing: XLA's partitioner follows the sharded pools.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fp8rl_jax.models.attention import dot_attention
from fp8rl_jax.models.policy import Kernels
from fp8rl_jax.numerics.fp8 import saturating_cast
from pallas_kernels import kv_write as kv_write_kernel
from pallas_kernels import paged_attention as paged_kernel
from pallas_kernels import prefill_attention as prefill_kernel

_FP8 = jnp.dtype(jnp.float8_e4m3fn)


def _replace_at(items: tuple, i: int, value) -> tuple:
    return items[:i] + (value,) + items[i + 1 :]


def _decode_mask(lengths: jax.Array, T: int, S: int) -> jax.Array:
    """[B, T, S]: query t of row b (at position lengths[b] + t) sees keys j <= its position."""
    q_pos = lengths[:, None] + jnp.arange(T)[None, :]
    return jnp.arange(S)[None, None, :] <= q_pos[:, :, None]


@struct.dataclass
class KVCache:
    """Contiguous KV cache.

    Attributes:
      k: per layer, keys [B, S, K, H] after k-norm and RoPE.
      v: per layer, values [B, S, K, H].
      lengths: [B] int32, tokens already in the cache per row (the next write position).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @classmethod
    def init(cls, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype) -> "KVCache":
        shape = (batch, max_len, num_kv_heads, head_dim)
        return cls(k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    def attend(self, layer: int, q, k, v, num_new) -> tuple[jax.Array, "KVCache"]:
        """Padded tokens are written too (into the row's own buffer, past its length, where
        the next step overwrites them). ``dynamic_update_slice`` clamps a write that would pass
        the end: callers keep ``lengths + T <= max_len``."""
        del num_new
        T = q.shape[1]
        write = jax.vmap(lambda c, x, s: jax.lax.dynamic_update_slice(c, x.astype(c.dtype), (s, 0, 0)))
        kc = write(self.k[layer], k, self.lengths)
        vc = write(self.v[layer], v, self.lengths)
        out = dot_attention(q, kc.astype(q.dtype), vc.astype(q.dtype), _decode_mask(self.lengths, T, self.max_len))
        return out, self.replace(k=_replace_at(self.k, layer, kc), v=_replace_at(self.v, layer, vc))

    def advance(self, num_new: jax.Array) -> "KVCache":
        """Counts ``num_new`` [B] (or a scalar) real tokens as written."""
        return self.replace(lengths=self.lengths + jnp.asarray(num_new, jnp.int32))


@dataclasses.dataclass(frozen=True)
class HeadSharding:
    """The pools' kv-head axis split over ``mesh`` axis ``axis`` (hashable: a static cache field)."""

    mesh: Mesh
    axis: str

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis]

    @property
    def pool_spec(self) -> P:
        """Spec of a page pool [P, page_size, K, H] (no trailing None: the spec XLA gives the pools a
        program returns, so a fresh pool and a returned one are the same input sharding to jit and
        compile one program, not two)."""
        return P(None, None, self.axis)

    def per_head(self, fn, q_spec: P, n_args: int):
        """``fn(q, k_pages, v_pages, *replicated)`` run per head shard: q and the output split by
        ``q_spec``, the pools by ``pool_spec``, the other ``n_args - 3`` arguments replicated."""
        in_specs = (q_spec, self.pool_spec, self.pool_spec) + (P(),) * (n_args - 3)
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=q_spec, check_vma=False)


@struct.dataclass
class PagedKVCache:
    """Paged KV cache, BF16 or FP8 (E4M3 with per-layer scales).

    Attributes:
      k_pages: per layer, the key page pool [P, page_size, K, H].
      v_pages: per layer, the value page pool [P, page_size, K, H].
      k_scale: [L] float32 dequantization scales of the keys (1.0 unless the pool is FP8).
      v_scale: [L] float32 dequantization scales of the values.
      page_table: [B, max_pages] int32, row b's i-th page (only entries below
        ceil(lengths / page_size) after the write are read; the engine allocates them).
      lengths: [B] int32, tokens already in the cache per row.
      kernels: static `Kernels`, which implementation reads the cache in a decode step (module
        note); None means ``Kernels.AUTO``.
      heads: static `HeadSharding` of the pools under tensor parallelism (module note), or None.
    """

    k_pages: tuple[jax.Array, ...]
    v_pages: tuple[jax.Array, ...]
    k_scale: jax.Array
    v_scale: jax.Array
    page_table: jax.Array
    lengths: jax.Array
    kernels: Kernels | None = struct.field(pytree_node=False, default=None)
    heads: HeadSharding | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def init(cls, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
             batch: int, max_pages: int, dtype, kernels: Kernels | None = None,
             heads: HeadSharding | None = None, device: jax.Device | None = None) -> "PagedKVCache":
        """An empty cache; with ``heads`` the pools are allocated already split over kv heads (each
        device only ever holds its share) and the scales replicated on the mesh; with ``device`` (and no
        ``heads``) every array is committed to that device (the pools allocated there, no copy), else
        uncommitted."""
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        if heads is None and device is not None:
            one = jax.sharding.SingleDeviceSharding(device)
            pool = jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=one)
            ones = jax.jit(functools.partial(jnp.ones, (num_layers,), jnp.float32), out_shardings=one)
            return cls(k_pages=tuple(pool() for _ in range(num_layers)),
                       v_pages=tuple(pool() for _ in range(num_layers)), k_scale=ones(), v_scale=ones(),
                       page_table=jax.device_put(jnp.zeros((batch, max_pages), jnp.int32), device),
                       lengths=jax.device_put(jnp.zeros((batch,), jnp.int32), device), kernels=kernels, heads=heads)
        if heads is None:
            pool = functools.partial(jnp.zeros, shape, dtype)
            ones = functools.partial(jnp.ones, (num_layers,), jnp.float32)
        else:
            pool = jax.jit(functools.partial(jnp.zeros, shape, dtype),
                           out_shardings=NamedSharding(heads.mesh, heads.pool_spec))
            ones = jax.jit(functools.partial(jnp.ones, (num_layers,), jnp.float32),
                           out_shardings=NamedSharding(heads.mesh, P()))
        return cls(
            k_pages=tuple(pool() for _ in range(num_layers)),
            v_pages=tuple(pool() for _ in range(num_layers)),
            k_scale=ones(),
            v_scale=ones(),
            page_table=jnp.zeros((batch, max_pages), jnp.int32),
            lengths=jnp.zeros((batch,), jnp.int32),
            kernels=kernels,
            heads=heads,
        )

    @property
    def page_size(self) -> int:
        return self.k_pages[0].shape[1]

    @property
    def num_pages(self) -> int:
        return self.k_pages[0].shape[0]

    @property
    def is_fp8(self) -> bool:
        return self.k_pages[0].dtype == _FP8

    def _store(self, x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
        if dtype == _FP8:
            return saturating_cast(x.astype(jnp.float32) * (1.0 / scale))
        return x.astype(dtype)

    def _load(self, pages: jax.Array, scale: jax.Array, dtype) -> jax.Array:
        if pages.dtype == _FP8:
            return (pages.astype(jnp.float32) * scale).astype(dtype)
        return pages.astype(dtype)

    def _decode_kernel(self, T: int, head_dim: int) -> bool:
        """Whether this attend runs the Pallas decode kernel (static)."""
        kernels = Kernels.AUTO if self.kernels is None else self.kernels
        if not isinstance(kernels, Kernels):
            raise ValueError(f"PagedKVCache.kernels must be a Kernels or None, got {kernels!r}")
        if T != 1 or not kernels.pallas():
            return False
        return kernels is Kernels.PALLAS or paged_kernel.supports(self.page_size, head_dim)

    def _prefill_kernel(self, T: int, head_dim: int) -> bool:
        """Whether this attend runs the Pallas prefill kernel (static; same rule as decode, T > 1)."""
        kernels = Kernels.AUTO if self.kernels is None else self.kernels
        if not isinstance(kernels, Kernels):
            raise ValueError(f"PagedKVCache.kernels must be a Kernels or None, got {kernels!r}")
        if T <= 1 or not kernels.pallas():
            return False
        return kernels is Kernels.PALLAS or prefill_kernel.supports(self.page_size, head_dim)

    def _write_kernel(self, k, v, kp, vp, page, slot, layer: int):
        """The decode step's write (one token per row) through the Pallas kernel, per head shard
        under tensor parallelism; bitwise the scatter of the reference path."""
        fn = kv_write_kernel.kv_write
        if self.heads is not None:
            rows = P(None, self.heads.axis, None)
            fn = jax.shard_map(fn, mesh=self.heads.mesh, in_specs=(rows, rows, self.heads.pool_spec,
                                                                   self.heads.pool_spec, P(), P(), P(), P()),
                               out_specs=(self.heads.pool_spec, self.heads.pool_spec), check_vma=False)
        return fn(k, v, kp, vp, page, slot, self.k_scale[layer], self.v_scale[layer])

    def _targets(self, T: int, num_new) -> tuple[jax.Array, jax.Array]:
        """(page, slot) [B, T] of the tokens this attend writes; tokens past ``num_new`` (or past the page
        table) get page ``num_pages``, which every write drops."""
        B = self.lengths.shape[0]
        ps, max_pages = self.page_size, self.page_table.shape[1]
        num_new = jnp.broadcast_to(jnp.asarray(num_new, jnp.int32), (B,))
        pos = self.lengths[:, None] + jnp.arange(T)[None, :]  # [B, T]
        page_idx = pos // ps
        page = jnp.take_along_axis(self.page_table, jnp.minimum(page_idx, max_pages - 1), axis=1)
        real = (jnp.arange(T)[None, :] < num_new[:, None]) & (page_idx < max_pages)
        return jnp.where(real, page, self.num_pages), pos % ps

    def _with_pools(self, layer: int, kp, vp) -> "PagedKVCache":
        return self.replace(k_pages=_replace_at(self.k_pages, layer, kp), v_pages=_replace_at(self.v_pages, layer, vp))

    def _decode_attention(self, layer: int, q, kp, vp) -> jax.Array:
        """The decode kernel over the written pools: q [B, N, H] -> [B, N, H]; keys j <= lengths[b] (the
        new one included), as the reference's mask; scales only apply to an FP8 pool (``_load``)."""
        one = jnp.float32(1.0)
        ks, vs = (self.k_scale[layer], self.v_scale[layer]) if self.is_fp8 else (one, one)
        fn = paged_kernel.paged_attention
        if self.heads is not None:
            fn = self.heads.per_head(fn, P(None, self.heads.axis, None), 7)
        return fn(q, kp, vp, ks, vs, self.page_table, self.lengths + 1)

    def qkv_kernel(self, T: int, num_heads: int, head_dim: int) -> bool:
        """Whether a decode attend can take the fused q/k/v GEMM's raw output (`attend_qkv`: q/k norms, RoPE
        and the KV write in one kernel; static). Not under tensor parallelism (head-sharded columns), nor with
        ``FP8RL_FUSED_QKV=0`` in the environment at trace time (the separate ops, for A/B timing)."""
        K = self.k_pages[0].shape[2]
        return (os.environ.get("FP8RL_FUSED_QKV", "1") != "0" and self.heads is None
                and self._decode_kernel(T, head_dim) and kv_write_kernel.supports_qkv(num_heads, K, head_dim))

    def attend_qkv(self, layer: int, qkv, q_norm, k_norm, eps: tuple[float, float], cos, sin, num_new,
                   num_heads: int) -> tuple[jax.Array, "PagedKVCache"]:
        """A decode step's attention from the fused q/k/v GEMM's output ``qkv`` [B, 1, (N + 2K) H] (q's heads,
        k's, v's): q and k RMS-normalized (weights ``q_norm`` / ``k_norm`` [H], epsilons ``eps``) and rotated
        (``cos`` / ``sin`` [B, 1, H]), k and v written, in one kernel (`pallas_kernels.kv_write.qkv_rope_write`),
        then the decode kernel. The same ops as the model's norms and RoPE followed by `attend` (tests).
        Returns ``(out [B, 1, N, H], cache)``; only where `qkv_kernel` holds."""
        page, slot = self._targets(1, num_new)
        q, kp, vp = kv_write_kernel.qkv_rope_write(
            qkv[:, 0], q_norm, k_norm, cos[:, 0], sin[:, 0], self.k_pages[layer], self.v_pages[layer], page[:, 0],
            slot[:, 0], self.k_scale[layer], self.v_scale[layer], num_heads=num_heads, q_eps=eps[0], k_eps=eps[1])
        return self._decode_attention(layer, q, kp, vp)[:, None], self._with_pools(layer, kp, vp)

    def attend(self, layer: int, q, k, v, num_new) -> tuple[jax.Array, "PagedKVCache"]:
        B, T = q.shape[:2]
        ps, max_pages = self.page_size, self.page_table.shape[1]
        page, slot = self._targets(T, num_new)
        kp, vp = self.k_pages[layer], self.v_pages[layer]
        K, H = kp.shape[2:]
        if self._decode_kernel(T, H) and kv_write_kernel.supports(K, H):
            kp, vp = self._write_kernel(k[:, 0], v[:, 0], kp, vp, page[:, 0], slot[:, 0], layer)
        else:
            kp = kp.at[page, slot].set(self._store(k, self.k_scale[layer], kp.dtype), mode="drop")
            vp = vp.at[page, slot].set(self._store(v, self.v_scale[layer], vp.dtype), mode="drop")
        new = self._with_pools(layer, kp, vp)
        if self._decode_kernel(T, H):
            return self._decode_attention(layer, q[:, 0], kp, vp)[:, None], new
        if self._prefill_kernel(T, H):
            # reads keys j < lengths[b] + num_new[b] (written above), query t seeing j <= lengths[b] + t
            one = jnp.float32(1.0)
            ks, vs = (self.k_scale[layer], self.v_scale[layer]) if self.is_fp8 else (one, one)
            fn = prefill_kernel.prefill_attention
            if self.heads is not None:
                fn = self.heads.per_head(fn, P(None, None, self.heads.axis, None), 8)
            out = fn(q, kp, vp, ks, vs, self.page_table, self.lengths, num_new)
            return out, new
        kg = self._load(kp[self.page_table], self.k_scale[layer], q.dtype).reshape(B, max_pages * ps, K, H)
        vg = self._load(vp[self.page_table], self.v_scale[layer], q.dtype).reshape(B, max_pages * ps, K, H)
        out = dot_attention(q, kg, vg, _decode_mask(self.lengths, T, max_pages * ps))
        return out, new

    def advance(self, num_new: jax.Array) -> "PagedKVCache":
        return self.replace(lengths=self.lengths + jnp.asarray(num_new, jnp.int32))
