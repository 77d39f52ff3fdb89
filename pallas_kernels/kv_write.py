"""Decode-step KV write (Pallas, Triton lowering): one new key and value per row into the page pools, in place.

Design note
===========

What: the write half of a decode step's attention. Row b's new key and value ``k_new[b], v_new[b]``
``[K, H]`` (after k-norm and RoPE, in the compute dtype) go to slot ``slot[b]`` of page
``page[b]`` of the pools ``[P, page_size, K, H]`` (the ``PagedKVCache`` layout); rows whose
``page[b]`` is outside ``[0, P)`` (finished or empty slots, padding) write nothing. FP8 pools
store ``saturating_cast(x * inv_scale)`` (clip to +-448, round to nearest even), exactly the
cache's ``_store``; other pools store ``x`` cast to the pool dtype.

Why a kernel: XLA lowers the cache's ``pool.at[page, slot].set(x)`` to a scatter that measured
2.2 ms per Qwen3-8B decode step (72 scatters of 256 rows x 2 KB) on a BF16 pool and 5.9 ms on
an FP8 one (H200, ``experiments/profile_decode.py``), 6-16% of the step, for 38 MB (BF16) of
writes. Here one program per row stores its ``[K, H]`` key and value tile (contiguous in the
pool: one token's heads) with masked vector stores; the pools are aliased to the outputs
(``input_output_aliases``), so nothing else is read or written and, under ``jit`` with the pool
donated or carried in a loop, the update is in place.

Math: none beyond the cast; bitwise equal to the reference twin (`kv_write_reference`, the
scatter the cache used). Under tensor parallelism the cache runs it per kv-head shard
(``shard_map``): rows, pages and slots are the same on every shard.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import resolve_interpret

_FP8 = jnp.dtype(jnp.float8_e4m3fn)
E4M3_MAX = 448.0


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def supports(num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel takes a pool of this many kv heads and head dim (Triton tiles are powers
    of two; the write is one ``[K, H]`` tile per row)."""
    return _pow2(num_kv_heads) and _pow2(head_dim) and num_kv_heads * head_dim >= 16


def _cast(x: jax.Array, inv_scale: jax.Array, dtype) -> jax.Array:
    if jnp.dtype(dtype) == _FP8:
        return jnp.clip(x.astype(jnp.float32) * inv_scale, -E4M3_MAX, E4M3_MAX).astype(dtype)
    return x.astype(dtype)


