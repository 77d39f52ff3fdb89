"""W8A8 block-scaled FP8 GEMM for Hopper (Pallas, Mosaic GPU lowering: TMA + wgmma).

Design note
===========

What: ``out [M, N] = A [M, K] @ B [N, K]^T``, both operands float8_e4m3fn, with
the DeepSeek-V3 / vLLM block scales of `pallas_kernels.fp8_gemm` (same
arguments, same math; `fp8_gemm_reference` there is this kernel's reference):

* ``a_scale float32 [M, K/128]``: per-token 1x128 groups, ``A ~= qa * a_scale``;
* ``b_scale_inv float32 [N/128, K/128]``: 128x128 blocks, ``B ~= qb * b_scale_inv``.

Math (two-level accumulation, "promotion")::

    acc = 0                                             # f32, registers
    for kb in range(K / 128):
        d = qa[:, kb] @ qb[:, kb]^T                     # wgmma E4M3 x E4M3 -> f32, fresh accumulator
        acc += d * (a_scale[:, kb] * b_scale_inv[n // 128, kb])[:, None]
    out = acc.astype(out_dtype)

The tensor cores accumulate only one 128-wide K block (4 wgmma k32 steps), so
Hopper's reduced-precision FP8 accumulation never spans more than 128
products; every block is promoted into the float32 register accumulator on
the CUDA cores. The two scales are multiplied first (one per row) so the
promotion is one FMA per accumulator element; the reference applies
``(d * sa) * sb``, which differs by float32 rounding only (~1 ulp per term).

Kernel structure (after jax's ``hopper_matmul_mgpu``, Lane semantics):

* Persistent grid: one CTA per SM (``num_sms``), looping over output tiles in
  a planar-snake order (``grid_minor_dim`` / ``grid_tile_width``) for L2 reuse.
* Warp specialization: 3 warpgroups per CTA; the last one only issues TMA
  copies (``emit_pipeline_warp_specialized``, ``max_concurrent_steps`` stages),
  the 2 consumer warpgroups each own a ``tile_m x tile_n`` accumulator pair
  (the wgmma accumulator ``d`` and the f32 ``acc``: 2 x 64 registers/thread at
  64 x 128). They split the CTA tile along M (CTA ``2*tile_m x tile_n``) or
  along N (CTA ``tile_m x 2*tile_n``, better for decode-sized M).
* Per pipeline step (one 128-wide K block) the memory warpgroup TMA-loads
  ``A[cta_m, kb]`` and ``B[cta_n, kb]`` (128 fp8 = 128 bytes per row: tiling
  (8, 128) and the 128-byte swizzle, the layout wgmma reads directly; B stays
  K-major [N, K] and is fed to wgmma transposed, as FP8 wgmma requires) and the
  scale row ``a_scale^T[kb, cta_m]``: the wrapper transposes ``a_scale`` to
  ``[K/128, M]`` (a few hundred KB at most) so a tile's scales are one
  contiguous TMA box. The consumer loads its slice of that row into registers
  in the WGMMA row layout; ``b_scale_inv[nb, kb]`` is a single scalar per step
  (``tile_n`` <= 128 divides the 128-row scale block) read from GMEM.
* Split-K (``k_splits`` > 1, for decode shapes with few output tiles): the
  persistent loop runs over (tile, split) pairs, each split a contiguous range
  of K blocks with its own pipeline; partials are written in float32
  ``[k_splits, M, N]`` and summed by XLA before the one cast to ``out_dtype``.
* Clusters (``cluster_n`` = 2, for decode shapes): pairs of CTAs side by side
  along N form a cluster; the A tile (all the CTA's rows of the activations, the
  same for both) arrives by one TMA multicast (``collective_axes=("cluster",)``
  on its BlockSpec), halving A's L2 -> SM traffic, which at M = 256 is most of
  the bytes a CTA reads (1 MB of A against 0.25-0.5 MB of B for K = 4096). The
  persistent loop runs over cluster tiles (grid ``num_sms / 2`` clusters).
* Overlapped promotion (``overlap_promotion``): block kb's wgmma is issued, block kb-1's product
  promoted while it runs, then waited for (the carry holds one block's product and scale). Slower
  than the same tiling without it at the decode shapes, so it is out of the sweeps.
* Epilogue: cast to ``out_dtype`` in registers, store to 128-byte-swizzled
  SMEM, TMA-store to GMEM (the next tile's epilogue waits for the previous
  store to have read the SMEM).

Limits: E4M3 only; out bf16, f16 or f32. ``K % 128 == 0`` and ``N`` a multiple
of the CTA tile width (``tile_n``, or ``2*tile_n`` when the warpgroups split N;
times ``cluster_n``) are required; the wrapper rejects other shapes with an error that names
`pallas_kernels.fp8_gemm.fp8_gemm` (masked edges) as the fallback, because
padding B would copy the weight on every call. ``M`` is arbitrary: the wrapper
zero-pads A and a_scale to a multiple of the CTA tile height (a copy of A only
when M is not already a multiple) and slices the output back.

Verification: the CPU tests run this kernel in Mosaic GPU interpret mode
(``interpret=True`` or an ``InterpretGPUParams``, passed to ``plgpu.kernel``;
wgmma simulated in float32, TMA and barriers simulated). The Python-side
Mosaic GPU lowering for CUDA also succeeds on the CPU for every sweep config
(``jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))``), which
checks layouts, wgmma operand constraints and shared-memory size; PTX
compilation, native numerics and timing need a Hopper GPU (``python -m experiments.bench
gemm_tune``; ``tests/test_fp8_gemm_mgpu.py::TestGpu``). At jax 0.11.2 interpret-mode race
detection reports a race on every pipeline slot that
``emit_pipeline_warp_specialized`` refills after its consumed barrier (a
minimal kernel whose body only reads its input block shows it too) and does not
race-check Hopper wgmma operand reads, so the race test covers only shapes
without slot reuse.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import device_kind, m_bucket, tuning_entries
from pallas_kernels.fp8_gemm import BK, _check_operands, fp8_gemm_reference

__all__ = [
    "BK",
    "DECODE_CONFIG",
    "DEFAULT_CONFIG",
    "MatmulDimension",
    "MgpuGemmConfig",
    "default_config",
    "fp8_gemm_mgpu",
    "config_dict",
    "fp8_gemm_reference",
    "supports",
]

_SWIZZLE = 128  # bytes: one 128-wide fp8 K block per row
_OPERAND_TRANSFORMS = (plgpu.TilingTransform((8, _SWIZZLE)), plgpu.SwizzleTransform(_SWIZZLE))
_SMEM_BYTES = 227 * 1024 - 1024  # Hopper's per-CTA opt-in shared memory, less room for barriers


class MatmulDimension(enum.IntEnum):
    """An output axis: how the 2 consumer warpgroups split a CTA tile, or the minor axis of the tile order."""

    M = 0
    N = 1


@dataclasses.dataclass(frozen=True)
class MgpuGemmConfig:
    """Tiling of the Mosaic GPU FP8 GEMM (BK is fixed at 128 = the scale group).

    Attributes:
      tile_m: rows of the output per consumer warpgroup: 64 or 128 (a multiple of wgmma's M=64).
        128 doubles the registers (2 x 128 f32 per thread); 64 is the DeepGEMM choice.
      tile_n: output columns per consumer warpgroup: 64 or 128 (must divide the 128-row B scale block).
      wg_dimension: the axis along which the 2 consumer warpgroups split the CTA tile
        (M: CTA ``2*tile_m x tile_n``; N: CTA ``tile_m x 2*tile_n``).
      max_concurrent_steps: TMA pipeline stages (K blocks in flight), >= 2.
      grid_minor_dim: the faster-moving output axis of the persistent tile loop.
      grid_tile_width: planar-snake band width of the tile loop (L2 reuse).
      num_sms: CTAs of the persistent grid; None uses the device's SM count (4 off the GPU).
      k_splits: split-K: each output tile is computed as ``k_splits`` partial products over equal
        ranges of K blocks (separate tiles of the persistent loop), written in float32 and summed
        by XLA, then cast. For decode-sized M with few output tiles (M = 256, N = 1024: 32 CTA
        tiles for 132 SMs) it gives the SMs work; costs one float32 [k_splits, M, N] round trip.
      cluster_n: 1, or 2: pairs of CTAs side by side along N form a cluster and receive the A tile
        (the activations, the same for both) by one TMA multicast, halving A's L2 -> SM traffic.
        At decode sizes each CTA holds all M rows and re-reads the whole activation (1 MB at
        M = 256, K = 4096) for a 64-128 column slice of B: that read, not the tensor cores, sets
        the time (the DeepGEMM / CUTLASS remedy). N must be a multiple of 2 CTA tiles.
    """

    tile_m: int = 64
    tile_n: int = 128
    wg_dimension: MatmulDimension = MatmulDimension.M
    max_concurrent_steps: int = 4
    grid_minor_dim: MatmulDimension = MatmulDimension.N
    grid_tile_width: int = 1
    num_sms: int | None = None
    k_splits: int = 1
    cluster_n: int = 1
    overlap_promotion: bool = False

    def __post_init__(self):
        if self.tile_m not in (64, 128):
            raise ValueError(f"MgpuGemmConfig.tile_m must be 64 or 128, got {self.tile_m!r}")
        if self.tile_n not in (64, 128):
            raise ValueError(f"MgpuGemmConfig.tile_n must be 64 or 128, got {self.tile_n!r}")
        for name in ("wg_dimension", "grid_minor_dim"):
            if not isinstance(getattr(self, name), MatmulDimension):
                raise ValueError(f"MgpuGemmConfig.{name} must be a MatmulDimension, got {getattr(self, name)!r}")
        if not isinstance(self.max_concurrent_steps, int) or self.max_concurrent_steps < 2:
            raise ValueError(f"MgpuGemmConfig.max_concurrent_steps must be an int >= 2, got {self.max_concurrent_steps!r}")
        if not isinstance(self.grid_tile_width, int) or self.grid_tile_width < 1:
            raise ValueError(f"MgpuGemmConfig.grid_tile_width must be a positive int, got {self.grid_tile_width!r}")
        if self.num_sms is not None and (not isinstance(self.num_sms, int) or self.num_sms < 1):
            raise ValueError(f"MgpuGemmConfig.num_sms must be None or a positive int, got {self.num_sms!r}")
        if not isinstance(self.k_splits, int) or self.k_splits < 1:
            raise ValueError(f"MgpuGemmConfig.k_splits must be a positive int, got {self.k_splits!r}")
        if self.cluster_n not in (1, 2):
            raise ValueError(f"MgpuGemmConfig.cluster_n must be 1 or 2, got {self.cluster_n!r}")
        if not isinstance(self.overlap_promotion, bool):
            raise ValueError(f"MgpuGemmConfig.overlap_promotion must be a bool, got {self.overlap_promotion!r}")

    @property
    def cta_tile_m(self) -> int:
        return self.tile_m * (2 if self.wg_dimension == MatmulDimension.M else 1)

    @property
    def cta_tile_n(self) -> int:
        return self.tile_n * (2 if self.wg_dimension == MatmulDimension.N else 1)

    @property
    def cluster_tile_n(self) -> int:
        """Output columns of one cluster (``cluster_n`` CTAs side by side along N)."""
        return self.cta_tile_n * self.cluster_n

    def smem_bytes(self, out_dtype) -> int:
        """Shared memory the kernel allocates: pipeline stages (A, B, scale row) + epilogue buffers
        (float32 partials with split-K)."""
        stage = self.cta_tile_m * BK + self.cta_tile_n * BK + self.cta_tile_m * 4
        itemsize = 4 if self.k_splits > 1 else jnp.dtype(out_dtype).itemsize
        return self.max_concurrent_steps * stage + 2 * self.tile_m * self.tile_n * itemsize


# CTA tiles of 128 x 128 or 64 x 256 with 64 x 128 per consumer warpgroup are the fastest at every
# Qwen3-8B shape; 128-row warpgroup tiles (2 x 128 f32 registers per thread) are 30-45% slower.
DEFAULT_CONFIG = MgpuGemmConfig(64, 128, MatmulDimension.M, 4, MatmulDimension.N, 8)  # CTA 128 x 128
DECODE_CONFIG = MgpuGemmConfig(64, 128, MatmulDimension.N, 3)  # CTA 64 x 256: more CTAs along N when M is small
SWEEP_CONFIGS = (  # all fit in shared memory with bf16 output
    DEFAULT_CONFIG,
    MgpuGemmConfig(64, 128, MatmulDimension.M, 4),
    MgpuGemmConfig(64, 128, MatmulDimension.M, 5),
    DECODE_CONFIG,
    MgpuGemmConfig(64, 128, MatmulDimension.N, 4, MatmulDimension.M, 8),
    MgpuGemmConfig(64, 64, MatmulDimension.N, 6),
    # clusters sharing A (DeepGEMM's multicast): not yet timed at prefill sizes
    dataclasses.replace(DEFAULT_CONFIG, cluster_n=2),
)


# Decode-sized M (the rollout engine's slots): a weight is streamed once per CTA row of tiles, so
# CTAs holding all M rows (128-row warpgroup tiles split along M, narrow N) read it once.
DECODE_SWEEP_CONFIGS = (
    DEFAULT_CONFIG,
    DECODE_CONFIG,
    MgpuGemmConfig(64, 64, MatmulDimension.N, 6),
    MgpuGemmConfig(64, 64, MatmulDimension.N, 8),
    MgpuGemmConfig(64, 64, MatmulDimension.M, 6),
    MgpuGemmConfig(128, 64, MatmulDimension.M, 4),
    MgpuGemmConfig(128, 64, MatmulDimension.M, 3),
    # split-K: M = 256 with N = 1024 leaves 32 CTA tiles for 132 SMs
    MgpuGemmConfig(64, 64, MatmulDimension.N, 6, k_splits=2),
    MgpuGemmConfig(64, 64, MatmulDimension.N, 6, k_splits=4),
    MgpuGemmConfig(64, 64, MatmulDimension.M, 6, k_splits=4),
    MgpuGemmConfig(128, 64, MatmulDimension.M, 3, k_splits=4),
    # clusters of 2 CTAs along N sharing the activation tile (TMA multicast): without it each CTA of
    # these holds all 256 rows and re-reads the 1 MB activation from L2 for 64-128 columns
    MgpuGemmConfig(128, 64, MatmulDimension.M, 4, cluster_n=2),
    MgpuGemmConfig(128, 64, MatmulDimension.M, 3, cluster_n=2),
    MgpuGemmConfig(64, 128, MatmulDimension.M, 4, cluster_n=2),
    MgpuGemmConfig(128, 64, MatmulDimension.M, 3, k_splits=4, cluster_n=2),
)
# Overlapped promotion: never the fastest at the decode shapes (6-34% slower than the same tiling
# without it). Kept as an option, tested, out of the sweeps.
OVERLAP_CONFIGS = (
    dataclasses.replace(DECODE_CONFIG, overlap_promotion=True),
    MgpuGemmConfig(64, 64, MatmulDimension.N, 6, overlap_promotion=True),
    MgpuGemmConfig(128, 64, MatmulDimension.M, 4, overlap_promotion=True),
    MgpuGemmConfig(128, 64, MatmulDimension.M, 4, cluster_n=2, overlap_promotion=True),
)

# Measured tuning (``python -m experiments.bench gemm_tune --tuning-out``): per device kind, the fastest
# config of each (M bucket, N, K) timed on it. `default_config` uses an entry only on that device kind.
TUNING_FILE = Path(__file__).with_name("fp8_gemm_mgpu_tuning.json")


_device_kind = device_kind  # module-level: the tests stand in another device kind


def config_dict(cfg: MgpuGemmConfig) -> dict:
    """``cfg`` as a tuning-table entry's ``config`` (enums by name): what `_tuning` reads back."""
    return {f.name: (getattr(cfg, f.name).name if isinstance(getattr(cfg, f.name), enum.Enum) else getattr(cfg, f.name))
            for f in dataclasses.fields(cfg)}


@functools.cache
def _tuning(kind: str) -> dict[tuple[int, int, int], MgpuGemmConfig]:
    out = {}
    for e in tuning_entries(TUNING_FILE, kind):
        c = dict(e["config"])
        for f in ("wg_dimension", "grid_minor_dim"):
            c[f] = MatmulDimension[c[f]]
        out[(int(e["m_bucket"]), int(e["n"]), int(e["k"]))] = MgpuGemmConfig(**c)
    return out


def default_config(m: int, n: int, k: int | None = None) -> MgpuGemmConfig:
    """The measured best for this (M bucket, N, K) on this device kind (`TUNING_FILE`), else: N-split
    CTAs (64 x 256) up to M = 2048 when N allows, else M-split 128 x 128."""
    if k is not None:
        tuned = _tuning(_device_kind()).get((m_bucket(m), n, k))
        if tuned is not None and n % tuned.cluster_tile_n == 0:
            return tuned
    if m <= 2048 and n % DECODE_CONFIG.cta_tile_n == 0:
        return DECODE_CONFIG
    return DEFAULT_CONFIG


def fit_shared_memory(config: MgpuGemmConfig, out_dtype) -> MgpuGemmConfig:
    """``config`` with fewer pipeline stages (down to 2) where its epilogue buffers in ``out_dtype``
    would not fit beside them: the tuned configs are measured with bfloat16 output, and a float32
    output doubles the epilogue (128 x 64 tiles with 4 stages: 233,472 bytes, over the limit)."""
    while config.smem_bytes(out_dtype) > _SMEM_BYTES and config.max_concurrent_steps > 2:
        config = dataclasses.replace(config, max_concurrent_steps=config.max_concurrent_steps - 1)
    return config


# Fewest K blocks dispatchers send here: the kernel is as accurate at K = 256 as at K = 512 (1.3e-4
# off float64 natively, Hopper's FP8 wgmma accumulation within a K block).
MIN_K_BLOCKS = 1


def supports(m: int, n: int, k: int, config: MgpuGemmConfig | None = None) -> bool:
    """Whether dispatchers should use `fp8_gemm_mgpu` for this shape: K a multiple of 128 with at
    least ``MIN_K_BLOCKS`` blocks (split evenly by ``k_splits``), N a multiple of the CTA tile width."""
    config = default_config(m, n, k) if config is None else config
    return (k % BK == 0 and k >= MIN_K_BLOCKS * BK and (k // BK) % config.k_splits == 0
            and n % config.cluster_tile_n == 0)


def _num_sms(config: MgpuGemmConfig) -> int:
    if config.num_sms is not None:
        return config.num_sms
    if jax.default_backend() == "gpu":
        return jax.devices()[0].core_count
    return 4


def _kernel(a_gmem, as_gmem, b_gmem, bs_gmem, out_gmem, out_smem, *, config: MgpuGemmConfig):
    """a [Mp, K] fp8, as [K/128, Mp] f32, b [N, K] fp8, bs [N/128, K/128] f32, out [Mp, N] (split-K:
    f32 [k_splits, Mp, N] partials); out_smem [2, tm, tn]."""
    m, k = a_gmem.shape
    n = b_gmem.shape[0]
    out_dtype = out_gmem.dtype
    tile_m, tile_n = config.tile_m, config.tile_n
    cta_m, cta_n = config.cta_tile_m, config.cta_tile_n
    splits = config.k_splits
    clustered = config.cluster_n > 1
    overlap = config.overlap_promotion
    # n_iters: clusters of cluster_n CTAs along N; k_iters: K blocks per split
    m_iters, n_iters, k_iters = m // cta_m, n // (cta_n * config.cluster_n), k // BK // splits
    split_m = config.wg_dimension == MatmulDimension.M
    stages = min(config.max_concurrent_steps, k_iters)  # the pipeline needs stages <= steps
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def get_pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[
                # A: the same rows for every CTA of a cluster, so one TMA multicast feeds them all
                plgpu.BlockSpec((cta_m, BK), lambda kb: (0, kb), transforms=_OPERAND_TRANSFORMS,
                                collective_axes=("cluster",) if clustered else ()),
                plgpu.BlockSpec((cta_n, BK), lambda kb: (0, kb), transforms=_OPERAND_TRANSFORMS),
                plgpu.BlockSpec((None, cta_m), lambda kb: (kb, 0)),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=stages,
            compute_context=compute_context,
        )

    ignore = lambda *_, **__: None  # the bodies do not change the allocations

    @functools.partial(
        pl.run_scoped,
        allocs=get_pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem, as_gmem),
        collective_axes="wg",
    )
    def _scope(allocs):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((m_iters * n_iters * splits,), collective_axes="cluster_grid" if clustered else "sm")
        def _tile_loop(info: plgpu.NDLoopInfo):
            (lin,) = info.index
            ks, lin = lax.rem(lin, splits), lax.div(lin, splits)  # the splits of a tile run side by side
            mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), config.grid_minor_dim, config.grid_tile_width)
            if clustered:  # this CTA's column tile within its cluster's
                ni = ni * config.cluster_n + lax.axis_index("cluster")
            k0 = ks * k_iters  # this split's first K block
            out_ref = out_gmem.at[ks] if splits > 1 else out_gmem
            cta_m_slice = pl.ds(mi * cta_m, cta_m)
            cta_n_slice = pl.ds(ni * cta_n, cta_n)
            if split_m:
                wg_m_slice, wg_n0 = pl.ds(wg * tile_m, tile_m), ni * cta_n
                wg_n_slice = slice(None)
            else:
                wg_m_slice, wg_n0 = slice(None), ni * cta_n + wg * tile_n
                wg_n_slice = pl.ds(wg * tile_n, tile_n)
            nb = lax.div(wg_n0, BK)  # this warpgroup's 128-row block of B

            def scaled(d, s):  # a block's product times its per-row scale (a_scale * b_scale_inv)
                return d * lax.broadcast_in_dim(s, (tile_m, tile_n), [0])

            def compute_context(run_pipeline):
                acc0 = plgpu.layout_cast(jnp.zeros((tile_m, tile_n), jnp.float32), plgpu.Layout.WGMMA)
                if overlap:  # the carry holds the last block's product and scale, promoted here
                    s0 = plgpu.layout_cast(jnp.zeros((tile_m,), jnp.float32), row_layout)
                    acc, d, s, _ = run_pipeline((acc0, acc0, s0, bs_gmem[nb, k0]))
                    acc = acc + scaled(d, s)
                else:
                    acc, _ = run_pipeline((acc0, bs_gmem[nb, k0]))
                # The previous tile's TMA store must have read out_smem before we overwrite it.
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                out_smem[wg] = acc.astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[wg], out_ref.at[cta_m_slice, cta_n_slice].at[wg_m_slice, wg_n_slice])

            def step(idx, a_smem, b_smem, as_smem, carry):
                (kb,) = idx
                sb = carry[-1]
                # Prefetch the next block's B scale: a GMEM load whose latency the wgmma hides.
                sb_next = bs_gmem[nb, k0 + jnp.minimum(kb + 1, k_iters - 1)]

                if overlap:
                    acc, d_prev, s_prev, _ = carry

                    def mma_overlapped(d_ref):
                        plgpu.wgmma(d_ref, a_smem.at[wg_m_slice], b_smem.at[wg_n_slice].T)  # async
                        acc_next = acc + scaled(d_prev, s_prev)  # CUDA cores, while the wgmma runs
                        s = plgpu.load(as_smem.at[wg_m_slice], layout=row_layout) * sb
                        return acc_next, d_ref[...], s  # the load waits for this block's wgmma

                    acc, d, s = pl.run_scoped(mma_overlapped, plgpu.ACC((tile_m, tile_n), jnp.float32))
                    return acc, d, s, sb_next

                acc, _ = carry

                def mma(d_ref):
                    plgpu.wgmma(d_ref, a_smem.at[wg_m_slice], b_smem.at[wg_n_slice].T)
                    return d_ref[...]  # waits for this block's wgmma

                d = pl.run_scoped(mma, plgpu.ACC((tile_m, tile_n), jnp.float32))
                s = plgpu.load(as_smem.at[wg_m_slice], layout=row_layout) * sb
                return acc + scaled(d, s), sb_next

            k_slice = pl.ds(k0 * BK, k_iters * BK)
            get_pipeline(step, compute_context)(
                a_gmem.at[cta_m_slice, k_slice], b_gmem.at[cta_n_slice, k_slice],
                as_gmem.at[pl.ds(k0, k_iters), cta_m_slice], allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _call(a, as_t, b, b_scale_inv, out_dtype, config: MgpuGemmConfig, interpret):
    m = a.shape[0]
    n = b.shape[0]
    splits = config.k_splits
    tiles = (m // config.cta_tile_m) * (n // config.cluster_tile_n) * splits  # per cluster of cluster_n CTAs
    if splits > 1:  # float32 partials, summed below
        out_dtype, out_shape = jnp.float32, (splits, m, n)
    else:
        out_shape = (m, n)
    out_itemsize = jnp.dtype(out_dtype).itemsize
    out_transforms = (plgpu.TilingTransform((8, _SWIZZLE // out_itemsize)), plgpu.SwizzleTransform(_SWIZZLE))
    cn = config.cluster_n
    grid = dict(grid=(min(_num_sms(config) // cn, tiles),), grid_names=("cluster_grid",), cluster=(cn,),
                cluster_names=("cluster",)) if cn > 1 else dict(grid=(min(_num_sms(config), tiles),),
                                                                 grid_names=("sm",))
    f = plgpu.kernel(
        functools.partial(_kernel, config=config),
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        scratch_types=[plgpu.SMEM((2, config.tile_m, config.tile_n), out_dtype, transforms=out_transforms)],
        **grid,
        num_threads=3,
        thread_name="wg",
        interpret=interpret,
        kernel_name="fp8_block_gemm_mgpu",
    )
    return f(a, as_t, b, b_scale_inv)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def _fp8_gemm_mgpu(a, a_scale, b, b_scale_inv, out_dtype, config: MgpuGemmConfig, interpret):
    m = a.shape[0]
    m_pad = pl.cdiv(m, config.cta_tile_m) * config.cta_tile_m
    as_t = a_scale.T  # [K/128, M]: a tile's scales for one K block are contiguous
    if m_pad != m:
        a = jnp.pad(a, ((0, m_pad - m), (0, 0)))
        as_t = jnp.pad(as_t, ((0, 0), (0, m_pad - m)))
    out = _call(a, as_t, b, b_scale_inv, out_dtype, config, interpret)
    if config.k_splits > 1:
        out = jnp.sum(out, axis=0).astype(out_dtype)
    return out[:m] if m_pad != m else out


def _resolve_interpret(interpret) -> plgpu.InterpretGPUParams | None:
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret must be None, a bool or a plgpu.InterpretGPUParams, got {interpret!r}")
    return plgpu.InterpretGPUParams() if interpret else None


def fp8_gemm_mgpu(
    a: jax.Array,
    a_scale: jax.Array,
    b: jax.Array,
    b_scale_inv: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    config: MgpuGemmConfig | None = None,
    interpret: bool | plgpu.InterpretGPUParams | None = None,
) -> jax.Array:
    """Block-scaled FP8 ``A @ B^T`` on Hopper tensor cores: see the module note for the math and limits.

    Args:
      a: float8_e4m3fn ``[M, K]`` activations (any M).
      a_scale: float32 ``[M, K/128]`` per-token 1x128 dequantization scales.
      b: float8_e4m3fn ``[N, K]`` weight (out_features, in_features); ``K % 128 == 0`` and
        ``N % config.cluster_tile_n == 0``.
      b_scale_inv: float32 ``[N/128, K/128]`` 128x128 block scales.
      out_dtype: bfloat16 (default), float16 or float32.
      config: tiling (`MgpuGemmConfig`); None picks `default_config(M, N, K)`.
      interpret: None runs natively on a GPU backend and in Mosaic GPU interpret mode otherwise;
        True/False force it; a ``plgpu.InterpretGPUParams`` (e.g. ``detect_races=True``) interprets with it.

    Returns:
      ``[M, N]`` in `out_dtype`.
    """
    out_dtype = _check_operands(a, a_scale, b, b_scale_inv, out_dtype)
    m, k = a.shape
    n = b.shape[0]
    if config is None:
        config = fit_shared_memory(default_config(m, n, k), out_dtype)
    if not isinstance(config, MgpuGemmConfig):
        raise ValueError(f"config must be a MgpuGemmConfig or None, got {type(config).__name__}")
    if k % BK:
        raise ValueError(f"fp8_gemm_mgpu needs K % {BK} == 0, got K={k}; use pallas_kernels.fp8_gemm.fp8_gemm "
                         "(masked edges) for ragged K")
    if (k // BK) % config.k_splits:
        raise ValueError(f"fp8_gemm_mgpu with k_splits={config.k_splits} needs K / {BK} = {k // BK} blocks to "
                         "divide evenly among the splits")
    if n % config.cluster_tile_n:
        raise ValueError(f"fp8_gemm_mgpu needs N % {config.cluster_tile_n} == 0 (CTA tile width x cluster_n of {config}), "
                         f"got N={n}; pick a config with a smaller tile_n / wg_dimension=M, or use "
                         "pallas_kernels.fp8_gemm.fp8_gemm")
    smem = config.smem_bytes(out_dtype)
    if smem > _SMEM_BYTES:
        raise ValueError(f"{config} needs {smem} bytes of shared memory with out_dtype={out_dtype}, more than "
                         f"Hopper's {_SMEM_BYTES}; lower max_concurrent_steps or the tiles")
    return _fp8_gemm_mgpu(a, a_scale, b, b_scale_inv, out_dtype, config, _resolve_interpret(interpret))
