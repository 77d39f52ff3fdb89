"""FP8 activation quantization of the linears' inputs in one pass (Pallas, Triton lowering), with the
1 x 128 activation quantization and RMSNorm references.

Kernels (each reads its inputs once and writes the codes and scales once, where XLA ran two or three
kernels that re-read the input):

- `silu_mul_quant`: ``gu [M, 2I]`` bf16 (the fused gate/up output ``[g | u]``) -> ``x = silu(g) * u``
  quantized per token in 1 x 128 groups (the down projection's input).
- `add_rms_norm_quant`: ``h = x + residual`` (bf16, residual optional), ``y = rms_norm(h, weight, eps)``
  quantized per token (the inputs of the fused q/k/v and gate/up GEMMs); writes ``h`` too.
- `add_rms_norm`: the same add and norm in bf16 without the quantization (the BF16 linears' input).
- `quantize_1x128`: plain per-token quantization of a bf16 matrix (the o_proj input).

Outputs: ``q float8_e4m3fn [M, K]`` and float32 scales ``[K/128, M]`` (``scales_t``, the order cuBLASLt
reads) or ``[M, K/128]``. Quantization rules are `quantize_groups_reference`'s (E4M3, FP32 scales):
``amax`` per group in float32, ``scale = amax / 448`` (IEEE division, ``div.rn.f32`` on the GPU, see
`pallas_kernels.fp8_quant`) floored at the smallest normal float32, 1.0 for an all-zero group,
``q = cast_rne(clip(x * (1 / scale), -448, 448))``.

Bf16 arithmetic: the kernels round every bf16 op as written (as torch and the jnp twins do op by op):
SwiGLU as XLA's HLO for ``jax.nn.silu`` of bf16, ``s = bf16(1 / f32(bf16(bf16(exp(-g)) + 1)))``,
``x = bf16(bf16(g * s) * u)``; RMSNorm as `rms_norm_reference` (float32 mean of squares, ``rsqrt``, bf16
products). In interpret mode (XLA:CPU) each kernel equals its `*_reference` twin bit for bit (the norms for
rows of up to 1024; wider rows XLA:CPU sums in another order). On the GPU the exponential, ``rsqrt`` and
the reduction order are the GPU's own, so a value next to a bf16 rounding boundary can round the other
way and its code move one E4M3 step (about 0.1% of the codes; no less accurate against float64).

Tiling: `silu_mul_quant` and `quantize_1x128` run one program per ``block_m`` rows x ``groups`` groups
(``M`` divisible by the chosen power of two, ``K`` a multiple of 128; SwiGLU reads the gate and up tiles
through two BlockSpecs of one array). The norms hold ``block_m`` whole rows per program (the mean needs
the row; ``D`` a power of two) and quantize all the row's groups at once as ``[bm, D/128, 128]``: a loop
over the groups serializes one dependent load/store round per group and runs several times slower.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import resolve_interpret
from pallas_kernels.fp8_quant import (E4M3_MAX, FP8_MAX, ieee_div, kernel_scale, pad_axis, saturating_cast,
                                      scale_from_amax)

GROUP = 128


# --- references (plain jnp) ---------------------------------------------------------------------------------------


def rms_norm_reference(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3's RMSNorm: ``weight * (x / sqrt(mean(x^2) + eps))``, normalized in float32, the product in x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * y.astype(x.dtype)


def quantize_groups_reference(x: jax.Array, group_size: int = GROUP, *, scales_t: bool = False,
                              dtype=jnp.float8_e4m3fn, pow2_scales: bool = False) -> tuple[jax.Array, jax.Array]:
    """Dynamic per-token FP8 quantization of ``x [..., K]`` in 1 x ``group_size`` groups along the last axis
    (K zero-padded to whole groups inside): ``(q [..., K], scale [..., ceil(K / group_size)])`` with
    ``x ~= q * scale`` per group. ``scales_t`` (a matrix ``[M, K]`` only): the scales ``[G, M]``, bit for bit
    the transpose, with the group maxima reduced from a transposed view so XLA can write them in that order
    from the reduction itself."""
    *lead, k = x.shape
    g = -(-k // group_size)
    fmt_max = FP8_MAX[jnp.dtype(dtype)]
    xf = pad_axis(x.astype(jnp.float32), -1, g * group_size).reshape(*lead, g, group_size)
    if scales_t:
        scale = scale_from_amax(jnp.max(jnp.abs(jnp.swapaxes(xf, 0, 1)), axis=-1), fmt_max, pow2_scales)  # [G, M]
        inv = (jnp.float32(1.0) / scale).T
    else:
        scale = scale_from_amax(jnp.max(jnp.abs(xf), axis=-1), fmt_max, pow2_scales)
        inv = jnp.float32(1.0) / scale
    q = saturating_cast(xf * inv[..., None], dtype).reshape(*lead, g * group_size)[..., :k]
    return q, scale


def quantize_1x128_reference(x: jax.Array, *, scales_t: bool = True) -> tuple[jax.Array, jax.Array]:
    """`quantize_1x128`'s twin: E4M3 1 x 128 groups, FP32 scales (``[K/128, M]`` when ``scales_t``)."""
    return quantize_groups_reference(x, GROUP, scales_t=scales_t)


