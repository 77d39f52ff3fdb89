"""Our parameter tree -> vLLM 0.26's parameters of Qwen3 / Qwen3-MoE: the name and layout table.

No vLLM or torch import: everything here is testable on the CPU.

What vLLM 0.26 registers (read from the vllm==0.26.0 wheel: ``model_executor/models/qwen3.py``,
``qwen2.py`` (Qwen3Model is Qwen2Model), ``qwen3_moe.py``, ``layers/linear.py``,
``layers/quantization/fp8.py`` (Fp8LinearMethod / Fp8MoEMethod ``create_weights``),
``layers/fused_moe/layer.py`` + ``runner/moe_runner.py`` (the ``routed_experts`` submodule) and
``model_loader/weight_utils.py``), for a block-FP8 checkpoint (``weight_block_size [bn, bk]``)::

    model.embed_tokens.weight                                  [V, D]          BF16
    model.layers.i.input_layernorm.weight                      [D]             BF16
    model.layers.i.post_attention_layernorm.weight             [D]             BF16
    model.layers.i.self_attn.q_norm.weight / k_norm.weight     [H]             BF16
    model.layers.i.self_attn.qkv_proj.weight                   [(N+2K)H, D]    FP8   q, k, v stacked on out
    model.layers.i.self_attn.qkv_proj.weight_scale_inv         [cq+ck+cv, cD]  f32   their scale rows stacked
    model.layers.i.self_attn.o_proj.weight (+ _scale_inv)      [D, NH]         FP8
    model.layers.i.mlp.gate_up_proj.weight (+ _scale_inv)      [2F, D]         FP8   dense layers: gate, up
    model.layers.i.mlp.down_proj.weight (+ _scale_inv)         [D, F]          FP8
    model.layers.i.mlp.gate.weight                             [E, D]          BF16  MoE router
    model.layers.i.mlp.experts.routed_experts.w13_weight       [E, 2I, D]      FP8   gate (w1), up (w3)
    model.layers.i.mlp.experts.routed_experts.w13_weight_scale_inv [E, 2cI, cD] f32
    model.layers.i.mlp.experts.routed_experts.w2_weight        [E, D, I]       FP8   down
    model.layers.i.mlp.experts.routed_experts.w2_weight_scale_inv  [E, cD, cI]  f32
    model.norm.weight                                          [D]             BF16
    lm_head.weight                                             [V, D]          BF16  absent when tied

with ``cX = ceil(X / bn)`` for output rows and ``ceil(X / bk)`` for input columns. Tied embeddings:
dense Qwen3 makes ``lm_head`` the embedding module and Qwen3-MoE assigns
``lm_head.weight = embed_tokens.weight``; ``named_parameters()`` lists the shared tensor once, as
``model.embed_tokens.weight``, and our tree has no ``lm_head`` then, so both sides agree.

Fused layouts (the condition is vLLM's ``validate_fp8_block_shape`` / Fp8MoEMethod check): the
scale rows of a fused FP8 weight are the parts' scale rows stacked, which equals the block
quantization of the fused weight only if no 128-row block straddles two parts, i.e. every part but
the last has an output size that is a multiple of ``bn`` (vLLM places part j's scales at row
``ceil(offset_j / bn)``); MoE experts need ``I % bn == 0`` (both halves of ``w13``). Real Qwen3
satisfies all of it (q 4096, k 1024, gate 12288, I 768 for bn = 128); the tiny test models do not
at bn = 128 and raise ``VllmLayoutError`` unless quantized with a smaller block.

Two exports walk one table (``vllm_table``):
- ``export_fused``: vLLM name -> one array in vLLM's (pre-``process_weights_after_loading``)
  parameter layout, fused on device with ``jnp.concatenate``;
- ``export_checkpoint``: the same tensors under their Hugging Face checkpoint names, one part per
  name (q/k/v separately, one 2-D tensor per expert: the format ``fp8rl quantize`` writes and vLLM's
  ``load_weights`` consumes, fusing them itself with the same offsets). The vLLM backend streams
  this one through ``reload_weights`` so vLLM redoes its post-loading processing.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fp8rl_jax.checkpoint.hf import SCALE_SUFFIX, param_table
from fp8rl_jax.models.config import ModelConfig
from fp8rl_jax.models.qwen3 import abstract_params
from fp8rl_jax.numerics.fp8 import QuantizedWeight
from fp8rl_jax.quant.policy import Kernels, LayerPolicy, quantize_params

Path = tuple[str | int, ...]

__all__ = ["Field", "Source", "VllmLayoutError", "VllmTensor", "abstract_quantized_params", "check_table",
           "expected_vllm_params", "export_checkpoint", "export_fused", "flat_leaves", "source_arrays", "to_torch",
           "to_torch_tensor", "vllm_table"]


class VllmLayoutError(ValueError):
    """Our parameters cannot be laid out as vLLM's (block straddling fused parts, mixed precision)."""


