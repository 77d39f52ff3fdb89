"""FP8 W8A8 precision for the one model: which layers go FP8, weight export, the matmul policy.

Recipe (the rollout side of the mission):
- Layer policy: attention q/k/v/o, MLP gate/up/down and every MoE expert projection are FP8;
  embeddings, all norms, the lm_head and the MoE router stay in the compute dtype (BF16).
  ``bf16_first_layers`` / ``bf16_last_layers`` keep the ends of the stack in BF16.
- Weights: E4M3, 128x128 blocks, float32 ``scale_inv`` (``fp8rl_jax.numerics.fp8``), quantized
  once per weight update by ``quantize_params``; the FP8 weight replaces the BF16 one in the
  params pytree (a ``QuantizedWeight`` leaf), so the generator's params carry their precision.
- Activations: quantized dynamically per token in 1x128 groups inside every FP8 matmul.
- The GEMM multiplies FP8 operands with float32 accumulation and applies both scales per
  128-wide K block; the output is the compute dtype.

``W8A8Policy`` decides by the weight it is given: a ``QuantizedWeight`` takes the FP8 path,
a plain array the dense path. The layer policy is therefore applied once, when the weights are
quantized, and trainer and generator still share one model definition.

Kernels (``Kernels``): on a GPU backend the Pallas kernels run (``pallas_kernels.fp8_quant``,
bit-identical to the reference evaluated on the CPU; the GEMM is ``pallas_kernels.fp8_gemm_mgpu``
(TMA + wgmma, Mosaic GPU) where the shape allows (K a multiple of 128, N of its 128-wide CTA tile:
every Qwen3 projection) and ``pallas_kernels.fp8_gemm`` (Triton lowering, masked edges) otherwise,
or cuBLASLt's block-scaled FP8 GEMM (``fp8rl_jax.quant.cublaslt``) with ``gemm=GemmBackend.CUBLASLT`` or
``FP8RL_FP8_GEMM=cublaslt``), or the Triton kernel with split-K at decode sizes with ``GemmBackend.TRITON``
(`triton_config`); elsewhere the jnp reference. (On XLA:GPU the reference's ``amax / 448`` compiles to a multiply by the
reciprocal, one ulp low on about half the scales; the kernel divides exactly, one more reason GPU quantization goes
through it.)
The reference GEMM dequantizes both operands and multiplies in float32 (HIGHEST): the same
math as the kernel's per-K-block promotion, summed in another order, without the kernel
reference's [K/128, M, N] intermediate. MoE experts run ``pallas_kernels.fp8_grouped_gemm``
(Triton) under the same condition, and the reference grouped path elsewhere. ``Kernels.PALLAS`` forces the kernels (interpret mode off the GPU: tests).

Tensor parallelism (``W8A8Policy.sharding``, a static ``WeightSharding``): XLA's partitioner cannot
split a ``pallas_call`` (an opaque custom call to it), so under a sharded jit it gathers every
operand and runs the kernel replicated: each device would all-gather the full FP8 weights (and
their scales) and multiply all of them at every step. With ``sharding`` set, the GEMMs run per
shard under ``shard_map`` following the weight's spec: column-parallel (weight split on N) takes
the activations replicated and returns its N shard; row-parallel (weight split on K, in whole FP8
blocks, so every activation group lies in one shard) takes the activations split on K, multiplies
into float32 and sums the partials over the mesh axis (one all-reduce) before the cast to the
compute dtype, as the reference path does. Activation quantization runs inside, per shard
(bitwise the unsharded groups). The jnp reference needs none of this: XLA partitions it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.policy import DENSE_DN, RAGGED_DN, DensePolicy, Kernels, MatmulPolicy, Proj, Site
from fp8rl_jax.models.fusion import FusedWeight, concat_parts
from fp8rl_jax.quant import cublaslt
from fp8rl_jax.numerics.fp8 import (QuantizedWeight, dequantize_activations, quantize_activations,
                                 quantize_activations_t, quantize_weight_blockwise)
from pallas_kernels import act_quant
from pallas_kernels import fp8_gemm as gemm_kernel
from pallas_kernels import fp8_gemm_mgpu as mgpu_kernel
from pallas_kernels import fp8_grouped_gemm as grouped_gemm_kernel
from pallas_kernels import fp8_quant as quant_kernel
from pallas_kernels.common import device_kind, m_bucket, tuning_entries

FP8_PROJS = frozenset({Proj.Q, Proj.K, Proj.V, Proj.O, Proj.GATE, Proj.UP, Proj.DOWN,
                       Proj.EXPERT_GATE, Proj.EXPERT_UP, Proj.EXPERT_DOWN})
_PROJ_BY_NAME = {p.value: p for p in Proj if "." not in p.value}
_EXPERT_PROJ = {"gate_proj": Proj.EXPERT_GATE, "up_proj": Proj.EXPERT_UP, "down_proj": Proj.EXPERT_DOWN}


_KERNEL_BLOCK = (quant_kernel.QBLOCK, quant_kernel.QBLOCK)


@dataclasses.dataclass(frozen=True)
class LayerPolicy:
    """Which matmuls run in FP8.

    Attributes:
      projs: the projections quantized (default: attention, MLP and experts; never the router
        or the lm_head, which stay BF16 for accuracy).
      bf16_first_layers: keep the first N decoder layers entirely in BF16.
      bf16_last_layers: keep the last N decoder layers entirely in BF16.
      block_size: the weight block (rows, cols).
    """

    projs: frozenset[Proj] = FP8_PROJS
    bf16_first_layers: int = 0
    bf16_last_layers: int = 0
    block_size: tuple[int, int] = (128, 128)

    def __post_init__(self) -> None:
        if self.bf16_first_layers < 0 or self.bf16_last_layers < 0:
            raise ValueError("bf16_first_layers and bf16_last_layers must be >= 0")
        bad = {Proj.ROUTER, Proj.LM_HEAD} & set(self.projs)
        if bad:
            raise ValueError(f"{sorted(p.value for p in bad)} must stay BF16 (router and lm_head are not quantized)")

    def quantizes(self, site: Site | None, num_layers: int) -> bool:
        if site is None or site.proj not in self.projs or site.layer is None:
            return False
        return self.bf16_first_layers <= site.layer < num_layers - self.bf16_last_layers


def site_of(path: tuple) -> Site | None:
    """The matmul site of a parameter path, or None for parameters that are not matmul weights."""
    if path[0] == "lm_head":
        return Site(None, Proj.LM_HEAD)
    if path[0] != "layers":
        return None
    layer = int(path[1])
    if path[-2] == "experts":
        return Site(layer, _EXPERT_PROJ[path[-1]])
    if path[-2] == "gate" and path[-3] == "mlp":
        return Site(layer, Proj.ROUTER)
    proj = _PROJ_BY_NAME.get(path[-2])
    return None if proj is None else Site(layer, proj)


def quantize_weight(w: jax.Array, block_size: tuple[int, int] = (128, 128), kernels: Kernels = Kernels.AUTO
                    ) -> QuantizedWeight:
    """E4M3 block quantization of one weight [N, K] or [E, N, K] through the chosen kernels."""
    if kernels.pallas() and tuple(block_size) == _KERNEL_BLOCK and jnp.dtype(w.dtype) in (jnp.bfloat16, jnp.float32):
        q, scale_inv = quant_kernel.quantize_weight(w, interpret=jax.default_backend() != "gpu")
        return QuantizedWeight(q, scale_inv, _KERNEL_BLOCK)
    return quantize_weight_blockwise(w, block_size)


def quantize_params(params: nnx.State, config: ModelConfig, layer_policy: LayerPolicy = LayerPolicy(),
                    kernels: Kernels = Kernels.AUTO) -> nnx.State:
    """Replaces the weights the layer policy selects by ``QuantizedWeight`` (jit-friendly). Weights
    already quantized, fused (`FusedWeight`: built quantized or kept dense by `quantizing_concat`) or
    fused away (empty placeholders) stay as they are."""
    out = []
    for path, var in nnx.to_flat_state(params):
        w = var.get_value()
        done = isinstance(w, (QuantizedWeight, FusedWeight)) or getattr(w, "size", 1) == 0
        if not done and layer_policy.quantizes(site_of(tuple(path)), config.num_layers):
            w = quantize_weight(w, layer_policy.block_size, kernels)
        out.append((path, var.replace(w)))
    return nnx.from_flat_state(out)


def quantize_weight_concat(parts: list, block_size: tuple[int, int] = (128, 128), kernels: Kernels = Kernels.AUTO
                           ) -> QuantizedWeight:
    """`quantize_weight` of ``parts`` ([N_i, K] each, or stacked experts [E, N_i, K]; every N_i a multiple
    of the block rows) concatenated on the output axis (-2). The Pallas path quantizes each [N_i, K] part
    straight into its rows of one buffer (`pallas_kernels.fp8_quant.quantize_weight_concat`); stacked
    experts are quantized part by part and concatenated (each expert's rows are not contiguous in the
    fused buffer). The result equals quantizing the parts and concatenating."""
    if (parts[0].ndim == 2 and kernels.pallas() and tuple(block_size) == _KERNEL_BLOCK
            and all(jnp.dtype(p.dtype) in (jnp.bfloat16, jnp.float32) for p in parts)):
        q, scale_inv = quant_kernel.quantize_weight_concat(parts, interpret=jax.default_backend() != "gpu")
        return QuantizedWeight(q, scale_inv, _KERNEL_BLOCK)
    qs = [quantize_weight(p, block_size, kernels) for p in parts]
    return QuantizedWeight(jnp.concatenate([q.q for q in qs], axis=-2),
                           jnp.concatenate([q.scale_inv for q in qs], axis=-2), tuple(block_size))


def quantizing_concat(parts: list, paths: list, config: ModelConfig, layer_policy: LayerPolicy = LayerPolicy(),
                      kernels: Kernels = Kernels.AUTO) -> Any:
    """A ``concat`` for `fp8rl_jax.models.fusion.fuse_params` on dense params, giving what
    ``fuse_params(quantize_params(params))`` gives without quantizing part by part and copying the parts
    into place: quantized into one buffer where the layer policy quantizes every part, the dense
    concatenation where it quantizes none, None (parts kept apart, quantized separately by
    `quantize_params`) where it quantizes some, or where fusion would refuse the quantized parts."""
    flags = [layer_policy.quantizes(site_of(tuple(p)), config.num_layers) for p in paths]
    if not any(flags):
        return concat_parts(parts)
    bn = layer_policy.block_size[0]
    if (not all(flags) or any(isinstance(p, (QuantizedWeight, FusedWeight)) for p in parts)
            or len({p.ndim for p in parts}) != 1 or parts[0].ndim not in (2, 3)
            or any(p.shape[-2] % bn for p in parts) or len({(*p.shape[:-2], p.shape[-1]) for p in parts}) != 1
            or len({jnp.dtype(p.dtype) for p in parts}) != 1):
        return None
    return quantize_weight_concat(parts, layer_policy.block_size, kernels)


def dequantize_params(params: nnx.State, dtype: Any = jnp.bfloat16) -> nnx.State:
    """Every ``QuantizedWeight`` back to a dense array of ``dtype``."""
    out = []
    for path, var in nnx.to_flat_state(params):
        w = var.get_value()
        out.append((path, var.replace(w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w)))
    return nnx.from_flat_state(out)


def w8a8_matmul_reference(xq: jax.Array, xs: jax.Array, w: QuantizedWeight, group_size: int) -> jax.Array:
    """float32 [M, N] = dequant(xq, xs) @ dequant(w).T: the FP8 GEMM's math in plain jnp
    (memory-light order; ``pallas_kernels.fp8_gemm.fp8_gemm_reference`` follows the kernel's)."""
    a = dequantize_activations(xq, xs, group_size, dtype=jnp.float32)
    return jax.lax.dot_general(a, w.dequantize(jnp.float32), DENSE_DN,
                               precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class WeightSharding:
    """Where the FP8 weights live on a mesh: the ``PartitionSpec`` of each quantized site's weight
    (``q`` and ``scale_inv`` share it). Hashable: a static field of the policy."""

    mesh: Mesh
    specs: tuple[tuple[Site, P], ...]

    @classmethod
    def of_params(cls, params: nnx.State, mesh: Mesh) -> WeightSharding:
        """The specs of the ``QuantizedWeight``s of ``params`` as they are placed on ``mesh``."""
        specs = []
        for path, var in nnx.to_flat_state(params):
            w = var.get_value()
            site = site_of(tuple(path))
            if isinstance(w, QuantizedWeight) and site is not None and isinstance(w.q.sharding, jax.NamedSharding):
                specs.append((site, P(*w.q.sharding.spec)))
        return cls(mesh, tuple(specs))

    def split(self, site: Site, ndim: int) -> tuple[Any, Any] | None:
        """(N axis, K axis) of the weight at ``site`` ([..., N, K], ``ndim`` dims) when it is split
        over the mesh on those dims only; None when it is replicated (or split on a leading dim)."""
        spec = dict(self.specs).get(site)
        if spec is None:
            return None
        spec = tuple(spec) + (None,) * (ndim - len(spec))
        if any(a is not None for a in spec[:-2]) or all(a is None for a in spec[-2:]):
            return None
        return spec[-2], spec[-1]


class GemmBackend(enum.Enum):
    """Which GPU GEMM runs a dense W8A8 matmul when the kernels run (``Kernels.pallas()``)."""

    AUTO = "auto"  # FP8RL_FP8_GEMM, else the measured table's choice for the shape or the device kind, else MOSAIC
    MOSAIC = "mosaic"  # pallas_kernels.fp8_gemm_mgpu where the shape allows, the Triton fp8_gemm elsewhere
    CUBLASLT = "cublaslt"  # fp8rl_jax.quant.cublaslt (cuBLAS's block-scaled FP8) where the shape allows
    TRITON = "triton"  # pallas_kernels.fp8_gemm with `triton_config`: split-K at decode-sized M. AUTO runs the shapes
    # its measured table (`TRITON_GEMM_TABLE`) has it winning

    def resolve(self, m: int | None = None, n: int | None = None, k: int | None = None) -> GemmBackend:
        """The backend for an ``[M, K] x [N, K]^T`` GEMM: this one unless AUTO; for AUTO the
        ``FP8RL_FP8_GEMM`` variable, else TRITON where its measured table (`TRITON_GEMM_TABLE`) found it faster
        than cuBLASLt on this device kind at this (M bucket, N, K), else the faster of Mosaic and cuBLASLt as
        measured there (`GEMM_BACKEND_TABLE`, written by ``python -m experiments.bench gemm --backend-table-out``),
        else the table's default for the device kind (chosen from end-to-end rollouts, with the measurement
        named in the table), else MOSAIC."""
        if self is not GemmBackend.AUTO:
            return self
        env = os.environ.get("FP8RL_FP8_GEMM", "").strip().lower()
        if env not in ("", "auto"):
            try:
                return GemmBackend(env)
            except ValueError:
                raise ValueError(f"FP8RL_FP8_GEMM must be one of auto, mosaic, cublaslt, triton; got {env!r}") from None
        if m is not None and n is not None and k is not None:
            tuned = _measured_triton(device_kind()).get((m_bucket(m), n, k))
            if tuned is not None and tuned[1]:
                return GemmBackend.TRITON
            chosen = _measured_backends(device_kind()).get((m_bucket(m), n, k))
            if chosen is not None:
                return chosen
        return _default_backend(device_kind())

    def describe(self) -> str:
        """What a benchmark records: the explicit or ``FP8RL_FP8_GEMM`` choice, else "auto" (per shape)."""
        env = os.environ.get("FP8RL_FP8_GEMM", "").strip().lower()
        return self.value if self is not GemmBackend.AUTO else (env if env not in ("", "auto") else "auto")


def _interpret() -> bool:
    """Pallas kernels run in interpret mode off the GPU."""
    return jax.default_backend() != "gpu"


# Measured per device kind (``python -m experiments.bench decode_gemms --triton --triton-table-out``): per (M bucket, N, K)
# the fastest Triton config of `pallas_kernels.fp8_gemm.DECODE_CONFIGS`, its GPU time and cuBLASLt's, and the backend
# that won ("triton" where it beat cuBLASLt by the bench's margin: `GemmBackend.AUTO` then runs the shape on it).
TRITON_GEMM_TABLE = Path(__file__).with_name("fp8_gemm_triton.json")


@functools.cache
def _measured_triton(kind: str) -> dict[tuple[int, int, int], tuple[gemm_kernel.GemmConfig, bool]]:
    return {(int(e["m_bucket"]), int(e["n"]), int(e["k"])): (gemm_kernel.GemmConfig(**e["config"]),
                                                             e["backend"] == GemmBackend.TRITON.value)
            for e in tuning_entries(TRITON_GEMM_TABLE, kind)}


def triton_config(m: int, n: int | None = None, k: int | None = None) -> gemm_kernel.GemmConfig:
    """The Triton GEMM's tiling for ``GemmBackend.TRITON`` at an ``[M, K] x [N, K]^T`` GEMM: the measured table's
    (`TRITON_GEMM_TABLE`) for this device kind and (M bucket, N, K) where it has one, else one of
    `pallas_kernels.fp8_gemm.DECODE_CONFIGS` by M up to 256 rows, else its default tiling. Up to 64 rows: 64 x 64
    with the weight's rows on the wgmma's M side, scales prefetched, K split in 2 (the pattern of every 64-row win
    over cuBLASLt); up to 256: 64-wide N tiles, M in one or two tiles, K split so the programs fill the SMs
    (Qwen3-8B's o_proj at 128 rows runs 64 x 4 programs)."""
    if n is not None and k is not None:
        tuned = _measured_triton(device_kind()).get((m_bucket(m), n, k))
        if tuned is not None:
            return tuned[0]
    if m <= 64:  # the winner's pattern at 64 rows: weight rows on the wgmma's M side
        return gemm_kernel.GemmConfig(64, 64, 4, 4, k_splits=2, swap_ab=True, prefetch_scales=True)
    if m <= 128:
        return gemm_kernel.GemmConfig(128, 64, 4, 4, k_splits=4)
    if m <= 256:  # the fastest at 256 rows on 3 of the 4 Qwen3-8B shapes
        return gemm_kernel.GemmConfig(128, 64, 4, 4, k_splits=2)
    return gemm_kernel.DEFAULT_CONFIG


def use_cublaslt(gemm: GemmBackend, m: int, n: int, k: int, out_dtype: Any) -> bool:
    """Whether an ``[M, K] x [N, K]^T`` FP8 GEMM goes to cuBLASLt on this GPU: ``gemm`` resolves to it for
    the shape and cuBLASLt takes the shape. Raises where cuBLASLt was asked for by name (the field or
    ``FP8RL_FP8_GEMM``) and cannot run here; the measured table's choice falls back quietly."""
    if gemm.resolve(m, n, k) is not GemmBackend.CUBLASLT:
        return False
    ok, why = cublaslt.available()
    if not ok:
        if gemm.describe() == GemmBackend.CUBLASLT.value:
            raise RuntimeError(f"the FP8 GEMM is set to cuBLASLt, which cannot run here: {why}")
        return False
    return cublaslt.supports(n, k, out_dtype)


# Measured per device kind (``python -m experiments.bench gemm --backend-table-out``): the faster dense FP8 GEMM
# (Mosaic kernel or cuBLASLt) per (M bucket, N, K); `GemmBackend.AUTO` follows it.
GEMM_BACKEND_TABLE = Path(__file__).with_name("fp8_gemm_backends.json")


@functools.cache
def _measured_backends(kind: str) -> dict[tuple[int, int, int], GemmBackend]:
    return {(int(e["m_bucket"]), int(e["n"]), int(e["k"])): GemmBackend(e["backend"])
            for e in tuning_entries(GEMM_BACKEND_TABLE, kind)}


def backend_defaults(path: Path | None = None) -> list[dict]:
    """The table's (`GEMM_BACKEND_TABLE` unless ``path``) per-device-kind defaults (``{"device_kind",
    "backend", "evidence"}``): the backend for the shapes it has no entry for, chosen from a measured
    end-to-end rollout."""
    path = GEMM_BACKEND_TABLE if path is None else path
    if not path.exists():
        return []
    return list(json.loads(path.read_text()).get("defaults", []))


# Measured per device kind (``python -m experiments.bench cublaslt_tune``): per (M bucket, N, K) the cuBLASLt algorithm
# (index in its heuristic list, K splits pinned or 0) that ran the block-scaled GEMM fastest (`cublaslt.list_algos`).
CUBLASLT_ALGO_TABLE = Path(__file__).with_name("cublaslt_algos.json")


@functools.cache
def _measured_cublaslt_algos(kind: str) -> dict[tuple[int, int, int], tuple[int, int]]:
    return {(int(e["m_bucket"]), int(e["n"]), int(e["k"])): (int(e["algo"]), int(e["split_k"]))
            for e in tuning_entries(CUBLASLT_ALGO_TABLE, kind, required=False)}


def cublaslt_algo(m: int, n: int, k: int) -> tuple[int, int]:
    """The cuBLASLt algorithm an ``[M, K] x [N, K]^T`` W8A8 GEMM runs (`fp8rl_jax.quant.cublaslt`'s ``algo``): the
    measured table's (`CUBLASLT_ALGO_TABLE`) for this device kind and (M bucket, N, K), else cuBLASLt's heuristic
    choice; ``FP8RL_CUBLASLT_ALGO=heuristic`` ignores the table (the A/B switch)."""
    env = os.environ.get("FP8RL_CUBLASLT_ALGO", "table").strip().lower()
    if env not in ("table", "heuristic"):
        raise ValueError(f"FP8RL_CUBLASLT_ALGO must be table or heuristic; got {env!r}")
    if env == "heuristic":
        return cublaslt.DEFAULT_ALGO
    return _measured_cublaslt_algos(device_kind()).get((m_bucket(m), n, k), cublaslt.DEFAULT_ALGO)


def describe_cublaslt_algos() -> dict:
    """What a benchmark records of the cuBLASLt algorithm choice (`cublaslt_algo`): ``FP8RL_CUBLASLT_ALGO`` and
    the table's entries for this device kind as ``{"m_bucket x n x k": [algo, split_k]}``."""
    mode = os.environ.get("FP8RL_CUBLASLT_ALGO", "table").strip().lower()
    entries = {} if mode == "heuristic" else _measured_cublaslt_algos(device_kind())
    return {"mode": mode, "entries": {f"{m}x{n}x{k}": list(v) for (m, n, k), v in sorted(entries.items())}}


@functools.cache
def _default_backend(kind: str) -> GemmBackend:
    for d in backend_defaults():
        if d.get("device_kind") == kind:
            return GemmBackend(d["backend"])
    return GemmBackend.MOSAIC


@dataclasses.dataclass(frozen=True)
class W8A8Policy(MatmulPolicy):
    """FP8 weights x dynamically quantized FP8 activations; dense weights take the dense path."""

    dtype: str = "bfloat16"
    group_size: int = 128
    kernels: Kernels = Kernels.AUTO
    sharding: WeightSharding | None = None  # tensor parallelism: run the Pallas GEMMs per shard
    gemm: GemmBackend = GemmBackend.AUTO  # the dense FP8 GEMM on the GPU (resolved at trace time)
    fused_cast: bool = False  # the dense (BF16) sites' GEMMs write the compute dtype (`DensePolicy.fused_cast`)

    @property
    def compute_dtype(self) -> Any:
        return jnp.dtype(self.dtype)

    @property
    def _dense(self) -> DensePolicy:
        return DensePolicy(self.dtype, fused_cast=self.fused_cast)

    def _per_shard(self, fn, site: Site, w: QuantizedWeight, x: jax.Array, *replicated: jax.Array) -> jax.Array:
        """``fn(x, q, scale_inv, *replicated, out_dtype)`` -> [M, N]: a Pallas GEMM, run per shard of
        ``w`` under ``shard_map`` when ``sharding`` splits it (module note), else as it is."""
        split = None if self.sharding is None else self.sharding.split(site, w.q.ndim)
        if split is None:
            return fn(x, w.q, w.scale_inv, *replicated, out_dtype=self.compute_dtype)
        n_ax, k_ax = split
        lead = (None,) * (w.q.ndim - 2)

        def local(x, q, s, *rest):
            if k_ax is None:
                return fn(x, q, s, *rest, out_dtype=self.compute_dtype)
            y = fn(x, q, s, *rest, out_dtype=jnp.float32)  # partial sums over this K shard
            return jax.lax.psum(y, k_ax).astype(self.compute_dtype)

        w_spec = P(*lead, n_ax, k_ax)
        return jax.shard_map(local, mesh=self.sharding.mesh,
                             in_specs=(P(None, k_ax), w_spec, w_spec) + (P(),) * len(replicated),
                             out_specs=P(None, n_ax), check_vma=False)(x, w.q, w.scale_inv, *replicated)

    def _kernels_for(self, w: QuantizedWeight) -> bool:
        return self.kernels.pallas() and self.group_size == _KERNEL_BLOCK[1] and w.block_size == _KERNEL_BLOCK

    def _kernel_gemm(self, quantize: Any) -> Any:
        """The kernels' GEMM ``gemm(x, q, scale_inv, out_dtype)`` of activations ``x`` that ``quantize(x,
        scales_t)`` turns into FP8 codes and 1x128 scales (``[K/128, M]`` when ``scales_t``, cuBLASLt's order,
        else ``[M, K/128]``); K is the weight's."""
        def gemm(x, q, s, out_dtype):
            t = self._scales_t(x.shape[0], *q.shape, out_dtype)
            return self._quantized_gemm(*quantize(x, t), t, q, s, out_dtype)

        return gemm

    def _scales_t(self, m: int, n: int, k: int, out_dtype: Any) -> bool:
        """Whether the kernels' GEMM of ``[M, K] x [N, K]^T`` reads the activation scales ``[K/128, M]``
        (cuBLASLt, and the Triton kernel, which reads them so: no transpose kernel before it) rather than
        ``[M, K/128]`` (the Mosaic GEMM)."""
        if jax.default_backend() != "gpu":
            return False
        return self.gemm.resolve(m, n, k) is GemmBackend.TRITON or use_cublaslt(self.gemm, m, n, k, out_dtype)

    def _quantized_gemm(self, xq, xs, scales_t: bool, q, s, out_dtype):
        """The kernels' GEMM of quantized activations (scales in the order `_scales_t` chose) and an FP8 weight."""
        interpret = _interpret()
        m, (n, k) = xq.shape[0], q.shape
        if self.gemm.resolve(m, n, k) is GemmBackend.TRITON:
            return gemm_kernel.fp8_gemm(xq, xs, q, s, out_dtype=out_dtype, config=triton_config(m, n, k),
                                        interpret=interpret, a_scale_t=scales_t)
        if scales_t:
            return cublaslt.fp8_gemm_cublaslt_t(xq, xs, q, s, out_dtype=out_dtype,
                                                algo=cublaslt_algo(xq.shape[0], *q.shape))
        if mgpu_kernel.supports(m, n, k):  # TMA + wgmma: 2-3x the Triton kernel on Hopper
            return mgpu_kernel.fp8_gemm_mgpu(xq, xs, q, s, out_dtype=out_dtype, interpret=interpret)
        return gemm_kernel.fp8_gemm(xq, xs, q, s, out_dtype=out_dtype, interpret=interpret)  # any N, K

    def _one_pass(self, w: Any, x: jax.Array, fits: Any) -> bool:
        """Whether a one-pass `pallas_kernels.act_quant` kernel quantizes the activation ``x`` (2-D) of the FP8
        weight ``w``: the kernels on, no sharding, bf16 ``x`` of a shape ``fits`` takes."""
        return (isinstance(w, QuantizedWeight) and self._kernels_for(w) and self.sharding is None
                and jnp.dtype(x.dtype) == jnp.dtype(jnp.bfloat16) and fits(tuple(x.shape)))

    def dot(self, x: jax.Array, w: Any, site: Site) -> jax.Array:
        if not isinstance(w, QuantizedWeight):
            return self._dense.dot(x, w, site)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self._kernels_for(w):
            gs = self.group_size
            if self._one_pass(w, x2, act_quant.supports_plain):  # one kernel where XLA ran three (act_quant's note)
                quantize = lambda x, t: act_quant.quantize_1x128(x, scales_t=t, interpret=_interpret())  # noqa: E731
            else:
                quantize = lambda x, t: quantize_activations_t(x, gs) if t else quantize_activations(x, gs)  # noqa: E731
            y = self._per_shard(self._kernel_gemm(quantize), site, w, x2)
        else:
            xq, xs = quantize_activations(x2, self.group_size)
            y = w8a8_matmul_reference(xq, xs, w, self.group_size)
        return y.astype(self.compute_dtype).reshape(*lead, w.shape[0])

    def swiglu_dot(self, gu: jax.Array, w: Any, site: Site) -> jax.Array:
        """With the kernels, an unsharded FP8 weight and bf16 ``gu``: ``silu(g) * u`` and its quantization in
        one kernel (`pallas_kernels.act_quant.silu_mul_quant`, the same codes and scales as the composition
        up to the GPU's exponential: its note), then the GEMM ``dot`` runs; else ``dot``'s path."""
        lead = gu.shape[:-1]
        gu2 = gu.reshape(-1, gu.shape[-1])
        if not self._one_pass(w, gu2, act_quant.supports):
            return super().swiglu_dot(gu, w, site)
        quantize = lambda x, t: act_quant.silu_mul_quant(x, scales_t=t, interpret=_interpret())  # noqa: E731
        y = self._kernel_gemm(quantize)(gu2, w.q, w.scale_inv, out_dtype=self.compute_dtype)
        return y.astype(self.compute_dtype).reshape(*lead, w.shape[0])

    def norm_dot(self, x: jax.Array, weight: jax.Array, eps: float, w: Any, site: Site,
                 residual: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """With the kernels, an unsharded FP8 weight and bf16 ``x`` of a power-of-two width: the residual add, the
        RMSNorm and the quantization in one kernel (`pallas_kernels.act_quant.add_rms_norm_quant`; the
        composition's codes up to the GPU's ``rsqrt``: its note), then the GEMM ``dot`` runs; else the
        composition (`MatmulPolicy.norm_dot`)."""
        lead, d = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, d)
        if (not self._one_pass(w, x2, act_quant.supports_norm)
                or (residual is not None and (jnp.dtype(residual.dtype) != jnp.dtype(x.dtype)
                                              or residual.shape != x.shape))):
            return super().norm_dot(x, weight, eps, w, site, residual)
        r2 = None if residual is None else residual.reshape(-1, d)
        t = self._scales_t(x2.shape[0], *w.q.shape, self.compute_dtype)
        out = act_quant.add_rms_norm_quant(x2, weight, eps, residual=r2, scales_t=t, interpret=_interpret())
        h = x if r2 is None else out[0].reshape(x.shape)
        y = self._quantized_gemm(*out[-2:], t, w.q, w.scale_inv, self.compute_dtype)
        return h, y.astype(self.compute_dtype).reshape(*lead, w.shape[0])

    def ragged_dot(self, x: jax.Array, w: Any, group_sizes: jax.Array, site: Site) -> jax.Array:
        if not isinstance(w, QuantizedWeight):
            return self._dense.ragged_dot(x, w, group_sizes, site)
        if (self.kernels.pallas() and self.group_size == _KERNEL_BLOCK[1] and w.block_size == _KERNEL_BLOCK
                and jnp.dtype(w.q.dtype) == jnp.dtype(jnp.float8_e4m3fn)):
            def gemm(x, q, s, group_sizes, out_dtype):
                xq, xs_t = quantize_activations_t(x, self.group_size)  # scales in the kernel's [K/128, M] order
                config = grouped_gemm_kernel.default_config(x.shape[0], *q.shape[1:])  # measured per shape
                return grouped_gemm_kernel.fp8_grouped_gemm(xq, xs_t, q, s, group_sizes, out_dtype=out_dtype,
                                                            config=config, interpret=jax.default_backend() != "gpu",
                                                            a_scale_t=True)

            return self._per_shard(gemm, site, w, x, group_sizes)
        xq, xs = quantize_activations(x, self.group_size)
        a = dequantize_activations(xq, xs, self.group_size, dtype=jnp.float32)
        y = jax.lax.ragged_dot_general(a, w.dequantize(jnp.float32), group_sizes, RAGGED_DN,
                                       precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return y.astype(self.compute_dtype)
