"""Block-scaled FP8 quantization: the pure-JAX reference math.

Design note
===========

This module is the *reference* for everything FP8 in fp8rl_jax: the trainer's
weight export, the generator's activation quantization, and the Pallas kernels
(which are tested bit-for-bit against these functions). It is plain `jnp`,
jit-compatible and free of side effects; speed is not a goal here. The array
maths lives beside the kernels as their references
(`pallas_kernels.fp8_quant.quantize_blocks_reference`,
`pallas_kernels.act_quant.quantize_groups_reference`); this module adds the
formats, the checks and the library's types on top.

Recipe (DeepSeek-V3 / Hugging Face `fp8` / vLLM block FP8)
----------------------------------------------------------
* Weights: one float32 scale per 128x128 block. A weight is laid out
  ``[..., N, K]`` = ``[..., out_features, in_features]`` (the HF/PyTorch Linear
  layout, and the layout vLLM loads), with any leading batch dims (stacked MoE
  experts ``[E, N, K]``). Scales have shape ``[..., ceil(N/bn), ceil(K/bk)]``.
* Activations: dynamic per-token scales in 1x128 groups along the last
  (contraction) axis: ``x [..., K] -> q [..., K], scale [..., ceil(K/128)]``.
  The 128-wide groups line up with the 128-wide K blocks of the weight, so a
  GEMM can apply ``scale_x[m, kb] * scale_inv_w[nb, kb]`` once per K block.
* Scale: ``s = amax(|block|) / fmt_max``, computed in float32 from the input
  (bf16 inputs are upcast exactly first) with a correctly rounded IEEE
  division, bit-identical to PyTorch's ``amax / 448`` (XLA would otherwise
  rewrite it as ``amax * (1/448)``; see `pallas_kernels.fp8_quant.scale_from_amax`). The stored
  quantity is the *dequantization* multiplier -- HF/vLLM call it
  ``weight_scale_inv`` -- so ``x ~= q * s`` block by block.
* Quantize: ``q = saturating_cast(x * (1/s))`` with the reciprocal ``1/s``
  computed once per block in float32 and the cast rounding to nearest even.

Dtypes
------
* ``Fp8Format.E4M3`` -> ``float8_e4m3fn`` (max 448, 3 mantissa bits, no Inf,
  0x7F/0xFF are NaN). The default for weights and activations (forward pass).
* ``Fp8Format.E5M2`` -> ``float8_e5m2`` (max 57344, 2 mantissa bits, IEEE-like
  with Inf). Offered for gradients; not used by the vLLM checkpoint format.
* Scales are always float32; amax and the multiply are done in float32.

Special values (deliberate)
---------------------------
* All-zero block/group: ``amax == 0`` gives ``s = 1.0``. It is finite and
  positive (no 0/0 NaN, no 1/0 Inf in the reciprocal), every ``q`` is +0, and
  dequantization is exactly 0. Zero groups are common: padded tokens in RL
  batches quantize to zeros with a unit scale.
* Tiny blocks: ``s`` is floored at the smallest normal float32 (~1.18e-38) so
  ``1/s`` stays finite. This only changes blocks whose amax is below
  ~5.3e-36 (E4M3), far below anything a trained bf16 weight holds.
* Overflow: the cast saturates. ``x * (1/s)`` can land a float32 ulp above
  ``fmt_max`` for the amax element (and a caller may pass its own larger
  values to ``saturating_cast``); a plain ``astype`` would turn values from
  464 upward into NaN for E4M3 (it has no Inf) and values past 61440 into Inf
  for E5M2. We clip to ``[-fmt_max, fmt_max]`` first, so q is never Inf/NaN
  for finite input.
* NaN/Inf input: cannot raise inside jit. A NaN propagates into its block's
  scale (NaN) and q; an Inf gives an Inf scale and NaN/0 codes. Both are
  visible, never silently finite, but they are garbage. Use
  ``count_nonfinite`` (jittable) to monitor, and ``quantize_weight_checked``
  (eager) when writing weights: it raises ``ValueError`` naming the tensor.

Where we deviate, and why
-------------------------
* Multiply by the reciprocal instead of dividing. XLA's algebraic simplifier
  rewrites ``x / broadcast(s)`` into ``x * broadcast(1/s)`` on CPU, so
  "divide" would mean different roundings on different backends (and forcing
  a true division would need a full-size materialized scale array). Writing
  the reciprocal explicitly pins the math; Pallas kernels match it bit for
  bit if they form ``1/s`` with an IEEE division (Triton: ``div_rn``, not the
  default approximate divide). Versus PyTorch-style float32 ``x / s`` it
  differs by one fp8 code on ~4e-4 of elements for bf16 inputs (~2e-7 for
  float32 inputs), measured on random data; with ``ScaleRounding.POW2`` the
  reciprocal is exact and the two agree. Both round twice (float32, then
  fp8), so both sometimes differ from the exact quotient at fp8 ties.
  DeepGEMM's ``x * (448 / amax)`` is a third variant; none of this affects the
  checkpoint format, which stores only ``q`` and ``s``.
* Zero-block scale 1.0 instead of clamping amax (DeepGEMM clamps amax at
  1e-4). A clamp changes the scale of legitimately small blocks; our rule
  keeps ``s == amax / fmt_max`` exactly for every non-degenerate block.
* ``ScaleRounding.POW2`` (UE8M0-style, ``s = 2**ceil(log2(amax/fmt_max))``,
  as DeepSeek-V3.1 ``scale_fmt: ue8m0`` and DeepGEMM on Blackwell use) is an
  option, not the default: the coarser scale wastes up to one binade of fp8
  range, and it was reported to cost about 12 GSM8K points in one vLLM
  report. The rounding is done on the float32 bits, not with ``log2``, so it is
  exact: a scale that is already a power of two is kept.
"""

