"""Decode-step KV write (Pallas, Triton lowering): each row's new key and value into the page pools, in place.

`kv_write`: row b's ``k_new[b], v_new[b]`` ``[K, H]`` go to slot ``slot[b]`` of page ``page[b]`` of the
pools ``[P, page_size, K, H]`` (the ``PagedKVCache`` layout); rows whose page is outside ``[0, P)``
(finished or empty slots, padding) write nothing. FP8 pools store ``saturating_cast(x / scale)`` (clip to
+-448, round to nearest even), other pools ``x`` cast to the pool dtype. One program per row stores its
``[K, H]`` tile (one token's heads, contiguous in the pool) with masked vector stores; the pools are
aliased to the outputs (``input_output_aliases``), so under ``jit`` with the pools donated or carried in a
loop the update is in place and nothing else is read or written. XLA lowers the same update
(``pool.at[page, slot].set(x)``, the twin `kv_write_reference`) to a much slower scatter. Under tensor
parallelism the cache runs it per kv-head shard: rows, pages and slots are the same on every shard.

`qkv_rope_write`: a decode step's q/k/v epilogue and KV write in one pass. One program per row reads the
row's ``[(N + 2K) H]`` fused q/k/v GEMM output once, RMS-normalizes q and k per head (Qwen3's q_norm /
k_norm), rotates both (RoPE), writes q ``[N, H]`` (the attention kernel's input) and stores k and v in
the pools as `kv_write` does. The maths is the model's ops in their order: per head
``y = w * (x * rsqrt(mean(x^2) + eps))`` with the mean in float32 and the product in q's dtype, then
``y * c + rot(y) * s`` with ``c, s`` cast to q's dtype and ``rot(y) = [-y[H/2:], y[:H/2]]``. The rotated
half is a second, permuted load of the same row (``(h + H/2) mod H``), so no register tile is sliced.
Interpret mode equals the twin (`qkv_rope_write_reference`) bit for bit; on the GPU XLA's composition
may differ by a bf16 rounding step on a few elements (reassociation, excess precision).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.act_quant import rms_norm_reference
from pallas_kernels.common import resolve_interpret
from pallas_kernels.fp8_quant import saturating_cast

_FP8 = jnp.dtype(jnp.float8_e4m3fn)


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def supports(num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel takes a pool of this many kv heads and head dim (Triton tiles are powers
    of two; the write is one ``[K, H]`` tile per row)."""
    return _pow2(num_kv_heads) and _pow2(head_dim) and num_kv_heads * head_dim >= 16


def _cast(x: jax.Array, inv_scale: jax.Array, dtype) -> jax.Array:
    if jnp.dtype(dtype) == _FP8:
        return saturating_cast(x.astype(jnp.float32) * inv_scale, dtype)
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


