"""Paged prefill attention (Pallas, Triton lowering): T new query tokens per row over a paged KV pool.

Design note
===========

What: the attention of a prefill or recompute chunk in the rollout engine. Row b has queries
``q [B, T, N, H]`` for tokens at positions ``lengths[b] + t``, of which the first ``num_new[b]``
are real; their keys and values are already written into the pool (``PagedKVCache.attend``
writes before it reads), so row b holds valid keys ``j < lengths[b] + num_new[b]``, key ``j``
at ``k_pages[page_table[b, j // page_size], j % page_size]``. Query t sees keys
``j <= lengths[b] + t`` (causal, continuing after the cache content: ``lengths > 0`` is a chunked
prefill or the recompute of a preempted sequence). Pools are ``[P, page_size, K, H]`` in
bfloat16, float32 or float8_e4m3fn with one float32 dequantization scale per tensor
(``k_scale``, ``v_scale``: ``K ~= k8 * k_scale``). Output ``[B, T, N, H]`` in q's dtype; padded
query rows (``t >= num_new[b]``) are exactly zero.

Grid: one program per (row b, query block i, kv head k). A program takes the ``block_q`` tokens
of its block times the ``G = N / K`` query heads of its kv head as one ``[block_q * Gp, H]`` tile
(GQA: each K/V tile is read once for the group; ``Gp`` is G rounded up to a power of two, the
padding heads are zero and dropped), and walks the row's keys in blocks of ``pages_per_block``
pages (one element gather ``[pages_per_block, page_size, H]`` by page id per step, as in the
decode kernel), flash-attention style: an online softmax in float32 keeps only the running max
``m``, sum ``l`` and accumulator ``acc [block_q * Gp, H]``; no ``[T, S]`` logits exist anywhere.
Only the pages the block needs are read: keys below ``lengths[b] + min(last token of the block,
num_new[b] - 1) + 1``. The blocks fully below the causal diagonal (every key visible to every
query of the block) run a loop without masks; the one or two blocks crossing the diagonal run a
second, masked loop whose loads of tokens past the valid keys are masked off (no traffic, no
garbage: unwritten slots may hold anything, NaN included). A block whose queries are all padding
reads nothing and writes zeros. Query blocks are visited last-first along the grid axis, so the
longest (most keys) programs start first and the short ones fill the tail.

Math (the jnp twin does the same in the same order, in one block per row)::

    c = k_scale * H**-0.5                          # one float32 scalar
    s_tj = (q_t . k8_j) * c                        # k8 upcast to q's dtype (exact for E4M3 ->
                                                   # bf16/f32), the dot accumulates in float32
    online softmax over key blocks, float32:  m, l, acc   (masked logits = float32 min)
    p = exp(s - m) cast to q's dtype, acc += p @ v8 (float32 accumulation)
    out = acc / l * v_scale, zero for padded rows

So the FP8 scales are applied in-kernel to the float32 logits and output (not to the ``tokens x H``
tiles: 8x fewer multiplies at H = 128, exact up to one float32 rounding) and FP8 costs storage
precision only: logits, softmax and PV accumulate in float32, nothing low-precision accumulates
with context length. float32 operands use IEEE dots (``Precision.HIGHEST``), never TF32. Key 0 is
visible to every query, and the first key block is processed first, so every row's running max
is a real logit before any fully masked row-block comes: ``exp(mask - m)`` is then exactly 0.

Differences from the gather-all path it replaces (``PagedKVCache.attend`` reading
``kp[page_table]`` into ``dot_attention`` with a ``[B, N, T, S]`` float32 logit tensor, ``S =
max_pages * page_size``): that path rounds ``k8 * k_scale`` to q's dtype before the dot and
normalizes the probabilities before P@V; here the scale stays in float32 and the division comes
last. Both are within rounding of the float64 result (tests).

Layout constraints: ``page_size``, ``pages_per_block``, ``block_q`` and ``H`` powers of two
(Triton tiles), ``H >= 16``, ``N % K == 0``; ``pages_per_block`` is raised to ``16 / page_size``
for small pages and ``block_q`` so that ``block_q * Gp >= 16`` (a dot needs M, N >= 16), and
``block_q`` is lowered to ``next_pow2(T)`` for short chunks. T is padded to a multiple of
``block_q`` (one XLA pad of q and slice of the output, only when it does not divide). The page
table is padded by ``pages_per_block`` columns so a block's page-id slice never runs past it;
page ids are clamped to ``[0, P)``.

Deviations / limits: the output of padded query rows is zero (the gather-all path leaves them
arbitrary). The key tiles are element gathers (page ids per page, contiguous along H), software
pipelined by Triton's ``num_stages``; a Mosaic GPU version would use TMA page loads into a
shared-memory ring, wgmma with the GQA group filling M = 64/128 directly, and warp-specialized
producer/consumer warpgroups (FlashAttention-3 style). With G = 4 and ``block_q = 32`` a tile is
128 rows; for very short chunks (T < 16 / Gp) the tile is padded.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import resolve_interpret, write_results

# the same pool/query dtypes, mask value, Triton tile minimum (M and N of a dot) and page/head
# constraints as the decode kernel: both read the one paged cache
from pallas_kernels.paged_attention import (
    _FP8,
    _MASK_VALUE,
    _POOL_DTYPES,
    _Q_DTYPES,
    MIN_ROWS,
    _pow2,
    chained_ms,
    supports,
)


def _next_pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class PrefillAttentionConfig:
    """Tuning of the prefill kernel.

    Attributes:
      block_q: query tokens per program (a power of two); the tile is ``block_q * Gp`` rows.
      pages_per_block: pages gathered per inner step (a power of two); a key block is
        ``pages_per_block * page_size`` tokens.
      num_warps: Triton warps per program.
      num_stages: Triton software-pipelining stages of the key-block loops.
    """

    block_q: int = 32
    pages_per_block: int = 4
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "pages_per_block"):
            if not _pow2(getattr(self, name)):
                raise ValueError(f"PrefillAttentionConfig.{name} must be a power of two, got {getattr(self, name)!r}")
        for name in ("num_warps", "num_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"PrefillAttentionConfig.{name} must be a positive int, got {v!r}")


DEFAULT_CONFIG = PrefillAttentionConfig()
SWEEP_CONFIGS = (
    PrefillAttentionConfig(block_q=32, pages_per_block=4, num_warps=4, num_stages=2),
    PrefillAttentionConfig(block_q=32, pages_per_block=8, num_warps=8, num_stages=2),
    PrefillAttentionConfig(block_q=32, pages_per_block=4, num_warps=8, num_stages=3),
    PrefillAttentionConfig(block_q=16, pages_per_block=4, num_warps=4, num_stages=2),
    PrefillAttentionConfig(block_q=16, pages_per_block=8, num_warps=4, num_stages=3),
    PrefillAttentionConfig(block_q=64, pages_per_block=4, num_warps=8, num_stages=2),
)


def _prefill_kernel(start_ref, nn_ref, pt_ref, scale_ref, q_ref, k_ref, v_ref, o_ref, *, num_q_blocks: int,
                    pages_per_block: int, max_pages: int, num_pages: int):
    """Refs: start [B], num_new [B], pt [B, max_pages + pages_per_block], scale [2]
    (k_scale * H^-0.5, v_scale), q [block_q, Gp, H], k/v [P, page_size, H] (this kv head);
    out [block_q, Gp, H]."""
    b = pl.program_id(0)
    qb = num_q_blocks - 1 - pl.program_id(1)  # last (longest) query blocks first
    bq, gp, h = q_ref.shape
    ps = k_ref.shape[1]
    bp = pages_per_block
    bk = bp * ps
    M = bq * gp
    cdt = q_ref.dtype
    prec = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else jax.lax.Precision.DEFAULT

    start, nn = start_ref[b], nn_ref[b]
    t0 = qb * bq
    n_real = jnp.clip(nn - t0, 0, bq)  # real query tokens in this block
    # keys any real query of the block sees: j < start + t0 + n_real (clamped to the table)
    kv_end = jnp.where(n_real > 0, jnp.minimum(start + t0 + n_real, max_pages * ps), 0)
    n_blocks = (kv_end + bk - 1) // bk
    # blocks with every key <= the first query's position (start + t0): no mask needed
    n_full = jnp.minimum(jnp.where(n_real > 0, (start + t0 + 1) // bk, 0), kv_end // bk)
    row_tok = t0 + jnp.arange(M, dtype=jnp.int32) // gp  # query token of each tile row
    row_pos = start + row_tok

    q = q_ref[...].reshape(M, h)
    k_scale, v_scale = scale_ref[0], scale_ref[1]
    page_off = jnp.arange(bp, dtype=jnp.int32)
    tok_off = jnp.arange(ps, dtype=jnp.int32)
    h_off = jnp.arange(h, dtype=jnp.int32)
    key_off = jnp.arange(bk, dtype=jnp.int32)
    shape3 = (bp, ps, h)

    def gather_idx(kb):
        ids = jnp.clip(pt_ref[b, pl.ds(kb * bp, bp)], 0, num_pages - 1)
        return (jnp.broadcast_to(ids[:, None, None], shape3), jnp.broadcast_to(tok_off[None, :, None], shape3),
                jnp.broadcast_to(h_off[None, None, :], shape3))

    def step(kb, carry, masked: bool):
        m, l, acc = carry
        idx = gather_idx(kb)
        if masked:
            tok = kb * bk + page_off[:, None] * ps + tok_off[None, :]  # [bp, ps] key positions
            ok3 = jnp.broadcast_to((tok < kv_end)[:, :, None], shape3)
            zeros = jnp.zeros(shape3, k_ref.dtype)
            kt = plgpu.load(k_ref.at[idx], mask=ok3, other=zeros)
            vt = plgpu.load(v_ref.at[idx], mask=ok3, other=zeros)
        else:
            kt, vt = plgpu.load(k_ref.at[idx]), plgpu.load(v_ref.at[idx])
        kt, vt = kt.reshape(bk, h).astype(cdt), vt.reshape(bk, h).astype(cdt)
        s = jax.lax.dot_general(q, kt, (((1,), (1,)), ((), ())), precision=prec,
                                preferred_element_type=jnp.float32) * k_scale
        if masked:
            keys = kb * bk + key_off  # [bk], the same positions flattened
            vis = (keys[None, :] <= row_pos[:, None]) & (keys[None, :] < kv_end)
            s = jnp.where(vis, s, _MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l = alpha * l + jnp.sum(p, axis=1)
        pv = jax.lax.dot_general(p.astype(cdt), vt, (((1,), (0,)), ((), ())), precision=prec,
                                 preferred_element_type=jnp.float32)
        return m_new, l, acc * alpha[:, None] + pv

    carry = (jnp.full((M,), _MASK_VALUE, jnp.float32), jnp.zeros((M,), jnp.float32), jnp.zeros((M, h), jnp.float32))
    carry = jax.lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    m, l, acc = jax.lax.fori_loop(n_full, n_blocks, functools.partial(step, masked=True), carry)
    del m
    keep = (row_tok < nn) & (l > 0)
    scale = jnp.where(keep, v_scale / jnp.where(keep, l, 1.0), 0.0)
    o_ref[...] = (acc * scale[:, None]).astype(o_ref.dtype).reshape(bq, gp, h)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _prefill_attention(q, k_pages, v_pages, k_scale, v_scale, page_table, lengths, num_new,
                       config: PrefillAttentionConfig, interpret: bool):
    B, T, N, H = q.shape
    P, ps, K, _ = k_pages.shape
    G = N // K
    gp = _next_pow2(G)
    max_pages = page_table.shape[1]
    bq, bp = config.block_q, config.pages_per_block
    Tp = pl.cdiv(T, bq) * bq
    nq = Tp // bq
    qg = q.reshape(B, T, K, G, H)
    if gp != G or Tp != T:
        qg = jnp.pad(qg, ((0, 0), (0, Tp - T), (0, 0), (0, gp - G), (0, 0)))
    pt = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, bp)))
    scales = jnp.stack([jnp.asarray(k_scale, jnp.float32).reshape(()) * (H**-0.5),
                        jnp.asarray(v_scale, jnp.float32).reshape(())])
    kernel = functools.partial(_prefill_kernel, num_q_blocks=nq, pages_per_block=bp, max_pages=max_pages,
                               num_pages=P)

    def q_map(b, i, k):  # the kernel visits query blocks last-first
        return (b, nq - 1 - i, k, 0, 0)

    out = pl.pallas_call(
        kernel,
        grid=(B, nq, K),
        in_specs=[
            pl.BlockSpec((B,), lambda b, i, k: (0,)),
            pl.BlockSpec((B,), lambda b, i, k: (0,)),
            pl.BlockSpec((B, max_pages + bp), lambda b, i, k: (0, 0)),
            pl.BlockSpec((2,), lambda b, i, k: (0,)),
            pl.BlockSpec((None, bq, None, gp, H), q_map),
            pl.BlockSpec((P, ps, None, H), lambda b, i, k: (0, 0, k, 0)),
            pl.BlockSpec((P, ps, None, H), lambda b, i, k: (0, 0, k, 0)),
        ],
        out_specs=pl.BlockSpec((None, bq, None, gp, H), q_map),
        out_shape=jax.ShapeDtypeStruct((B, Tp, K, gp, H), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="paged_attention_prefill",
    )(lengths.astype(jnp.int32), num_new.astype(jnp.int32), pt, scales, qg, k_pages, v_pages)
    return out[:, :T, :, :G].reshape(B, T, N, H)


def _check_operands(q, k_pages, v_pages, k_scale, v_scale, page_table, lengths, num_new) -> None:
    for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages), ("k_scale", k_scale),
                    ("v_scale", v_scale), ("page_table", page_table), ("lengths", lengths), ("num_new", num_new)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if q.ndim != 4 or q.shape[1] < 1:
        raise ValueError(f"q must be [B, T, N, H] with T >= 1, got shape {tuple(q.shape)}")
    if jnp.dtype(q.dtype) not in _Q_DTYPES:
        raise ValueError(f"q must be bfloat16 or float32, got {q.dtype}")
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages must be [P, page_size, K, H], got shape {tuple(k_pages.shape)}")
    if tuple(k_pages.shape) != tuple(v_pages.shape) or k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages {tuple(k_pages.shape)} {k_pages.dtype} and v_pages "
                         f"{tuple(v_pages.shape)} {v_pages.dtype} must match")
    if jnp.dtype(k_pages.dtype) not in _POOL_DTYPES:
        raise ValueError(f"the page pools must be one of {[str(d) for d in _POOL_DTYPES]}, got {k_pages.dtype}")
    B, _, N, H = q.shape
    P, ps, K, Hk = k_pages.shape
    if Hk != H:
        raise ValueError(f"head dims differ: q has H={H}, the pools {Hk}")
    if K < 1 or N % K:
        raise ValueError(f"N={N} query heads must be a multiple of K={K} kv heads")
    if not supports(ps, H):
        raise ValueError(f"page_size ({ps}) must be a power of two and head_dim ({H}) a power of two >= 16")
    if P < 1:
        raise ValueError("the page pools hold no page")
    if page_table.ndim != 2 or page_table.shape[0] != B or page_table.shape[1] < 1:
        raise ValueError(f"page_table must be [B={B}, max_pages], got shape {tuple(page_table.shape)}")
    for name, x in (("lengths", lengths), ("num_new", num_new)):
        if tuple(x.shape) != (B,):
            raise ValueError(f"{name} must be [B={B}], got shape {tuple(x.shape)}")
    for name, x in (("page_table", page_table), ("lengths", lengths), ("num_new", num_new)):
        if jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
            raise ValueError(f"{name} must be int32, got {x.dtype}")
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if x.size != 1 or jnp.dtype(x.dtype) != jnp.dtype(jnp.float32):
            raise ValueError(f"{name} must be one float32 scalar, got shape {tuple(x.shape)} {x.dtype}")


_SMEM_BUDGET = 200 * 1024  # of Hopper's 227 KB per block: room for Triton's reduction scratch


def smem_bytes(block_q: int, pages_per_block: int, G: int, page_size: int, head_dim: int, pool_dtype,
               q_dtype, num_stages: int) -> int:
    """Estimated shared memory of one program: the q tile, the K and V tiles of every pipeline
    stage (in the pool's dtype), their upcast copies when the pool's dtype differs from q's (the
    dot operands) and the probabilities re-laid out for the PV dot."""
    M, bk = block_q * _next_pow2(G), pages_per_block * page_size
    q_item, kv_item = jnp.dtype(q_dtype).itemsize, jnp.dtype(pool_dtype).itemsize
    upcast = 0 if jnp.dtype(pool_dtype) == jnp.dtype(q_dtype) else 2 * bk * head_dim * q_item
    return (M * head_dim * q_item + 2 * bk * head_dim * kv_item * max(num_stages, 1) + upcast
            + M * bk * q_item)


def fit_config(config: PrefillAttentionConfig, T: int, G: int, page_size: int, head_dim: int, pool_dtype,
               q_dtype=jnp.bfloat16) -> PrefillAttentionConfig:
    """The config the kernel actually runs for these shapes: ``block_q`` down to ``next_pow2(T)``
    but up to ``16 / Gp``; ``pages_per_block`` up to ``16 / page_size``; then, while `smem_bytes`
    is over budget (a float32 pool at H = 128 needed 264 KB in the decode kernel, seen on the
    H200), the larger of the K/V and q tiles halved, down to the 16-row minimum of a dot."""
    gp = _next_pow2(G)
    bq = max(min(config.block_q, _next_pow2(T)), max(1, MIN_ROWS // gp))
    bp = max(config.pages_per_block, max(1, MIN_ROWS // page_size))
    def est(bq, bp):
        return smem_bytes(bq, bp, G, page_size, head_dim, pool_dtype, q_dtype, config.num_stages)

    kv_first = jnp.dtype(pool_dtype).itemsize * max(config.num_stages, 1) >= jnp.dtype(q_dtype).itemsize
    while est(bq, bp) > _SMEM_BUDGET:
        can_bp, can_bq = (bp // 2) * page_size >= MIN_ROWS, (bq // 2) * gp >= MIN_ROWS
        if can_bp and (kv_first or not can_bq):
            bp //= 2
        elif can_bq:
            bq //= 2
        else:
            break
        kv_first = not kv_first  # alternate
    if (bq, bp) == (config.block_q, config.pages_per_block):
        return config
    return dataclasses.replace(config, block_q=bq, pages_per_block=bp)


def prefill_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    k_scale: jax.Array,
    v_scale: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    num_new: jax.Array,
    *,
    config: PrefillAttentionConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Causal attention of T new tokens per row over a paged KV pool (see the module note).

    Args:
      q: ``[B, T, N, H]`` bfloat16 or float32 queries (after q-norm and RoPE); token t of row b
        is at position ``lengths[b] + t``.
      k_pages, v_pages: ``[P, page_size, K, H]`` pools, bfloat16, float32 or float8_e4m3fn,
        holding row b's keys ``j < lengths[b] + num_new[b]`` (the new ones already written).
      k_scale, v_scale: float32 scalars (shape () or (1,)), dequantization multipliers of the
        pools (1.0 for unquantized pools).
      page_table: ``[B, max_pages]`` int32; entries at or past the pages of the valid keys are
        ignored; positions past ``max_pages * page_size`` are clamped to it.
      lengths: ``[B]`` int32 tokens in the cache before this chunk (the first query's position).
      num_new: ``[B]`` int32 real query tokens per row (``<= T``); the rest are padding.
      config: tuning (`PrefillAttentionConfig`); None uses `DEFAULT_CONFIG`. It is adapted to
        the shapes by `fit_config`.
      interpret: None runs natively on a GPU backend and in interpret mode otherwise.

    Returns:
      ``[B, T, N, H]`` in q's dtype; padded query rows (``t >= num_new[b]``) are zero.
    """
    config = DEFAULT_CONFIG if config is None else config
    if not isinstance(config, PrefillAttentionConfig):
        raise ValueError(f"config must be a PrefillAttentionConfig or None, got {type(config).__name__}")
    interpret = resolve_interpret(interpret)
    _check_operands(q, k_pages, v_pages, k_scale, v_scale, page_table, lengths, num_new)
    _, T, N, H = q.shape
    config = fit_config(config, T, N // k_pages.shape[2], k_pages.shape[1], H, k_pages.dtype, q.dtype)
    return _prefill_attention(q, k_pages, v_pages, k_scale, v_scale, page_table, lengths, num_new, config,
                              interpret)


@jax.jit
def prefill_attention_reference(q, k_pages, v_pages, k_scale, v_scale, page_table, lengths, num_new) -> jax.Array:
    """Pure-jnp twin of `prefill_attention`: the same math in one block per row (gathers every
    page of the table, materializes ``[B, K, G, T, S]`` float32 logits; garbage ids are clamped
    like the kernel's, keys at or past the row's valid end are masked, padded rows are zero)."""
    _check_operands(q, k_pages, v_pages, k_scale, v_scale, page_table, lengths, num_new)
    B, T, N, H = q.shape
    P, ps, K, _ = k_pages.shape
    S = page_table.shape[1] * ps
    cdt = q.dtype
    prec = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else jax.lax.Precision.DEFAULT
    ids = jnp.clip(page_table, 0, P - 1)
    kg = k_pages[ids].reshape(B, S, K, H).astype(cdt)
    vg = v_pages[ids].reshape(B, S, K, H).astype(cdt)
    c = jnp.asarray(k_scale, jnp.float32).reshape(()) * (H**-0.5)
    qg = q.reshape(B, T, K, N // K, H)
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, kg, precision=prec, preferred_element_type=jnp.float32) * c
    keys = jnp.arange(S)
    kv_end = jnp.minimum(lengths + num_new, S)  # [B]
    pos = lengths[:, None] + jnp.arange(T)[None, :]  # [B, T]
    valid = (keys[None, None, :] <= pos[:, :, None]) & (keys[None, None, :] < kv_end[:, None, None])  # [B, T, S]
    logits = jnp.where(valid[:, None, None], logits, _MASK_VALUE)
    vg = jnp.where((keys[None, :] < kv_end[:, None])[:, :, None, None], vg, 0)  # unwritten slots: 0 * NaN
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.where(valid[:, None, None], jnp.exp(logits - m), 0.0)
    l = jnp.sum(p, axis=-1)
    acc = jnp.einsum("bkgts,bskh->btkgh", p.astype(cdt), vg, precision=prec, preferred_element_type=jnp.float32)
    real = jnp.arange(T)[None, :] < num_new[:, None]  # [B, T]
    keep = real[:, None, None, :] & (l > 0)  # [B, K, G, T]
    scale = jnp.where(keep, jnp.asarray(v_scale, jnp.float32).reshape(()) / jnp.where(keep, l, 1.0), 0.0)
    out = acc * jnp.transpose(scale, (0, 3, 1, 2))[..., None]
    return out.reshape(B, T, N, H).astype(cdt)


# ----------------------------------------------------------------------------
# Benchmark

# (name, B, T new tokens, lengths before the chunk): Qwen3-8B prefill of 1024-token prompts, and a
# chunk continuing at 2k context (chunked prefill / recompute after preemption)
BENCH_CASES = (
    ("prompt1024", 4, 1024, 0),
    ("prompt1024", 8, 1024, 0),
    ("prompt1024", 16, 1024, 0),
    ("chunk512@2k", 8, 512, 2048),
    ("chunk1024@2k", 4, 1024, 2048),
)


def attention_flops(lengths: np.ndarray, num_new: np.ndarray, num_heads: int, head_dim: int) -> int:
    """Useful FLOPs of causal attention: query t of row b sees ``lengths[b] + t + 1`` keys, 2 x H
    multiply-adds each for QK^T and for PV, per head (masked-off work is not counted)."""
    total = 0
    for L, n in zip(np.asarray(lengths, np.int64), np.asarray(num_new, np.int64)):
        total += n * L + n * (n + 1) // 2
    return int(4 * total * num_heads * head_dim)


def bench_inputs(batch: int, T: int, start: int, pool_dtype, *, num_heads: int = 32, num_kv_heads: int = 8,
                 head_dim: int = 128, page_size: int = 16, seed: int = 0):
    """Random prefill inputs: every row continuing at ``start`` with T real new tokens, pages
    shuffled across the pool, one spare page-table column of garbage ids."""
    rng = np.random.default_rng(seed)
    need = -(-(start + T) // page_size)
    max_pages = need + 1
    P = batch * need
    perm = rng.permutation(P).astype(np.int32)
    table = rng.integers(-(2**20), 2**20, (batch, max_pages)).astype(np.int32)
    table[:, :need] = perm.reshape(batch, need)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    shape = (P, page_size, num_kv_heads, head_dim)
    if jnp.dtype(pool_dtype) == _FP8:
        k_pages = (jax.random.normal(kk, shape, jnp.float32) * 64).astype(_FP8)
        v_pages = (jax.random.normal(kv, shape, jnp.float32) * 64).astype(_FP8)
        ks, vs = jnp.float32(1 / 64), jnp.float32(1 / 64)
    else:
        k_pages = jax.random.normal(kk, shape, pool_dtype)
        v_pages = jax.random.normal(kv, shape, pool_dtype)
        ks, vs = jnp.float32(1.0), jnp.float32(1.0)
    q = jax.random.normal(kq, (batch, T, num_heads, head_dim), jnp.bfloat16)
    lengths = jnp.full((batch,), start, jnp.int32)
    num_new = jnp.full((batch,), T, jnp.int32)
    return q, k_pages, v_pages, ks, vs, jnp.asarray(table), lengths, num_new


@jax.jit
def gather_all_attention(q, k_pages, v_pages, k_scale, v_scale, page_table, lengths, num_new):
    """What ``PagedKVCache.attend`` runs for T > 1 without the kernel: gather every page of the
    table, dequantize to q's dtype, ``dot_attention`` with the causal mask (``num_new`` unused there)."""
    from fp8rl_jax.models.attention import dot_attention

    del num_new
    B, T, _, H = q.shape
    _, ps, K, _ = k_pages.shape
    S = page_table.shape[1] * ps

    def load(pages, scale):
        x = pages[page_table]
        if pages.dtype == _FP8:
            x = x.astype(jnp.float32) * scale
        return x.astype(q.dtype).reshape(B, S, K, H)

    mask = jnp.arange(S)[None, None, :] <= (lengths[:, None] + jnp.arange(T)[None, :])[:, :, None]
    return dot_attention(q, load(k_pages, k_scale), load(v_pages, v_scale), mask)


def main(argv: list[str] | None = None) -> int:
    """Sweep PrefillAttentionConfigs over Qwen3-8B prefill shapes; print TFLOP/s and time vs the
    jnp gather-all path."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", default=None, help="write results as JSON to this path")
    parser.add_argument("--dtypes", nargs="*", default=["bfloat16", "float8_e4m3fn"])
    parser.add_argument("--cases", nargs="*", default=None,
                        help="indices into BENCH_CASES (default all): " +
                        ", ".join(f"{i}={c[0]} B={c[1]}" for i, c in enumerate(BENCH_CASES)))
    parser.add_argument("--quick", action="store_true", help="default config only (no sweep)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="after this many seconds, time the default config only (keeps a device run bounded)")
    args = parser.parse_args(argv)
    t_start = time.perf_counter()
    if jax.default_backend() != "gpu":
        print(f"prefill_attention benchmark needs a GPU (jax.default_backend() is {jax.default_backend()!r}); "
              "nothing to do.")
        return 0
    cases = BENCH_CASES if args.cases is None else tuple(BENCH_CASES[int(i)] for i in args.cases)
    configs = (DEFAULT_CONFIG,) if args.quick else (DEFAULT_CONFIG,) + SWEEP_CONFIGS
    results = []
    for name, batch, T, start in cases:
        for dtype_name in args.dtypes:
            inputs = bench_inputs(batch, T, start, jnp.dtype(dtype_name))
            q, kp, lengths, num_new = inputs[0], inputs[1], inputs[6], inputs[7]
            flops = attention_flops(np.asarray(lengths), np.asarray(num_new), q.shape[2], q.shape[3])
            ref = prefill_attention_reference(*inputs).astype(jnp.float32)
            row = {"case": name, "pool": dtype_name, "B": batch, "T": T, "lengths": start, "flops": flops,
                   "configs": []}
            best = None
            over = args.max_seconds is not None and time.perf_counter() - t_start > args.max_seconds
            for cfg in (DEFAULT_CONFIG,) if over else configs:
                try:
                    out = prefill_attention(*inputs, config=cfg, interpret=False)
                    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / (jnp.max(jnp.abs(ref)) + 1e-30))
                    run_cfg = fit_config(cfg, T, q.shape[2] // kp.shape[2], kp.shape[1], q.shape[3], kp.dtype, q.dtype)
                    ms = chained_ms(functools.partial(_prefill_attention, config=run_cfg, interpret=False),
                                    *inputs, n=4)
                except Exception as e:  # report and go on
                    row["configs"].append({"config": dataclasses.asdict(cfg),
                                           "error": f"{type(e).__name__}: {str(e)[:300]}"})
                    continue
                tflops = flops / (ms * 1e-3) / 1e12
                row["configs"].append({"config": dataclasses.asdict(cfg), "ms": ms, "TFLOPs": tflops,
                                       "max_rel_err": err})
                if best is None or ms < best[1]:
                    best = (cfg, ms, tflops, err)
            try:  # the path the kernel replaces in the engine (max_pages = the context here; the engine's
                # follows max_seq_len, so its gather-all cost there is larger still)
                row["gather_all_ms"] = chained_ms(gather_all_attention, *inputs, n=2)
                row["gather_all_TFLOPs"] = flops / (row["gather_all_ms"] * 1e-3) / 1e12
            except Exception as e:  # it can run out of memory at large B
                row["gather_all_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            if best is not None:
                c = best[0]
                row["best"] = {"config": dataclasses.asdict(c), "ms": best[1], "TFLOPs": best[2],
                               "max_rel_err": best[3]}
                g = row.get("gather_all_ms", float("nan"))
                print(f"{name:13s} {dtype_name:14s} B={batch:3d}: {best[2]:6.1f} TFLOP/s, {best[1]:.3f} ms "
                      f"(bq={c.block_q} bp={c.pages_per_block} w={c.num_warps} st={c.num_stages}), "
                      f"err {best[3]:.1e} | gather-all jnp {g:.3f} ms ({g / best[1]:.1f}x)", flush=True)
            else:
                print(f"{name} {dtype_name} B={batch}: every config failed", flush=True)
            row["swept"] = not over and not args.quick
            results.append(row)
            if args.out:
                write_results(args.out, results)
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