from __future__ import annotations

import enum
import functools
import inspect
import math
from collections.abc import Sequence
from typing import Any

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import act_quant, fp8_quant
from pallas_kernels.fp8_quant import E4M3_MAX, E5M2_MAX, codes_to_float32

__all__ = [
    "E4M3_MAX", "E5M2_MAX", "Fp8Format", "QuantizedWeight", "ScaleRounding", "codes_to_float32", "count_nonfinite",
    "dequantize_activations", "dequantize_weight", "quantize_activations", "quantize_activations_t",
    "quantize_weight_blockwise", "quantize_weight_checked", "saturating_cast",
]


class Fp8Format(enum.Enum):
    """FP8 storage format: its JAX dtype and its largest finite value."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"

    @property
    def dtype(self) -> jnp.dtype:
        """The JAX dtype (``float8_e4m3fn`` or ``float8_e5m2``)."""
        return jnp.dtype(_FORMAT_DTYPE[self])

    @property
    def max(self) -> float:
        """Largest finite magnitude: 448 (E4M3) or 57344 (E5M2)."""
        return _FORMAT_MAX[self]

    @classmethod
    def from_dtype(cls, dtype: Any) -> Fp8Format:
        """The format stored as `dtype`; ValueError for a non-FP8 dtype."""
        dtype = jnp.dtype(dtype)
        for fmt in cls:
            if fmt.dtype == dtype:
                return fmt
        raise ValueError(
            f"dtype {dtype} is not an FP8 format; expected one of "
            f"{[str(f.dtype) for f in cls]}"
        )


_FORMAT_DTYPE = {Fp8Format.E4M3: jnp.float8_e4m3fn, Fp8Format.E5M2: jnp.float8_e5m2}
_FORMAT_MAX = {Fp8Format.E4M3: E4M3_MAX, Fp8Format.E5M2: E5M2_MAX}


class ScaleRounding(enum.Enum):
    """How the float32 scale ``amax / fmt_max`` is stored.

    FP32: exactly ``amax / fmt_max`` in float32 (default; HF/vLLM/DeepSeek-V3).
    POW2: rounded *up* to a power of two (UE8M0-style). Rounding up keeps
      ``|x| / s <= fmt_max``, so nothing extra saturates. Option only: reported to
      cost ~12 GSM8K points in one vLLM report.
    """

    FP32 = "fp32"
    POW2 = "pow2"


@flax.struct.dataclass
class QuantizedWeight:
    """A block-quantized FP8 weight in the HF/vLLM ``weight``/``weight_scale_inv`` layout.

    Attributes:
      q: FP8 codes, ``[..., N, K]`` (out_features, in_features), float8_e4m3fn
        or float8_e5m2. Leading dims are batch dims, e.g. MoE experts ``E``.
      scale_inv: float32 dequantization multipliers, one per block,
        ``[..., ceil(N / bn), ceil(K / bk)]``; ``w[n, k] ~= q[n, k] *
        scale_inv[n // bn, k // bk]``. Edge blocks cover the partial remainder.
      block_size: static ``(bn, bk)`` block shape, default ``(128, 128)``. Not
        a pytree leaf, so it survives jit/tree_map unchanged.
    """

    q: jax.Array
    scale_inv: jax.Array
    block_size: tuple[int, int] = flax.struct.field(pytree_node=False, default=(128, 128))

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical weight shape ``[..., N, K]`` (the shape of `q`)."""
        return tuple(self.q.shape)

    @property
    def fmt(self) -> Fp8Format:
        """The FP8 format of `q`."""
        return Fp8Format.from_dtype(self.q.dtype)

    def dequantize(self, dtype: Any = jnp.bfloat16) -> jax.Array:
        """``q * scale_inv`` per block, multiplied in float32, cast to `dtype`."""
        return dequantize_weight(self, dtype)


# ----------------------------------------------------------------------------
# Validation helpers (static: they only look at shapes, dtypes and Python args)


def _check_block_size(block_size: Sequence[int], name: str = "block_size") -> tuple[int, int]:
    try:
        block = tuple(block_size)
    except TypeError:
        msg = f"{name} must be a pair of positive ints (bn, bk), got {block_size!r}"
        raise ValueError(msg) from None
    if len(block) != 2 or not all(_is_positive_int(b) for b in block):
        raise ValueError(f"{name} must be a pair of positive ints (bn, bk), got {block_size!r}")
    return int(block[0]), int(block[1])


def _check_group_size(group_size: int) -> int:
    if not _is_positive_int(group_size):
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    return int(group_size)


def _is_positive_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0


def _check_enums(fmt: Any, rounding: Any) -> None:
    if not isinstance(fmt, Fp8Format):
        raise ValueError(f"fmt must be an Fp8Format, got {fmt!r}")
    if not isinstance(rounding, ScaleRounding):
        raise ValueError(f"rounding must be a ScaleRounding, got {rounding!r}")


def _check_fp8(q: jax.Array, name: str) -> None:
    if q.dtype not in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)):
        raise ValueError(f"{name} must be float8_e4m3fn or float8_e5m2, got {q.dtype}")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _jit_when_eager(*static_argnames: str):
    """Runs the decorated function as one compiled program when it is called outside a trace.

    Eagerly, JAX compiles each operation on its own, once per shape: a quantizer called on a new shape
    compiled ~10 one-op programs (the CPU test suite spent ~0.6 s per shape on them), where one jitted
    program costs one compile. Inside a trace (a jitted or differentiated caller) the function is
    inlined as before, so the programs that use it do not change."""

    def wrap(fn):
        jitted = jax.jit(fn, static_argnames=static_argnames)
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((args, kwargs))):
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs).arguments
            for name in static_argnames:  # a list (e.g. a block size read from JSON) is not hashable
                if isinstance(bound.get(name), list):
                    bound[name] = tuple(bound[name])
            return jitted(**bound)

        return call

    return wrap