def _write_kernel(page_ref, slot_ref, inv_ref, k_ref, v_ref, kp_in, vp_in, kp_out, vp_out, *, num_pages: int):
    """Refs: page/slot [B], inv [2] (1 / k_scale, 1 / v_scale), k/v [K, H] (this row), pools
    [P, page_size, K, H] (aliased in/out; only the outputs are touched)."""
    del kp_in, vp_in  # the same buffers as the outputs
    b = pl.program_id(0)
    page, slot = page_ref[b], slot_ref[b]
    kh, h = k_ref.shape
    ok = (page >= 0) & (page < num_pages)
    page = jnp.clip(page, 0, num_pages - 1)
    shape = (kh, h)
    idx = (jnp.full(shape, page, jnp.int32), jnp.full(shape, slot, jnp.int32),
           jnp.broadcast_to(jnp.arange(kh, dtype=jnp.int32)[:, None], shape),
           jnp.broadcast_to(jnp.arange(h, dtype=jnp.int32)[None, :], shape))
    mask = jnp.full(shape, ok)
    plgpu.store(kp_out.at[idx], _cast(k_ref[...], inv_ref[0], kp_out.dtype), mask=mask)
    plgpu.store(vp_out.at[idx], _cast(v_ref[...], inv_ref[1], vp_out.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _kv_write(k_new, v_new, k_pages, v_pages, page, slot, inv_scales, interpret: bool):
    B, K, H = k_new.shape
    P, ps = k_pages.shape[:2]
    pool = pl.BlockSpec((P, ps, K, H), lambda b: (0, 0, 0, 0))
    return pl.pallas_call(
        functools.partial(_write_kernel, num_pages=P),
        grid=(B,),
        in_specs=[
            pl.BlockSpec((B,), lambda b: (0,)),
            pl.BlockSpec((B,), lambda b: (0,)),
            pl.BlockSpec((2,), lambda b: (0,)),
            pl.BlockSpec((None, K, H), lambda b: (b, 0, 0)),
            pl.BlockSpec((None, K, H), lambda b: (b, 0, 0)),
            pool,
            pool,
        ],
        out_specs=[pool, pool],
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={5: 0, 6: 1},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="paged_kv_write",
    )(page, slot, inv_scales, k_new, v_new, k_pages, v_pages)


def _check(k_new, v_new, k_pages, v_pages, page, slot, k_scale, v_scale) -> None:
    if k_new.ndim != 3 or k_new.shape != v_new.shape:
        raise ValueError(f"k_new and v_new must both be [B, K, H], got {tuple(k_new.shape)} and {tuple(v_new.shape)}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages and v_pages must be equal [P, page_size, K, H] pools, got "
                         f"{tuple(k_pages.shape)} {k_pages.dtype} and {tuple(v_pages.shape)} {v_pages.dtype}")
    B, K, H = k_new.shape
    if tuple(k_pages.shape[2:]) != (K, H):
        raise ValueError(f"the pools hold [K, H] = {tuple(k_pages.shape[2:])} per token, the new rows {(K, H)}")
    if not supports(K, H):
        raise ValueError(f"kv heads ({K}) and head dim ({H}) must be powers of two with K * H >= 16")
    for name, x in (("page", page), ("slot", slot)):
        if tuple(x.shape) != (B,) or jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
            raise ValueError(f"{name} must be int32 [B={B}], got {tuple(x.shape)} {x.dtype}")
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if jnp.size(x) != 1:
            raise ValueError(f"{name} must be one scalar, got shape {jnp.shape(x)}")


def kv_write(k_new: jax.Array, v_new: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page: jax.Array,
             slot: jax.Array, k_scale: jax.Array, v_scale: jax.Array, *,
             interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Writes row b's ``k_new[b], v_new[b]`` ``[K, H]`` at ``(page[b], slot[b])`` of the pools.

    Args:
      k_new, v_new: ``[B, K, H]`` new keys and values (any float dtype).
      k_pages, v_pages: ``[P, page_size, K, H]`` pools (bfloat16, float32 or float8_e4m3fn),
        aliased to the outputs: inside a jitted program whose pools are donated or loop-carried
        the write is in place (otherwise XLA copies them first).
      page: ``[B]`` int32 page of each row's write; outside ``[0, P)`` = no write.
      slot: ``[B]`` int32 slot within the page (``0 <= slot < page_size`` where written).
      k_scale, v_scale: float32 dequantization scales of FP8 pools (stored: ``x / scale``,
        saturated); ignored for other pools.
      interpret: None runs natively on a GPU backend and in interpret mode otherwise.

    Returns:
      The updated ``(k_pages, v_pages)``.
    """
    _check(k_new, v_new, k_pages, v_pages, page, slot, k_scale, v_scale)
    inv = jnp.stack([1.0 / jnp.asarray(k_scale, jnp.float32).reshape(()),
                     1.0 / jnp.asarray(v_scale, jnp.float32).reshape(())])
    return _kv_write(k_new, v_new, k_pages, v_pages, page, slot, inv, resolve_interpret(interpret))


@jax.jit
def kv_write_reference(k_new, v_new, k_pages, v_pages, page, slot, k_scale, v_scale):
    """Pure-jnp twin: the scatter ``pool.at[page, slot].set(cast(x))`` (rows out of range dropped)."""
    _check(k_new, v_new, k_pages, v_pages, page, slot, k_scale, v_scale)
    P = k_pages.shape[0]
    page = jnp.where((page >= 0) & (page < P), page, P)  # out of range: dropped
    ks = 1.0 / jnp.asarray(k_scale, jnp.float32).reshape(())
    vs = 1.0 / jnp.asarray(v_scale, jnp.float32).reshape(())
    k_pages = k_pages.at[page, slot].set(_cast(k_new, ks, k_pages.dtype), mode="drop")
    v_pages = v_pages.at[page, slot].set(_cast(v_new, vs, v_pages.dtype), mode="drop")
    return k_pages, v_pages