def silu_mul_quant_reference(gu: jax.Array, *, scales_t: bool = True) -> tuple[jax.Array, jax.Array]:
    """`silu_mul_quant`'s twin: ``g, u = split(gu)``; ``x = jax.nn.silu(g) * u`` in ``gu``'s dtype; its
    per-token 1 x 128 quantization."""
    g, u = jnp.split(gu, 2, axis=-1)
    return quantize_1x128_reference(jax.nn.silu(g) * u, scales_t=scales_t)


def add_rms_norm_reference(x: jax.Array, weight: jax.Array, eps: float, *, residual: jax.Array | None = None
                           ) -> tuple[jax.Array, ...]:
    """`add_rms_norm`'s twin: ``h = x + residual``, ``rms_norm_reference(h, weight, eps)``; ``(h, y)`` with a
    residual, ``(y,)`` without."""
    h = x if residual is None else x + residual
    y = rms_norm_reference(h, weight, eps)
    return (y,) if residual is None else (h, y)


def add_rms_norm_quant_reference(x: jax.Array, weight: jax.Array, eps: float, *, residual: jax.Array | None = None,
                                 scales_t: bool = True) -> tuple[jax.Array, ...]:
    """`add_rms_norm_quant`'s twin: `add_rms_norm_reference`, then the 1 x 128 quantization of ``y``;
    ``(h, q, s)`` with a residual, ``(q, s)`` without."""
    *h, y = add_rms_norm_reference(x, weight, eps, residual=residual)
    return (*h, *quantize_1x128_reference(y, scales_t=scales_t))


# --- kernels ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ActQuantConfig:
    """Tiling: ``block_m`` rows (at most; the largest power of two <= it that divides M) and ``groups``
    quantization groups (at most; the largest that divides I / 128) per program."""

    block_m: int = 16
    groups: int = 2
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_m", "groups", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0 or v & (v - 1):
                raise ValueError(f"ActQuantConfig.{name} must be a positive power of two, got {v!r}")


DEFAULT_CONFIG = ActQuantConfig()


def supports(gu_shape: tuple[int, ...]) -> bool:
    """Whether the kernel takes ``gu`` of this shape: ``[M, 2I]``, ``I`` a multiple of 128, ``M >= 1``."""
    return len(gu_shape) == 2 and gu_shape[0] >= 1 and gu_shape[1] % (2 * GROUP) == 0


def _bf16(x: jax.Array) -> jax.Array:
    """Rounded to bfloat16 and back: what XLA does after every bf16 op."""
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def _kernel(g_ref, u_ref, q_ref, s_ref, *, groups: int, native: bool, scales_t: bool):
    for j in range(groups):
        cols = pl.ds(j * GROUP, GROUP)
        g = g_ref[:, cols].astype(jnp.float32)
        u = u_ref[:, cols].astype(jnp.float32)
        den = _bf16(_bf16(jnp.exp(-g)) + 1.0)
        sig = _bf16(ieee_div(jnp.ones_like(den), den, native))
        x = _bf16(_bf16(g * sig) * u)
        _store_group(x, j, q_ref, s_ref, native=native, scales_t=scales_t)


def _store_group(x: jax.Array, j: int, q_ref, s_ref, *, native: bool, scales_t: bool) -> None:
    """Group ``j`` (columns ``j*128 ...``) of the program's rows, float32 ``x [bm, 128]``: its scale and codes
    (`quantize_groups_reference`'s), stored."""
    bm = x.shape[0]
    scale, inv = kernel_scale(jnp.max(jnp.abs(x), axis=1, keepdims=True), native)  # [bm, 1]
    q_ref[:, pl.ds(j * GROUP, GROUP)] = jnp.clip(x * inv, -E4M3_MAX, E4M3_MAX).astype(q_ref.dtype)
    if scales_t:
        s_ref[pl.ds(j, 1), :] = scale.reshape(1, bm)
    else:
        s_ref[:, pl.ds(j, 1)] = scale