# ----------------------------------------------------------------------------
# Core math


def saturating_cast(x: jax.Array, fmt: Fp8Format = Fp8Format.E4M3) -> jax.Array:
    """Clip to ``[-fmt.max, fmt.max]``, then round to nearest even in `fmt`.

    Finite or infinite inputs never produce Inf/NaN codes; NaN stays NaN.
    """
    if not isinstance(fmt, Fp8Format):
        raise ValueError(f"fmt must be an Fp8Format, got {fmt!r}")
    return fp8_quant.saturating_cast(x, fmt.dtype)


@_jit_when_eager("block_size", "fmt", "rounding")
def quantize_weight_blockwise(
    w: jax.Array,
    block_size: Sequence[int] = (128, 128),
    fmt: Fp8Format = Fp8Format.E4M3,
    rounding: ScaleRounding = ScaleRounding.FP32,
) -> QuantizedWeight:
    """Quantize a weight ``[..., N, K]`` to FP8 with one float32 scale per block.

    Args:
      w: floating weight (bf16/f32/...), rank >= 2, ``[..., out, in]``.
      block_size: ``(bn, bk)``; N and K need not be multiples (edge blocks are
        padded with zeros internally and sliced back).
      fmt: FP8 storage format.
      rounding: scale rounding (FP32 exact by default).

    Returns:
      ``QuantizedWeight(q [..., N, K], scale_inv [..., ceil(N/bn), ceil(K/bk)])``.
    """
    bn, bk = _check_block_size(block_size)
    _check_enums(fmt, rounding)
    w = jnp.asarray(w)
    if w.ndim < 2:
        raise ValueError(f"weight must have rank >= 2 ([..., N, K]), got shape {w.shape}")
    chex.assert_type(w, float)

    *lead, n, k = w.shape
    q, scale = fp8_quant.quantize_blocks_reference(w, (bn, bk), fmt.dtype, rounding is ScaleRounding.POW2)
    chex.assert_shape(scale, (*lead, _cdiv(n, bn), _cdiv(k, bk)))
    return QuantizedWeight(q=q, scale_inv=scale, block_size=(bn, bk))