class Field(enum.Enum):
    """Which array of one of our parameters a source is."""

    DENSE = "dense"  # a plain (BF16) array
    CODES = "codes"  # QuantizedWeight.q, FP8 [..., N, K]
    SCALES = "scales"  # QuantizedWeight.scale_inv, float32 [..., ceil(N/bn), ceil(K/bk)]


@dataclasses.dataclass(frozen=True)
class Source:
    """One array of ours: ``field`` of the parameter at ``path``, shape and dtype."""

    path: Path
    field: Field
    shape: tuple[int, ...]
    dtype: Any

    @property
    def stacked(self) -> bool:
        return len(self.path) >= 2 and self.path[-2] == "experts"


@dataclasses.dataclass(frozen=True)
class VllmTensor:
    """One vLLM parameter: its name, shape, dtype, and the sources concatenated along axis -2
    (the output axis, ``[..., out, in]``) in this order; a single source is a plain copy."""

    name: str
    shape: tuple[int, ...]
    dtype: Any
    sources: tuple[Source, ...]


def flat_leaves(params: nnx.State | Mapping) -> dict[Path, Any]:
    """``path -> leaf`` of a params ``nnx.State`` (leaves: arrays, ShapeDtypeStructs, QuantizedWeight)."""
    if isinstance(params, nnx.State):
        return {tuple(p): v.get_value() for p, v in nnx.to_flat_state(params)}
    return {tuple(p): v for p, v in params.items()}


_DEFAULT_POLICY = LayerPolicy()


def abstract_quantized_params(config: ModelConfig, layer_policy: LayerPolicy | None = _DEFAULT_POLICY,
                              dtype: Any = jnp.bfloat16) -> nnx.State:
    """Shapes and dtypes of ``quantize_params(params, config, layer_policy)`` without arrays
    (``jax.eval_shape``); ``layer_policy=None`` is the unquantized (all-BF16) tree."""
    abstract = abstract_params(config, dtype)
    if layer_policy is None:
        return abstract
    return jax.eval_shape(functools.partial(quantize_params, config=config, layer_policy=layer_policy,
                                            kernels=Kernels.REFERENCE), abstract)


def _sources(path: Path, leaf: Any) -> tuple[Source, ...]:
    if isinstance(leaf, QuantizedWeight):
        return (Source(path, Field.CODES, tuple(leaf.q.shape), jnp.dtype(leaf.q.dtype)),
                Source(path, Field.SCALES, tuple(leaf.scale_inv.shape), jnp.dtype(leaf.scale_inv.dtype)))
    return (Source(path, Field.DENSE, tuple(leaf.shape), jnp.dtype(leaf.dtype)),)


def _fused(name: str, parts: list[tuple[Path, Any]], block_rows_rule: str) -> list[VllmTensor]:
    """The weight (and scale) tensors of vLLM parameter ``name`` fused from ``parts`` along out.

    ``block_rows_rule``: "all_but_last" (vLLM's merged linears) or "all" (MoE ``w13``: vLLM requires
    ``I % bn == 0``).
    """
    quantized = [isinstance(leaf, QuantizedWeight) for _, leaf in parts]
    if any(quantized) and not all(quantized):
        mixed = {".".join(map(str, p)): q for (p, _), q in zip(parts, quantized)}
        raise VllmLayoutError(f"{name} fuses parts of mixed precision (FP8: {mixed}); vLLM holds one precision "
                              "per fused layer: quantize all of them or none (LayerPolicy.projs)")
    srcs = [_sources(p, leaf) for p, leaf in parts]
    if not all(quantized):
        s = [x[0] for x in srcs]
        shape = s[0].shape if len(s) == 1 else (*s[0].shape[:-2], sum(x.shape[-2] for x in s), s[0].shape[-1])
        return [VllmTensor(f"{name}.weight" if not name.endswith("_") else f"{name}weight", shape, s[0].dtype,
                           tuple(s))]
    blocks = {leaf.block_size for _, leaf in parts}
    if len(blocks) > 1:
        raise VllmLayoutError(f"{name}: parts quantized with different block sizes {sorted(blocks)}")
    bn = blocks.pop()[0]
    checked = parts if block_rows_rule == "all" else parts[:-1]
    bad = {".".join(map(str, p)): leaf.q.shape[-2] for p, leaf in checked if leaf.q.shape[-2] % bn}
    if bad:
        raise VllmLayoutError(
            f"{name}: output sizes {bad} are not multiples of the block rows bn={bn}, so a scale block would "
            "straddle two fused parts (vLLM rejects this too); quantize with a block size that divides them "
            "(LayerPolicy.block_size) or keep these projections in BF16")
    codes, scales = [x[0] for x in srcs], [x[1] for x in srcs]
    base = f"{name}." if not name.endswith("_") else name
    w_shape = (*codes[0].shape[:-2], sum(x.shape[-2] for x in codes), codes[0].shape[-1])
    s_shape = (*scales[0].shape[:-2], sum(x.shape[-2] for x in scales), scales[0].shape[-1])
    return [VllmTensor(f"{base}weight", w_shape, codes[0].dtype, tuple(codes)),
            VllmTensor(f"{base}weight{SCALE_SUFFIX}", s_shape, scales[0].dtype, tuple(scales))]


