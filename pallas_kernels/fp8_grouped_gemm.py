"""W8A8 block-scaled FP8 grouped (ragged) GEMM for MoE experts (Pallas, Triton lowering).

Design note
===========

What: the MoE expert matmul. Rows of ``A [M, K]`` are sorted by expert and
``group_sizes [E]`` counts them; row ``r`` of group ``g`` is multiplied by
expert ``g``'s weight::

    out[r, :] = A[r, :] @ B[g, :, :]^T      for start_g <= r < end_g
    out[r, :] = 0                           for rows past sum(group_sizes)

with both operands float8_e4m3fn and the DeepSeek-V3 / vLLM block scales of
`pallas_kernels.fp8_gemm` (its sibling, same math per row):

* ``a_scale float32 [M, ceil(K/128)]``: per-token 1x128 groups;
* ``b_scale_inv float32 [E, ceil(N/128), ceil(K/128)]``: 128x128 blocks per
  expert (`pallas_kernels.fp8_quant.quantize_weight` of stacked experts ``[E, N, K]``).

Math, per row r of group g (the reference does the same in float32)::

    acc = 0
    for kb in range(ceil(K / 128)):
        d = qa[r, kb] @ qb[g, :, kb]^T               # fp8 x fp8 -> f32, one 128-wide K block
        acc += (d * a_scale[r, kb]) * b_scale_inv[g, n // 128, kb]
    out[r] = acc.astype(out_dtype)

Tiling (the megablox idea, written for a GPU grid): M is cut into tiles of
``block_m`` rows; a group may straddle tiles and a tile may hold several
groups. Every (group, M tile) pair that overlaps is one *work item*. The
wrapper lists the work items with plain jnp from ``group_sizes`` (group id,
M tile, row range [lo, hi), number of K steps), padded to a static upper
bound ``W = ceil(M / block_m) + E``: the rows past ``sum(group_sizes)`` form
one extra "tail" group (0 K steps, its rows are stored as zeros, so every
output row is written exactly once and no memset is needed), and at most
``(#non-empty groups) - 1`` tiles are shared, hence ``<= ceil(M/bm) + E``
items. Padding items run 0 K steps and store nothing. The grid is
``W x ceil(N / block_n)`` (by default the N tiles of one item are launched
consecutively, so its A tile and its expert's weight stay in L2); each
program reads its item's scalars from the metadata array, computes the full
``block_m x block_n`` tile with its group's weight and stores only the rows
in ``[lo, hi)`` (masked store). Rows
of a shared tile are thus computed once per group that touches the tile; the
waste is at most ``E`` tiles, the price of a static grid. At decode sizes
(a few rows per expert) the kernel is bound by reading each expert's weight
once, which this layout does; ``block_m = 16`` keeps the wasted MMA small.

Layout: row-major ``A [M, K]``, ``B [E, N, K]`` (both K-major, the HF layout).
The Triton backend has no scalar prefetch, so A, its scales and the output
are passed whole (block = full array; a Triton "block" is only a pointer)
and sliced inside the kernel at the item's dynamic row offset; B and its
scales are blocked over N only, and the expert is a dynamic index. As in
`fp8_gemm`, scales are made M/N-major inside the jitted wrapper: ``a_scale^T
[kb, M]`` and the block scales expanded to one per row of B, ``[E, kb, N]``
(E*N*K/32 bytes, 1/32 of the FP8 weight bytes, rebuilt by XLA on every
call), so each K step reads one contiguous scale vector per operand. ``swap_ab`` tiles instead load
all their K steps' scales once, before the K loop (``preload_scales``: Triton does not pipeline
loads that feed no dot).

Edges: M, N, K need not be multiples of the tiles; loads are masked on the
axes that need it (static flags), stores always mask rows. ``group_sizes``
is sanitized the way the reference does it: negative sizes count as 0 and
groups are cut at M (the caller's contract is sum <= M).

Unscaled twin: `grouped_gemm` (BF16 or F32 operands, no scales) runs the same work items, grid
and K loop with plain float32-accumulated dots: the generator's BF16 MoE experts.

MMA (offline sm_90 codegen, ``experiments/inspect_triton_codegen.py --kernel
grouped_gemm``): with `pallas_kernels.common.enable_fp8_wgmma` (installed at
import) Triton runs each FP8 dot on wgmma when the dot's M side is a multiple
of 64: ``block_m >= 64``, or ``swap_ab`` with ``block_n >= 64`` (m64n16k32 for
16 token rows). Smaller M sides stay on Ampere-style ``mma.sync`` over
operands converted to float16 in registers.

Deviations / limits: E4M3 only; out bf16, f16 or f32; the tensor core's
accumulation within one 128-wide K block is the hardware's (reduced
precision on Hopper's wgmma, see the GPU tolerance in the tests); the blocks
are summed in float32 outside the MMA. Loads are cp.async, not TMA; no
persistent grid, so up to E padding programs per N tile start and exit at once.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import device_kind, enable_fp8_wgmma, m_bucket, resolve_interpret, tuning_entries

enable_fp8_wgmma()  # FP8 dots on wgmma, not the float16 mma.sync fallback (see its note)

BK = 128  # K block = scale group width
_FP8 = jnp.dtype(jnp.float8_e4m3fn)
_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# Rows of the work-item metadata array [5, W].
_GROUP, _TILE, _LO, _HI, _STEPS = range(5)


@dataclasses.dataclass(frozen=True)
class GroupedGemmConfig:
    """Tiling of the grouped GEMM kernel (BK is fixed at 128).

    Attributes:
      block_m: rows of A / out per program (an M tile); a positive multiple of 16.
      block_n: rows of B (columns of out) per program; a positive multiple of 16.
      num_warps: Triton warps per program.
      num_stages: Triton software-pipelining stages of the K loop.
      n_fastest: launch order. True: the N tiles of one work item are consecutive programs
        (its A tile is reused from L2 across them, and the next item of the same group finds the
        expert's weight in L2); False: the work items of one N tile are consecutive.
      swap_ab: compute each tile transposed, ``out^T = B_tile @ A_tile^T`` ([block_n, block_m]),
        and store it back transposed. The weight's rows become the MMA's M side, so a decode-size
        tile (16 rows of tokens) still fills Hopper's 64-row wgmma (Triton falls back to the
        Ampere-style mma.sync for a 16-row M side); the usual small-M trick of CUTLASS and
        DeepGEMM MoE kernels. With FP8 operands ``block_n`` must divide 128: the tile then lies in
        one 128-row scale block, whose one scale per K step is read from ``b_scale_inv`` as is (no
        per-row expansion of the scales on every call).
      preload_scales: with ``swap_ab``, load the tile's activation scales ``[kb, block_m]`` and
        weight scales ``[kb]`` of every K step once, before the K loop, and pick each step's in
        registers (a one-hot sum: exact). Loaded inside the loop (False, and always without
        ``swap_ab``) they are plain global loads that Triton does not pipeline: the TTGIR shows
        them after each step's wgmma wait and before the next step's cp.async, a memory round trip
        per K step (preloading is ~10% faster at the 30B-A3B decode shapes). Without ``swap_ab``
        the weight scales are a ``[kb, block_n]`` tile whose registers cost occupancy, so it is
        not offered.
        Used only where the scales fit (`preload_scales`).
    """

    block_m: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    n_fastest: bool = True
    swap_ab: bool = False
    preload_scales: bool = True

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0 or v % 16:
                raise ValueError(f"GroupedGemmConfig.{name} must be a positive multiple of 16, got {v!r}")
        for name in ("num_warps", "num_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"GroupedGemmConfig.{name} must be a positive int, got {v!r}")
        for name in ("n_fastest", "swap_ab", "preload_scales"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GroupedGemmConfig.{name} must be a bool, got {getattr(self, name)!r}")


DEFAULT_CONFIG = GroupedGemmConfig()
SWEEP_CONFIGS = (
    GroupedGemmConfig(16, 64, 4, 4),
    GroupedGemmConfig(16, 128, 4, 4),
    GroupedGemmConfig(32, 128, 4, 4),
    GroupedGemmConfig(64, 128, 4, 3),
    GroupedGemmConfig(64, 256, 8, 3),
    GroupedGemmConfig(128, 128, 8, 3),
    GroupedGemmConfig(128, 256, 8, 3),
    GroupedGemmConfig(128, 128, 8, 3, n_fastest=False),
    # swap_ab (decode sizes: a few rows per expert on the wgmma's N side)
    GroupedGemmConfig(16, 64, 4, 4, swap_ab=True),
    GroupedGemmConfig(16, 128, 4, 4, swap_ab=True),
    GroupedGemmConfig(32, 128, 4, 4, swap_ab=True),
    GroupedGemmConfig(16, 128, 4, 6, swap_ab=True),
    # 32 token rows: one tile per expert at 256 decode tokens (uniform top-8 routing: <= ~30 rows an expert),
    # where 16-row tiles give half the experts a second tile
    GroupedGemmConfig(32, 64, 4, 4, swap_ab=True),
)


# Measured tuning (``python -m experiments.bench grouped_gemm --tuning-out``): per device kind, the fastest
# config of each (M bucket, N, K) timed on it; `default_config` uses an entry only on that device kind.
TUNING_FILE = Path(__file__).with_name("fp8_grouped_gemm_tuning.json")
_device_kind = device_kind  # module-level: the tests stand in another device kind


@functools.cache
def _tuning(kind: str) -> dict[tuple[int, int, int], GroupedGemmConfig]:
    return {(int(e["m_bucket"]), int(e["n"]), int(e["k"])): GroupedGemmConfig(**e["config"])
            for e in tuning_entries(TUNING_FILE, kind)}


# Untuned shapes at decode sizes (M <= DECODE_ROWS rows): the config measured best on both 30B-A3B expert shapes
# at 256 tokens.
DECODE_ROWS = 2048
DECODE_CONFIG = GroupedGemmConfig(16, 128, 4, 4, swap_ab=True)


def default_config(m: int, n: int, k: int) -> GroupedGemmConfig:
    """The measured best for this (M bucket, N, K) on this device kind (`TUNING_FILE`), else
    `DECODE_CONFIG` up to `DECODE_ROWS` rows and `DEFAULT_CONFIG` above."""
    tuned = _tuning(_device_kind()).get((m_bucket(m), n, k))
    if tuned is not None and (not tuned.swap_ab or BK % tuned.block_n == 0):
        return tuned
    return DECODE_CONFIG if m <= DECODE_ROWS else DEFAULT_CONFIG


def group_bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """Row range ``[start_g, end_g)`` of each group (negative sizes count as 0; cut at M)."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def num_work_items(m: int, num_groups: int, block_m: int) -> int:
    """Static upper bound on (group, M tile) work items: ceil(M / block_m) + E (see the note)."""
    return pl.cdiv(m, block_m) + num_groups