@_jit_when_eager("dtype")
def dequantize_weight(qw: QuantizedWeight, dtype: Any = jnp.bfloat16) -> jax.Array:
    """``q * scale_inv`` per block in float32, cast to `dtype`; shape ``[..., N, K]``."""
    bn, bk = _check_block_size(qw.block_size, "QuantizedWeight.block_size")
    q, scale = qw.q, qw.scale_inv
    _check_fp8(q, "QuantizedWeight.q")
    chex.assert_type(scale, jnp.float32)
    if q.ndim < 2:
        raise ValueError(f"QuantizedWeight.q must have rank >= 2, got shape {q.shape}")
    *lead, n, k = q.shape
    expected = (*lead, _cdiv(n, bn), _cdiv(k, bk))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"QuantizedWeight.scale_inv has shape {scale.shape}, expected {expected} "
            f"for q {q.shape} with block_size {(bn, bk)}"
        )
    full = jnp.repeat(jnp.repeat(scale, bn, axis=-2), bk, axis=-1)[..., :n, :k]
    return (codes_to_float32(q) * full).astype(dtype)


@_jit_when_eager("group_size", "fmt", "rounding")
def quantize_activations(
    x: jax.Array,
    group_size: int = 128,
    fmt: Fp8Format = Fp8Format.E4M3,
    rounding: ScaleRounding = ScaleRounding.FP32,
) -> tuple[jax.Array, jax.Array]:
    """Dynamic per-token FP8 quantization in 1 x `group_size` groups along the last axis.

    Args:
      x: floating activations ``[..., K]`` (e.g. ``[B, T, D]``), rank >= 1.
      group_size: group width along K; K need not be a multiple.
      fmt: FP8 storage format.
      rounding: scale rounding (FP32 exact by default).

    Returns:
      ``(q [..., K] fp8, scale [..., ceil(K / group_size)] float32)`` with
      ``x ~= q * scale`` per group.
    """
    x = jnp.asarray(x)
    if x.ndim < 1:
        raise ValueError("activations must have rank >= 1 ([..., K]), got a scalar")
    return _quantize_groups(x, group_size, fmt, rounding, scales_t=False)


