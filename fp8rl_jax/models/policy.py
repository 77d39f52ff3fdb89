"""The injectable matmul policy: the one place where precision enters the model.

Every linear layer of the model (attention q/k/v/o, MLP gate/up/down, the stacked MoE experts,
the MoE router and the lm_head) calls ``policy.dot`` or ``policy.ragged_dot`` with its ``Site``
(layer index and projection). The trainer and the generator build the same model definition
with different policies, so precision is the only thing that can differ between them.

``DensePolicy`` is plain BF16/FP32 compute with float32 accumulation (HIGHEST precision for
float32, so Hopper does not fall back to TF32). ``fp8rl_jax.quant.policy.W8A8Policy`` decides by
the weight it receives: a ``QuantizedWeight`` takes the FP8 path, a dense array the dense one; the
layer policy (which projections are FP8, first/last N layers in BF16) is applied once, when
``quantize_params`` replaces the selected weights. FP8 training will subclass ``MatmulPolicy``
the same way and may use the ``Site`` to choose per layer.

Weight layout everywhere is the Hugging Face one, ``[out, in]`` (``[N, K]`` in GEMM terms);
stacked experts are ``[E, out, in]``. The activation is ``[..., in]``.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import act_quant
from pallas_kernels.fp8_grouped_gemm import grouped_gemm


class Kernels(enum.Enum):
    """Which implementation runs a matmul family that has a Pallas kernel (FP8 quantization and
    GEMMs, the generator's BF16 grouped expert GEMM)."""

    AUTO = "auto"  # Pallas on a GPU backend, the jnp reference elsewhere
    PALLAS = "pallas"  # always Pallas (interpret mode without a GPU)
    REFERENCE = "reference"  # always the jnp reference

    def pallas(self) -> bool:
        return self is Kernels.PALLAS or (self is Kernels.AUTO and jax.default_backend() == "gpu")


class Proj(enum.Enum):
    """Which projection a matmul belongs to."""

    Q = "q_proj"
    K = "k_proj"
    V = "v_proj"
    O = "o_proj"
    GATE = "gate_proj"
    UP = "up_proj"
    DOWN = "down_proj"
    EXPERT_GATE = "experts.gate_proj"
    EXPERT_UP = "experts.up_proj"
    EXPERT_DOWN = "experts.down_proj"
    ROUTER = "router"
    LM_HEAD = "lm_head"


@dataclasses.dataclass(frozen=True)
class Site:
    """Where a matmul sits: the decoder layer (None for the lm_head) and the projection."""

    layer: int | None
    proj: Proj


class Fp8Mode(enum.Enum):
    """Rollout precision modes: FP8 linears (W8A8), FP8 KV cache, both, or neither."""

    NONE = "none"
    W8A8 = "w8a8"
    KV = "kv"
    ALL = "all"

    @property
    def fp8_weights(self) -> bool:
        return self in (Fp8Mode.W8A8, Fp8Mode.ALL)

    @property
    def fp8_kv(self) -> bool:
        return self in (Fp8Mode.KV, Fp8Mode.ALL)


# Contracting the activation's last axis with the weight's last axis ([out, in] layout).
DENSE_DN = (((1,), (1,)), ((), ()))
RAGGED_DN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


class MatmulPolicy(abc.ABC):
    """How a linear layer multiplies. Implementations must be hashable (frozen dataclasses)."""

    @property
    @abc.abstractmethod
    def compute_dtype(self) -> Any:
        """Dtype of activations between layers."""

    @abc.abstractmethod
    def dot(self, x: jax.Array, w: Any, site: Site) -> jax.Array:
        """x [..., in] times w [out, in] -> [..., out] in compute_dtype."""

    @abc.abstractmethod
    def ragged_dot(self, x: jax.Array, w: Any, group_sizes: jax.Array, site: Site) -> jax.Array:
        """Grouped matmul: rows of x [M, in] sorted by group, w [E, out, in] -> [M, out].

        ``group_sizes`` [E] int32 counts the rows of each group; it sums to M.
        """

    def swiglu_dot(self, gu: jax.Array, w: Any, site: Site) -> jax.Array:
        """``dot(silu(g) * u, w)`` for ``gu = [g | u]`` [..., 2 * in], the fused gate/up GEMM's output (the
        SwiGLU MLP's down projection). A policy may fuse the activation into its input quantization."""
        g, u = jnp.split(gu, 2, axis=-1)
        return self.dot(jax.nn.silu(g) * u, w, site)

    def norm_dot(self, x: jax.Array, weight: jax.Array, eps: float, w: Any, site: Site,
                 residual: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """``h = x + residual`` (``x`` when None) and ``dot(rms_norm(h, weight, eps), w)``, returned as ``(h, y)``:
        a linear layer fed by the residual stream's RMSNorm (the generator's fused q/k/v and gate/up). A policy may
        fuse the add and the norm into its input quantization."""
        h = x if residual is None else x + residual
        return h, self.dot(rms_norm(h, weight, eps), w, site)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3's RMSNorm: ``weight * (x / sqrt(mean(x^2) + eps))``, normalized in float32, the product in x's dtype
    (`pallas_kernels.act_quant.rms_norm_reference`, the fused norm kernels' twin)."""
    return act_quant.rms_norm_reference(x, weight, eps)


def matmul_precision(dtype: Any) -> jax.lax.Precision:
    """float32 means float32: without HIGHEST, XLA on Hopper multiplies float32 in TF32 (a 6e-4 relative
    logit error against transformers' float32)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def _check_dense(w: Any, site: Site) -> None:
    if not hasattr(w, "dtype"):
        raise TypeError(f"DensePolicy got a {type(w).__name__} weight at {site}; quantized weights need an FP8 policy "
                        "(fp8rl_jax.quant.policy.W8A8Policy)")


@dataclasses.dataclass(frozen=True)
class DensePolicy(MatmulPolicy):
    """BF16 or FP32 compute, float32 accumulation, output cast back to the compute dtype.

    ``ragged_kernels``: the MoE expert matmul (``ragged_dot``) through the Pallas grouped GEMM
    (``pallas_kernels.fp8_grouped_gemm.grouped_gemm``) when it says so. Off (``REFERENCE``) by
    default: the kernel has no VJP, so only the generator turns it on (``AUTO``), where XLA's
    ``ragged_dot`` runs at ~5 TFLOP/s on Hopper against 135-145 for the grouped kernel's FP8 twin. The kernel is a custom call XLA cannot
    partition: sharded engines keep ``REFERENCE``.

    ``fused_cast``: the GEMM writes the compute dtype itself (``preferred_element_type`` = the compute
    dtype) instead of float32 that a separate convert then rounds. Accumulation stays float32 (cuBLAS and
    XLA's Triton GEMMs accumulate BF16 products in float32; on the CPU the results are the same bits), and
    the output is the same rounding of it, but XLA does not fold a cast of a float32 GEMM result into the
    GEMM's epilogue: each such cast runs as its own kernel, plus the float32 writes. The generator turns it
    on. Off by default: under ``jax.grad`` it would also make the backward GEMMs BF16 x BF16 (the float32
    cotangent meets BF16 operands, which XLA upcasts to float32 GEMMs), a change to the trainer's numerics.

    ``norm_kernels``: the residual add and RMSNorm in front of the fused q/k/v and gate/up GEMMs (`norm_dot`) as
    one Pallas kernel; off (``REFERENCE``) by default, the generator turns it on (``AUTO``)."""

    dtype: str = "bfloat16"
    ragged_kernels: Kernels = Kernels.REFERENCE
    fused_cast: bool = False
    norm_kernels: Kernels = Kernels.REFERENCE

    def __post_init__(self) -> None:
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"DensePolicy dtype must be 'bfloat16' or 'float32', got {self.dtype!r}")
        for name in ("ragged_kernels", "norm_kernels"):
            if not isinstance(getattr(self, name), Kernels):
                raise ValueError(f"DensePolicy.{name} must be a Kernels, got {getattr(self, name)!r}")

    def norm_dot(self, x: jax.Array, weight: jax.Array, eps: float, w: Any, site: Site,
                 residual: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """`MatmulPolicy.norm_dot`; with ``norm_kernels`` on, bf16 rows the kernel takes, the add and the norm run
        as one kernel (`pallas_kernels.act_quant.add_rms_norm`: the same ops, bit for bit on the CPU). Off by
        default (no VJP): the generator turns it on."""
        flat = (x.size // x.shape[-1], x.shape[-1])
        if (not self.norm_kernels.pallas() or self.dtype != "bfloat16" or x.dtype != jnp.bfloat16
                or not act_quant.supports_norm(flat)):
            return super().norm_dot(x, weight, eps, w, site, residual)
        res = None if residual is None else residual.reshape(flat)
        out = act_quant.add_rms_norm(x.reshape(flat), weight, eps, residual=res,
                                     interpret=jax.default_backend() != "gpu")
        h = x if residual is None else out[0].reshape(x.shape)
        return h, self.dot(out[-1].reshape(x.shape), w, site)

    @property
    def compute_dtype(self) -> Any:
        return jnp.dtype(self.dtype)

    @property
    def _precision(self) -> jax.lax.Precision:
        return matmul_precision(self.dtype)

    @property
    def _gemm_out(self) -> Any:
        """The dtype the GEMMs write (``fused_cast``)."""
        return self.compute_dtype if self.fused_cast else jnp.dtype(jnp.float32)

    def dot(self, x: jax.Array, w: jax.Array, site: Site) -> jax.Array:
        _check_dense(w, site)
        dt = self.compute_dtype
        lead = x.shape[:-1]
        y = jax.lax.dot_general(
            x.reshape(-1, x.shape[-1]).astype(dt), w.astype(dt), DENSE_DN, precision=self._precision,
            preferred_element_type=self._gemm_out,
        )
        return y.astype(dt).reshape(*lead, w.shape[0])

    def ragged_dot(self, x: jax.Array, w: jax.Array, group_sizes: jax.Array, site: Site) -> jax.Array:
        _check_dense(w, site)
        dt = self.compute_dtype
        if self.ragged_kernels.pallas():
            return grouped_gemm(x.astype(dt), w.astype(dt), group_sizes, out_dtype=dt,
                                interpret=jax.default_backend() != "gpu")
        y = jax.lax.ragged_dot_general(
            x.astype(dt), w.astype(dt), group_sizes, RAGGED_DN, precision=self._precision,
            preferred_element_type=self._gemm_out,
        )
        return y.astype(dt)
