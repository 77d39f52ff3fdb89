"""Paged-attention decode (Pallas, Triton lowering): one new query token per row over a paged KV pool.

Row b has one query ``q [B, N, H]`` (its key and value already written) and ``lengths[b]`` valid keys
in pages of ``page_size`` tokens: key ``j`` lives at ``k_pages[page_table[b, j // page_size], j %
page_size]``. Pools are ``[P, page_size, K, H]`` (`KvLayout.NHD`, the ``PagedKVCache`` layout) or
``[P, K, page_size, H]`` (HND), bfloat16, float32 or float8_e4m3fn with one float32 dequantization
scale per tensor (``K ~= k8 * k_scale``). Output ``[B, N, H]`` in q's dtype.

Work split (flash-decoding): one program per (row, kv head, split). A program attends the ``G = N / K``
query heads of its kv head as one ``[Gp, H]`` tile, ``Gp = max(16, next_pow2(G))`` (a Triton dot's M;
the padding rows are loaded as zeros and never stored), so each K/V tile is read once per GQA group. A
row of ``n`` pages takes ``min(ceil(n / pages_per_split), S)`` splits of equal page ranges: the split
depends on the row's own length only, so a row's result does not depend on its batch (bit for bit).
Within a split the program walks blocks of ``pages_per_block`` pages, each one 2-D ``[tokens, H]``
element gather with a page id per token row (16-byte ``cp.async`` loads that feed the dots directly).
Only pages below a row's length are read; the loads past the length are masked, page ids clamped to
``[0, P)``, so garbage table entries never reach the output. With more than one split, every program
writes a float32 partial and its log-sum-exp, combined by a second kernel (`_combine`).

Math (`paged_attention_reference` is the same in one block per row)::

    s_j = (q . k8_j) * (k_scale * H**-0.5)      # float32 accumulation
    online softmax over blocks in float32; p cast to the dot dtype; acc += p @ v8
    out = acc / l * v_scale

The scales multiply the float32 logits and output, not the ``tokens x H`` tiles, so FP8 costs storage
precision only. FP8 tiles convert exactly to the dot dtype; with ``fp8_dot_dtype="float16"`` and
``fp8_word_gather`` the pool is gathered as uint32 words of four E4M3 values, split into four byte
planes in registers (``prmt`` + packed ``cvt.f16x2.e4m3x2``), each plane a dot over ``H / 4``.
float32 operands use IEEE dots (``Precision.HIGHEST``).

Tuning: `PagedAttentionConfig`. `default_config` takes the measured best per pool dtype for this
device kind from ``paged_attention_tuning.json`` (``python -m experiments.bench paged_attention
--tuning-out``; ``FP8RL_PAGED_ATTENTION_TUNING`` names another table). Tables hold configs of two
warps or more (one-warp configs stalled long rollouts). Constraints: ``page_size``,
``pages_per_block`` and ``H`` powers of two, ``H >= 16``, ``N % K == 0``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import device_kind, resolve_interpret, tuning_entries

_FP8 = jnp.dtype(jnp.float8_e4m3fn)
_POOL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), _FP8)
_Q_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_MASK_VALUE = float(np.finfo(np.float32).min)
MIN_ROWS = 16  # smallest M of a Triton dot
_FP8_DOT_DTYPES = ("bfloat16", "float16")
_F16_MAX = float(np.finfo(np.float16).max)


class KvLayout(enum.Enum):
    """Axis order of a page pool. NHD ``[P, page_size, K, H]`` (the ``PagedKVCache`` layout: one
    token's heads together) or HND ``[P, K, page_size, H]`` (one head's page contiguous: a page of
    one kv head is ``page_size * H`` consecutive elements instead of ``page_size`` runs of H)."""

    NHD = "nhd"
    HND = "hnd"


def _pow2(x: int) -> bool:
    return isinstance(x, int) and x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class PagedAttentionConfig:
    """Tuning of the decode kernel.

    Attributes:
      pages_per_block: pages gathered per inner step (a power of two); a block is
        ``pages_per_block * page_size`` tokens.
      pages_per_split: a row of n pages is split over ``min(ceil(n / pages_per_split),
        max_splits)`` programs per kv head (flash-decoding), its pages divided evenly.
      max_splits: cap on the splits of a row (and on the grid's split axis).
      num_warps: Triton warps per program.
      num_stages: Triton software-pipelining stages of the block loop.
      fp8_dot_dtype: ``"bfloat16"`` or ``"float16"``: the dtype FP8 tiles (and q, P) are converted
        to for the tensor-core dots of an FP8 pool with a bfloat16 q. E4M3 converts to float16
        exactly with one packed instruction per two values (``cvt.rn.f16x2.e4m3x2``) and float16
        keeps 3 more mantissa bits of q and P than bfloat16; q is clamped to float16's range
        first. Ignored for bfloat16 / float32 pools and float32 queries.
      fp8_word_gather: with float16 dots on an FP8 pool (head dim a multiple of 64), gather the
        pool as uint32 words of 4 E4M3 values and split them into 4 byte planes in registers (one
        ``prmt`` + one packed ``cvt`` per two words, inline PTX), each plane a dot of H / 4: V
        then needs no byte-wise shared-memory reads (sm_90 has no 8-bit transposing ldmatrix).
        The kernel loads q and stores the output plane by plane at those head dims, so q and the
        output keep their natural order in memory. Ignored otherwise.
      kv_heads_per_program: kv heads one program attends (a power of two; the grid's head axis shrinks by
        it). Each block's page ids are loaded once for all of them and their K/V gathers are issued
        together, so a program has that many times the bytes in flight per dependent page-id load (in
        the NHD layout the heads of a token are adjacent: one 128-byte FP8 row per head becomes a
        ``heads x 128``-byte run). Each head keeps its own softmax state and dots. Where it does not
        divide the kv heads, the largest power of two that does is used.
      heads_fastest: the launch order of the programs. False: rows vary fastest (CUDA's x axis), so the
        programs resident at one time cover every row for two or three kv heads. True: kv heads vary
        fastest, so the programs of one row's kv heads run side by side and read the same tokens' K/V
        rows together (in the NHD layout one token's heads are adjacent: 8 x 128 bytes of FP8 at
        Qwen3's 8 kv heads, where one program reads one 128-byte run). Same results, bit for bit.
    """

    pages_per_block: int = 8
    pages_per_split: int = 64
    max_splits: int = 16
    num_warps: int = 4
    num_stages: int = 2
    fp8_dot_dtype: str = "bfloat16"
    fp8_word_gather: bool = False
    kv_heads_per_program: int = 1
    heads_fastest: bool = False

    def __post_init__(self):
        if not _pow2(self.kv_heads_per_program):
            raise ValueError(f"PagedAttentionConfig.kv_heads_per_program must be a power of two, got "
                             f"{self.kv_heads_per_program!r}")
        if not _pow2(self.pages_per_block):
            raise ValueError(
                f"PagedAttentionConfig.pages_per_block must be a power of two, got {self.pages_per_block!r}")
        for name in ("pages_per_split", "max_splits", "num_warps", "num_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"PagedAttentionConfig.{name} must be a positive int, got {v!r}")
        if self.fp8_dot_dtype not in _FP8_DOT_DTYPES:
            raise ValueError(f"PagedAttentionConfig.fp8_dot_dtype must be one of {_FP8_DOT_DTYPES}, "
                             f"got {self.fp8_dot_dtype!r}")

    def grid_splits(self, max_pages: int) -> int:
        """S, the grid's split axis: the most splits any row of at most ``max_pages`` pages takes."""
        return max(1, min(pl.cdiv(max_pages, self.pages_per_split), self.max_splits))


DEFAULT_CONFIG = PagedAttentionConfig()

# Measured tuning (``python -m experiments.bench paged_attention --tuning-out``): per device kind, the fastest
# config of each pool dtype at the rollout's decode shape. `default_config` uses an entry only on the device kind
# it was measured on. FP8RL_PAGED_ATTENTION_TUNING names another table (a device of your own, or a candidate).
TUNING_FILE = Path(os.environ.get("FP8RL_PAGED_ATTENTION_TUNING") or Path(__file__).with_name(
    "paged_attention_tuning.json"))


_device_kind = device_kind  # module-level: the tests stand in another device kind


@functools.cache
def _tuning(kind: str) -> dict[str, PagedAttentionConfig]:
    return {e["pool"]: PagedAttentionConfig(**e["config"]) for e in tuning_entries(TUNING_FILE, kind)}


def default_config(pool_dtype) -> PagedAttentionConfig:
    """The measured best for pools of ``pool_dtype`` on this device kind (`TUNING_FILE`), else
    `DEFAULT_CONFIG`."""
    return _tuning(_device_kind()).get(jnp.dtype(pool_dtype).name, DEFAULT_CONFIG)


def describe_config(pool_dtype) -> dict:
    """What the decode kernel runs for pools of ``pool_dtype`` on this device kind, for result files:
    the table it reads (`TUNING_FILE`, ``FP8RL_PAGED_ATTENTION_TUNING`` included) and the config."""
    return {"table": str(TUNING_FILE), "device_kind": _device_kind(),
            "config": dataclasses.asdict(default_config(pool_dtype))}


def _dot_dtype(q_dtype, pool_dtype, config: PagedAttentionConfig):
    """The dtype of the kernel's dot operands: q's, except float16 for an FP8 pool with a bfloat16
    q when the config asks for it."""
    if (jnp.dtype(pool_dtype) == _FP8 and jnp.dtype(q_dtype) == jnp.dtype(jnp.bfloat16)
            and config.fp8_dot_dtype == "float16"):
        return jnp.dtype(jnp.float16)
    return jnp.dtype(q_dtype)


# One FP8 byte plane of two uint32 words as one float16x2 (``pack=2``: $1, $2 are adjacent elements,
# $0 their two results): prmt moves byte j of each word into the low 16 bits, cvt converts that
# E4M3 pair exactly. Selector nibbles: result byte 0 <- byte j of $1, byte 1 <- byte j of $2.
_PLANE_ASM = ("{ .reg .b32 x; .reg .b16 lo, hi; prmt.b32 x, $1, $2, %s; mov.b32 {lo, hi}, x; "
              "cvt.rn.f16x2.e4m3x2 $0, lo; }")


def _planes(tile, planes: int, cdt, asm: bool) -> list:
    """The dot operands of a gathered K/V tile: ``[tile.astype(cdt)]`` for one plane; for four, the
    tile holds uint32 words of four E4M3 values and plane j is byte j of every word, as float16
    (``asm``: one prmt + one packed cvt per two words, inline PTX for the GPU; else the same values
    by shifts, for interpret mode)."""
    if planes == 1:
        return [tile.astype(cdt)]
    if asm:
        return [plgpu.elementwise_inline_asm(_PLANE_ASM % hex(((4 + j) << 4) | j), args=[tile], constraints="=r,r,r",
                                             pack=2, result_shape_dtypes=[jax.ShapeDtypeStruct(tile.shape, cdt)])[0]
                for j in range(4)]
    return [jax.lax.bitcast_convert_type(((tile >> (8 * j)) & 0xFF).astype(jnp.uint8), _FP8).astype(cdt)
            for j in range(4)]


def _word_gather(config: PagedAttentionConfig, pool_dtype, cdt, head_dim: int) -> bool:
    """Whether the kernel gathers the pool as uint32 words split into 4 byte planes."""
    return (config.fp8_word_gather and jnp.dtype(pool_dtype) == _FP8 and jnp.dtype(cdt) == jnp.dtype(jnp.float16)
            and head_dim % (4 * MIN_ROWS) == 0)


def _decode_kernel(len_ref, pt_ref, scale_ref, q_ref, k_ref, v_ref, *out_refs, num_splits: int,
                   pages_per_block: int, pages_per_split: int, max_pages: int, num_pages: int, cdt,
                   planes: int = 1, asm: bool = False, groups: int | None = None, heads: int = 1,
                   hnd: bool = False, heads_fastest: bool = False):
    """Refs: len [B], pt [B, max_pages + pages_per_block], scale [2] (k_scale * H^-0.5, v_scale),
    q [Gq, H], k/v [P, page_size, H / planes] (this kv head); out [Gq, H] (S == 1) or o [Gq, H]
    f32 and lse [Gq] f32. ``groups`` (G, default Gq): the real query heads, the first rows of q (Gq is
    G rounded up to a power of two); the program computes ``Gp = max(16, Gq)`` rows (a Triton dot's
    M), loading rows past G as zeros and storing only the first Gq, so the dots' padding rows exist
    neither in q nor in the output. ``cdt``: the
    dots' operand dtype (`_dot_dtype`). ``planes`` = 4: the pools are uint32 words of 4 E4M3 values,
    split into 4 byte planes (plane j holds head dims ``4c + j``); the logits are the sum of 4 plane
    dots and P@V runs per plane, q is loaded and the output stored plane by plane at those dims, in
    the natural order. ``heads`` > 1 (`kv_heads_per_program`): q, out, o and lse gain a leading axis
    of that many kv heads and k/v are [P, page_size, heads, H / planes] ([P, heads, page_size, H /
    planes] with ``hnd``); the heads share the block loop and its page ids, each with its own softmax
    state. ``heads_fastest``: the grid is (heads, B, S) instead of (B, heads, S)."""
    b, s = pl.program_id(1 if heads_fastest else 0), pl.program_id(2)
    gq = q_ref.shape[-2]
    gp = max(MIN_ROWS, gq)
    g = gq if groups is None else groups
    ps, hw = (k_ref.shape[2], k_ref.shape[3]) if heads > 1 and hnd else (k_ref.shape[1], k_ref.shape[-1])
    bp = pages_per_block
    prec = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else jax.lax.Precision.DEFAULT

    length = jnp.minimum(len_ref[b], max_pages * ps)
    n_pages = (length + ps - 1) // ps
    row_splits = jnp.clip((n_pages + pages_per_split - 1) // pages_per_split, 1, num_splits)
    pps = (n_pages + row_splits - 1) // row_splits  # depends on this row only: batch-invariant
    p_start = s * pps
    p_end = jnp.minimum(p_start + pps, n_pages)
    n_blocks = (jnp.maximum(p_end - p_start, 0) + bp - 1) // bp

    # index tiles: [Gp, H / planes] for q (row r; the rows past G read zeros, their index clamped so that no
    # address leaves the block) and [Gq, H / planes] for the output (its rows: an equal power-of-two split of
    # the Gp computed, so the padding rows of the dots cost no output bytes); plane j's head dims are 4c + j
    def tiles(n):
        rows = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[:, None], (n, hw))
        return rows, [jnp.broadcast_to((jnp.arange(hw, dtype=jnp.int32) * planes + j)[None, :], (n, hw))
                      for j in range(planes)]

    q_rows, q_dims = tiles(gp)
    q_real = q_rows < g
    q_rows = jnp.minimum(q_rows, gq - 1)
    o_rows, o_dims = tiles(gq)

    def at(hd, *idx):  # a ref index of kv head ``hd`` (the leading head axis of kv_heads_per_program)
        return (jnp.full(idx[0].shape, hd, jnp.int32), *idx) if heads > 1 else idx

    def real(x):  # the first Gq rows (an equal power-of-two split: what Triton's lowering takes)
        return x if gq == gp else jnp.split(x, gp // gq, axis=0)[0]

    def head_q(hd):
        qs = [plgpu.load(q_ref.at[at(hd, q_rows, d2)], mask=q_real, other=jnp.zeros((gp, hw), q_ref.dtype))
              for d2 in q_dims]
        if qs[0].dtype != cdt:  # bfloat16 -> float16: clamp to its range (no inf from a huge query)
            qs = [jnp.clip(q.astype(jnp.float32), -_F16_MAX, _F16_MAX).astype(cdt) for q in qs]
        return qs

    qss = [head_q(hd) for hd in range(heads)]
    k_scale, v_scale = scale_ref[0], scale_ref[1]
    nt = bp * ps  # tokens per block
    row = jnp.arange(nt, dtype=jnp.int32)
    row_page, row_tok = row // ps, row % ps  # block row -> (page in block, token in page)
    h_off = jnp.arange(hw, dtype=jnp.int32)
    limit = jnp.minimum(p_end * ps, length)  # tokens of this split's range end here

    def body(i, carry):
        pages = p_start + i * bp + row_page  # [nt]: the page (index into the row's table) of each row
        # Page id per token row (a gather of bp distinct table entries, repeated ps times: L1 hits),
        # so the K/V gather below is one 2-D [nt, H] pointer tile that feeds the dots without a
        # reshape (a [bp, ps, H] tile reshaped to [nt, H] kept V out of Triton's cp.async pipeline).
        ids = jnp.clip(plgpu.load(pt_ref.at[b, pages]), 0, num_pages - 1)
        ok = pages * ps + row_tok < limit  # [nt]
        shape2 = (nt, hw)
        ok2 = jnp.broadcast_to(ok[:, None], shape2)
        ids2, tok2 = jnp.broadcast_to(ids[:, None], shape2), jnp.broadcast_to(row_tok[:, None], shape2)
        h2 = jnp.broadcast_to(h_off[None, :], shape2)
        tiles = []
        for hd in range(heads):  # every head's gathers first: all of them in flight before the dots
            if heads == 1:
                idx = (ids2, tok2, h2)  # an element gather: [nt, H / planes]
            else:
                hd2 = jnp.full(shape2, hd, jnp.int32)
                idx = (ids2, hd2, tok2, h2) if hnd else (ids2, tok2, hd2, h2)
            kt = plgpu.load(k_ref.at[idx], mask=ok2, other=jnp.zeros(shape2, k_ref.dtype))
            vt = plgpu.load(v_ref.at[idx], mask=ok2, other=jnp.zeros(shape2, v_ref.dtype))
            tiles.append((kt, vt))
        out = []
        for qs, (kt, vt), (m, l, accs) in zip(qss, tiles, carry):
            logits = None
            for q, kj in zip(qs, _planes(kt, planes, cdt, asm)):
                d = jax.lax.dot_general(q, kj, (((1,), (1,)), ((), ())), precision=prec,
                                        preferred_element_type=jnp.float32)
                logits = d if logits is None else logits + d
            logits = jnp.where(ok[None, :], logits * k_scale, _MASK_VALUE)
            m_new = jnp.maximum(m, jnp.max(logits, axis=1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(logits - m_new[:, None])
            l = alpha * l + jnp.sum(p, axis=1)
            pc = p.astype(cdt)
            accs = tuple(acc * alpha[:, None] + jax.lax.dot_general(pc, vj, (((1,), (0,)), ((), ())), precision=prec,
                                                                    preferred_element_type=jnp.float32)
                         for acc, vj in zip(accs, _planes(vt, planes, cdt, asm)))
            out.append((m_new, l, accs))
        return tuple(out)

    init = tuple((jnp.full((gp,), _MASK_VALUE, jnp.float32), jnp.zeros((gp,), jnp.float32),
                  tuple(jnp.zeros((gp, hw), jnp.float32) for _ in range(planes))) for _ in range(heads))
    states = jax.lax.fori_loop(0, n_blocks, body, init)
    o_ref = out_refs[0]
    for hd, (m, l, accs) in enumerate(states):
        has = l > 0
        inv = jnp.where(has, 1.0 / jnp.where(has, l, 1.0), 0.0)
        for d2, acc in zip(o_dims, accs):
            plgpu.store(o_ref.at[at(hd, o_rows, d2)], real(acc * (inv * v_scale)[:, None]).astype(o_ref.dtype))
        if num_splits > 1:
            lse = real(jnp.where(has, m + jnp.log(jnp.where(has, l, 1.0)), _MASK_VALUE))
            plgpu.store(out_refs[1].at[at(hd, jnp.arange(gq, dtype=jnp.int32))], lse)


def _pool_dims(pages, layout: KvLayout) -> tuple[int, int, int, int]:
    """(P, page_size, K, H) of a pool in ``layout``."""
    if layout is KvLayout.HND:
        P, K, ps, H = pages.shape
        return P, ps, K, H
    return tuple(pages.shape)


@functools.partial(jax.jit, static_argnames=("config", "interpret", "layout"))
def _paged_attention(q, k_pages, v_pages, k_scale, v_scale, page_table, lengths, config: PagedAttentionConfig,
                     interpret: bool, layout: KvLayout = KvLayout.NHD):
    B, N, H = q.shape
    P, ps, K, _ = _pool_dims(k_pages, layout)
    G = N // K
    go = 1 << (G - 1).bit_length()  # the group's rows in q and out blocks (Triton block dims are powers of two)
    max_pages = page_table.shape[1]
    bp = config.pages_per_block
    S = config.grid_splits(max_pages)
    cdt = _dot_dtype(q.dtype, k_pages.dtype, config)
    planes = 4 if _word_gather(config, k_pages.dtype, cdt, H) else 1
    # q as given (the kernel loads the Gp = max(16, go) rows of its dots, zeros past G, and each byte plane's
    # head dims itself): no padded or permuted copy of q, no permutation of the output.
    qg = q.reshape(B, K, G, H)
    if go != G:  # a group that is no power of two: padding rows up to the next one
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, go - G), (0, 0)))
    if planes > 1:  # [..., H] E4M3 -> [..., H/4] uint32, byte j of word c = dim 4c + j (a bitcast, no copy)
        k_pages, v_pages = (jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], H // 4, 4), jnp.uint32)
                            for x in (k_pages, v_pages))
    pt = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, bp)))
    scales = jnp.stack([jnp.asarray(k_scale, jnp.float32).reshape(()) * (H**-0.5),
                        jnp.asarray(v_scale, jnp.float32).reshape(())])
    kh = kv_heads_per_program(config, K)
    kernel = functools.partial(_decode_kernel, num_splits=S, pages_per_block=bp,
                               pages_per_split=config.pages_per_split, max_pages=max_pages, num_pages=P,
                               cdt=cdt, planes=planes, asm=not interpret, groups=G, heads=kh,
                               hnd=layout is KvLayout.HND, heads_fastest=config.heads_fastest)
    hw = H // planes
    hb = None if kh == 1 else kh  # the head axis of a block: squeezed for one head per program

    def spec(block, index_map):  # index maps are written for the (b, k, s) grid
        if config.heads_fastest:
            return pl.BlockSpec(block, lambda k, b, s: index_map(b, k, s))
        return pl.BlockSpec(block, index_map)

    in_specs = [
        spec((B,), lambda b, k, s: (0,)),
        spec((B, max_pages + bp), lambda b, k, s: (0, 0)),
        spec((2,), lambda b, k, s: (0,)),
        spec((None, hb, go, H), lambda b, k, s: (b, k, 0, 0)),
    ]
    if layout is KvLayout.HND:  # with one head per program the kernel sees [P, page_size, H] either way
        pool_spec = spec((P, hb, ps, hw), lambda b, k, s: (0, k, 0, 0))
    else:
        pool_spec = spec((P, ps, hb, hw), lambda b, k, s: (0, 0, k, 0))
    in_specs += [pool_spec, pool_spec]
    if S == 1:
        out_specs = spec((None, hb, go, H), lambda b, k, s: (b, k, 0, 0))
        out_shape = jax.ShapeDtypeStruct((B, K, go, H), q.dtype)
    else:
        out_specs = [spec((None, None, hb, go, H), lambda b, k, s: (s, b, k, 0, 0)),
                     spec((None, None, hb, go), lambda b, k, s: (s, b, k, 0))]
        out_shape = [jax.ShapeDtypeStruct((S, B, K, go, H), jnp.float32),
                     jax.ShapeDtypeStruct((S, B, K, go), jnp.float32)]
    res = pl.pallas_call(
        kernel,
        grid=(K // kh, B, S) if config.heads_fastest else (B, K // kh, S),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="paged_attention_decode",
    )(lengths.astype(jnp.int32), pt, scales, qg, k_pages, v_pages)
    if S == 1:
        out = res
    elif _pow2(K * go * H):  # one kernel, where XLA runs the reference as two fusions
        out = _combine(*res, q.dtype, interpret)
    else:
        out = _combine_reference(*res, q.dtype)
    return out[:, :, :G].reshape(B, N, H).astype(q.dtype)


def _combine_reference(o, lse, dtype):
    """The splits' partials ``o [S, B, K, go, H]``, ``lse [S, B, K, go]`` (float32) combined: weights
    ``exp(lse_s - max_s lse)``, summed in split order (a fixed elementwise order: no reduction whose order depends
    on B), divided last; ``[B, K, go, H]`` in ``dtype``."""
    S = o.shape[0]
    w = jnp.exp(lse - jnp.max(lse, axis=0, keepdims=True))  # [S, B, K, go]
    num, den = o[0] * w[0][..., None], w[0]
    for i in range(1, S):
        num, den = num + o[i] * w[i][..., None], den + w[i]
    return (num / jnp.maximum(den, 1e-30)[..., None]).astype(dtype)


def _combine_kernel(o_ref, lse_ref, out_ref, *, splits: int, rows: int):
    """One row b: `_combine_reference`'s ops in its order. ``o_ref [S, W]`` (``W = K * go * H``, contiguous per
    split), ``lse_ref [S, K * go]``, ``out_ref [W]``: each split's partial is one contiguous vector load."""
    w_ = o_ref.shape[-1]
    h = w_ // rows
    lses = [lse_ref[i, :] for i in range(splits)]
    m = lses[0]
    for x in lses[1:]:
        m = jnp.maximum(m, x)
    ws = [jnp.exp(x - m) for x in lses]
    num, den = o_ref[0, :].reshape(rows, h) * ws[0][:, None], ws[0]
    for i in range(1, splits):
        num = num + o_ref[i, :].reshape(rows, h) * ws[i][:, None]
        den = den + ws[i]
    out_ref[...] = (num / jnp.maximum(den, 1e-30)[:, None]).reshape(w_).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("dtype", "interpret"))