@_jit_when_eager("group_size", "fmt", "rounding")
def quantize_activations_t(
    x: jax.Array,
    group_size: int = 128,
    fmt: Fp8Format = Fp8Format.E4M3,
    rounding: ScaleRounding = ScaleRounding.FP32,
) -> tuple[jax.Array, jax.Array]:
    """`quantize_activations` of a matrix ``x [M, K]`` with the scales transposed: ``(q [M, K],
    scale_t [ceil(K / group_size), M])``, ``scale_t == quantize_activations(x)[1].T`` bit for bit.

    The layout cuBLASLt reads 1x128 scales in (M-contiguous, `fp8rl_jax.quant.cublaslt`). The group
    maxima are reduced from a transposed view of ``x``, so XLA can write them in that order from the
    reduction itself instead of transposing the scales in a kernel of their own after it.
    """
    x = jnp.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"quantize_activations_t takes a matrix [M, K], got shape {x.shape}")
    return _quantize_groups(x, group_size, fmt, rounding, scales_t=True)


def _quantize_groups(x: jax.Array, group_size: int, fmt: Fp8Format, rounding: ScaleRounding,
                     scales_t: bool) -> tuple[jax.Array, jax.Array]:
    """The checks of `quantize_activations`, then its maths (`act_quant.quantize_groups_reference`)."""
    gs = _check_group_size(group_size)
    _check_enums(fmt, rounding)
    chex.assert_type(x, float)
    *lead, k = x.shape
    q, scale = act_quant.quantize_groups_reference(x, gs, scales_t=scales_t, dtype=fmt.dtype,
                                                   pow2_scales=rounding is ScaleRounding.POW2)
    chex.assert_shape(scale, (_cdiv(k, gs), *lead) if scales_t else (*lead, _cdiv(k, gs)))
    return q, scale


@_jit_when_eager("group_size", "dtype")
def dequantize_activations(
    q: jax.Array,
    scale: jax.Array,
    group_size: int = 128,
    dtype: Any = jnp.bfloat16,
) -> jax.Array:
    """``q * scale`` per 1 x `group_size` group in float32, cast to `dtype`."""
    gs = _check_group_size(group_size)
    _check_fp8(q, "q")
    chex.assert_type(scale, jnp.float32)
    if q.ndim < 1:
        raise ValueError("q must have rank >= 1 ([..., K]), got a scalar")
    *lead, k = q.shape
    expected = (*lead, _cdiv(k, gs))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"scale has shape {scale.shape}, expected {expected} for q {q.shape} "
            f"with group_size {gs}"
        )
    full = jnp.repeat(scale, gs, axis=-1)[..., :k]
    return (codes_to_float32(q) * full).astype(dtype)


# ----------------------------------------------------------------------------
# Non-finite guards


def count_nonfinite(w: jax.Array) -> jax.Array:
    """Number of NaN/+Inf/-Inf elements as an int32 scalar. Jittable.

    int32 is exact up to 2**31 - 1 elements per tensor.
    """
    w = jnp.asarray(w)
    if not jnp.issubdtype(w.dtype, jnp.floating):
        return jnp.zeros((), jnp.int32)
    return jnp.sum(~jnp.isfinite(w), dtype=jnp.int32)


@jax.jit
def _count_nan_and_nonfinite(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jnp.sum(jnp.isnan(w), dtype=jnp.int32), count_nonfinite(w)


_quantize_weight_jit = jax.jit(
    quantize_weight_blockwise, static_argnames=("block_size", "fmt", "rounding")
)


def quantize_weight_checked(w: jax.Array, name: str, **kw: Any) -> QuantizedWeight:
    """Eager `quantize_weight_blockwise` that refuses NaN/Inf input.

    Raises ``ValueError`` naming `name` and the NaN/Inf counts before anything
    is quantized, so a corrupt tensor is never written as FP8. Not for use
    inside jit (it reads the count back to the host); inside jit, log
    `count_nonfinite` instead. `kw` are `quantize_weight_blockwise`'s options.
    """
    w = jnp.asarray(w)
    if jnp.issubdtype(w.dtype, jnp.floating):
        n_nan, n_bad = (int(v) for v in _count_nan_and_nonfinite(w))
        if n_bad:
            raise ValueError(
                f"refusing to quantize {name!r} (shape {tuple(w.shape)}, {w.dtype}): "
                f"{n_bad} non-finite values ({n_nan} NaN, {n_bad - n_nan} Inf) "
                f"of {math.prod(w.shape)}"
            )
    if "block_size" in kw:
        kw["block_size"] = _check_block_size(kw["block_size"])
    return _quantize_weight_jit(w, **kw)
