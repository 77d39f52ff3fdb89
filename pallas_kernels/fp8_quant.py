"""Blockwise FP8 weight quantization in one pass (Pallas, Triton lowering), and the FP8 reference maths.

What: ``w [N, K]`` (or stacked ``[E, N, K]``) in bf16/f32 -> ``q float8_e4m3fn [..., N, K]`` and
``scale_inv float32 [..., ceil(N/128), ceil(K/128)]`` with ``w ~= q * scale_inv`` per 128x128 block: the
HF/vLLM ``weight`` / ``weight_scale_inv`` layout. The kernel reads w once and writes q and the scales
once (the pure-jnp reference materializes float32 copies).

The module also holds the block-scaling maths every FP8 kernel and the library share, in plain jnp
(`quantize_blocks_reference`, `scale_from_amax`, `saturating_cast`, `codes_to_float32`):

* ``amax = max |x|`` over the block, in float32 (bf16 upcasts exactly);
* ``s = amax / fmt_max`` with a correctly rounded IEEE division, floored at the smallest normal
  float32, and ``s = 1.0`` for an all-zero block (optionally rounded up to a power of two);
* ``q = cast_rne(clip(x * (1 / s), -fmt_max, fmt_max))`` with ``1 / s`` formed once per block.

Rounding pins (why the kernel is not just ``/``): Triton lowers a float32 ``arith.divf`` to the
approximate ``div.full.f32`` (2 ulp), so on the GPU both divisions are inline PTX ``div.rn.f32``. In
interpret mode the body runs through XLA:CPU, whose simplifier rewrites ``amax / 448.0`` into
``amax * f32(1/448)``; the divisor is hidden behind ``optimization_barrier`` as in the reference. The
cast is Triton's ``cvt.rn.satfinite`` after an explicit clip, so saturation matches `saturating_cast`.
The bit-exact reference runs on XLA:CPU (`quantize_weight_reference`): XLA:GPU turns the reference's
division into a multiply by the reciprocal (one ulp low on about half the scales), while ``div.rn``
matches float64.

Tiling: one program per ``(block_n, block_k)`` tile (multiples of 128), looping statically over its
128x128 blocks. Edge tiles use masked loads (padding reads as 0, which never raises a block's amax)
and masked stores, so no padded copy of ``w`` is made. A stacked ``[E, N, K]`` weight gets a leading
grid axis. `quantize_weight_concat` writes several parts into one buffer (aliased launches).

Limits: the kernel does E4M3 with FP32 scales and 128x128 blocks only (the exported checkpoint
format); other options use the reference. On the GPU, float32 subnormal inputs are flushed to zero
(Triton's default), so bit-exactness holds for inputs without subnormals. NaN/Inf input gives
garbage as in the reference; guard with a non-finite count upstream.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import resolve_interpret

QBLOCK = 128  # quantization block edge (rows and columns)
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
FP8_MAX = {jnp.dtype(jnp.float8_e4m3fn): E4M3_MAX, jnp.dtype(jnp.float8_e5m2): E5M2_MAX}
F32_TINY = float(np.finfo(np.float32).tiny)  # the floor on scales, so 1/scale is finite
ZERO_BLOCK_SCALE = 1.0  # the scale of an all-zero block or group
_SUPPORTED_IN = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


# ----------------------------------------------------------------------------
# Reference maths (plain jnp; the library wraps it in its own types and checks)


def saturating_cast(x: jax.Array, dtype=jnp.float8_e4m3fn) -> jax.Array:
    """Clip to the FP8 ``dtype``'s finite range, then round to nearest even: finite or infinite inputs
    never give Inf/NaN codes; NaN stays NaN."""
    fmt_max = FP8_MAX[jnp.dtype(dtype)]
    return jnp.clip(x, -fmt_max, fmt_max).astype(dtype)


def codes_to_float32(q: jax.Array) -> jax.Array:
    """FP8 codes as float32, exactly, even when they were produced in the same jitted program.

    XLA:GPU may delete a float32 -> float8 -> float32 chain of converts inside one jitted program as
    "excess precision" (``xla_allow_excess_precision``, on by default), so a quantize-then-dequantize
    inside one jit would silently skip the quantization (a jitted FP8 reference linear came out 3.7e-2
    off its eager result on Hopper, 1.2e-7 with this barrier). The optimization barrier on the codes
    keeps the rounding; everything else still fuses around it."""
    return jax.lax.optimization_barrier(q).astype(jnp.float32)


def round_scale_pow2(scale: jax.Array) -> jax.Array:
    """Exact ``2**ceil(log2(scale))`` for positive normal float32 ``scale``, on the bits: the exponent
    goes up by one unless the mantissa is zero. NaN and Inf (exponent 255) pass through."""
    bits = jax.lax.bitcast_convert_type(scale, jnp.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    rounded = jnp.minimum(exponent + (mantissa != 0).astype(jnp.int32), 255) << 23
    pow2 = jax.lax.bitcast_convert_type(rounded, jnp.float32)
    return jnp.where(jnp.isfinite(scale), pow2, scale)


def scale_from_amax(amax: jax.Array, fmt_max: float = E4M3_MAX, pow2: bool = False) -> jax.Array:
    """float32 scale ``amax / fmt_max``: floored at the smallest normal float32, 1.0 where ``amax == 0``,
    rounded up to a power of two when ``pow2``."""
    # XLA's simplifier turns `amax / 448.0` into `amax * f32(1/448)`, one float32 ulp off the IEEE
    # division (PyTorch/HF/vLLM) for about half the blocks; a divisor behind an optimization barrier
    # keeps a true division (the array is one per block).
    divisor = jax.lax.optimization_barrier(jnp.full(amax.shape, fmt_max, jnp.float32))
    scale = amax / divisor
    scale = jnp.maximum(scale, jnp.float32(F32_TINY))  # propagates NaN
    scale = jnp.where(amax == 0, jnp.float32(ZERO_BLOCK_SCALE), scale)
    return round_scale_pow2(scale) if pow2 else scale


def pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    """``x`` zero-padded at the end of ``axis`` to ``size`` (zeros never raise a block's amax)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def quantize_blocks_reference(w: jax.Array, block_size: Sequence[int] = (QBLOCK, QBLOCK),
                              dtype=jnp.float8_e4m3fn, pow2_scales: bool = False) -> tuple[jax.Array, jax.Array]:
    """A weight ``[..., N, K]`` quantized with one float32 scale per ``(bn, bk)`` block (edge blocks
    zero-padded inside and sliced back): ``(q [..., N, K], scale_inv [..., ceil(N/bn), ceil(K/bk)])``."""
    bn, bk = block_size
    *lead, n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    x = w.astype(jnp.float32)
    x = pad_axis(pad_axis(x, -2, nb * bn), -1, kb * bk)
    x = x.reshape(*lead, nb, bn, kb, bk)
    amax = jnp.max(jnp.abs(x), axis=(-3, -1))
    scale = scale_from_amax(amax, FP8_MAX[jnp.dtype(dtype)], pow2_scales)
    inv = jnp.float32(1.0) / scale
    q = saturating_cast(x * inv[..., :, None, :, None], dtype)
    return q.reshape(*lead, nb * bn, kb * bk)[..., :n, :k], scale


