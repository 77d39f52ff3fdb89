"""FP8 training: block-scaled FP8 GEMMs in the forward and backward of every selected linear.

Design note
===========

Why: the rollout runs W8A8 (``fp8rl_jax.quant.policy.W8A8Policy``). Training the same layers
with the same FP8 forward narrows the train/inference mismatch the RL corrections have to absorb,
and on Hopper all three GEMMs of a linear (fprop, dgrad, wgrad) can run on the FP8 tensor cores.
``Fp8TrainPolicy`` is a ``MatmulPolicy``: the one model definition is unchanged, the trainer just
builds it with this policy. Master weights stay float32 (or whatever the params hold); every
call re-quantizes them ("current" scaling: scales come from the tensor being quantized, no amax
history).

Recipe, per GEMM (x [M, K] tokens x in-features, W [N, K] = [out, in], dy [M, N])
-------------------------------------------------------------------------------
============  ==========================  =================================  ===================
GEMM          left operand                right operand                      accumulate / output
============  ==========================  =================================  ===================
fprop  y=xWᵀ  x: E4M3, 1x128 along K      W: E4M3, 128x128 blocks            f32 / compute dtype
              (per token, = rollout)      (= rollout's weight export)
dgrad  dx=dyW dy: ``grad_format``,         W: the forward's FP8 codes and     f32 / compute dtype
              1x128 along N (per token)   block scales, reused (a 128x128
                                          block of W is one of Wᵀ)
wgrad  dW=dyᵀx dy: ``grad_format``,        x: E4M3, 128x1 (128 tokens x 1     f32 / master dtype
              128x1 along M               channel) along M, quantized in
              (128 tokens x 1 channel)    the forward from high precision
============  ==========================  =================================  ===================

Every GEMM has its scale groups along its contraction axis (K, N, M respectively), so a kernel
can apply ``scale_a * scale_b`` once per 128-wide contraction block and accumulate in float32.
Scales are float32 ``amax / fmt_max`` with the zero/tiny rules of ``fp8rl_jax.numerics.fp8``
(all-zero group -> scale 1.0, codes 0: padded tokens give exact zeros, never NaN). The weight is
cast to the compute dtype *before* quantizing, so for BF16 masters-cast-to-BF16 the trainer's FP8
forward uses the very codes and scales the rollout's ``quantize_params`` exports, and its
activations the very codes ``W8A8Policy`` makes: trainer and rollout forward agree up to GEMM
summation order (a test checks the logits). The VJP is straight-through: quantization is treated
as the identity (with current scaling nothing saturates beyond float32 rounding of the amax
element, so there is no clipping mask to apply).

MoE experts (``ragged_dot``, W [E, N, K], rows of x sorted by expert): the same recipe per
expert. The wgrad's 128-token groups restart at every expert boundary (the rows of one expert
are padded to a multiple of 128 in a scratch layout, the layout a k-grouped kernel consumes), so
one expert's gradient never shares a scale with its neighbour's.

What the backward keeps (residuals)
-----------------------------------
Per linear: W as FP8 [N, K] (or [E, N, K]) + float32 block scales [N/128, K/128] (for the dgrad),
and x as FP8 E4M3 in its *wgrad* layout, 128x1 groups along tokens ([K, M] codes + float32
scales [K, M/128]), quantized in the forward from the high-precision x. The forward's 1x128 copy
of x is not kept: the backward never needs it. That is M*K + N*K bytes (+3 % for x's float32
scales) against 2*M*K + 2*N*K for plain BF16 autodiff (which keeps x and the BF16 cast of the
float32 master).
Keeping the 1x128 copy and re-quantizing it to 128x1 in the backward (what DeepSeek-V3 does for
the activations it caches) would need the same memory and round x twice, so we quantize both
layouts from high precision (Transformer Engine's row- and column-wise usage, keeping only the
column-wise one). Under ``jax.checkpoint`` the residuals are recomputed like everything else.
For the MoE wgrad the x copy is saved in the expert-aligned scratch layout (above), which has
``(ceil(M/128) + E + 1) * 128`` rows: at most (E + 1) * 128 rows of padding per linear.

Layer selection
---------------
The rollout's ``LayerPolicy``: attention q/k/v/o, MLP gate/up/down and the experts go FP8;
embeddings, norms, the router and the lm_head stay in the compute dtype (they never reach this
module: norms and embeddings are no matmuls, router and lm_head take ``DensePolicy``);
``bf16_first_layers`` / ``bf16_last_layers`` keep the ends of the stack in high precision. The
policy needs ``num_layers`` to place "the last N layers" (``Fp8TrainPolicy.for_model``).

Compute path (``Kernels``)
--------------------------
Reference (CPU, or ``Kernels.REFERENCE``): dequantize both operands to float32 and dot with
HIGHEST precision: exact products, float32 sums, the same math as the kernel's per-128-block
promotion in another order. On a GPU backend (``AUTO``) or with ``Kernels.PALLAS`` the weight
quantization runs ``pallas_kernels.fp8_quant`` (bit-identical), and the fprop and the dgrad run
``pallas_kernels.fp8_gemm_mgpu`` (TMA + wgmma; ``pallas_kernels.fp8_gemm`` for shapes it does not
take), or cuBLASLt's block-scaled FP8 (``fp8rl_jax.quant.cublaslt``) as ``Fp8TrainRecipe.gemm`` picks,
when the block is 128x128 and the operands are E4M3 (dgrad with E5M2 gradients falls back
to the reference). The wgrad (per-row scales on *both* operands) multiplies the FP8 codes
dequantized to BF16 on the BF16 tensor cores (``_wgrad``: within 2^-9 of the reference, far
below the FP8 step), or in FP8 on cuBLASLt's 1Dx1D scaling when ``gemm`` names cuBLASLt (the field or
``FP8RL_FP8_GEMM``) and the GPU's cuBLASLt has it; the MoE GEMMs use the reference.

Where we deviate, and why
-------------------------
* DeepSeek-V3: same granularities (1x128 activations/gradients, 128x128 weights, 128x1 wgrad
  operands) and E4M3 for gradients by default. We keep float32 scales (no power-of-two
  rounding) because the rollout does, so fprop matches the rollout. DeepSeek re-quantizes its
  cached 1x128 FP8 activations to 128x1 for the wgrad; we quantize the 128x1 copy from high
  precision in the forward instead (same memory, one rounding less). DeepSeek's E5M6 storage of
  selected activations is not reproduced. dW is accumulated in float32 and returned in the
  master dtype.
* Transformer Engine ``Float8BlockScaling``: same block shapes, E4M3 everywhere by default, x
  quantized row- and column-wise in the forward as here. TE's per-tensor recipes
  (delayed/current scaling, ``HYBRID`` = E5M2 gradients) are coarser; ``grad_format=E5M2`` is
  offered for that comparison (blockwise scales make E4M3's range sufficient; see the measured
  errors in the tests).
* torchao float8: tensorwise or rowwise (per-row along the contraction, power-of-two scales)
  scaling, and ``ROWWISE_WITH_GW_HP`` keeps the wgrad in BF16. Block scales are finer than rows
  along K and, above all, identical to what the rollout serves.
* Plain BF16 autodiff of ``w.astype(bf16)`` returns a BF16-rounded dW; ours comes straight from
  the float32 accumulator in the master dtype.
* The weight is re-quantized at every call (every micro-batch): one elementwise pass, cheap next
  to the GEMMs; caching it per optimizer step needs the trainer's cooperation.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.policy import DENSE_DN, RAGGED_DN, DensePolicy, MatmulPolicy, Site
from fp8rl_jax.numerics.fp8 import Fp8Format, QuantizedWeight, dequantize_activations, quantize_activations
from fp8rl_jax.quant import cublaslt
from fp8rl_jax.quant.policy import GemmBackend, Kernels, LayerPolicy, quantize_weight, triton_config, use_cublaslt
from pallas_kernels import fp8_gemm as gemm_kernel
from pallas_kernels import fp8_gemm_mgpu as mgpu_kernel

_HIGHEST = jax.lax.Precision.HIGHEST
_KERNEL_BLOCK = (gemm_kernel.BK, gemm_kernel.BK)
_COMPUTE_DTYPES = ("bfloat16", "float32")
# dgrad of a grouped matmul: dy [M, N] . W_e [N, K] -> [M, K] (contract N, rows ragged).
_RAGGED_DGRAD_DN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (1,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
# wgrad of a grouped matmul: dyᵀ [N, M] . x [M, K] -> [E, N, K] (contract the ragged token axis).
_RAGGED_WGRAD_DN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


@dataclasses.dataclass(frozen=True)
class Fp8TrainRecipe:
    """The numeric recipe of an FP8 training linear (everything but layer selection).

    Attributes:
      grad_format: FP8 format of the output gradient dy in the dgrad and wgrad (E4M3 default,
        as DeepSeek-V3 and TE's block recipe; E5M2 as TE's per-tensor HYBRID). Forward operands
        are always E4M3, as in the rollout.
      block_size: weight block (bn, bk); x is grouped 1 x bk, dy 1 x bn, so groups line up with
        the weight blocks along each contraction axis.
      token_group: group length along tokens of both wgrad operands (128 tokens x 1 channel).
      kernels: Pallas kernels or the jnp reference (``Kernels``).
      gemm: the fprop/dgrad (and, with cuBLASLt, wgrad) GEMM on the GPU (`GemmBackend`): the Mosaic
        kernel or cuBLASLt; AUTO follows ``FP8RL_FP8_GEMM``, else the measured per-shape table, else
        the table's default for the device kind (``GemmBackend.resolve``). The wgrad goes to cuBLASLt
        only when cuBLASLt is named.
    """

    grad_format: Fp8Format = Fp8Format.E4M3
    block_size: tuple[int, int] = (128, 128)
    token_group: int = 128
    kernels: Kernels = Kernels.AUTO
    gemm: GemmBackend = GemmBackend.AUTO

    def __post_init__(self) -> None:
        if not isinstance(self.grad_format, Fp8Format):
            raise ValueError(f"grad_format must be an Fp8Format, got {self.grad_format!r}")
        if not isinstance(self.kernels, Kernels):
            raise ValueError(f"kernels must be a Kernels, got {self.kernels!r}")
        if not isinstance(self.gemm, GemmBackend):
            raise ValueError(f"gemm must be a GemmBackend, got {self.gemm!r}")
        bs = self.block_size
        if not (isinstance(bs, tuple) and len(bs) == 2 and all(_positive_int(b) for b in bs)):
            raise ValueError(f"block_size must be a pair of positive ints (bn, bk), got {bs!r}")
        if not _positive_int(self.token_group):
            raise ValueError(f"token_group must be a positive int, got {self.token_group!r}")

    def _gemm_kernel(self, *fmts: Fp8Format) -> bool:
        """Whether a Pallas fp8_gemm runs for operands of these formats."""
        return (self.kernels.pallas() and tuple(self.block_size) == _KERNEL_BLOCK
                and all(f is Fp8Format.E4M3 for f in fmts))


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Static description of one FP8 linear call (hashable: a custom_vjp nondiff argument)."""

    recipe: Fp8TrainRecipe
    dtype: str  # compute dtype: activations in and out, dx
    w_dtype: str  # master weight dtype: dW