def _pow2_divisor(n: int, cap: int) -> int:
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


@functools.partial(jax.jit, static_argnames=("scales_t", "config", "interpret"))
def _call(gu: jax.Array, scales_t: bool, config: ActQuantConfig, interpret: bool):
    m, two_i = gu.shape
    i = two_i // 2
    bm = _pow2_divisor(m, config.block_m)
    gb = _pow2_divisor(i // GROUP, config.groups)
    bw = gb * GROUP
    half = i // bw
    kernel = functools.partial(_kernel, groups=gb, native=not interpret, scales_t=scales_t)
    if scales_t:
        s_spec = pl.BlockSpec((gb, bm), lambda r, c: (c, r))
        s_shape = jax.ShapeDtypeStruct((i // GROUP, m), jnp.float32)
    else:
        s_spec = pl.BlockSpec((bm, gb), lambda r, c: (r, c))
        s_shape = jax.ShapeDtypeStruct((m, i // GROUP), jnp.float32)
    return pl.pallas_call(
        kernel,
        grid=(m // bm, half),
        in_specs=[pl.BlockSpec((bm, bw), lambda r, c: (r, c)), pl.BlockSpec((bm, bw), lambda r, c: (r, c + half))],
        out_specs=[pl.BlockSpec((bm, bw), lambda r, c: (r, c)), s_spec],
        out_shape=[jax.ShapeDtypeStruct((m, i), jnp.float8_e4m3fn), s_shape],
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret,
        name="silu_mul_quant",
    )(gu, gu)


def silu_mul_quant(gu: jax.Array, *, scales_t: bool = True, config: ActQuantConfig | None = None,
                   interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """The 1 x 128 quantization of ``silu(g) * u`` (scales ``[I/128, M]`` when ``scales_t``, else ``[M, I/128]``)
    of ``gu = [g | u]`` ``[M, 2I]`` bfloat16, in one kernel (module note); twin `silu_mul_quant_reference`."""
    config = DEFAULT_CONFIG if config is None else config
    if not hasattr(gu, "dtype") or jnp.dtype(gu.dtype) != jnp.dtype(jnp.bfloat16):
        raise ValueError(f"silu_mul_quant takes bfloat16 [M, 2I], got {getattr(gu, 'dtype', type(gu))}")
    if not supports(tuple(gu.shape)):
        raise ValueError(f"silu_mul_quant takes [M, 2I] with I a multiple of {GROUP}, got shape {tuple(gu.shape)}")
    return _call(gu, scales_t, config, resolve_interpret(interpret))


# --- the normalized inputs of q/k/v and gate/up, and plain 1 x 128 quantization ---------------------------------


@dataclasses.dataclass(frozen=True)
class NormQuantConfig:
    """`add_rms_norm_quant`'s tiling: ``block_m`` whole rows per program (at most; the largest power of two <= it
    that divides M). The default is the fastest measured tiling for decode batches (256 x 4096)."""

    block_m: int = 1
    num_warps: int = 8

    def __post_init__(self):
        for name in ("block_m", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0 or v & (v - 1):
                raise ValueError(f"NormQuantConfig.{name} must be a positive power of two, got {v!r}")


DEFAULT_NORM_CONFIG = NormQuantConfig()


def supports_norm(x_shape: tuple[int, ...]) -> bool:
    """Whether `add_rms_norm_quant` takes ``x`` of this shape: ``[M, D]``, ``D`` a power of two >= 128 (one program
    holds whole rows; Triton tiles are powers of two), ``M >= 1``."""
    return (len(x_shape) == 2 and x_shape[0] >= 1 and x_shape[1] >= GROUP
            and x_shape[1] & (x_shape[1] - 1) == 0)


def supports_plain(x_shape: tuple[int, ...]) -> bool:
    """Whether `quantize_1x128` takes ``x`` of this shape: ``[M, K]``, ``K`` a multiple of 128, ``M >= 1``."""
    return len(x_shape) == 2 and x_shape[0] >= 1 and x_shape[1] >= GROUP and x_shape[1] % GROUP == 0


def _norm_kernel(*refs, residual: bool, eps: float, native: bool, scales_t: bool):
    if residual:
        x_ref, r_ref, w_ref, h_ref, q_ref, s_ref = refs
    else:
        (x_ref, w_ref, q_ref, s_ref), r_ref, h_ref = refs, None, None
    bm, d = x_ref.shape
    g = d // GROUP
    h = x_ref[...].astype(jnp.float32)
    if residual:  # h = x + residual in bf16
        h = _bf16(h + r_ref[...].astype(jnp.float32))
        h_ref[...] = h.astype(h_ref.dtype)
    inv_rms = jax.lax.rsqrt(jnp.mean(h * h, axis=1, keepdims=True) + jnp.float32(eps))  # [bm, 1]
    y = _bf16(w_ref[...].astype(jnp.float32) * _bf16(h * inv_rms)).reshape(bm, g, GROUP)
    # the whole row's groups at once (a loop over them serializes one dependent load/store round per group)
    scale, inv = kernel_scale(jnp.max(jnp.abs(y), axis=2), native)  # [bm, g]
    q_ref[...] = jnp.clip(y * inv[:, :, None], -E4M3_MAX, E4M3_MAX).astype(q_ref.dtype).reshape(bm, d)
    s_ref[...] = scale.T if scales_t else scale


@functools.partial(jax.jit, static_argnames=("eps", "scales_t", "config", "interpret"))
def _norm_call(x, residual, weight, eps: float, scales_t: bool, config: NormQuantConfig, interpret: bool):
    m, d = x.shape
    bm = _pow2_divisor(m, config.block_m)
    row = pl.BlockSpec((bm, d), lambda r: (r, 0))
    s_spec, s_shape = _scale_spec(m, d // GROUP, bm, d // GROUP, scales_t, lambda r: r, lambda r: 0)
    ins = [x] + ([residual] if residual is not None else []) + [weight.astype(jnp.bfloat16).reshape(1, d)]
    in_specs = [row] * (len(ins) - 1) + [pl.BlockSpec((1, d), lambda r: (0, 0))]
    out_specs = ([row] if residual is not None else []) + [row, s_spec]
    out_shape = (([jax.ShapeDtypeStruct((m, d), jnp.bfloat16)] if residual is not None else [])
                 + [jax.ShapeDtypeStruct((m, d), jnp.float8_e4m3fn), s_shape])
    kernel = functools.partial(_norm_kernel, residual=residual is not None, eps=eps, native=not interpret,
                               scales_t=scales_t)
    return pl.pallas_call(
        kernel, grid=(m // bm,), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret, name="add_rms_norm_quant",
    )(*ins)


def _plain_norm_kernel(*refs, residual: bool, eps: float):
    if residual:
        x_ref, r_ref, w_ref, h_ref, y_ref = refs
    else:
        (x_ref, w_ref, y_ref), r_ref, h_ref = refs, None, None
    h = x_ref[...].astype(jnp.float32)
    if residual:  # h = x + residual in bf16
        h = _bf16(h + r_ref[...].astype(jnp.float32))
        h_ref[...] = h.astype(h_ref.dtype)
    inv_rms = jax.lax.rsqrt(jnp.mean(h * h, axis=1, keepdims=True) + jnp.float32(eps))
    y_ref[...] = (w_ref[...].astype(jnp.float32) * _bf16(h * inv_rms)).astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "config", "interpret"))
def _plain_norm_call(x, residual, weight, eps: float, config: NormQuantConfig, interpret: bool):
    m, d = x.shape
    bm = _pow2_divisor(m, config.block_m)
    row = pl.BlockSpec((bm, d), lambda r: (r, 0))
    ins = [x] + ([residual] if residual is not None else []) + [weight.astype(jnp.bfloat16).reshape(1, d)]
    in_specs = [row] * (len(ins) - 1) + [pl.BlockSpec((1, d), lambda r: (0, 0))]
    n_out = 2 if residual is not None else 1
    return pl.pallas_call(
        functools.partial(_plain_norm_kernel, residual=residual is not None, eps=eps), grid=(m // bm,),
        in_specs=in_specs, out_specs=[row] * n_out, out_shape=[jax.ShapeDtypeStruct((m, d), jnp.bfloat16)] * n_out,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret, name="add_rms_norm",
    )(*ins)


def add_rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, residual: jax.Array | None = None,
                 config: NormQuantConfig | None = None, interpret: bool | None = None) -> tuple[jax.Array, ...]:
    """``h = x + residual`` (``x`` when there is none) and ``rms_norm(h, weight, eps)`` in one kernel, bf16 ``[M, D]``
    in and out (module note): ``(h, y)`` with a residual, ``(y,)`` without. The tiling is `add_rms_norm_quant`'s."""
    config = DEFAULT_NORM_CONFIG if config is None else config
    _check_norm_inputs("add_rms_norm", x, weight, residual)
    return tuple(_plain_norm_call(x, residual, weight, float(eps), config, resolve_interpret(interpret)))


def _check_norm_inputs(name: str, x, weight, residual) -> None:
    arrays = {"x": x} if residual is None else {"x": x, "residual": residual}
    for what, a in arrays.items():
        if not hasattr(a, "dtype") or jnp.dtype(a.dtype) != jnp.dtype(jnp.bfloat16):
            raise ValueError(f"{name} takes bfloat16 [M, D] {what}, got {getattr(a, 'dtype', type(a))}")
    if not supports_norm(tuple(x.shape)):
        raise ValueError(f"{name} takes [M, D] with D a power of two >= {GROUP}, got {tuple(x.shape)}")
    if residual is not None and tuple(residual.shape) != tuple(x.shape):
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if tuple(weight.shape) != (x.shape[1],):
        raise ValueError(f"norm weight shape {tuple(weight.shape)} != ({x.shape[1]},)")


def _scale_spec(m: int, groups: int, bm: int, gb: int, scales_t: bool, row_block, group_block):
    """The scales' BlockSpec and shape: ``[groups, M]`` blocks ``(gb, bm)`` when ``scales_t``, else the transpose."""
    if scales_t:
        return (pl.BlockSpec((gb, bm), lambda *i: (group_block(*i), row_block(*i))),
                jax.ShapeDtypeStruct((groups, m), jnp.float32))
    return (pl.BlockSpec((bm, gb), lambda *i: (row_block(*i), group_block(*i))),
            jax.ShapeDtypeStruct((m, groups), jnp.float32))


def add_rms_norm_quant(x: jax.Array, weight: jax.Array, eps: float, *, residual: jax.Array | None = None,
                       scales_t: bool = True, config: NormQuantConfig | None = None, interpret: bool | None = None
                       ) -> tuple[jax.Array, ...]:
    """``h = x + residual`` (``x`` when there is none), ``rms_norm(h, weight, eps)`` and its per-token 1 x 128
    quantization in one kernel (module note). ``x`` and ``residual`` bf16 ``[M, D]``; returns ``(h, q, scales)``
    with a residual, ``(q, scales)`` without; scales ``[D/128, M]`` when ``scales_t``, else ``[M, D/128]``."""
    config = DEFAULT_NORM_CONFIG if config is None else config
    _check_norm_inputs("add_rms_norm_quant", x, weight, residual)
    return tuple(_norm_call(x, residual, weight, float(eps), scales_t, config, resolve_interpret(interpret)))


def _plain_kernel(x_ref, q_ref, s_ref, *, groups: int, native: bool, scales_t: bool):
    for j in range(groups):
        _store_group(x_ref[:, pl.ds(j * GROUP, GROUP)].astype(jnp.float32), j, q_ref, s_ref, native=native,
                     scales_t=scales_t)


@functools.partial(jax.jit, static_argnames=("scales_t", "config", "interpret"))
def _plain_call(x: jax.Array, scales_t: bool, config: ActQuantConfig, interpret: bool):
    m, k = x.shape
    bm = _pow2_divisor(m, config.block_m)
    gb = _pow2_divisor(k // GROUP, config.groups)
    tile = pl.BlockSpec((bm, gb * GROUP), lambda r, c: (r, c))
    s_spec, s_shape = _scale_spec(m, k // GROUP, bm, gb, scales_t, lambda r, c: r, lambda r, c: c)
    return pl.pallas_call(
        functools.partial(_plain_kernel, groups=gb, native=not interpret, scales_t=scales_t),
        grid=(m // bm, k // (gb * GROUP)), in_specs=[tile], out_specs=[tile, s_spec],
        out_shape=[jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), s_shape],
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret, name="quantize_1x128",
    )(x)


def quantize_1x128(x: jax.Array, *, scales_t: bool = True, config: ActQuantConfig | None = None,
                   interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """The 1 x 128 quantization of bf16 ``x [M, K]`` (scales ``[K/128, M]`` when ``scales_t``, else ``[M, K/128]``)
    in one kernel; twin `quantize_1x128_reference`, bit for bit in interpret mode (module note)."""
    config = DEFAULT_CONFIG if config is None else config
    if not hasattr(x, "dtype") or jnp.dtype(x.dtype) != jnp.dtype(jnp.bfloat16):
        raise ValueError(f"quantize_1x128 takes bfloat16 [M, K], got {getattr(x, 'dtype', type(x))}")
    if not supports_plain(tuple(x.shape)):
        raise ValueError(f"quantize_1x128 takes [M, K] with K a multiple of {GROUP}, got shape {tuple(x.shape)}")
    return tuple(_plain_call(x, scales_t, config, resolve_interpret(interpret)))
