"""W8A8 block-scaled FP8 GEMM (Pallas, Triton lowering).

Design note
===========

What: ``out [M, N] = A [M, K] @ B [N, K]^T`` with both operands float8_e4m3fn
and DeepSeek-V3 / vLLM block scales:

* ``a_scale float32 [M, ceil(K/128)]``: per-token 1x128 groups
  (`pallas_kernels.act_quant.quantize_groups_reference`), ``A ~= qa * a_scale`` per group;
* ``b_scale_inv float32 [ceil(N/128), ceil(K/128)]``: 128x128 weight blocks
  (`pallas_kernels.fp8_quant.quantize_blocks_reference`), ``B ~= qb * b_scale_inv``.

Math (the reference does the same, in the same order, in float32)::

    acc = 0
    for kb in range(ceil(K / 128)):
        d = qa[:, kb] @ qb[:, kb]^T                   # fp8 x fp8 -> f32, one 128-wide K block
        acc += (d * a_scale[:, kb, None]) * b_scale_inv[n // 128, kb][None, :]
    out = acc.astype(out_dtype)

The scales are applied once per K block in float32 on the CUDA cores (the
"promotion" DeepSeek-V3 describes), so the tensor-core FP8 accumulation only
ever spans 128 products. BK is fixed at 128 to line up with the scale groups.

Layout: row-major ``A [M, K]`` and ``B [N, K]`` (both K-major: the HF Linear
layout, which is what wgmma wants for FP8). Inside the jitted wrapper the
scales are made M/N-major: ``a_scale^T [kb, M]`` and B's block scales expanded
to one per row of B, ``[kb, N]`` (a few MB at most), so each K step reads one
contiguous scale vector per operand whatever ``block_n`` is.

Edges: M, N and K need not be multiples of the tiles; loads are masked (zero
fill) and stores are masked, only on the axes that need it (static flags), so
aligned shapes run unmasked. No operand is padded or copied.

Deviations / limits: E4M3 only; output bf16, f16 or f32. The Triton FP8 dot's
in-tensor-core accumulation precision is the hardware's (Hopper's FP8 wgmma
accumulates with reduced precision; see the GPU tolerance in the tests). The
dots run wgmma for tiles of ``block_m >= 64`` (or ``swap_ab``) because
`pallas_kernels.common.enable_fp8_wgmma` sets the ``maxNumImpreciseAcc`` that
jax's lowering leaves out. The Pallas Triton backend is deprecated upstream in
favour of Mosaic GPU: `fp8_gemm_mgpu` is the wgmma/TMA variant; the library's
policy picks per shape between these kernels and cuBLASLt from measured tables.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import enable_fp8_wgmma, resolve_interpret
from pallas_kernels.fp8_quant import codes_to_float32

enable_fp8_wgmma()  # FP8 dots on wgmma, not the float16 mma.sync fallback (see its note)

BK = 128  # K block = scale group width
_FP8 = jnp.dtype(jnp.float8_e4m3fn)
_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tiling of the GEMM kernel (BK is fixed at 128).

    Attributes:
      block_m: rows of A / out per program; a positive multiple of 16.
      block_n: rows of B (columns of out) per program; a positive multiple of 16.
      num_warps: Triton warps per program.
      num_stages: Triton software-pipelining stages of the K loop.
      k_splits: programs per output tile along K (split-K, for decode-sized M where the output tiles alone
        leave SMs idle: Qwen3-8B's o_proj at M = 128 has 32 tiles of 128 x 128 for 132 SMs). Each split runs a
        contiguous range of the 128-wide K blocks and writes a float32 partial ``[k_splits, M, N]``; XLA sums
        them in split order (deterministic) and casts once. 1: no split.
      swap_ab: compute each tile transposed, ``out^T = B_tile @ A_tile^T`` ([block_n, block_m]): the weight's rows
        on the wgmma's M side (64 per instruction), decode-sized M on its N side (8-256). Needs ``block_n``
        dividing 128 (a tile's rows of B in one 128-row scale block: one weight scale per K step) or a multiple
        of 128 (one accumulator and one scale per 128-row block, A's tile loaded once a step for all of them:
        fewer programs re-reading the activations from L2 for the same weight bytes; 256-row tiles were slower
        than the best 64-row tile at every Qwen3-8B decode shape, so none is in `DECODE_CONFIGS`).
      preload_scales: load the program's scales of every K step it runs before its K loop (the steps padded to a
        power of two with zero scales), each step picking its own in registers, where they are otherwise loaded
        per step: those loads do not feed a dot, so Triton's pipeliner leaves them as plain global loads whose
        latency each step waits for. Applied where the scales fit `_PRELOAD_REGS` registers a thread, else the
        per-step loads.
      prefetch_scales: each K step loads the next step's scales (carried in registers), so a load's latency is
        hidden behind a whole step, without preloading's per-step selection (a cross-thread reduction in
        shared memory). Where preloading applies too, preloading wins.
    """

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 4
    k_splits: int = 1
    swap_ab: bool = False
    preload_scales: bool = False
    prefetch_scales: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0 or v % 16:
                raise ValueError(f"GemmConfig.{name} must be a positive multiple of 16, got {v!r}")
        for name in ("num_warps", "num_stages", "k_splits"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"GemmConfig.{name} must be a positive int, got {v!r}")
        for name in ("swap_ab", "preload_scales", "prefetch_scales"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GemmConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.swap_ab and BK % self.block_n and self.block_n % BK:
            raise ValueError(f"GemmConfig.swap_ab needs block_n dividing {BK} or a multiple of it, got {self.block_n}")

    @classmethod
    def from_spec(cls, spec: str) -> GemmConfig:
        """``block_m,block_n,warps,stages,k_splits[,swap][,preload][,prefetch]``, e.g. ``64,64,4,4,2,swap,prefetch``
        (the command lines' notation; `spec` writes it)."""
        f = [x.strip() for x in spec.split(",")]
        flags = {"swap": "swap_ab", "preload": "preload_scales", "prefetch": "prefetch_scales"}
        if len(f) < 5 or not all(x.isdigit() for x in f[:5]) or any(x not in flags for x in f[5:]):
            raise ValueError(f"a GemmConfig spec is block_m,block_n,warps,stages,k_splits[,swap][,preload][,prefetch]; "
                             f"got {spec!r}")
        bm, bn, w, st, ks = (int(x) for x in f[:5])
        return cls(bm, bn, w, st, k_splits=ks, **{flags[x]: True for x in f[5:]})

    def spec(self) -> str:
        """The inverse of `from_spec`."""
        return ",".join([str(v) for v in (self.block_m, self.block_n, self.num_warps, self.num_stages, self.k_splits)]
                        + [n for n, on in (("swap", self.swap_ab), ("preload", self.preload_scales),
                                           ("prefetch", self.prefetch_scales)) if on])


DEFAULT_CONFIG = GemmConfig()
SWEEP_CONFIGS = (
    GemmConfig(64, 64, 4, 4),
    GemmConfig(64, 128, 4, 4),
    GemmConfig(64, 256, 8, 4),
    GemmConfig(128, 64, 4, 4),
    GemmConfig(128, 128, 8, 3),
    GemmConfig(128, 128, 8, 4),
    GemmConfig(128, 256, 8, 3),
    GemmConfig(256, 128, 8, 3),
)
# Decode-sized M (the generator's 16-256 rows): narrow N tiles and K split so the programs fill the SMs while each
# streams a contiguous slab of the weight (memory-bound: the weight is read once). The first three load their scales
# per step; the rest preload or prefetch them, and the swap_ab ones put the weight rows on the wgmma's M side (offline
# sm_90 codegen: every one runs wgmma with no spills and no global load left in its K loop but prefetch's next-step
# scales). `python -m experiments.bench decode_gemms --triton` times them beside cuBLASLt and writes the table the
# policy reads.
DECODE_CONFIGS = (
    GemmConfig(64, 64, 4, 4, k_splits=2),
    GemmConfig(128, 64, 4, 4, k_splits=2),
    GemmConfig(128, 64, 4, 4, k_splits=4),
    GemmConfig(64, 64, 4, 4, k_splits=2, preload_scales=True),
    GemmConfig(128, 64, 4, 4, k_splits=4, preload_scales=True),
    GemmConfig(128, 64, 4, 4, k_splits=2, prefetch_scales=True),
    GemmConfig(64, 64, 4, 4, k_splits=2, swap_ab=True, preload_scales=True),
    GemmConfig(128, 64, 4, 4, k_splits=2, swap_ab=True, preload_scales=True),
    GemmConfig(128, 64, 4, 4, k_splits=4, swap_ab=True, preload_scales=True),
    GemmConfig(128, 128, 8, 4, k_splits=2, swap_ab=True, preload_scales=True),
    GemmConfig(256, 64, 8, 4, k_splits=4, swap_ab=True, preload_scales=True),
    GemmConfig(64, 64, 4, 4, k_splits=2, swap_ab=True, prefetch_scales=True),
    GemmConfig(128, 64, 4, 4, k_splits=2, swap_ab=True, prefetch_scales=True),
    GemmConfig(128, 64, 4, 4, k_splits=4, swap_ab=True, prefetch_scales=True),
    GemmConfig(256, 64, 8, 4, k_splits=4, swap_ab=True, prefetch_scales=True),
    GemmConfig(64, 64, 4, 4, k_splits=4, swap_ab=True, prefetch_scales=True),
    GemmConfig(64, 64, 4, 4, k_splits=1, swap_ab=True, prefetch_scales=True),
)

# Preloaded scales stay in registers for the whole K loop: at most this many float32 per thread.
_PRELOAD_REGS = 48


def _next_pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def preload_steps(config: GemmConfig, steps: int) -> int:
    """The K steps a program of ``config`` preloads the scales of when it runs ``steps`` of them (a power of two
    >= steps), or 0 where it loads them per step: no ``preload_scales``, or more than `_PRELOAD_REGS` float32 a
    thread (activation scales [P, block_m] plus the weight's: [P] per 128-row block with ``swap_ab``, else
    [P, block_n])."""
    p = _next_pow2(steps)
    weight = max(1, config.block_n // BK) if config.swap_ab else config.block_n  # swap_ab: one per 128-row block
    per_thread = p * (config.block_m + weight) / (32 * config.num_warps)
    return p if config.preload_scales and per_thread <= _PRELOAD_REGS else 0


def _gemm_kernel(a_ref, as_ref, b_ref, bs_ref, o_ref, *, m: int, n: int, k: int, blocks_per_split: int = 0,
                 swap_ab: bool = False, preload: int = 0, prefetch: bool = False):
    """Refs: a [BM, Kp], as [kbp, BM], b [BN, Kp], bs [kbp, BN] (``swap_ab``: the unexpanded ``b_scale_inv
    [ceil(N/128), kbp]``), o [BM, BN] (Kp = kb * 128; kbp >= kb rows of scales, zeros past kb). With
    ``blocks_per_split`` > 0 (split-K) the program runs K blocks ``[s * blocks_per_split, (s + 1) *
    blocks_per_split)`` of its split s (grid axis 2) and ``o`` is its float32 partial, [1, BM, BN]. ``swap_ab``:
    the accumulators are the tile transposed, one [sub, BM] per 128-row scale block of B the tile spans (sub =
    min(BN, 128)), each product scaled by its block's scale; a K step loads A's tile once for all of them.
    ``preload`` > 0: the scales of K steps ``[lo, lo + preload)`` are loaded before the K loop (see
    `GemmConfig.preload_scales`). ``prefetch``: each step loads the next step's scales
    (`GemmConfig.prefetch_scales`)."""
    block_m, block_n = o_ref.shape[-2:]
    kb = pl.cdiv(k, BK)
    i, j = pl.program_id(0), pl.program_id(1)
    lo, hi = 0, kb
    if blocks_per_split:
        lo = pl.program_id(2) * blocks_per_split
        hi = jnp.minimum(lo + blocks_per_split, kb)
    mask_m, mask_n, mask_k = m % block_m != 0, n % block_n != 0, k % BK != 0
    row_ok = i * block_m + jnp.arange(block_m, dtype=jnp.int32) < m
    # swap_ab: the tile's rows of B in `nsub` sub-tiles of `sub` rows, each inside one 128-row scale block
    sub = min(block_n, BK) if swap_ab else block_n
    nsub = block_n // sub
    sub_ok = [j * block_n + r * sub + jnp.arange(sub, dtype=jnp.int32) < n for r in range(nsub)]
    col_ok = sub_ok[0] if nsub == 1 else None
    # their scale blocks, clamped where a masked edge tile runs past N (those rows are zeros, stores masked)
    sblocks = [(j * block_n + r * sub) // BK for r in range(nsub)]
    if mask_n and nsub > 1:
        sblocks = [jnp.minimum(sb, pl.cdiv(n, BK) - 1) for sb in sblocks]

    def load(ref, mask):
        return plgpu.load(ref) if mask is None else plgpu.load(ref, mask=mask, other=0.0)

    if preload:  # the scales of the program's K steps, loaded once (zeros past kb)
        ksel = lo + jnp.arange(preload, dtype=jnp.int32)
        steps = pl.ds(lo, preload)
        sa_all = load(as_ref.at[steps, :], jnp.broadcast_to(row_ok[None, :], (preload, block_m)) if mask_m else None)
        if swap_ab:
            sb_all = tuple(plgpu.load(bs_ref.at[sb, steps]) for sb in sblocks)  # nsub x [P]
        else:
            sb_all = load(bs_ref.at[steps, :], jnp.broadcast_to(col_ok[None, :], (preload, block_n)) if mask_n
                          else None)  # [P, BN]

    def scales(t):
        """(sa [block_m], sb: a tuple of nsub scalars (swap_ab) or [block_n]) of K step t. Preloaded: a one-hot sum
        over the preloaded steps, exact (one term is nonzero)."""
        if preload:
            hot = ksel == t
            sa = jnp.sum(jnp.where(hot[:, None], sa_all, 0.0), axis=0)
            if swap_ab:
                return sa, tuple(jnp.sum(jnp.where(hot, x, 0.0)) for x in sb_all)
            return sa, jnp.sum(jnp.where(hot[:, None], sb_all, 0.0), axis=0)
        sa = load(as_ref.at[t, :], row_ok if mask_m else None)
        if swap_ab:
            return sa, tuple(bs_ref[sb, t] for sb in sblocks)
        return sa, load(bs_ref.at[t, :], col_ok if mask_n else None)

    def product(t, ts=None):
        """K step t's unscaled products (a tuple: [BM, BN]; swap_ab: nsub x [sub, BM]) and the scales of step
        ``ts`` (default t)."""
        kk = pl.ds(pl.multiple_of(t * BK, BK), BK)
        k_ok = t * BK + jnp.arange(BK, dtype=jnp.int32) < k
        am = None
        if mask_m or mask_k:
            am = (row_ok if mask_m else jnp.full((block_m,), True))[:, None] & (
                k_ok if mask_k else jnp.full((BK,), True))[None, :]

        def b_mask(ok):
            if not (mask_n or mask_k):
                return None
            return (ok if mask_n else jnp.full(ok.shape, True))[:, None] & (
                k_ok if mask_k else jnp.full((BK,), True))[None, :]

        a = load(a_ref.at[:, kk], am)
        if swap_ab:
            bs = [load(b_ref.at[pl.ds(r * sub, sub), kk] if nsub > 1 else b_ref.at[:, kk], b_mask(sub_ok[r]))
                  for r in range(nsub)]
        else:
            bs = [load(b_ref.at[:, kk], b_mask(col_ok))]
        sa, sb = scales(t if ts is None else ts)  # before the dots: per-step loads are in flight while they run
        dn = (((1,), (1,)), ((), ()))
        ds = tuple(jax.lax.dot_general(b, a, dn, preferred_element_type=jnp.float32) if swap_ab else
                   jax.lax.dot_general(a, b, dn, preferred_element_type=jnp.float32) for b in bs)
        return ds, sa, sb

    def scaled(d, sa, sb):  # swap_ab: the same products, scaled in the same order
        return (d * sa[None, :]) * sb if swap_ab else (d * sa[:, None]) * sb[None, :]

    def accumulate(accs, ds, sa, sb):
        sbs = sb if swap_ab else (sb,)
        return tuple(acc + scaled(d, sa, s) for acc, d, s in zip(accs, ds, sbs))

    zero = tuple(jnp.zeros((sub, block_m) if swap_ab else (block_m, block_n), jnp.float32) for _ in range(nsub))
    if prefetch:  # step t loads step t + 1's scales (clamped at the last step: a harmless reload)

        def body(t, carry):
            accs, sa, sb = carry
            ds, sa_next, sb_next = product(t, jnp.minimum(t + 1, hi - 1))
            return accumulate(accs, ds, sa, sb), sa_next, sb_next

        accs, _, _ = jax.lax.fori_loop(lo, hi, body, (zero, *scales(jnp.asarray(lo, jnp.int32))))
    else:
        accs = jax.lax.fori_loop(lo, hi, lambda t, accs: accumulate(accs, *product(t)), zero)
    for r, acc in enumerate(accs):
        out = (acc.T if swap_ab else acc).astype(o_ref.dtype)
        ok = row_ok[:, None] & sub_ok[r][None, :]
        ref = o_ref.at[..., pl.ds(r * sub, sub)] if nsub > 1 else o_ref
        if blocks_per_split:  # the partial's block [1, BM, BN]
            out, ok = out[None], ok[None]
        if mask_m or mask_n:
            plgpu.store(ref, out, mask=ok)
        else:
            ref[...] = out


def split_k(k_blocks: int, k_splits: int) -> tuple[int, int]:
    """``(splits, blocks per split)`` of a GEMM over ``k_blocks`` 128-wide K blocks asked for ``k_splits``: every
    split runs ``per`` blocks but the last, and none is empty (5 blocks in 4 splits: 3 splits of 2, 2, 1)."""
    per = pl.cdiv(k_blocks, min(k_splits, k_blocks))
    return pl.cdiv(k_blocks, per), per


def grid_programs(m: int, n: int, k: int, config: GemmConfig) -> int:
    """The programs `fp8_gemm` launches for ``[M, K] x [N, K]^T`` with ``config``: M tiles x N tiles x K splits."""
    return pl.cdiv(m, config.block_m) * pl.cdiv(n, config.block_n) * split_k(pl.cdiv(k, BK), config.k_splits)[0]


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret", "a_scale_t"))
def _fp8_gemm(a, a_scale, b, b_scale_inv, out_dtype, config: GemmConfig, interpret: bool, a_scale_t: bool = False):
    m, k = a.shape
    n = b.shape[0]
    kb = pl.cdiv(k, BK)
    bm, bn = config.block_m, config.block_n
    splits, per = split_k(kb, config.k_splits)
    preload = preload_steps(config, per)
    kbp = (splits - 1) * per + preload if preload else kb  # scale rows: the last split's preload fits
    as_t = jnp.pad(a_scale if a_scale_t else a_scale.T, ((0, kbp - kb), (0, 0)))  # [kbp, M]
    if config.swap_ab:  # as is: one scale per (128-row block, K step)
        bs = jnp.pad(b_scale_inv, ((0, 0), (0, kbp - kb)))  # [ceil(N/128), kbp]
        bs_spec = pl.BlockSpec(bs.shape, lambda i, j, *s: (0, 0))
    else:
        bs = jnp.pad(jnp.repeat(b_scale_inv, BK, axis=0)[:n].T, ((0, kbp - kb), (0, 0)))  # [kbp, N], one per row of B
        bs_spec = pl.BlockSpec((kbp, bn), lambda i, j, *s: (0, j))
    kernel = functools.partial(_gemm_kernel, m=m, n=n, k=k, blocks_per_split=per if splits > 1 else 0,
                               swap_ab=config.swap_ab, preload=preload,
                               prefetch=config.prefetch_scales and not preload)
    if splits > 1:
        grid = (pl.cdiv(m, bm), pl.cdiv(n, bn), splits)
        out_spec = pl.BlockSpec((1, bm, bn), lambda i, j, s: (s, i, j))
        out_shape = jax.ShapeDtypeStruct((splits, m, n), jnp.float32)
    else:
        grid = (pl.cdiv(m, bm), pl.cdiv(n, bn))
        out_spec = pl.BlockSpec((bm, bn), lambda i, j: (i, j))
        out_shape = jax.ShapeDtypeStruct((m, n), out_dtype)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((bm, kb * BK), lambda i, j, *s: (i, 0)),
            pl.BlockSpec((kbp, bm), lambda i, j, *s: (0, i)),
            pl.BlockSpec((bn, kb * BK), lambda i, j, *s: (j, 0)),
            bs_spec,
        ],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="fp8_block_gemm",
    )(a, as_t, b, bs)
    if splits > 1:  # the partials in split order, one rounding
        out = out.sum(0).astype(out_dtype)
    return out


def _check_operands(a, a_scale, b, b_scale_inv, out_dtype) -> jnp.dtype:
    for name, x in (("a", a), ("a_scale", a_scale), ("b", b), ("b_scale_inv", b_scale_inv)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name} must be an array, got {type(x).__name__}")
        if x.ndim != 2:
            raise ValueError(f"{name} must have rank 2, got shape {tuple(x.shape)}")
    for name, x in (("a", a), ("b", b)):
        if jnp.dtype(x.dtype) != _FP8:
            raise ValueError(f"{name} must be float8_e4m3fn, got {x.dtype}")
    for name, x in (("a_scale", a_scale), ("b_scale_inv", b_scale_inv)):
        if jnp.dtype(x.dtype) != jnp.dtype(jnp.float32):
            raise ValueError(f"{name} must be float32, got {x.dtype}")
    (m, k), (n, k_b) = a.shape, b.shape
    if k != k_b:
        raise ValueError(f"contraction sizes differ: a is [M, K] = {tuple(a.shape)}, b is [N, K] = {tuple(b.shape)}")
    if min(m, n, k) == 0:
        raise ValueError(f"M, N, K must be positive, got M={m}, N={n}, K={k}")
    kb = pl.cdiv(k, BK)
    if tuple(a_scale.shape) != (m, kb):
        raise ValueError(f"a_scale has shape {tuple(a_scale.shape)}, expected (M, ceil(K/128)) = {(m, kb)}")
    if tuple(b_scale_inv.shape) != (pl.cdiv(n, BK), kb):
        raise ValueError(
            f"b_scale_inv has shape {tuple(b_scale_inv.shape)}, expected "
            f"(ceil(N/128), ceil(K/128)) = {(pl.cdiv(n, BK), kb)}")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {[str(d) for d in _OUT_DTYPES]}, got {out_dtype}")
    return out_dtype


def fp8_gemm(
    a: jax.Array,
    a_scale: jax.Array,
    b: jax.Array,
    b_scale_inv: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    config: GemmConfig | None = None,
    interpret: bool | None = None,
    a_scale_t: bool = False,
) -> jax.Array:
    """Block-scaled FP8 ``A @ B^T``: see the module note for the exact math.

    Args:
      a: float8_e4m3fn ``[M, K]`` activations.
      a_scale: float32 ``[M, ceil(K/128)]`` per-token 1x128 dequantization scales (``[ceil(K/128), M]`` with
        ``a_scale_t``).
      b: float8_e4m3fn ``[N, K]`` weight (out_features, in_features).
      b_scale_inv: float32 ``[ceil(N/128), ceil(K/128)]`` 128x128 block scales.
      out_dtype: bfloat16 (default), float16 or float32.
      config: tiling (`GemmConfig`); None uses `DEFAULT_CONFIG`.
      interpret: None runs natively on a GPU backend and in interpret mode otherwise.
      a_scale_t: ``a_scale`` comes transposed, in the order the kernel reads it (the activation quantization
        kernels write it so: `pallas_kernels.act_quant`'s ``scales_t``), which saves the transpose kernel XLA
        otherwise runs before every call.

    Returns:
      ``[M, N]`` in `out_dtype`.
    """
    config = DEFAULT_CONFIG if config is None else config
    if not isinstance(config, GemmConfig):
        raise ValueError(f"config must be a GemmConfig or None, got {type(config).__name__}")
    interpret = resolve_interpret(interpret)
    if a_scale_t:
        if not hasattr(a_scale, "shape") or not hasattr(a_scale, "dtype"):
            raise ValueError(f"a_scale must be an array, got {type(a_scale).__name__}")
        expected = (pl.cdiv(a.shape[-1], BK), a.shape[0]) if getattr(a, "ndim", 0) == 2 else None
        if expected is not None and tuple(a_scale.shape) != expected:
            raise ValueError(f"a_scale (a_scale_t=True) has shape {tuple(a_scale.shape)}, expected "
                             f"(ceil(K/128), M) = {expected}")
        shown = jax.ShapeDtypeStruct(tuple(a_scale.shape)[::-1], a_scale.dtype)  # the rest checked as [M, K/128]
        out_dtype = _check_operands(a, shown, b, b_scale_inv, out_dtype)
    else:
        out_dtype = _check_operands(a, a_scale, b, b_scale_inv, out_dtype)
    return _fp8_gemm(a, a_scale, b, b_scale_inv, out_dtype, config, interpret, a_scale_t=bool(a_scale_t))


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def fp8_gemm_reference(a, a_scale, b, b_scale_inv, *, out_dtype=jnp.bfloat16) -> jax.Array:
    """Pure-jnp twin of `fp8_gemm`: per-128-K-block f32 dots, scales applied in the kernel's order."""
    out_dtype = _check_operands(a, a_scale, b, b_scale_inv, out_dtype)
    m, k = a.shape
    n = b.shape[0]
    kb = pl.cdiv(k, BK)
    pad = kb * BK - k
    af = jnp.pad(codes_to_float32(a), ((0, 0), (0, pad))).reshape(m, kb, BK)  # exact codes under jit on GPU
    bf = jnp.pad(codes_to_float32(b), ((0, 0), (0, pad))).reshape(n, kb, BK)
    d = jnp.einsum("mtk,ntk->tmn", af, bf, precision=jax.lax.Precision.HIGHEST)  # [kb, M, N]
    sb = jnp.repeat(b_scale_inv, BK, axis=0)[:n].T  # [kb, N]
    scaled = (d * a_scale.T[:, :, None]) * sb[:, None, :]

    def step(acc, x):
        return acc + x, None

    acc, _ = jax.lax.scan(step, jnp.zeros((m, n), jnp.float32), scaled)
    return acc.astype(out_dtype)
