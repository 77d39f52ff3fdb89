"""SwiGLU and FP8 activation quantization in one pass (Pallas, Triton lowering): the down projection's input.

What: ``gu [M, 2I]`` bf16, the fused gate/up GEMM's output ``[g | u]`` -> ``x = silu(g) * u`` quantized per token
in 1 x 128 groups: ``q float8_e4m3fn [M, I]`` and float32 scales, ``[I/128, M]`` (``scales_t``, the order cuBLASLt
reads) or ``[M, I/128]``. `silu_mul_quant_reference` is the jnp twin: ``quantize_activations_t(jax.nn.silu(g) *
u)``, what the model computed before this kernel.

Why: XLA ran that as three kernels per layer (the group maxima of ``silu(g) * u``, recomputing it; the scales; the
codes, recomputing it again): reading the [256, 24576] bf16 GEMM output twice. On the H200 in Qwen3-8B's decode
step (mode all, 256 rows, session 20) the three took 188 + 184 + 58 us per step of 15.9 ms. This kernel reads
``gu`` once and writes the codes and scales once.

Math, as the reference computes it in bf16 (XLA's HLO for ``jax.nn.silu`` of bf16, checked in the H200 profile):
``s = bf16(1 / f32(bf16(bf16(exp(-g)) + 1)))``, ``x = bf16(bf16(g * s) * u)``; then `quantize_activations`'s
rules: ``amax`` per group in float32, ``scale = amax / 448`` (IEEE division) floored at the smallest normal
float32, 1.0 for an all-zero group, ``q = cast_rne(clip(x * (1 / scale), -448, 448))``. The divisions are IEEE
``div.rn.f32`` on the GPU (`pallas_kernels.fp8_quant`'s design note says why). The exponential is the GPU's own,
and XLA:GPU's reference has its own: where they differ next to a bf16 rounding boundary an element of ``x`` rounds
to the neighbouring bf16 value, and its code can move one E4M3 step (on the H200, session 20: 0.08-0.16% of the
codes, and no less accurate against float64 than XLA's). On the CPU (interpret mode) the result is the
reference's bit for bit. `tests/test_act_quant.py` checks both.

Tiling: one program per ``block_m`` rows x ``groups`` quantization groups, the gate and up tiles read through two
BlockSpecs of the same array. ``M`` a multiple of ``block_m`` (a power of two dividing M is chosen), ``I`` a
multiple of 128.

The other activations the FP8 linears quantize, each in one pass as well (session 21):

- `add_rms_norm_quant`: the inputs of the fused q/k/v and gate/up GEMMs. ``h = x + residual`` (bf16; the residual
  optional), ``y = rms_norm(h, weight, eps)`` as `fp8rl_jax.models.policy.rms_norm` computes it (float32 mean of
  squares, ``rsqrt``, bf16 products), quantized per token in 1 x 128 groups; writes ``h`` (the residual stream the
  layer goes on with), the codes and the scales. The session 20 HLO of the mode-all decode step ran this as three
  XLA kernels before gate/up (102 + 105 + 104 us per step) and two before q/k/v (87 + 87). One program holds
  ``block_m`` whole rows (the mean needs the row; the width a power of two) and quantizes all their groups at once
  (``[bm, D/128, 128]``); a loop over the groups, one dependent load/store round each, took 27.6 us at 256 x 4096
  on the H200 where XLA's kernels took 7.6.
  `add_rms_norm_quant_reference` is the twin. The GPU's ``rsqrt`` and its reduction order are not XLA:GPU's, so
  there, as for the exponential above, a few codes can move one E4M3 step; on the CPU it is bit for bit (rows of
  up to 1024; wider rows XLA:CPU sums in another order). Inside a jitted model XLA lets fused bf16 ops skip their
  roundings (``xla_allow_excess_precision``), so the model's composition there was not the twin's per-op
  arithmetic; the kernel rounds every op as written (as torch does). Compiled without excess precision, the
  generator's logits equal the composition's bit for bit (`tests/test_act_quant.py`); with it, on a tiny random
  FP8 model, both were as far from float32 (relative logit error 0.0698 against 0.0692).
- `add_rms_norm`: the same add and norm without the quantization, for the BF16 linears (modes ``none`` and ``kv``):
  writes ``h`` and ``y`` in bf16. XLA ran the decode step's pair of norms as three kernels per layer (the input
  norm's add, then its norm reading ``h`` back, and the post-attention add + norm: 180 + 95 + 167 us per step of
  the Qwen3-8B kv profile at 256 rows, session 22). `add_rms_norm_reference` is the twin.
- `quantize_1x128`: plain `quantize_activations` / `quantize_activations_t` of a bf16 matrix (the o_proj input,
  the attention output; XLA ran it as three kernels, 78 + 61 + 58 us per step). On the CPU bit for bit. XLA:GPU's
  float32 division is not IEEE: on the H200 60% of its scales were an ulp or two from the kernel's and 0.17% of the
  codes one step (session 21). H200: 2.0 against 3.5 us at 256 x 4096, 14.7 against 24.7 at 4096 x 4096.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fp8rl_jax.models.policy import rms_norm
from fp8rl_jax.numerics.fp8 import E4M3_MAX, quantize_activations, quantize_activations_t
from pallas_kernels.common import resolve_interpret
from pallas_kernels.fp8_quant import _ieee_div

GROUP = 128
_F32_TINY = float(np.finfo(np.float32).tiny)


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
        sig = _bf16(_ieee_div(jnp.ones_like(den), den, native))
        x = _bf16(_bf16(g * sig) * u)
        _store_group(x, j, q_ref, s_ref, native=native, scales_t=scales_t)


def _store_group(x: jax.Array, j: int, q_ref, s_ref, *, native: bool, scales_t: bool) -> None:
    """Group ``j`` (columns ``j*128 ...``) of the program's rows, float32 ``x [bm, 128]``: `quantize_activations`'s
    scale and codes, stored."""
    bm = x.shape[0]
    amax = jnp.max(jnp.abs(x), axis=1, keepdims=True)  # [bm, 1]
    scale = _ieee_div(amax, jnp.full(amax.shape, E4M3_MAX, jnp.float32), native)
    scale = jnp.maximum(scale, jnp.float32(_F32_TINY))
    scale = jnp.where(amax == 0, jnp.float32(1.0), scale)
    inv = _ieee_div(jnp.ones_like(scale), scale, native)
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
    """``quantize_activations_t(silu(g) * u)`` (``scales_t``; else `quantize_activations`'s ``[M, I/128]``
    scales) of ``gu = [g | u]`` ``[M, 2I]`` bfloat16, in one kernel (module note)."""
    config = DEFAULT_CONFIG if config is None else config
    if not hasattr(gu, "dtype") or jnp.dtype(gu.dtype) != jnp.dtype(jnp.bfloat16):
        raise ValueError(f"silu_mul_quant takes bfloat16 [M, 2I], got {getattr(gu, 'dtype', type(gu))}")
    if not supports(tuple(gu.shape)):
        raise ValueError(f"silu_mul_quant takes [M, 2I] with I a multiple of {GROUP}, got shape {tuple(gu.shape)}")
    return _call(gu, scales_t, config, resolve_interpret(interpret))


def silu_mul_quant_reference(gu: jax.Array, *, scales_t: bool = True) -> tuple[jax.Array, jax.Array]:
    """The jnp twin: ``g, u = split(gu)``; ``x = jax.nn.silu(g) * u`` in ``gu``'s dtype; its per-token 1x128
    quantization (`quantize_activations_t` / `quantize_activations`)."""
    g, u = jnp.split(gu, 2, axis=-1)
    x = jax.nn.silu(g) * u
    return quantize_activations_t(x) if scales_t else quantize_activations(x)


# --- the normalized inputs of q/k/v and gate/up, and plain 1 x 128 quantization ---------------------------------


@dataclasses.dataclass(frozen=True)
class NormQuantConfig:
    """`add_rms_norm_quant`'s tiling: ``block_m`` whole rows per program (at most; the largest power of two <= it
    that divides M). The default was the fastest at 256 x 4096 on the H200 (session 21 call 2: 3.99 us; 2 rows and 4
    warps 4.74, 8 rows and 2 warps 319); at 4096 rows it took 38.1 us, the best 37.2."""

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
    # the whole row's groups at once (a loop over them serialized 32 dependent load/store rounds per program:
    # 27.6 us at 256 x 4096 on the H200, session 21)
    amax = jnp.max(jnp.abs(y), axis=2)  # [bm, g]
    scale = _ieee_div(amax, jnp.full(amax.shape, E4M3_MAX, jnp.float32), native)
    scale = jnp.maximum(scale, jnp.float32(_F32_TINY))
    scale = jnp.where(amax == 0, jnp.float32(1.0), scale)
    inv = _ieee_div(jnp.ones_like(scale), scale, native)
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


def add_rms_norm_reference(x: jax.Array, weight: jax.Array, eps: float, *, residual: jax.Array | None = None
                           ) -> tuple[jax.Array, ...]:
    """The jnp twin: ``h = x + residual``, ``rms_norm(h, weight, eps)``; ``(h, y)`` with a residual, ``(y,)``
    without."""
    h = x if residual is None else x + residual
    y = rms_norm(h, weight, eps)
    return (y,) if residual is None else (h, y)


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


def add_rms_norm_quant_reference(x: jax.Array, weight: jax.Array, eps: float, *, residual: jax.Array | None = None,
                                 scales_t: bool = True) -> tuple[jax.Array, ...]:
    """The jnp twin: ``h = x + residual``; ``quantize_activations_t(rms_norm(h, weight, eps))`` (or
    `quantize_activations`); ``(h, q, s)`` with a residual, ``(q, s)`` without."""
    h = x if residual is None else x + residual
    y = rms_norm(h, weight, eps)
    qs = quantize_activations_t(y) if scales_t else quantize_activations(y)
    return qs if residual is None else (h, *qs)


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
    """`quantize_activations_t` (``scales_t``) or `quantize_activations` of bf16 ``x [M, K]`` in one kernel, bit
    for bit (module note)."""
    config = DEFAULT_CONFIG if config is None else config
    if not hasattr(x, "dtype") or jnp.dtype(x.dtype) != jnp.dtype(jnp.bfloat16):
        raise ValueError(f"quantize_1x128 takes bfloat16 [M, K], got {getattr(x, 'dtype', type(x))}")
    if not supports_plain(tuple(x.shape)):
        raise ValueError(f"quantize_1x128 takes [M, K] with K a multiple of {GROUP}, got shape {tuple(x.shape)}")
    return tuple(_plain_call(x, scales_t, config, resolve_interpret(interpret)))


def main(argv: list[str] | None = None) -> int:
    """GPU time of the kernels against their jnp twins (XLA's fusions) per M: ``python -m pallas_kernels.act_quant
    --m 256 4096 --out r.json``. ``silu``: SwiGLU of ``[M, 2I]`` (``--i``); ``norm``: residual add + RMSNorm of
    ``[M, D]`` (``--d``); ``plain``: ``[M, D]``. ``--sweep`` also times the tilings (block_m x num_warps; groups for
    silu/plain). Bytes moved: inputs read once, outputs written once."""
    import argparse
    import itertools

    from pallas_kernels.common import replay_gpu_ms, write_results

    p = argparse.ArgumentParser(description="time the one-pass activation quantization kernels against their twins")
    p.add_argument("--m", type=int, nargs="+", default=[256, 4096])
    p.add_argument("--i", type=int, default=12288)
    p.add_argument("--d", type=int, default=4096)
    p.add_argument("--kernels", nargs="+", default=["silu", "norm", "plain"],
                   choices=["silu", "norm", "plain", "bnorm"])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--sets", type=int, default=6)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = []
    for kind, m in itertools.product(args.kernels, args.m):
        if kind == "silu":
            sets = [(_gu_random(m, args.i, seed),) for seed in range(args.sets)]
            moved = m * 2 * args.i * 2 + m * args.i + 4 * m * args.i // GROUP
            ref = silu_mul_quant_reference
            impl = lambda cfg: lambda gu: silu_mul_quant(gu, config=cfg, interpret=False)  # noqa: E731
            configs = [ActQuantConfig(bm, g, w) for bm, g, w in itertools.product((4, 8, 16, 32), (1, 2, 4), (2, 4))]
            default = DEFAULT_CONFIG
        elif kind == "norm":
            d = args.d
            sets = [(_gu_random(m, d // 2, seed), _gu_random(m, d // 2, seed + 100) * 0.25,
                     jnp.ones((d,), jnp.bfloat16)) for seed in range(args.sets)]
            moved = 3 * m * d * 2 + m * d + 4 * m * d // GROUP
            ref = lambda x, r, w: add_rms_norm_quant_reference(x, w, 1e-6, residual=r)  # noqa: E731
            impl = lambda cfg: lambda x, r, w: add_rms_norm_quant(x, w, 1e-6, residual=r, config=cfg,  # noqa: E731
                                                                   interpret=False)
            configs = [NormQuantConfig(bm, w) for bm, w in itertools.product((1, 2, 4, 8), (2, 4, 8))]
            default = DEFAULT_NORM_CONFIG
        elif kind == "bnorm":  # add + RMSNorm, bf16 out (the BF16 linears' input)
            d = args.d
            sets = [(_gu_random(m, d // 2, seed), _gu_random(m, d // 2, seed + 100) * 0.25,
                     jnp.ones((d,), jnp.bfloat16)) for seed in range(args.sets)]
            moved = 4 * m * d * 2
            ref = lambda x, r, w: add_rms_norm_reference(x, w, 1e-6, residual=r)  # noqa: E731
            impl = lambda cfg: lambda x, r, w: add_rms_norm(x, w, 1e-6, residual=r, config=cfg,  # noqa: E731
                                                             interpret=False)
            configs = [NormQuantConfig(bm, w) for bm, w in itertools.product((1, 2, 4), (4, 8, 16))]
            default = DEFAULT_NORM_CONFIG
        else:
            d = args.d
            sets = [(_gu_random(m, d // 2, seed),) for seed in range(args.sets)]
            moved = m * d * 2 + m * d + 4 * m * d // GROUP
            ref = quantize_activations_t
            impl = lambda cfg: lambda x: quantize_1x128(x, config=cfg, interpret=False)  # noqa: E731
            configs = [ActQuantConfig(bm, g, 4) for bm, g in itertools.product((4, 8, 32), (1, 4, 8))]
            default = DEFAULT_CONFIG
        runs = [("reference", None, ref), ("kernel", default, impl(default))]
        if args.sweep:
            runs += [("sweep", c, impl(c)) for c in configs if c != default]
        for name, cfg, fn in runs:
            res = replay_gpu_ms(fn, sets)
            rows.append({"kernel": kind, "m": m, "width": args.i if kind == "silu" else args.d, "impl": name,
                         "config": None if cfg is None else dataclasses.asdict(cfg), "gpu_us": res["busy_ms"] * 1e3,
                         "gbps": moved / res["busy_ms"] / 1e6, "kernels": res["kernels"]})
            print(f"{kind:5s} M={m:5d} {name:9s} {cfg} {res['busy_ms'] * 1e3:8.2f} us {rows[-1]['gbps']:7.0f} GB/s "
                  f"{list(res['kernels'])[:2]}", flush=True)
    if args.out:
        write_results(args.out, rows)
    return 0


def _gu_random(m: int, i: int, seed: int) -> jax.Array:
    return (jax.random.normal(jax.random.key(seed), (m, 2 * i), jnp.float32) * 3).astype(jnp.bfloat16)


if __name__ == "__main__":
    raise SystemExit(main())