def vllm_table(config: ModelConfig, params: nnx.State | Mapping) -> list[VllmTensor]:
    """The vLLM parameters of ``config`` and how each is assembled from ``params``.

    ``params`` is our (possibly quantized, possibly abstract: ``abstract_quantized_params``) tree;
    FP8 leaves (``QuantizedWeight``) become vLLM's ``weight`` + ``weight_scale_inv``. Raises
    ``VllmLayoutError`` when a fused layout is impossible (see the module docstring).
    """
    leaves = flat_leaves(params)
    out: list[VllmTensor] = []

    def leaf(*path) -> tuple[Path, Any]:
        if path not in leaves:
            raise VllmLayoutError(f"params lack {'.'.join(map(str, path))}, required by the {config.architecture} "
                                  "config (pass the tree of this config)")
        return path, leaves[path]

    def single(vname: str, *path) -> None:
        out.extend(_fused(vname, [leaf(*path)], "all_but_last"))

    single("model.embed_tokens", "embed_tokens", "weight")
    for i in range(config.num_layers):
        m = f"model.layers.{i}"
        single(f"{m}.input_layernorm", "layers", i, "input_layernorm", "weight")
        single(f"{m}.post_attention_layernorm", "layers", i, "post_attention_layernorm", "weight")
        for norm in ("q_norm", "k_norm"):
            single(f"{m}.self_attn.{norm}", "layers", i, "self_attn", norm, "weight")
        out.extend(_fused(f"{m}.self_attn.qkv_proj",
                          [leaf("layers", i, "self_attn", p, "weight") for p in ("q_proj", "k_proj", "v_proj")],
                          "all_but_last"))
        single(f"{m}.self_attn.o_proj", "layers", i, "self_attn", "o_proj", "weight")
        if config.layer_is_moe(i):
            single(f"{m}.mlp.gate", "layers", i, "mlp", "gate", "weight")
            e = f"{m}.mlp.experts.routed_experts"
            out.extend(_fused(f"{e}.w13_", [leaf("layers", i, "mlp", "experts", p) for p in ("gate_proj", "up_proj")],
                              "all"))
            out.extend(_fused(f"{e}.w2_", [leaf("layers", i, "mlp", "experts", "down_proj")], "all"))
        else:
            out.extend(_fused(f"{m}.mlp.gate_up_proj",
                              [leaf("layers", i, "mlp", p, "weight") for p in ("gate_proj", "up_proj")], "all_but_last"))
            single(f"{m}.mlp.down_proj", "layers", i, "mlp", "down_proj", "weight")
    single("model.norm", "norm", "weight")
    if not config.tie_word_embeddings:
        single("lm_head", "lm_head", "weight")
    return out


