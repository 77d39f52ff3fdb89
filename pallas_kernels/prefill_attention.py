"""Paged prefill attention (Pallas, Triton lowering): T new query tokens per row over a paged KV pool.

Row b has queries ``q [B, T, N, H]`` at positions ``lengths[b] + t``, the first ``num_new[b]`` real;
their keys and values are already in the pool (``PagedKVCache.attend`` writes before it reads), so the
row holds keys ``j < lengths[b] + num_new[b]``, key ``j`` at ``k_pages[page_table[b, j // page_size],
j % page_size]``. Query t sees keys ``j <= lengths[b] + t`` (causal, continuing after the cached ones:
``lengths > 0`` is a chunked prefill or the recompute of a preempted sequence). Pools ``[P, page_size,
K, H]`` in bfloat16, float32 or float8_e4m3fn with one float32 dequantization scale per tensor; output
``[B, T, N, H]`` in q's dtype, padded query rows (``t >= num_new[b]``) exactly zero.

Work split: one program per (row, query block, kv head). A program takes its ``block_q`` tokens times
the G query heads of its kv head as one ``[block_q * Gp, H]`` tile (``Gp = next_pow2(G)``, padding
heads zero and dropped), so each K/V tile is read once per GQA group, and walks the row's keys in blocks
of ``pages_per_block`` pages (one element gather by page id per block, as in the decode kernel) with an
online softmax in float32: no ``[T, S]`` logits exist. Only the keys the block's real queries see are
read. Blocks wholly below the causal diagonal run a loop without masks; the one or two crossing it run
a masked loop whose loads past the valid keys are masked off (unwritten slots may hold anything, NaN
included). Query blocks run last-first, so the longest programs start first.

Math (`prefill_attention_reference` does the same in one block per row): logits ``(q . k8) * k_scale *
H**-0.5`` in float32, online softmax in float32, ``p`` cast to q's dtype for P@V, ``out = acc / l *
v_scale``. The FP8 scales multiply logits and output, not the tiles, so FP8 costs storage precision only.
Key 0 is visible to every query and the first key block comes first, so a row's running max is a real
logit before any fully masked block: ``exp(mask - m)`` is then exactly 0.

Constraints: ``page_size``, ``pages_per_block``, ``block_q`` and ``H`` powers of two, ``H >= 16``,
``N % K == 0``. `fit_config` raises blocks to a dot's 16-row minimum, lowers ``block_q`` for short
chunks and shrinks tiles that would overflow shared memory; T is padded to a multiple of ``block_q``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import resolve_interpret

# the same pool/query dtypes, mask value, Triton tile minimum (M and N of a dot) and page/head
# constraints as the decode kernel: both read the one paged cache
from pallas_kernels.paged_attention import _MASK_VALUE, _POOL_DTYPES, _Q_DTYPES, MIN_ROWS, _pow2, supports


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
    is over budget (a float32 pool at H = 128 needed 264 KB in the decode kernel), the larger of the K/V and q tiles halved, down to the 16-row minimum of a dot."""
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
