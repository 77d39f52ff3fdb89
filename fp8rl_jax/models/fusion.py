"""Fused projections for the generator: q/k/v as one GEMM, MLP gate/up as one GEMM (the MoE experts'
stacked gate/up as one grouped GEMM).

At decode sizes (M = a few hundred rows) the separate k and v projections (N = 1024 for Qwen3-8B)
give a GEMM only a few dozen output tiles for 132 SMs, and each projection quantizes the same
activations again. ``fuse_params`` stores the generator's weights concatenated on the output axis,
``[q; k; v]`` in ``q_proj.weight`` and ``[gate; up]`` in ``gate_proj.weight`` (experts: ``[E, 2I, D]`` in
``experts.gate_proj``, each expert's gate rows then its up rows), as a ``FusedWeight``
(the concatenated weight, dense or ``QuantizedWeight``, and the static part sizes); the weights
fused away become empty placeholders. The model (``qwen3.Attention`` / ``MLP``) sees a
``FusedWeight`` and runs one ``policy.dot`` whose output it splits, so it stays one definition:
this is a layout of the params, which the generator picks (``EngineConfig.fuse_projections``).
Row-wise, the fused GEMM computes exactly the separate ones (the same K reduction per output
column); quantized parts concatenate only when each part's rows are whole weight blocks, so the
``scale_inv`` rows concatenate with them.

Not for the trainer (gradients want the HF layout) nor a sharded generator (tensor parallelism
splits q, k and v by heads, not the concatenation evenly).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fp8rl_jax.numerics.fp8 import QuantizedWeight

# (module path in a layer, parts, leaf under each part): the parts' weights are concatenated on their
# output axis (-2: rows of a [N, K] weight, or of every expert of a stacked [E, N, K] one).
FUSED_GROUPS = ((("self_attn",), ("q_proj", "k_proj", "v_proj"), ("weight",)),
                (("mlp",), ("gate_proj", "up_proj"), ("weight",)),
                (("mlp", "experts"), ("gate_proj", "up_proj"), ()))


@flax.struct.dataclass
class FusedWeight:
    """Weights concatenated on the output axis: ``w`` [sum(sizes), in] (an array or a
    ``QuantizedWeight``), ``sizes`` the output rows of each part, in order."""

    w: Any
    sizes: tuple[int, ...] = flax.struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.w.shape)


def fused_dot(policy: Any, x: jax.Array, fw: FusedWeight, site: Any) -> list[jax.Array]:
    """``policy.dot`` of the concatenated weight, split back into the parts' outputs."""
    return split_fused(policy.dot(x, fw.w, site), fw)


def split_fused(y: jax.Array, fw: FusedWeight) -> list[jax.Array]:
    """A fused GEMM's output ``[..., sum(sizes)]`` split back into the parts' outputs."""
    return jnp.split(y, np.cumsum(fw.sizes)[:-1].tolist(), axis=-1)


def fused_ragged_dot(policy: Any, x: jax.Array, fw: FusedWeight, group_sizes: jax.Array, site: Any) -> list[jax.Array]:
    """``policy.ragged_dot`` of stacked experts' concatenated weights ``[E, sum(sizes), K]``, split back."""
    y = policy.ragged_dot(x, fw.w, group_sizes, site)
    return jnp.split(y, np.cumsum(fw.sizes)[:-1].tolist(), axis=-1)


def _placeholder(w: Any) -> jax.Array:
    dtype = w.q.dtype if hasattr(w, "q") else w.dtype
    return jnp.zeros((0,), dtype)


def concat_parts(parts: list[Any]) -> Any | None:
    """The parts ([N_i, K] weights, or stacked experts [E, N_i, K]) concatenated on the output axis
    (-2), or None where they cannot be (quantized parts that do not end on a block row, mixed precision
    or rank, other input widths or expert counts)."""
    if any(isinstance(p, FusedWeight) for p in parts) or len({len(p.shape) for p in parts}) != 1:
        return None
    if len(parts[0].shape) not in (2, 3) or len({(*p.shape[:-2], p.shape[-1]) for p in parts}) != 1:
        return None
    if all(isinstance(p, QuantizedWeight) for p in parts):
        bn = parts[0].block_size[0]
        if any(p.block_size != parts[0].block_size or p.shape[-2] % bn or p.q.dtype != parts[0].q.dtype
               for p in parts):
            return None
        return QuantizedWeight(jnp.concatenate([p.q for p in parts], axis=-2),
                               jnp.concatenate([p.scale_inv for p in parts], axis=-2), parts[0].block_size)
    if any(isinstance(p, QuantizedWeight) for p in parts) or len({p.dtype for p in parts}) != 1:
        return None
    return jnp.concatenate(parts, axis=-2)


def fuse_params(params: nnx.State, concat: Callable[[list, list], Any] | None = None) -> nnx.State:
    """The params with q/k/v and gate/up fused wherever they can be (module docstring); jit-friendly.
    Layers whose parts cannot be concatenated (see ``concat_parts``) keep them separate. ``concat(parts,
    paths)`` builds a group's fused weight from its parts and their param paths, or returns None to
    keep them separate (default: ``concat_parts``; the generator's weight sync passes one that quantizes
    the parts straight into the fused buffer, `fp8rl_jax.quant.policy.quantizing_concat`)."""
    flat = dict(nnx.to_flat_state(params))
    layers = sorted({path[1] for path in flat if path[0] == "layers"})
    for layer in layers:
        for module, names, leaf in FUSED_GROUPS:
            paths = [("layers", layer, *module, n, *leaf) for n in names]
            if not all(p in flat for p in paths):
                continue  # e.g. an MoE layer's dense mlp, a dense layer's experts
            parts = [flat[p].get_value() for p in paths]
            fused = concat_parts(parts) if concat is None else concat(parts, paths)
            if fused is None:
                continue
            flat[paths[0]] = flat[paths[0]].replace(FusedWeight(fused, tuple(int(p.shape[-2]) for p in parts)))
            for p in paths[1:]:
                flat[p] = flat[p].replace(_placeholder(fused))
    return nnx.from_flat_state(list(flat.items()))


def is_fused(params: nnx.State) -> bool:
    """Whether any projection of ``params`` is fused."""
    return any(isinstance(v.get_value(), FusedWeight) for _, v in nnx.to_flat_state(params))