def work_items(group_sizes: jax.Array, m: int, block_m: int, k_steps: int) -> jax.Array:
    """int32 ``[5, W]`` work-item table: group id, M tile, rows [lo, hi), K steps.

    Items are ordered by group then tile (so consecutive programs of one group share
    its weight tile). Group ``E`` is the tail (rows past the sum): it stores zeros and is
    reported with group id ``E - 1`` and 0 K steps. Padding items have an empty row range.
    """
    e = group_sizes.shape[0]
    w = num_work_items(m, e, block_m)
    starts, ends = group_bounds(group_sizes, m)
    starts = jnp.concatenate([starts, ends[-1:]])  # + tail group
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    nonempty = ends > starts
    first = starts // block_m
    last = (jnp.maximum(ends, 1) - 1) // block_m
    n_tiles = jnp.where(nonempty, last - first + 1, 0)
    cum = jnp.cumsum(n_tiles)
    item = jnp.arange(w, dtype=jnp.int32)
    # compare_all: one [W, E+1] comparison fusion. The default method ("scan") is a while loop of
    # ~log2(E) tiny steps on the GPU, paid three times per MoE layer at every decode step.
    g = jnp.minimum(jnp.searchsorted(cum, item, side="right", method="compare_all").astype(jnp.int32), e)
    valid = item < cum[-1]
    tile = first[g] + item - (cum[g] - n_tiles[g])
    tile = jnp.where(valid, tile, 0)
    lo = jnp.where(valid, jnp.maximum(starts[g], tile * block_m), 0)
    hi = jnp.where(valid, jnp.minimum(ends[g], (tile + 1) * block_m), 0)
    steps = jnp.where(valid & (g < e), k_steps, 0)
    return jnp.stack([jnp.minimum(g, e - 1), tile, lo, hi, steps]).astype(jnp.int32)


