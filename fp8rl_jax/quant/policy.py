"""FP8 W8A8 precision for the one model: which layers go FP8, weight export, the matmul policy.

Recipe (the rollout side of the mission):
- Layer policy: attention q/k/v/o, MLP gate/up/down and every MoE expert projection are FP8;
  embeddings, all norms, the lm_head and the MoE router stay in the compute dtype (BF16).
  ``bf16_first_layers`` / ``bf16_last_layers`` keep the ends of the stack in BF16.
- Weights: E4M3, 128x128 blocks, float32 ``scale_inv`` (``fp8rl_jax.quant.fp8``), quantized
  once per weight update by ``quantize_params``; the FP8 weight replaces the BF16 one in the
  params pytree (a ``QuantizedWeight`` leaf), so the generator's params carry their precision.
- Activations: quantized dynamically per token in 1x128 groups inside every FP8 matmul.
- The GEMM multiplies FP8 operands with float32 accumulation and applies both scales per
  128-wide K block; the output is the compute dtype.

``W8A8Policy`` decides by the weight it is given: a ``QuantizedWeight`` takes the FP8 path,
a plain array the dense path. The layer policy is therefore applied once, when the weights are
quantized, and trainer and generator still share one model definition.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.policy import DENSE_DN, RAGGED_DN, DensePolicy, MatmulPolicy, Proj, Site
from fp8rl_jax.quant.fp8 import (QuantizedWeight, dequantize_activations, quantize_activations,
                                 quantize_weight_blockwise)

FP8_PROJS = frozenset({Proj.Q, Proj.K, Proj.V, Proj.O, Proj.GATE, Proj.UP, Proj.DOWN,
                       Proj.EXPERT_GATE, Proj.EXPERT_UP, Proj.EXPERT_DOWN})
_PROJ_BY_NAME = {p.value: p for p in Proj if "." not in p.value}
_EXPERT_PROJ = {"gate_proj": Proj.EXPERT_GATE, "up_proj": Proj.EXPERT_UP, "down_proj": Proj.EXPERT_DOWN}


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


def quantize_params(params: nnx.State, config: ModelConfig, layer_policy: LayerPolicy = LayerPolicy()) -> nnx.State:
    """Replaces the weights the layer policy selects by ``QuantizedWeight`` (jit-friendly)."""
    out = []
    for path, var in nnx.to_flat_state(params):
        w = var.get_value()
        if not isinstance(w, QuantizedWeight) and layer_policy.quantizes(site_of(tuple(path)), config.num_layers):
            w = quantize_weight_blockwise(w, layer_policy.block_size)
        out.append((path, var.replace(w)))
    return nnx.from_flat_state(out)


def dequantize_params(params: nnx.State, dtype: Any = jnp.bfloat16) -> nnx.State:
    """Every ``QuantizedWeight`` back to a dense array of ``dtype``."""
    out = []
    for path, var in nnx.to_flat_state(params):
        w = var.get_value()
        out.append((path, var.replace(w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w)))
    return nnx.from_flat_state(out)


def w8a8_matmul_reference(xq: jax.Array, xs: jax.Array, w: QuantizedWeight, group_size: int) -> jax.Array:
    """float32 [M, N] = dequant(xq, xs) @ dequant(w).T: the FP8 GEMM's math in plain jnp."""
    a = dequantize_activations(xq, xs, group_size, dtype=jnp.float32)
    return jax.lax.dot_general(a, w.dequantize(jnp.float32), DENSE_DN,
                               precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class W8A8Policy(MatmulPolicy):
    """FP8 weights x dynamically quantized FP8 activations; dense weights take the dense path."""

    dtype: str = "bfloat16"
    group_size: int = 128

    @property
    def compute_dtype(self) -> Any:
        return jnp.dtype(self.dtype)

    @property
    def _dense(self) -> DensePolicy:
        return DensePolicy(self.dtype)

    def dot(self, x: jax.Array, w: Any, site: Site) -> jax.Array:
        if not isinstance(w, QuantizedWeight):
            return self._dense.dot(x, w, site)
        lead = x.shape[:-1]
        xq, xs = quantize_activations(x.reshape(-1, x.shape[-1]), self.group_size)
        y = w8a8_matmul_reference(xq, xs, w, self.group_size)
        return y.astype(self.compute_dtype).reshape(*lead, w.shape[0])

    def ragged_dot(self, x: jax.Array, w: Any, group_sizes: jax.Array, site: Site) -> jax.Array:
        if not isinstance(w, QuantizedWeight):
            return self._dense.ragged_dot(x, w, group_sizes, site)
        xq, xs = quantize_activations(x, self.group_size)
        a = dequantize_activations(xq, xs, self.group_size, dtype=jnp.float32)
        y = jax.lax.ragged_dot_general(a, w.dequantize(jnp.float32), group_sizes, RAGGED_DN,
                                       precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return y.astype(self.compute_dtype)