def quantize_weight_reference(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The kernel's pure-jnp twin: `quantize_blocks_reference` (E4M3, FP32 scales, 128x128) run on
    XLA:CPU, which keeps the IEEE division (XLA:GPU does not: module note). Returns CPU arrays."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        return _quantize_weight_cpu(jax.device_put(w, cpu))


_quantize_weight_cpu = jax.jit(quantize_blocks_reference)


# ----------------------------------------------------------------------------
# Kernel


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Tiling of the quantization kernel.

    Attributes:
      block_n: rows of w per program; a positive multiple of 128.
      block_k: columns of w per program; a positive multiple of 128.
      num_warps: Triton warps per program.
      num_stages: Triton software-pipelining stages (little effect: no K loop).
    """

    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0 or v % QBLOCK:
                raise ValueError(f"QuantConfig.{name} must be a positive multiple of {QBLOCK}, got {v!r}")
        for name in ("num_warps", "num_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"QuantConfig.{name} must be a positive int, got {v!r}")


DEFAULT_CONFIG = QuantConfig()
# The tilings the quant_kernels suite times; 128x128 is the natural unit, larger tiles amortize launches.
SWEEP_CONFIGS = (
    QuantConfig(128, 128, 4),
    QuantConfig(128, 128, 8),
    QuantConfig(128, 256, 4),
    QuantConfig(128, 256, 8),
    QuantConfig(256, 256, 8),
)


def ieee_div(a: jax.Array, b: jax.Array, native: bool) -> jax.Array:
    """Correctly rounded float32 ``a / b`` inside a kernel: PTX ``div.rn.f32`` natively, a true
    division (divisor behind a barrier) in interpret mode."""
    if native:
        [out] = plgpu.elementwise_inline_asm(
            "div.rn.f32 $0, $1, $2;",
            args=[a, b],
            constraints="=r,r,r",
            pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
        )
        return out
    return a / jax.lax.optimization_barrier(b)


def kernel_scale(amax: jax.Array, native: bool) -> tuple[jax.Array, jax.Array]:
    """Inside a kernel: `scale_from_amax` for E4M3 (FP32 scales) and its reciprocal, both IEEE
    divisions: ``(scale, 1 / scale)``."""
    scale = ieee_div(amax, jnp.full(amax.shape, E4M3_MAX, jnp.float32), native)
    scale = jnp.maximum(scale, jnp.float32(F32_TINY))
    scale = jnp.where(amax == 0, jnp.float32(ZERO_BLOCK_SCALE), scale)
    return scale, ieee_div(jnp.ones(scale.shape, jnp.float32), scale, native)


def _quant_kernel(w_ref, q_ref, s_ref, *, n: int, k: int, native: bool):
    """One (block_n, block_k) tile: refs are w/q ``[block_n, block_k]``, s ``[block_n/128, block_k/128]``."""
    block_n, block_k = w_ref.shape
    pid_n, pid_k = pl.program_id(1), pl.program_id(2)
    rows0 = pid_n * block_n
    cols0 = pid_k * block_k
    r = jnp.arange(QBLOCK, dtype=jnp.int32)
    for i in range(block_n // QBLOCK):
        row_ok = (rows0 + i * QBLOCK + r) < n
        for j in range(block_k // QBLOCK):
            col_ok = (cols0 + j * QBLOCK + r) < k
            mask = row_ok[:, None] & col_ok[None, :]
            tile = (pl.ds(i * QBLOCK, QBLOCK), pl.ds(j * QBLOCK, QBLOCK))
            x = plgpu.load(w_ref.at[tile], mask=mask, other=0.0).astype(jnp.float32)
            amax = jnp.max(jnp.max(jnp.abs(x), axis=1, keepdims=True), axis=0, keepdims=True)
            scale, inv = kernel_scale(amax, native)
            q = jnp.clip(x * inv, -E4M3_MAX, E4M3_MAX).astype(q_ref.dtype)
            plgpu.store(q_ref.at[tile], q, mask=mask)
            s_ok = ((rows0 // QBLOCK + i) * QBLOCK < n) & ((cols0 // QBLOCK + j) * QBLOCK < k)
            plgpu.store(
                s_ref.at[pl.ds(i, 1), pl.ds(j, 1)],
                scale,
                mask=jnp.full((1, 1), s_ok),
            )


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _quantize_stacked(w: jax.Array, config: QuantConfig, interpret: bool) -> tuple[jax.Array, jax.Array]:
    e, n, k = w.shape
    bn, bk = config.block_n, config.block_k
    nb, kb = pl.cdiv(n, QBLOCK), pl.cdiv(k, QBLOCK)
    grid = (e, pl.cdiv(n, bn), pl.cdiv(k, bk))
    kernel = functools.partial(_quant_kernel, n=n, k=k, native=not interpret)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[pl.BlockSpec((None, bn, bk), lambda b, i, j: (b, i, j))],
        out_specs=[
            pl.BlockSpec((None, bn, bk), lambda b, i, j: (b, i, j)),
            pl.BlockSpec((None, bn // QBLOCK, bk // QBLOCK), lambda b, i, j: (b, i, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((e, n, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((e, nb, kb), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="fp8_quantize_weight",
    )(w)


def quantize_weight(
    w: jax.Array,
    config: QuantConfig | None = None,
    *,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Quantize ``w [N, K]`` or ``[E, N, K]`` to E4M3 with float32 128x128 block scales.

    Args:
      w: bfloat16 or float32 weight, rank 2 ``[N, K]`` or rank 3 ``[E, N, K]``.
      config: tiling (`QuantConfig`); None uses `DEFAULT_CONFIG`.
      interpret: None runs the native kernel on a GPU backend and interpret mode
        otherwise; True/False force it.

    Returns:
      ``(q float8_e4m3fn [..., N, K], scale_inv float32 [..., ceil(N/128), ceil(K/128)])``,
      bit-identical to `quantize_weight_reference(w)`.
    """
    config = DEFAULT_CONFIG if config is None else config
    if not isinstance(config, QuantConfig):
        raise ValueError(f"config must be a QuantConfig or None, got {type(config).__name__}")
    interpret = resolve_interpret(interpret)
    if not hasattr(w, "shape") or not hasattr(w, "dtype"):
        w = jnp.asarray(w)
    if w.ndim not in (2, 3):
        raise ValueError(f"w must have rank 2 [N, K] or 3 [E, N, K], got shape {tuple(w.shape)}")
    if jnp.dtype(w.dtype) not in _SUPPORTED_IN:
        raise ValueError(f"w must be bfloat16 or float32, got {w.dtype}")
    if any(d == 0 for d in w.shape):
        raise ValueError(f"w must have no zero-size dimension, got shape {tuple(w.shape)}")
    stacked = w if w.ndim == 3 else w[None]
    q, s = _quantize_stacked(stacked, config, interpret)
    if w.ndim == 2:
        q, s = q[0], s[0]
    return q, s


def _concat_part_kernel(w_ref, *refs, kernel):
    """`_quant_kernel` on one part; ``refs`` end with the buffer's q and scale outputs (after the
    aliased inputs of the same buffer, which it does not read)."""
    kernel(w_ref, *refs[-2:])


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _quantize_concat(ws: tuple, config: QuantConfig, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """The parts quantized into one ``[sum N, K]`` buffer: one kernel launch per part, each writing its
    rows of the buffer the previous launch returned (aliased: no copy, and no fill of the rows a later
    part writes)."""
    n_total, k = sum(w.shape[0] for w in ws), ws[0].shape[1]
    bn, bk = config.block_n, config.block_k
    assert bn == QBLOCK  # a part's first row block must start at a multiple of the tile
    kb = pl.cdiv(k, QBLOCK)
    out_shape = [jax.ShapeDtypeStruct((n_total, k), jnp.float8_e4m3fn),
                 jax.ShapeDtypeStruct((pl.cdiv(n_total, QBLOCK), kb), jnp.float32)]
    q = s = None
    row0 = 0
    for w in ws:
        n = w.shape[0]
        off = row0 // bn  # this part's first tile row in the buffer
        kernel = functools.partial(_quant_kernel, n=n, k=k, native=not interpret)
        # the kernel's grid is (E, N tiles, K tiles) with one E here (it reads program ids 1 and 2)
        out_specs = [pl.BlockSpec((bn, bk), lambda e, i, j, off=off: (off + i, j)),
                     pl.BlockSpec((bn // QBLOCK, bk // QBLOCK), lambda e, i, j, off=off: (off + i, j))]
        in_specs = [pl.BlockSpec((bn, bk), lambda e, i, j: (i, j))]
        args, aliases = (w,), {}
        if q is not None:  # the buffer so far, updated in place
            in_specs += out_specs
            args, aliases = (w, q, s), {1: 0, 2: 1}
        q, s = pl.pallas_call(
            functools.partial(_concat_part_kernel, kernel=kernel),
            grid=(1, pl.cdiv(n, bn), pl.cdiv(k, bk)),
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=out_shape,
            input_output_aliases=aliases,
            compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
            interpret=interpret,
            name="fp8_quantize_weight_concat",
        )(*args)
        row0 += n
    return q, s


def quantize_weight_concat(
    ws,
    config: QuantConfig | None = None,
    *,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`quantize_weight` of the parts ``ws`` (``[N_i, K]`` each) concatenated on the output axis, without
    the concatenation: each part is quantized straight into its rows of one buffer. The generator's
    fused q/k/v and gate/up weights, which a weight sync would otherwise
    quantize part by part and then copy into place. Every part but the last must have ``N_i % 128 ==
    0`` (so no 128x128 block straddles two parts); the result is bit-identical to concatenating the
    parts' `quantize_weight` results. ``config.block_n`` must be 128."""
    config = DEFAULT_CONFIG if config is None else config
    if not isinstance(config, QuantConfig):
        raise ValueError(f"config must be a QuantConfig or None, got {type(config).__name__}")
    if config.block_n != QBLOCK:
        raise ValueError(f"quantize_weight_concat needs config.block_n == {QBLOCK}, got {config.block_n}")
    interpret = resolve_interpret(interpret)
    ws = tuple(jnp.asarray(w) if not hasattr(w, "shape") else w for w in ws)
    if not ws:
        raise ValueError("quantize_weight_concat needs at least one part")
    for i, w in enumerate(ws):
        if w.ndim != 2 or any(d == 0 for d in w.shape):
            raise ValueError(f"part {i} must be a non-empty [N, K] matrix, got shape {tuple(w.shape)}")
        if w.shape[1] != ws[0].shape[1] or jnp.dtype(w.dtype) != jnp.dtype(ws[0].dtype):
            raise ValueError(f"part {i} is {w.dtype}{tuple(w.shape)}, part 0 {ws[0].dtype}{tuple(ws[0].shape)}: "
                             "the parts need one K and one dtype")
        if jnp.dtype(w.dtype) not in _SUPPORTED_IN:
            raise ValueError(f"part {i} must be bfloat16 or float32, got {w.dtype}")
        if i < len(ws) - 1 and w.shape[0] % QBLOCK:
            raise ValueError(f"part {i} has N={w.shape[0]}, not a multiple of {QBLOCK}: its last block would "
                             "straddle the next part")
    return _quantize_concat(ws, config, interpret)