def _next_pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


# Preloaded scales stay in registers for the whole K loop: at most this many float32 per thread.
_PRELOAD_REGS = 32


def preload_scales(config: GroupedGemmConfig, kb: int) -> bool:
    """Whether the kernel loads a tile's scales of all ``kb`` K steps before its K loop: ``swap_ab``
    and ``preload_scales`` configs whose scales (activations [kb, block_m] plus weights [kb], kb
    padded to a power of two) fit in `_PRELOAD_REGS` registers a thread."""
    per_thread = _next_pow2(kb) * (config.block_m + 1) / (32 * config.num_warps)
    return config.swap_ab and config.preload_scales and per_thread <= _PRELOAD_REGS


def _grouped_kernel(meta_ref, a_ref, as_ref, b_ref, bs_ref, o_ref, *, m: int, n: int, k: int,
                    block_m: int, n_fastest: bool, swap_ab: bool = False, preload: bool = False):
    """Refs: meta [5, W]; a [M, Kp]; as [kb, M]; b [E, BN, Kp]; bs [E, kb, BN] (``swap_ab``: the
    unexpanded ``b_scale_inv [E, ceil(N/128), kb]``); o [M, BN]. Without scales (``as_ref`` and
    ``bs_ref`` None: `grouped_gemm`, BF16/F32 operands) the K blocks are plain dots accumulated in
    float32. ``swap_ab``: the accumulator is the tile transposed, [BN, block_m]. ``preload`` (with
    ``swap_ab``): kb is padded to a power of two (zero scales) and the tile's scales of every K step
    are loaded once, before the K loop; each step picks its own in registers (see
    `GroupedGemmConfig.preload_scales`)."""
    block_n = o_ref.shape[1]
    scaled = as_ref is not None
    i, j = (pl.program_id(1), pl.program_id(0)) if n_fastest else (pl.program_id(0), pl.program_id(1))
    g = meta_ref[_GROUP, i]
    row0 = pl.multiple_of(meta_ref[_TILE, i] * block_m, block_m)
    lo, hi, steps = meta_ref[_LO, i], meta_ref[_HI, i], meta_ref[_STEPS, i]
    mask_m, mask_n, mask_k = m % block_m != 0, n % block_n != 0, k % BK != 0
    rows = row0 + jnp.arange(block_m, dtype=jnp.int32)
    row_ok = rows < m
    col_ok = j * block_n + jnp.arange(block_n, dtype=jnp.int32) < n

    def load(ref, mask):
        return plgpu.load(ref) if mask is None else plgpu.load(ref, mask=mask, other=0.0)

    if scaled and preload:  # every K step's scales of the tile, loaded once (kb padded, zeros past it)
        kbp = as_ref.shape[0]
        ksel = jnp.arange(kbp, dtype=jnp.int32)
        sa_all = load(as_ref.at[:, pl.ds(row0, block_m)],
                      jnp.broadcast_to(row_ok[None, :], (kbp, block_m)) if mask_m else None)  # [kbp, bm]
        sb_all = plgpu.load(bs_ref.at[g, (j * block_n) // BK, :])  # [kbp]: the tile's one 128-row scale block

    def scales(t):
        """(sa [block_m], sb: scalar (swap_ab) or [block_n]) of K step t. Preloaded: a one-hot sum over the
        padded steps, exact (one term is nonzero)."""
        if preload:
            hot = ksel == t
            return jnp.sum(jnp.where(hot[:, None], sa_all, 0.0), axis=0), jnp.sum(jnp.where(hot, sb_all, 0.0))
        sa = load(as_ref.at[t, pl.ds(row0, block_m)], row_ok if mask_m else None)
        if swap_ab:  # the tile's rows of B lie in one 128-row scale block: one scale per K step
            return sa, bs_ref[g, (j * block_n) // BK, t]
        return sa, load(bs_ref.at[g, t, :], col_ok if mask_n else None)

    def body(t, acc):
        kk = pl.ds(pl.multiple_of(t * BK, BK), BK)
        k_ok = t * BK + jnp.arange(BK, dtype=jnp.int32) < k
        am = bm = None
        if mask_m or mask_k:
            am = (row_ok if mask_m else jnp.full((block_m,), True))[:, None] & (
                k_ok if mask_k else jnp.full((BK,), True))[None, :]
        if mask_n or mask_k:
            bm = (col_ok if mask_n else jnp.full((block_n,), True))[:, None] & (
                k_ok if mask_k else jnp.full((BK,), True))[None, :]
        a = load(a_ref.at[pl.ds(row0, block_m), kk], am)
        b = load(b_ref.at[g, :, kk], bm)
        prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None  # float32: IEEE, not TF32
        lhs, rhs = (b, a) if swap_ab else (a, b)
        d = jax.lax.dot_general(lhs, rhs, (((1,), (1,)), ((), ())), precision=prec,
                                preferred_element_type=jnp.float32)
        if not scaled:
            return acc + d
        sa, sb = scales(t)
        if swap_ab:
            return acc + (d * sa[None, :]) * sb
        return acc + (d * sa[:, None]) * sb[None, :]

    shape = (block_n, block_m) if swap_ab else (block_m, block_n)
    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros(shape, jnp.float32))
    if swap_ab:
        acc = acc.T
    keep = (rows >= lo) & (rows < hi)
    if mask_n:
        keep = keep[:, None] & col_ok[None, :]
    else:
        keep = jnp.broadcast_to(keep[:, None], (block_m, block_n))
    plgpu.store(o_ref.at[pl.ds(row0, block_m)], acc.astype(o_ref.dtype), mask=keep)


def _grouped_call(a, b, group_sizes, scales, out_dtype, config: GroupedGemmConfig, interpret: bool, name: str):
    """The pallas_call of both kernels: work items from ``group_sizes``, grid (N tiles x items) or
    (items x N tiles); ``scales`` = (a_scale, b_scale_inv, a_scale_t) for FP8 operands (``a_scale_t``:
    a_scale comes as ``[kb, M]``), None for unscaled."""
    m, k = a.shape
    e, n, _ = b.shape
    kb = pl.cdiv(k, BK)
    bm, bn = config.block_m, config.block_n
    meta = work_items(group_sizes, m, bm, kb)
    w = meta.shape[1]
    # Index maps take (item, N tile) whatever the launch order.
    order = (lambda f: lambda j, i: f(i, j)) if config.n_fastest else (lambda f: f)
    meta_spec = pl.BlockSpec((5, w), order(lambda i, j: (0, 0)))
    a_spec = pl.BlockSpec((m, kb * BK), order(lambda i, j: (0, 0)))
    b_spec = pl.BlockSpec((e, bn, kb * BK), order(lambda i, j: (0, j, 0)))
    preload = scales is not None and preload_scales(config, kb)
    body = functools.partial(_grouped_kernel, m=m, n=n, k=k, block_m=bm, n_fastest=config.n_fastest,
                             swap_ab=config.swap_ab, preload=preload)
    if scales is None:
        operands, in_specs = (meta, a, b), [meta_spec, a_spec, b_spec]

        def kernel(meta_ref, a_ref, b_ref, o_ref):
            body(meta_ref, a_ref, None, b_ref, None, o_ref)
    else:
        a_scale, b_scale_inv, a_scale_t = scales
        kbp = _next_pow2(kb) if preload else kb  # Triton tiles are powers of two; the padded steps' scales are 0
        as_t = jnp.pad(a_scale if a_scale_t else a_scale.T, ((0, kbp - kb), (0, 0)))  # [kbp, M]
        if config.swap_ab:  # read as is: one scale per (128-row block, K step) of the tile
            if BK % bn:
                raise ValueError(f"swap_ab with FP8 operands needs block_n dividing {BK}, got {bn}")
            bs_t = jnp.pad(b_scale_inv, ((0, 0), (0, 0), (0, kbp - kb)))
            bs_spec = pl.BlockSpec(bs_t.shape, order(lambda i, j: (0, 0, 0)))
        else:  # [E, kb, N], one scale per row of B
            bs_t = jnp.swapaxes(jnp.repeat(b_scale_inv, BK, axis=1)[:, :n], 1, 2)
            bs_spec = pl.BlockSpec((e, kb, bn), order(lambda i, j: (0, 0, j)))
        operands = (meta, a, as_t, b, bs_t)
        in_specs = [meta_spec, a_spec, pl.BlockSpec((kbp, m), order(lambda i, j: (0, 0))), b_spec, bs_spec]
        kernel = body
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(n, bn), w) if config.n_fastest else (w, pl.cdiv(n, bn)),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((m, bn), order(lambda i, j: (0, j))),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name=name,
    )(*operands)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret", "a_scale_t"))