def expected_vllm_params(config: ModelConfig, fp8_block: tuple[int, int] | None) -> dict[str, tuple[tuple[int, ...], str]]:
    """``name -> (shape, kind)`` of the parameters vLLM 0.26 creates for ``config``, written from
    vLLM's ``create_weights`` formulas (independently of ``vllm_table``); ``kind`` is "dense",
    "fp8" or "scale". ``fp8_block=None``: an unquantized model; else every linear but the router
    and the lm_head is block FP8 (the default ``LayerPolicy``)."""
    V, D, L = config.vocab_size, config.hidden_size, config.num_layers
    N, K, H, F = config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size
    E, I = config.num_experts, config.moe_intermediate_size
    out: dict[str, tuple[tuple[int, ...], str]] = {}

    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    def linear(name: str, parts: list[int], d_in: int, experts: int | None = None) -> None:
        lead = () if experts is None else (experts,)
        w, s = ("weight", "weight_scale_inv") if experts is None else ("", "_scale_inv")
        wname = f"{name}.{w}" if experts is None else name
        if fp8_block is None:
            out[wname] = ((*lead, sum(parts), d_in), "dense")
            return
        bn, bk = fp8_block
        out[wname] = ((*lead, sum(parts), d_in), "fp8")
        out[f"{name}.{s}" if experts is None else f"{name}{s}"] = (
            (*lead, sum(cdiv(p, bn) for p in parts), cdiv(d_in, bk)), "scale")

    out["model.embed_tokens.weight"] = ((V, D), "dense")
    for i in range(L):
        m = f"model.layers.{i}"
        out[f"{m}.input_layernorm.weight"] = ((D,), "dense")
        out[f"{m}.post_attention_layernorm.weight"] = ((D,), "dense")
        out[f"{m}.self_attn.q_norm.weight"] = ((H,), "dense")
        out[f"{m}.self_attn.k_norm.weight"] = ((H,), "dense")
        linear(f"{m}.self_attn.qkv_proj", [N * H, K * H, K * H], D)
        linear(f"{m}.self_attn.o_proj", [D], N * H)
        if config.layer_is_moe(i):
            out[f"{m}.mlp.gate.weight"] = ((E, D), "dense")
            linear(f"{m}.mlp.experts.routed_experts.w13_weight", [I, I], D, experts=E)
            linear(f"{m}.mlp.experts.routed_experts.w2_weight", [D], I, experts=E)
        else:
            linear(f"{m}.mlp.gate_up_proj", [F, F], D)
            linear(f"{m}.mlp.down_proj", [D], F)
    out["model.norm.weight"] = ((D,), "dense")
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = ((V, D), "dense")
    return out


def check_table(table: list[VllmTensor], params: nnx.State | Mapping,
                expected: Mapping[str, tuple[tuple[int, ...], str]] | None = None) -> None:
    """Proves the table is a bijection: every array of ``params`` is consumed exactly once, every
    vLLM name produced exactly once, each shape is the concatenation of its sources', and (with
    ``expected``, e.g. ``expected_vllm_params``) the names and shapes are vLLM's. Raises
    ``VllmLayoutError`` listing every discrepancy."""
    errors: list[str] = []
    have = {s for path, leaf in flat_leaves(params).items() for s in _sources(path, leaf)}
    used: dict[Source, list[str]] = {}
    names: dict[str, int] = {}
    for t in table:
        names[t.name] = names.get(t.name, 0) + 1
        for s in t.sources:
            used.setdefault(s, []).append(t.name)
        first = t.sources[0].shape
        if len(t.sources) == 1:
            ok = t.shape == first
        else:
            ok = all(len(s.shape) >= 2 and s.shape[:-2] == first[:-2] and s.shape[-1] == first[-1]
                     for s in t.sources) and t.shape == (*first[:-2], sum(s.shape[-2] for s in t.sources), first[-1])
        if not ok:
            errors.append(f"{t.name}: shape {t.shape} is not the out-axis concatenation of {[s.shape for s in t.sources]}")
        if any(s.dtype != t.dtype for s in t.sources):
            errors.append(f"{t.name}: sources of different dtypes {[str(s.dtype) for s in t.sources]}")
    errors += [f"vLLM name {n!r} produced {c} times" for n, c in names.items() if c > 1]
    errors += [f"{'.'.join(map(str, s.path))} ({s.field.value}) consumed by {n}" for s, n in used.items() if len(n) > 1]
    errors += [f"{'.'.join(map(str, s.path))} ({s.field.value}) is not in params" for s in used if s not in have]
    errors += [f"{'.'.join(map(str, s.path))} ({s.field.value}) is consumed by no vLLM tensor"
               for s in sorted(have - set(used), key=str)]
    if expected is not None:
        got = {t.name: t.shape for t in table}
        errors += [f"vLLM parameter {n} {shape} is produced by no table entry" for n, (shape, _) in expected.items()
                   if n not in got]
        errors += [f"table entry {n} is not a vLLM parameter" for n in got if n not in expected]
        errors += [f"{n}: table shape {got[n]} != vLLM's {expected[n][0]}" for n in got
                   if n in expected and got[n] != expected[n][0]]
    if errors:
        raise VllmLayoutError(f"the vLLM table is wrong in {len(errors)} places: " + "; ".join(errors[:20]))