# ---------------------------------------------------------------------------- shared pieces


def _deq_rows(q: jax.Array, s: jax.Array, group: int) -> jax.Array:
    return dequantize_activations(q, s, group, dtype=jnp.float32)


def _quant_cols(a: jax.Array, group: int, fmt: Fp8Format) -> tuple[jax.Array, jax.Array]:
    """a [M, C] in 128x1 groups along M: codes [C, M] and scales [C, ceil(M/group)] (transposed,
    so each row is one channel and the contraction axis M is last, K-major for a kernel)."""
    return quantize_activations(a.T, group, fmt)


def _dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """float32 a [P, C] . b [Q, C]ᵀ -> [P, Q] (both operands already float32)."""
    return jax.lax.dot_general(a, b, DENSE_DN, precision=_HIGHEST, preferred_element_type=jnp.float32)


def _interpret() -> bool:
    return jax.default_backend() != "gpu"


def _block_gemm(aq: jax.Array, a_s: jax.Array, bq: jax.Array, b_s: jax.Array, dt: Any,
                gemm: GemmBackend) -> jax.Array:
    """FP8 ``A [M, K] (1x128) @ B [N, K]ᵀ (128x128)`` on the GPU GEMMs, as ``W8A8Policy`` picks
    them: cuBLASLt's block-scaled FP8 where ``gemm`` picks it (by name, ``FP8RL_FP8_GEMM``, or the measured
    table for the shape) and it takes the shape, the Triton kernel where ``gemm`` resolves to it, else the Mosaic
    GPU kernel (TMA + wgmma) where it takes the shape, else the Triton one."""
    m, k = aq.shape
    n = bq.shape[0]
    if not _interpret() and use_cublaslt(gemm, m, n, k, dt):
        return cublaslt.fp8_gemm_cublaslt(aq, a_s, bq, b_s, out_dtype=dt)
    if gemm.resolve(m, n, k) is GemmBackend.TRITON:
        return gemm_kernel.fp8_gemm(aq, a_s, bq, b_s, out_dtype=dt, config=triton_config(m, n, k),
                                     interpret=_interpret())
    if mgpu_kernel.supports(m, n, k):
        return mgpu_kernel.fp8_gemm_mgpu(aq, a_s, bq, b_s, out_dtype=dt, interpret=_interpret())
    return gemm_kernel.fp8_gemm(aq, a_s, bq, b_s, out_dtype=dt, interpret=_interpret())