def _combine(o, lse, dtype, interpret: bool):
    S, B, K, go, H = o.shape
    n, w_ = K * go, K * go * H
    return pl.pallas_call(
        functools.partial(_combine_kernel, splits=S, rows=n), grid=(B,),
        in_specs=[pl.BlockSpec((S, None, w_), lambda b: (0, b, 0)), pl.BlockSpec((S, None, n), lambda b: (0, b, 0))],
        out_specs=pl.BlockSpec((None, w_), lambda b: (b, 0)),
        out_shape=jax.ShapeDtypeStruct((B, w_), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="paged_attention_combine",
    )(o.reshape(S, B, w_), lse.reshape(S, B, n)).reshape(B, K, go, H)


def kv_heads_per_program(config: PagedAttentionConfig, num_kv_heads: int) -> int:
    """The kv heads a program attends: ``config.kv_heads_per_program`` or, where it does not divide
    ``num_kv_heads``, the largest power of two below it that does."""
    kh = config.kv_heads_per_program
    while num_kv_heads % kh:
        kh //= 2
    return kh


def supports(page_size: int, head_dim: int) -> bool:
    """Whether the kernel takes pools of this page size and head dim (Triton tile constraints)."""
    return _pow2(page_size) and _pow2(head_dim) and head_dim >= MIN_ROWS


def _check_operands(q, k_pages, v_pages, k_scale, v_scale, page_table, lengths,
                    layout: KvLayout = KvLayout.NHD) -> None:
    for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages), ("k_scale", k_scale),
                    ("v_scale", v_scale), ("page_table", page_table), ("lengths", lengths)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if q.ndim != 3:
        raise ValueError(f"q must be [B, N, H], got shape {tuple(q.shape)}")
    if jnp.dtype(q.dtype) not in _Q_DTYPES:
        raise ValueError(f"q must be bfloat16 or float32, got {q.dtype}")
    if not isinstance(layout, KvLayout):
        raise ValueError(f"layout must be a KvLayout, got {layout!r}")
    if k_pages.ndim != 4:
        names = "[P, K, page_size, H]" if layout is KvLayout.HND else "[P, page_size, K, H]"
        raise ValueError(f"k_pages must be {names}, got shape {tuple(k_pages.shape)}")
    if tuple(k_pages.shape) != tuple(v_pages.shape) or k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages {tuple(k_pages.shape)} {k_pages.dtype} and v_pages "
                         f"{tuple(v_pages.shape)} {v_pages.dtype} must match")
    if jnp.dtype(k_pages.dtype) not in _POOL_DTYPES:
        raise ValueError(f"the page pools must be one of {[str(d) for d in _POOL_DTYPES]}, got {k_pages.dtype}")
    B, N, H = q.shape
    P, ps, K, Hk = _pool_dims(k_pages, layout)
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
    if tuple(lengths.shape) != (B,):
        raise ValueError(f"lengths must be [B={B}], got shape {tuple(lengths.shape)}")
    for name, x in (("page_table", page_table), ("lengths", lengths)):
        if jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
            raise ValueError(f"{name} must be int32, got {x.dtype}")
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if x.size != 1 or jnp.dtype(x.dtype) != jnp.dtype(jnp.float32):
            raise ValueError(f"{name} must be one float32 scalar, got shape {tuple(x.shape)} {x.dtype}")


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    k_scale: jax.Array,
    v_scale: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    config: PagedAttentionConfig | None = None,
    interpret: bool | None = None,
    layout: KvLayout = KvLayout.NHD,
) -> jax.Array:
    """Decode attention of one query token per row over a paged KV pool (see the module note).

    Args:
      q: ``[B, N, H]`` bfloat16 or float32 queries (after q-norm and RoPE).
      k_pages, v_pages: ``[P, page_size, K, H]`` pools (``[P, K, page_size, H]`` with
        ``layout=KvLayout.HND``), bfloat16, float32 or float8_e4m3fn.
      k_scale, v_scale: float32 scalars (shape () or (1,)), dequantization multipliers of the
        pools (1.0 for unquantized pools).
      page_table: ``[B, max_pages]`` int32; entries at or past ``ceil(lengths / page_size)``
        are ignored.
      lengths: ``[B]`` int32 valid keys per row (the new token included), at least 1; values
        past ``max_pages * page_size`` are clamped to it.
      config: tuning (`PagedAttentionConfig`); None uses `default_config` of the pool dtype (the
        measured table of this device kind, else `DEFAULT_CONFIG`).
      interpret: None runs natively on a GPU backend and in interpret mode otherwise.
      layout: the pools' axis order (`KvLayout`).

    Returns:
      ``[B, N, H]`` in q's dtype (zeros for a row of length 0).
    """
    config = default_config(k_pages.dtype) if config is None else config
    if not isinstance(config, PagedAttentionConfig):
        raise ValueError(f"config must be a PagedAttentionConfig or None, got {type(config).__name__}")
    interpret = resolve_interpret(interpret)
    _check_operands(q, k_pages, v_pages, k_scale, v_scale, page_table, lengths, layout)
    config = fit_config(config, k_pages, layout)
    return _paged_attention(q, k_pages, v_pages, k_scale, v_scale, page_table, lengths, config, interpret, layout)