def _array(leaves: dict[Path, Any], s: Source) -> jax.Array:
    leaf = leaves[s.path]
    return leaf.q if s.field is Field.CODES else leaf.scale_inv if s.field is Field.SCALES else leaf


def source_arrays(t: VllmTensor, leaves: Mapping[Path, Any]) -> list[jax.Array]:
    """The arrays of ``t``'s sources, in order (``leaves``: ``flat_leaves(params)``)."""
    return [_array(leaves, s) for s in t.sources]


def export_fused(table: list[VllmTensor], params: nnx.State | Mapping) -> dict[str, jax.Array]:
    """vLLM name -> array in vLLM's parameter layout (FP8 codes stay float8_e4m3fn, scales float32).

    Fused tensors are one ``jnp.concatenate`` along the out axis (a new device buffer); single
    sources are returned as is (no copy). Jit it together with the quantization to fuse both.
    """
    leaves = flat_leaves(params)
    out = {}
    for t in table:
        arrays = [_array(leaves, s) for s in t.sources]
        out[t.name] = arrays[0] if len(arrays) == 1 else jnp.concatenate(arrays, axis=-2)
    return out


def export_checkpoint(config: ModelConfig, table: list[VllmTensor], params: nnx.State | Mapping,
                      convert: Callable[[jax.Array], Any] = lambda a: a) -> Iterator[tuple[str, Any]]:
    """(Hugging Face checkpoint name, array) for every part, grouped by vLLM tensor in table order
    (so vLLM's layerwise reload finishes one layer before the next starts).

    Names come from ``fp8rl_jax.checkpoint.hf.param_table``; a scale is ``<name>_scale_inv``;
    stacked experts yield one ``[out, in]`` slice per expert, ``convert(arr)[e]``. ``convert`` is
    applied once per whole array before slicing: pass ``to_torch_tensor`` to get zero-copy torch
    views (a torch slice is a view; a JAX slice would be a copy).
    """
    hf = {spec.path: spec.hf_names for spec in param_table(config)}
    leaves = flat_leaves(params)
    for t in table:
        for s in t.sources:
            arr = convert(_array(leaves, s))
            suffix = SCALE_SUFFIX if s.field is Field.SCALES else ""
            names = hf[s.path]
            if s.stacked:
                for e, n in enumerate(names):
                    yield n + suffix, arr[e]
            else:
                yield names[0] + suffix, arr


# ------------------------------------------------------------------------------------ DLPack

_FP8_TORCH_DTYPES = {"float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}


def to_torch_tensor(array: jax.Array, torch_module: Any = None) -> Any:
    """A zero-copy torch view of a JAX array (``torch.from_dlpack``; torch is imported here).

    DLPack and FP8: jax 0.11.2 exports float8_e4m3fn / float8_e5m2 through DLPack (DLPack 1.0
    type codes; JAX -> DLPack -> JAX is bit-exact, tested), but an importer must know those codes
    (NumPy does not: ``BufferError: Unsupported dtype``; older torch neither). So an FP8 array is
    handed to torch natively when its ``from_dlpack`` accepts it, else as its uint8 bit pattern
    (``jax.lax.bitcast_convert_type``, one device copy) reinterpreted on the torch side with
    ``tensor.view(torch.float8_e4m3fn)`` (zero-copy): the same bytes either way.
    ``torch_module`` replaces ``torch`` (tests).
    """
    if torch_module is None:
        try:
            import torch as torch_module
        except ImportError:
            raise ImportError("torch is not installed; the vLLM backend needs it: pip install 'fp8rl_jax[vllm]'") from None
    fp8 = _FP8_TORCH_DTYPES.get(jnp.dtype(array.dtype).name)
    if fp8 is None:
        return torch_module.from_dlpack(array)
    try:
        return torch_module.from_dlpack(array)
    except (BufferError, RuntimeError, TypeError, ValueError):
        codes = torch_module.from_dlpack(jax.lax.bitcast_convert_type(array, jnp.uint8))
        return codes.view(getattr(torch_module, fp8))


def to_torch(arrays: Mapping[str, jax.Array], torch_module: Any = None) -> dict[str, Any]:
    """``name -> torch tensor`` views of ``name -> JAX array`` (see ``to_torch_tensor``)."""
    return {name: to_torch_tensor(a, torch_module) for name, a in arrays.items()}