def _wgrad(dytq, dyts, xtq, xts, group: int, kernels: bool, gemm: GemmBackend) -> jax.Array:
    """dW [N, K] float32 = dyᵀ x from 128x1-grouped FP8 codes (``_quant_cols`` layouts).

    Reference: both operands dequantized to float32, HIGHEST-precision dot (exact products,
    float32 sums). Kernel path (GPU): dequantized to BF16 instead and multiplied on the BF16
    tensor cores with float32 accumulation: an E4M3 code has 4 significant bits, so ``code x
    scale`` rounded to BF16's 8 loses at most 2^-9 relative, 32x below the FP8 quantization step
    (2^-4) that defines the recipe; float32 HIGHEST dots run at a small fraction of the tensor
    cores' rate. When ``gemm`` names cuBLASLt and the gradients are E4M3 it runs in FP8 on cuBLASLt's 1Dx1D
    scaling where this GPU's cuBLASLt has it (`cublaslt.one_d_available`)."""
    if not kernels:
        return _dot_nt(_deq_rows(dytq, dyts, group), _deq_rows(xtq, xts, group))
    fp8 = jnp.dtype(jnp.float8_e4m3fn)
    if (group == 128 and not _interpret() and gemm.describe() == GemmBackend.CUBLASLT.value
            and jnp.dtype(dytq.dtype) == fp8 and jnp.dtype(xtq.dtype) == fp8 and xtq.shape[0] % 16 == 0
            and cublaslt.one_d_available()):  # FP8 x FP8 on the tensor cores, 1D x 1D scales
        return cublaslt.fp8_gemm_cublaslt_1d(dytq, dyts, xtq, xts, out_dtype=jnp.float32)
    a = dequantize_activations(dytq, dyts, group, dtype=jnp.bfloat16)
    b = dequantize_activations(xtq, xts, group, dtype=jnp.bfloat16)
    return jax.lax.dot_general(a, b, DENSE_DN, preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------- dense linear


def _linear_fwd_impl(x: jax.Array, w: jax.Array, spec: _Spec):
    r = spec.recipe
    bk = r.block_size[1]
    dt = jnp.dtype(spec.dtype)
    qw: QuantizedWeight = quantize_weight(w.astype(dt), r.block_size, r.kernels)
    xq, xs = quantize_activations(x, bk, Fp8Format.E4M3)
    m, k = x.shape
    n = w.shape[0]
    if r._gemm_kernel(Fp8Format.E4M3) and min(m, n, k) > 0:
        y = _block_gemm(xq, xs, qw.q, qw.scale_inv, dt, r.gemm)
    else:
        y = _dot_nt(_deq_rows(xq, xs, bk), qw.dequantize(jnp.float32)).astype(dt)
    # The wgrad's x, 128x1 along tokens, from high precision; the 1x128 copy is not kept.
    return y, (qw, _quant_cols(x, r.token_group, Fp8Format.E4M3))


def _fp8_linear_fwd(x, w, spec: _Spec):
    return _linear_fwd_impl(x, w, spec)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fp8_linear(x: jax.Array, w: jax.Array, spec: _Spec) -> jax.Array:
    return _linear_fwd_impl(x, w, spec)[0]


def _fp8_linear_bwd(spec: _Spec, res, dy: jax.Array):
    r = spec.recipe
    bn = r.block_size[0]
    g = r.token_group
    qw, (xtq, xts) = res
    dt = jnp.dtype(spec.dtype)
    m, n = dy.shape
    k = qw.q.shape[1]
    # dgrad: dy per token in 1 x bn groups along N (the contraction), W's blocks reused transposed.
    dyq, dys = quantize_activations(dy, bn, r.grad_format)
    if r._gemm_kernel(r.grad_format) and min(m, n, k) > 0:
        dx = _block_gemm(dyq, dys, qw.q.T, qw.scale_inv.T, dt, r.gemm)
    else:
        dx = jax.lax.dot_general(_deq_rows(dyq, dys, bn), qw.dequantize(jnp.float32), (((1,), (0,)), ((), ())),
                                 precision=_HIGHEST, preferred_element_type=jnp.float32).astype(dt)
    # wgrad: both operands in 128x1 groups along the token axis M (the contraction).
    dytq, dyts = _quant_cols(dy, g, r.grad_format)  # [N, M], [N, M/g]
    dw = _wgrad(dytq, dyts, xtq, xts, g, r.kernels.pallas(), r.gemm)  # [N, K] float32
    return dx, dw.astype(spec.w_dtype)


_fp8_linear.defvjp(_fp8_linear_fwd, _fp8_linear_bwd)


def fp8_linear(x: jax.Array, w: jax.Array, recipe: Fp8TrainRecipe = Fp8TrainRecipe(),
               dtype: Any = jnp.bfloat16) -> jax.Array:
    """``x [..., K] @ w [N, K]ᵀ -> [..., N]`` in ``dtype`` with FP8 fprop, dgrad and wgrad.

    ``w`` is the master weight (any float dtype; cast to ``dtype`` before quantizing); its
    gradient comes back in ``w.dtype``, x's in ``dtype``. Differentiable (custom VJP), jittable,
    usable under ``lax.scan`` and ``jax.checkpoint``.
    """
    spec = _spec(recipe, dtype, w)
    if w.ndim != 2:
        raise ValueError(f"fp8_linear needs a weight [N, K], got shape {tuple(w.shape)}")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x [..., K] = {tuple(x.shape)} does not contract with w [N, K] = {tuple(w.shape)}")
    lead = x.shape[:-1]
    y = _fp8_linear(x.reshape(-1, x.shape[-1]).astype(spec.dtype), w, spec)
    return y.reshape(*lead, w.shape[0])


def _spec(recipe: Fp8TrainRecipe, dtype: Any, w: Any) -> _Spec:
    if not isinstance(recipe, Fp8TrainRecipe):
        raise ValueError(f"recipe must be an Fp8TrainRecipe, got {recipe!r}")
    if isinstance(w, QuantizedWeight):
        raise TypeError("FP8 training multiplies dense master weights and quantizes them itself; got a "
                        "QuantizedWeight (a rollout weight: use W8A8Policy, or train on the dense params)")
    if not hasattr(w, "dtype") or not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"FP8 training needs a floating weight array, got {type(w).__name__} "
                        f"{getattr(w, 'dtype', '')}")
    name = jnp.dtype(dtype).name
    if name not in _COMPUTE_DTYPES:
        raise ValueError(f"compute dtype must be one of {_COMPUTE_DTYPES}, got {name}")
    return _Spec(recipe, name, jnp.dtype(w.dtype).name)