def fit_config(config: PagedAttentionConfig, k_pages: jax.Array,
               layout: KvLayout = KvLayout.NHD) -> PagedAttentionConfig:
    """``config`` adjusted to the pool: blocks of at least 16 tokens (a Triton dot's minimum) and
    K/V tiles that fit in shared memory."""
    ps = _pool_dims(k_pages, layout)[1]
    if ps * config.pages_per_block < MIN_ROWS:
        config = dataclasses.replace(config, pages_per_block=MIN_ROWS // ps)
    return _fit_shared_memory(config, k_pages, layout)


_SMEM_BUDGET = 160 * 1024  # of Hopper's 227 KB per block: room for q, the accumulator and Triton's scratch


def _fit_shared_memory(config: PagedAttentionConfig, k_pages: jax.Array,
                       layout: KvLayout = KvLayout.NHD) -> PagedAttentionConfig:
    """Halves ``pages_per_block`` while the K and V tiles of all pipeline stages would overflow shared
    memory (a float32 pool at H = 128 needs 256 KB with 8 pages of 16 tokens and 2 stages), down to
    the 16-row minimum of a Triton dot."""
    _, page_size, K, H = _pool_dims(k_pages, layout)
    kh = kv_heads_per_program(config, K)  # a program's tiles hold kh heads
    tile = lambda ppb: (2 * kh * ppb * page_size * H * jnp.dtype(k_pages.dtype).itemsize  # noqa: E731
                        * max(config.num_stages, 1))
    ppb = config.pages_per_block
    while tile(ppb) > _SMEM_BUDGET and ppb > 1 and (ppb // 2) * page_size >= MIN_ROWS:
        ppb //= 2
    return config if ppb == config.pages_per_block else dataclasses.replace(config, pages_per_block=ppb)


@functools.partial(jax.jit, static_argnames=("config",))
def paged_attention_reference(q, k_pages, v_pages, k_scale, v_scale, page_table, lengths,
                              config: PagedAttentionConfig = DEFAULT_CONFIG) -> jax.Array:
    """Pure-jnp twin of `paged_attention`: the same math in one block per row (gathers every page
    of the table, masks keys at or past the length; garbage ids are clamped like the kernel's).
    ``config`` matters only through ``fp8_dot_dtype`` (the dots' operand dtype)."""
    _check_operands(q, k_pages, v_pages, k_scale, v_scale, page_table, lengths)
    B, N, H = q.shape
    P, ps, K, _ = k_pages.shape
    max_pages = page_table.shape[1]
    cdt = _dot_dtype(q.dtype, k_pages.dtype, config)
    prec = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else jax.lax.Precision.DEFAULT
    ids = jnp.clip(page_table, 0, P - 1)
    kg = k_pages[ids].reshape(B, max_pages * ps, K, H).astype(cdt)
    vg = v_pages[ids].reshape(B, max_pages * ps, K, H).astype(cdt)
    c = jnp.asarray(k_scale, jnp.float32).reshape(()) * (H**-0.5)
    qg = q.reshape(B, K, N // K, H)
    if qg.dtype != cdt:
        qg = jnp.clip(qg.astype(jnp.float32), -_F16_MAX, _F16_MAX).astype(cdt)
    logits = jnp.einsum("bkgh,bskh->bkgs", qg, kg, precision=prec, preferred_element_type=jnp.float32) * c
    valid = jnp.arange(max_pages * ps)[None, :] < jnp.minimum(lengths, max_pages * ps)[:, None]
    logits = jnp.where(valid[:, None, None], logits, _MASK_VALUE)
    vg = jnp.where(valid[:, :, None, None], vg, 0)  # unwritten slots may hold anything (NaN): 0 * NaN
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.where(valid[:, None, None], jnp.exp(logits - m), 0.0)
    l = jnp.sum(p, axis=-1)
    acc = jnp.einsum("bkgs,bskh->bkgh", p.astype(cdt), vg, precision=prec, preferred_element_type=jnp.float32)
    inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
    out = acc * (inv * jnp.asarray(v_scale, jnp.float32).reshape(()))[..., None]
    return out.reshape(B, N, H).astype(q.dtype)