def _fp8_grouped_gemm(a, a_scale, b, b_scale_inv, group_sizes, out_dtype, config: GroupedGemmConfig,
                      interpret: bool, a_scale_t: bool = False):
    return _grouped_call(a, b, group_sizes, (a_scale, b_scale_inv, a_scale_t), out_dtype, config, interpret,
                         "fp8_block_grouped_gemm")


def _check_operands(a, a_scale, b, b_scale_inv, group_sizes, out_dtype, a_scale_t: bool = False) -> jnp.dtype:
    for name, x in (("a", a), ("a_scale", a_scale), ("b", b), ("b_scale_inv", b_scale_inv),
                    ("group_sizes", group_sizes)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    for name, x, rank in (("a", a, 2), ("a_scale", a_scale, 2), ("b", b, 3), ("b_scale_inv", b_scale_inv, 3),
                          ("group_sizes", group_sizes, 1)):
        if x.ndim != rank:
            raise ValueError(f"{name} must have rank {rank}, got shape {tuple(x.shape)}")
    for name, x in (("a", a), ("b", b)):
        if jnp.dtype(x.dtype) != _FP8:
            raise ValueError(f"{name} must be float8_e4m3fn, got {x.dtype}")
    for name, x in (("a_scale", a_scale), ("b_scale_inv", b_scale_inv)):
        if jnp.dtype(x.dtype) != jnp.dtype(jnp.float32):
            raise ValueError(f"{name} must be float32, got {x.dtype}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be an integer array, got {group_sizes.dtype}")
    (m, k), (e, n, k_b) = a.shape, b.shape
    if k != k_b:
        raise ValueError(f"contraction sizes differ: a is [M, K] = {tuple(a.shape)}, b is [E, N, K] = {tuple(b.shape)}")
    if min(m, n, k, e) == 0:
        raise ValueError(f"M, N, K and E must be positive, got M={m}, N={n}, K={k}, E={e}")
    if tuple(group_sizes.shape) != (e,):
        raise ValueError(
            f"group_sizes has shape {tuple(group_sizes.shape)}, expected (E,) = ({e},) for b {tuple(b.shape)}")
    kb = pl.cdiv(k, BK)
    if a_scale_t and tuple(a_scale.shape) != (kb, m):
        raise ValueError(f"a_scale (a_scale_t=True) has shape {tuple(a_scale.shape)}, expected (ceil(K/128), M) = "
                         f"{(kb, m)}")
    if not a_scale_t and tuple(a_scale.shape) != (m, kb):
        raise ValueError(f"a_scale has shape {tuple(a_scale.shape)}, expected (M, ceil(K/128)) = {(m, kb)}")
    if tuple(b_scale_inv.shape) != (e, pl.cdiv(n, BK), kb):
        raise ValueError(
            f"b_scale_inv has shape {tuple(b_scale_inv.shape)}, expected "
            f"(E, ceil(N/128), ceil(K/128)) = {(e, pl.cdiv(n, BK), kb)}")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {[str(d) for d in _OUT_DTYPES]}, got {out_dtype}")
    return out_dtype


def fp8_grouped_gemm(
    a: jax.Array,
    a_scale: jax.Array,
    b: jax.Array,
    b_scale_inv: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    config: GroupedGemmConfig | None = None,
    interpret: bool | None = None,
    a_scale_t: bool = False,
) -> jax.Array:
    """Block-scaled FP8 grouped ``A @ B[g]^T``: see the module note for the exact math.

    Args:
      a: float8_e4m3fn ``[M, K]`` activations, rows sorted by group.
      a_scale: float32 ``[M, ceil(K/128)]`` per-token 1x128 dequantization scales.
      b: float8_e4m3fn ``[E, N, K]`` stacked expert weights (out_features, in_features).
      b_scale_inv: float32 ``[E, ceil(N/128), ceil(K/128)]`` 128x128 block scales.
      group_sizes: integer ``[E]`` rows per group (sum <= M; rows past the sum give zeros).
      out_dtype: bfloat16 (default), float16 or float32.
      config: tiling (`GroupedGemmConfig`); None uses `DEFAULT_CONFIG`.
      interpret: None runs natively on a GPU backend and in interpret mode otherwise.
      a_scale_t: ``a_scale`` comes transposed, ``[ceil(K/128), M]``, the kernel's layout
        (`pallas_kernels.act_quant.quantize_1x128` writes it from the quantization itself), so the
        call transposes nothing.

    Returns:
      ``[M, N]`` in `out_dtype`.
    """
    config = DEFAULT_CONFIG if config is None else config
    if not isinstance(config, GroupedGemmConfig):
        raise ValueError(f"config must be a GroupedGemmConfig or None, got {type(config).__name__}")
    if not isinstance(a_scale_t, bool):
        raise ValueError(f"a_scale_t must be a bool, got {a_scale_t!r}")
    interpret = resolve_interpret(interpret)
    out_dtype = _check_operands(a, a_scale, b, b_scale_inv, group_sizes, out_dtype, a_scale_t)
    return _fp8_grouped_gemm(a, a_scale, b, b_scale_inv, group_sizes.astype(jnp.int32), out_dtype, config,
                             interpret, a_scale_t)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def _grouped_gemm(a, b, group_sizes, out_dtype, config: GroupedGemmConfig, interpret: bool):
    return _grouped_call(a, b, group_sizes, None, out_dtype, config, interpret, "grouped_gemm")


_DENSE_IN = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def grouped_gemm(
    a: jax.Array,
    b: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    config: GroupedGemmConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Unscaled grouped ``A @ B[g]^T`` (bfloat16 or float32 operands of one dtype, float32
    accumulation): the BF16 MoE expert matmul of the generator, the same work items and tiles as
    `fp8_grouped_gemm` with plain dots per 128-wide K block (XLA's ``ragged_dot`` is far slower on
    GPU, see docs/performance.md).

    Args:
      a: ``[M, K]`` activations, rows sorted by group.
      b: ``[E, N, K]`` stacked expert weights, a's dtype.
      group_sizes: integer ``[E]`` rows per group (sum <= M; rows past the sum give zeros).
      out_dtype: bfloat16 (default), float16 or float32.
      config: tiling (`GroupedGemmConfig`); None uses `DEFAULT_CONFIG`.
      interpret: None runs natively on a GPU backend and in interpret mode otherwise.

    Returns:
      ``[M, N]`` in `out_dtype`; equals ``ragged_dot`` with float32 accumulation up to summation order.
    """
    config = DEFAULT_CONFIG if config is None else config
    if not isinstance(config, GroupedGemmConfig):
        raise ValueError(f"config must be a GroupedGemmConfig or None, got {type(config).__name__}")
    for name, x, rank in (("a", a, 2), ("b", b, 3), ("group_sizes", group_sizes, 1)):
        if not hasattr(x, "ndim") or x.ndim != rank:
            raise ValueError(f"{name} must be an array of rank {rank}, got {getattr(x, 'shape', type(x).__name__)}")
    if jnp.dtype(a.dtype) not in _DENSE_IN or a.dtype != b.dtype:
        raise ValueError(f"a and b must both be bfloat16 or both float32, got {a.dtype} and {b.dtype}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be an integer array, got {group_sizes.dtype}")
    (m, k), (e, n, k_b) = a.shape, b.shape
    if k != k_b or min(m, n, k, e) == 0 or tuple(group_sizes.shape) != (e,):
        raise ValueError(f"shapes do not fit: a [M, K] = {tuple(a.shape)}, b [E, N, K] = {tuple(b.shape)}, "
                         f"group_sizes {tuple(group_sizes.shape)} (expected (E,), all sizes positive)")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {[str(d) for d in _OUT_DTYPES]}, got {out_dtype}")
    return _grouped_gemm(a, b, group_sizes.astype(jnp.int32), out_dtype, config, resolve_interpret(interpret))


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def grouped_gemm_reference(a, b, group_sizes, *, out_dtype=jnp.bfloat16) -> jax.Array:
    """Pure-jnp twin of `grouped_gemm`: ``ragged_dot`` with float32 accumulation (HIGHEST for
    float32 operands), rows past the groups zero."""
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    sizes = group_bounds(group_sizes, a.shape[0])
    y = jax.lax.ragged_dot_general(a, b, sizes[1] - sizes[0], _RAGGED_DN, precision=prec,
                                   preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


_RAGGED_DN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def fp8_grouped_gemm_reference(a, a_scale, b, b_scale_inv, group_sizes, *, out_dtype=jnp.bfloat16) -> jax.Array:
    """Pure-jnp twin of `fp8_grouped_gemm`: per-128-K-block f32 grouped dots, scales applied in the
    kernel's order, rows past the groups zero. Memory: O(M * N) per K block (scanned)."""
    out_dtype = _check_operands(a, a_scale, b, b_scale_inv, group_sizes, out_dtype)
    m, k = a.shape
    e, n, _ = b.shape
    kb = pl.cdiv(k, BK)
    pad = kb * BK - k
    starts, ends = group_bounds(group_sizes, m)
    sizes = ends - starts
    rows = jnp.arange(m, dtype=jnp.int32)
    gid = jnp.minimum(jnp.searchsorted(ends, rows, side="right").astype(jnp.int32), e - 1)  # [M]
    in_group = rows < ends[-1]
    af = jnp.pad(a.astype(jnp.float32), ((0, 0), (0, pad))).reshape(m, kb, BK).transpose(1, 0, 2)  # [kb, M, 128]
    bf = jnp.pad(b.astype(jnp.float32), ((0, 0), (0, 0), (0, pad))).reshape(e, n, kb, BK).transpose(2, 0, 1, 3)
    sb = jnp.repeat(b_scale_inv, BK, axis=1)[:, :n].transpose(2, 0, 1)  # [kb, E, N]

    def step(acc, x):
        a_t, b_t, sa_t, sb_t = x
        d = jax.lax.ragged_dot_general(a_t, b_t, sizes, _RAGGED_DN, precision=jax.lax.Precision.HIGHEST,
                                       preferred_element_type=jnp.float32)
        return acc + (d * sa_t[:, None]) * sb_t[gid], None

    acc, _ = jax.lax.scan(step, jnp.zeros((m, n), jnp.float32), (af, bf, a_scale.T, sb))
    return jnp.where(in_group[:, None], acc, 0.0).astype(out_dtype)