# ---------------------------------------------------------------------------- grouped (MoE) linear


def _expert_aligned_rows(group_sizes: jax.Array, m: int, group: int) -> tuple[jax.Array, jax.Array, int]:
    """A scratch layout in which every expert's rows start on a multiple of ``group``.

    Returns (dest [m] int32: the scratch row of each row, padded_sizes [E] int32: rows per
    expert rounded up to ``group``, rows: the static scratch length). Rows past
    ``sum(group_sizes)`` (which ragged_dot ignores) all go to the scratch's last row, which no
    expert owns. ``sum(ceil(s_e / group)) <= ceil(m / group) + E - 1`` bounds the layout.
    """
    e = group_sizes.shape[0]
    rows = (-(-m // group) + e + 1) * group
    padded = ((group_sizes + group - 1) // group) * group
    starts = jnp.cumsum(group_sizes) - group_sizes
    pstarts = jnp.cumsum(padded) - padded
    idx = jnp.arange(m, dtype=jnp.int32)
    expert = jnp.searchsorted(jnp.cumsum(group_sizes), idx, side="right", method="compare_all")  # E: tail rows
    safe = jnp.minimum(expert, e - 1)
    dest = jnp.where(expert < e, pstarts[safe] + idx - starts[safe], rows - 1).astype(jnp.int32)
    return dest, padded.astype(jnp.int32), rows


def _grouped_quant_cols(a: jax.Array, dest: jax.Array, rows: int, group: int, fmt: Fp8Format, valid: jax.Array):
    """a [M, C] quantized in 128x1 groups along tokens that restart at each expert: codes and
    scales in the expert-aligned scratch layout, transposed ([C, rows], [C, rows/group])."""
    a = jnp.where(valid[:, None], a.astype(jnp.float32), 0.0)
    scratch = jnp.zeros((rows, a.shape[1]), jnp.float32).at[dest].set(a)
    return _quant_cols(scratch, group, fmt)


def _ragged_fwd_impl(x, w, group_sizes, spec: _Spec):
    r = spec.recipe
    bk = r.block_size[1]
    dt = jnp.dtype(spec.dtype)
    qw: QuantizedWeight = quantize_weight(w.astype(dt), r.block_size, r.kernels)
    xq, xs = quantize_activations(x, bk, Fp8Format.E4M3)
    y = jax.lax.ragged_dot_general(_deq_rows(xq, xs, bk), qw.dequantize(jnp.float32), group_sizes, RAGGED_DN,
                                   precision=_HIGHEST, preferred_element_type=jnp.float32).astype(dt)
    dest, _, rows = _expert_aligned_rows(group_sizes, x.shape[0], r.token_group)
    valid = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
    xt = _grouped_quant_cols(x, dest, rows, r.token_group, Fp8Format.E4M3, valid)
    return y, (qw, xt, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fp8_ragged(x, w, group_sizes, spec: _Spec):
    return _ragged_fwd_impl(x, w, group_sizes, spec)[0]


def _fp8_ragged_fwd(x, w, group_sizes, spec: _Spec):
    return _ragged_fwd_impl(x, w, group_sizes, spec)


def _fp8_ragged_bwd(spec: _Spec, res, dy):
    r = spec.recipe
    bn = r.block_size[0]
    g = r.token_group
    qw, (xtq, xts), group_sizes = res
    dt = jnp.dtype(spec.dtype)
    m = dy.shape[0]
    dyq, dys = quantize_activations(dy, bn, r.grad_format)
    wf = qw.dequantize(jnp.float32)
    dx = jax.lax.ragged_dot_general(_deq_rows(dyq, dys, bn), wf, group_sizes, _RAGGED_DGRAD_DN,
                                    precision=_HIGHEST, preferred_element_type=jnp.float32).astype(dt)
    dest, padded, rows = _expert_aligned_rows(group_sizes, m, g)
    valid = jnp.arange(m) < jnp.sum(group_sizes)
    dytq, dyts = _grouped_quant_cols(dy, dest, rows, g, r.grad_format, valid)  # [N, rows]
    dw = jax.lax.ragged_dot_general(_deq_rows(dytq, dyts, g).T, _deq_rows(xtq, xts, g).T, padded,
                                    _RAGGED_WGRAD_DN, precision=_HIGHEST,
                                    preferred_element_type=jnp.float32)  # [E, N, K]
    return dx, dw.astype(spec.w_dtype), None


_fp8_ragged.defvjp(_fp8_ragged_fwd, _fp8_ragged_bwd)


def fp8_ragged_linear(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                      recipe: Fp8TrainRecipe = Fp8TrainRecipe(), dtype: Any = jnp.bfloat16) -> jax.Array:
    """Grouped ``x [M, K]`` (rows sorted by expert) times experts ``w [E, N, K]`` -> ``[M, N]``
    with FP8 fprop, dgrad and wgrad; gradients for x and w (``group_sizes`` [E] int32 gets none)."""
    spec = _spec(recipe, dtype, w)
    if w.ndim != 3 or x.ndim != 2 or x.shape[1] != w.shape[2]:
        raise ValueError(f"fp8_ragged_linear needs x [M, K] and w [E, N, K] with matching K, got x "
                         f"{tuple(x.shape)} and w {tuple(w.shape)}")
    if tuple(group_sizes.shape) != (w.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integer [E] = [{w.shape[0]}], got {group_sizes.dtype} "
                         f"{tuple(group_sizes.shape)}")
    return _fp8_ragged(x.astype(spec.dtype), w, group_sizes.astype(jnp.int32), spec)


# ---------------------------------------------------------------------------- the policy


@dataclasses.dataclass(frozen=True)
class Fp8TrainPolicy(MatmulPolicy):
    """FP8 GEMMs in training forward and backward for the linears ``layer_policy`` selects.

    Attributes:
      dtype: compute dtype ("bfloat16" or "float32") of activations and of the high-precision
        matmuls (router, lm_head, layers kept out of FP8), as ``DensePolicy``.
      recipe: the FP8 numerics (``Fp8TrainRecipe``). Its block_size must equal the layer
        policy's (the rollout's weight block).
      layer_policy: which projections / layers go FP8 (the rollout's ``LayerPolicy``).
      num_layers: decoder layers of the model; needed only for ``bf16_last_layers``.
    """

    dtype: str = "bfloat16"
    recipe: Fp8TrainRecipe = Fp8TrainRecipe()
    layer_policy: LayerPolicy = LayerPolicy()
    num_layers: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"Fp8TrainPolicy dtype must be one of {_COMPUTE_DTYPES}, got {self.dtype!r}")
        if not isinstance(self.recipe, Fp8TrainRecipe):
            raise ValueError(f"recipe must be an Fp8TrainRecipe, got {self.recipe!r}")
        if not isinstance(self.layer_policy, LayerPolicy):
            raise ValueError(f"layer_policy must be a LayerPolicy, got {self.layer_policy!r}")
        if tuple(self.layer_policy.block_size) != tuple(self.recipe.block_size):
            raise ValueError(f"recipe.block_size {self.recipe.block_size} differs from layer_policy.block_size "
                             f"{self.layer_policy.block_size}; the trainer must quantize like the rollout")
        if self.num_layers is not None and not _positive_int(self.num_layers):
            raise ValueError(f"num_layers must be a positive int or None, got {self.num_layers!r}")
        if self.num_layers is None and self.layer_policy.bf16_last_layers:
            raise ValueError("layer_policy.bf16_last_layers needs num_layers (use Fp8TrainPolicy.for_model)")

    @classmethod
    def for_model(cls, config: ModelConfig, dtype: str = "bfloat16", recipe: Fp8TrainRecipe | None = None,
                  layer_policy: LayerPolicy | None = None) -> Fp8TrainPolicy:
        """The policy for ``config``'s layer count (default recipe and layer policy when None)."""
        return cls(dtype, recipe or Fp8TrainRecipe(), layer_policy or LayerPolicy(), config.num_layers)

    @property
    def compute_dtype(self) -> Any:
        return jnp.dtype(self.dtype)

    def is_fp8(self, site: Site) -> bool:
        """Whether the matmul at ``site`` runs in FP8 under this policy."""
        if site.layer is None:
            return False
        n = self.num_layers if self.num_layers is not None else site.layer + 1
        return self.layer_policy.quantizes(site, n)

    def dot(self, x: jax.Array, w: Any, site: Site) -> jax.Array:
        if isinstance(w, QuantizedWeight):
            raise TypeError(f"Fp8TrainPolicy got a QuantizedWeight at {site}; training needs the dense master "
                            "weights (quantized weights are for the rollout's W8A8Policy)")
        if not self.is_fp8(site):
            return DensePolicy(self.dtype).dot(x, w, site)
        return fp8_linear(x, w, self.recipe, self.dtype)

    def ragged_dot(self, x: jax.Array, w: Any, group_sizes: jax.Array, site: Site) -> jax.Array:
        if isinstance(w, QuantizedWeight):
            raise TypeError(f"Fp8TrainPolicy got a QuantizedWeight at {site}; training needs the dense master "
                            "weights (quantized weights are for the rollout's W8A8Policy)")
        if not self.is_fp8(site):
            return DensePolicy(self.dtype).ragged_dot(x, w, group_sizes, site)
        return fp8_ragged_linear(x, w, group_sizes, self.recipe, self.dtype)