def supports_qkv(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether `qkv_rope_write` takes this attention shape (the pool write's rule, an even head dim for
    RoPE's halves, and whole GQA groups; the query heads need not be a power of two)."""
    return (supports(num_kv_heads, head_dim) and head_dim % 2 == 0 and num_heads >= 1
            and num_heads % num_kv_heads == 0)


def _pow2_parts(n: int) -> list[tuple[int, int]]:
    """``(first, rows)`` pieces of ``range(n)`` whose sizes are powers of two (``n``'s binary digits, largest
    first): Triton tiles, with no padding rows to mask (40 query heads: 32 + 8)."""
    parts, first = [], 0
    for bit in reversed(range(n.bit_length())):
        if n >> bit & 1:
            parts.append((first, 1 << bit))
            first += 1 << bit
    return parts


def _norm_rope_tile(qkv_ref, b, first: int, rows: int, h: int, w, wp, c, s, neg, eps: float, dt):
    """Heads ``first .. first + rows`` (a power of two) of row ``b``: RMS-normalized with ``w`` and rotated.
    ``wp`` is ``w`` at the permuted dims ``(d + H/2) mod H``, ``neg`` the dims whose rotated value is negated,
    ``c`` / ``s`` the rotary tables rounded to ``dt``."""
    r_idx = jnp.arange(rows, dtype=jnp.int32)[:, None]
    d_idx = jnp.arange(h, dtype=jnp.int32)[None, :]
    base = (first + r_idx) * h
    bb = jnp.full((rows, h), b, jnp.int32)
    x = plgpu.load(qkv_ref.at[bb, base + d_idx]).astype(jnp.float32)
    xp = plgpu.load(qkv_ref.at[bb, base + (d_idx + h // 2) % h]).astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / h + eps)
    y = (w[None, :] * (x * inv).astype(dt).astype(jnp.float32)).astype(dt).astype(jnp.float32)
    yp = (wp[None, :] * (xp * inv).astype(dt).astype(jnp.float32)).astype(dt).astype(jnp.float32)
    rot = jnp.where(neg[None, :], -yp, yp)
    out = (y * c[None, :]).astype(dt).astype(jnp.float32) + (rot * s[None, :]).astype(dt).astype(jnp.float32)
    return out.astype(dt)


def _qkv_kernel(page_ref, slot_ref, inv_ref, qkv_ref, cos_ref, sin_ref, qw_ref, kw_ref, kp_in, vp_in,
                q_out, kp_out, vp_out, *, num_pages: int, num_heads: int, q_eps: float, k_eps: float):
    """Refs: page/slot [B], inv [2], qkv [B, (N + 2K) H], cos/sin [B, H] float32, qw/kw [H] (the norms'
    weights), pools [P, page_size, K, H] (aliased in/out), q_out [B, N, H]. One program per row."""
    del kp_in, vp_in
    b = pl.program_id(0)
    kh, h = kp_out.shape[2], kp_out.shape[3]
    n = num_heads
    dt = q_out.dtype
    d = jnp.arange(h, dtype=jnp.int32)
    dp = (d + h // 2) % h
    neg = d < h // 2
    c = plgpu.load(cos_ref.at[b, d]).astype(dt).astype(jnp.float32)
    s = plgpu.load(sin_ref.at[b, d]).astype(dt).astype(jnp.float32)

    def weights(ref):  # the norm weight cast to q's dtype, as rms_norm does, at the dims and the permuted ones
        return (plgpu.load(ref.at[d]).astype(dt).astype(jnp.float32),
                plgpu.load(ref.at[dp]).astype(dt).astype(jnp.float32))

    qw = weights(qw_ref)
    for first, rows in _pow2_parts(n):
        q = _norm_rope_tile(qkv_ref, b, first, rows, h, *qw, c, s, neg, q_eps, dt)
        q_idx = (jnp.full((rows, h), b, jnp.int32),
                 jnp.broadcast_to(first + jnp.arange(rows, dtype=jnp.int32)[:, None], (rows, h)),
                 jnp.broadcast_to(d[None, :], (rows, h)))
        plgpu.store(q_out.at[q_idx], q)

    k = _norm_rope_tile(qkv_ref, b, n, kh, h, *weights(kw_ref), c, s, neg, k_eps, dt)
    kv_rows = jnp.broadcast_to(jnp.arange(kh, dtype=jnp.int32)[:, None], (kh, h))
    cols = jnp.broadcast_to(d[None, :], (kh, h))
    v = plgpu.load(qkv_ref.at[jnp.full((kh, h), b, jnp.int32), (n + kh + kv_rows) * h + cols])

    page, slot = page_ref[b], slot_ref[b]
    ok = jnp.full((kh, h), (page >= 0) & (page < num_pages))
    page = jnp.clip(page, 0, num_pages - 1)
    idx = (jnp.full((kh, h), page, jnp.int32), jnp.full((kh, h), slot, jnp.int32), kv_rows, cols)
    plgpu.store(kp_out.at[idx], _cast(k, inv_ref[0], kp_out.dtype), mask=ok)
    plgpu.store(vp_out.at[idx], _cast(v, inv_ref[1], vp_out.dtype), mask=ok)


@functools.partial(jax.jit, static_argnames=("num_heads", "q_eps", "k_eps", "num_warps", "interpret"))
def _qkv_rope_write(qkv, cos, sin, q_norm, k_norm, k_pages, v_pages, page, slot, inv_scales, *, num_heads: int,
                    q_eps: float, k_eps: float, num_warps: int, interpret: bool):
    B, W = qkv.shape
    P, ps, K, H = k_pages.shape
    pool = pl.BlockSpec((P, ps, K, H), lambda b: (0, 0, 0, 0))

    def whole(*shape):
        return pl.BlockSpec(shape, lambda b: (0,) * len(shape))

    return pl.pallas_call(
        functools.partial(_qkv_kernel, num_pages=P, num_heads=num_heads, q_eps=q_eps, k_eps=k_eps),
        grid=(B,),
        in_specs=[whole(B), whole(B), whole(2), whole(B, W), whole(B, H), whole(B, H), whole(H), whole(H), pool, pool],
        out_specs=[whole(B, num_heads, H), pool, pool],
        out_shape=[jax.ShapeDtypeStruct((B, num_heads, H), qkv.dtype),
                   jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={8: 1, 9: 2},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="qkv_rope_kv_write",
    )(page, slot, inv_scales, qkv, cos, sin, q_norm, k_norm, k_pages, v_pages)


def _check_qkv(qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, page, slot, k_scale, v_scale, num_heads) -> None:
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages must be a [P, page_size, K, H] pool, got {tuple(k_pages.shape)}")
    K, H = k_pages.shape[2:]
    if qkv.ndim != 2 or qkv.shape[1] != (num_heads + 2 * K) * H:
        raise ValueError(f"qkv must be [B, (N + 2K) * H] = [B, {(num_heads + 2 * K) * H}] for N={num_heads} query "
                         f"heads, K={K} kv heads of H={H}, got {tuple(qkv.shape)}")
    if not jnp.issubdtype(qkv.dtype, jnp.floating) or jnp.dtype(qkv.dtype) == _FP8:
        raise ValueError(f"qkv must be bfloat16, float16 or float32, got {qkv.dtype}")
    if not supports_qkv(num_heads, K, H):
        raise ValueError(f"unsupported attention shape: {num_heads} query heads, {K} kv heads (a power of two "
                         f"dividing them), head dim {H} (a power of two, K * H >= 16)")
    B = qkv.shape[0]
    for name, x in (("q_norm", q_norm), ("k_norm", k_norm)):
        if tuple(x.shape) != (H,):
            raise ValueError(f"{name} must be [H={H}], got {tuple(x.shape)}")
    for name, x in (("cos", cos), ("sin", sin)):
        if tuple(x.shape) != (B, H):
            raise ValueError(f"{name} must be [B, H] = {(B, H)}, got {tuple(x.shape)}")
    _check(jnp.zeros((B, K, H), qkv.dtype), jnp.zeros((B, K, H), qkv.dtype), k_pages, v_pages, page, slot,
           k_scale, v_scale)


def qkv_rope_write(qkv: jax.Array, q_norm: jax.Array, k_norm: jax.Array, cos: jax.Array, sin: jax.Array,
                   k_pages: jax.Array, v_pages: jax.Array, page: jax.Array, slot: jax.Array, k_scale: jax.Array,
                   v_scale: jax.Array, *, num_heads: int, q_eps: float, k_eps: float, num_warps: int = 8,
                   interpret: bool | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A decode step's q/k/v epilogue and KV write in one kernel (module note).

    Args:
      qkv: ``[B, (N + 2K) H]`` the fused q/k/v GEMM's output, one token per row (q's heads, then k's,
        then v's).
      q_norm, k_norm: ``[H]`` the RMSNorm weights of q and k (Qwen3's per-head norms).
      cos, sin: ``[B, H]`` float32 rotary tables at each row's position (`rope_cos_sin`).
      k_pages, v_pages, page, slot, k_scale, v_scale: as `kv_write` (pools aliased, rows whose page is
        outside ``[0, P)`` write nothing).
      num_heads: N. q_eps, k_eps: the norms' epsilons.
      num_warps: per program (one row); 8 is the fastest measured at 64 and 256 rows.

    Returns:
      ``(q [B, N, H], k_pages, v_pages)``: q normalized and rotated in qkv's dtype, the pools updated.
    """
    _check_qkv(qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, page, slot, k_scale, v_scale, num_heads)
    inv = jnp.stack([1.0 / jnp.asarray(k_scale, jnp.float32).reshape(()),
                     1.0 / jnp.asarray(v_scale, jnp.float32).reshape(())])
    return _qkv_rope_write(qkv, cos.astype(jnp.float32), sin.astype(jnp.float32), q_norm, k_norm, k_pages, v_pages,
                           page, slot, inv, num_heads=num_heads, q_eps=float(q_eps), k_eps=float(k_eps),
                           num_warps=num_warps, interpret=resolve_interpret(interpret))


def _norm_rope_reference(x, weight, eps: float, cos, sin):
    """Heads ``x [B, n, H]`` RMS-normalized with ``weight [H]`` and rotated by ``cos, sin [B, H]`` (float32),
    each op rounded to x's dtype as the model rounds it: the twin of `_norm_rope_tile`."""
    y = rms_norm_reference(x, weight, eps)
    h = x.shape[-1] // 2
    rot = jnp.concatenate([-y[..., h:], y[..., :h]], axis=-1)
    return y * cos[:, None, :].astype(x.dtype) + rot * sin[:, None, :].astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("num_heads", "q_eps", "k_eps"))
def qkv_rope_write_reference(qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, page, slot, k_scale, v_scale, *,
                             num_heads: int, q_eps: float, k_eps: float):
    """Pure-jnp twin: split, per-head RMS norm and RoPE (`_norm_rope_reference`), then `kv_write_reference`."""
    _check_qkv(qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, page, slot, k_scale, v_scale, num_heads)
    B = qkv.shape[0]
    K, H = k_pages.shape[2:]
    q, k, v = jnp.split(qkv, [num_heads * H, (num_heads + K) * H], axis=-1)
    q = _norm_rope_reference(q.reshape(B, num_heads, H), q_norm, q_eps, cos, sin)
    k = _norm_rope_reference(k.reshape(B, K, H), k_norm, k_eps, cos, sin)
    # k rounded to its dtype before the FP8 cast, as the kernel and the model store it: without the barrier
    # XLA may fuse the chain and keep its float32 value (excess precision)
    k = jax.lax.optimization_barrier(k)
    k_pages, v_pages = kv_write_reference(k, v.reshape(B, K, H), k_pages, v_pages, page, slot, k_scale, v_scale)
    return q, k_pages, v_pages
