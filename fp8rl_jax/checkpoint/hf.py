"""Hugging Face checkpoint folders <-> (ModelConfig, params pytree).

A folder holds ``config.json``, the weights as ``model.safetensors`` or as shards listed in
``model.safetensors.index.json``, and optionally ``tokenizer.json`` (plus the other tokenizer and
generation files, which ``save_checkpoint`` copies along).

The mapping between our parameter paths and HF tensor names is one declarative table
(``param_table``): every parameter path of the model maps to one HF name, except the stacked
MoE experts ``layers.i.mlp.experts.{gate,up,down}_proj`` [E, out, in], which map to the E
per-expert 2-D tensors ``model.layers.i.mlp.experts.e.{gate,up,down}_proj.weight`` of the
public checkpoints. The vLLM export walks the same table.

Loading streams: shard by shard, tensor by tensor, from memory-mapped files, converted to the
target dtype and placed on the device one tensor at a time (stacked experts gather one layer's
projection in a host buffer first). No second full copy of the model exists in host memory.
Every problem raises ``CheckpointError`` naming the file and the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from tokenizers import Tokenizer

from fp8rl_jax.checkpoint.atomic import write_text_atomic
from fp8rl_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsFile, save_tensors
from fp8rl_jax.models.config import ConfigError, ModelConfig, fp8_block_size, fp8_quantization_config
from fp8rl_jax.models.qwen3 import abstract_params
from fp8rl_jax.numerics.fp8 import QuantizedWeight

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
AUX_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
# Tensors some exporters add that carry no parameters of ours.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One parameter of ours and the HF tensor(s) it is made of.

    Attributes:
      path: the parameter's path in the params ``nnx.State``.
      hf_names: one HF name, or E per-expert names stacked along axis 0 in this order.
      shape: our parameter's shape ([E, out, in] when stacked).
    """

    path: tuple[str | int, ...]
    hf_names: tuple[str, ...]
    shape: tuple[int, ...]

    @property
    def stacked(self) -> bool:
        return len(self.path) >= 2 and self.path[-2] == "experts"

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return self.shape[1:] if self.stacked else self.shape


def param_table(config: ModelConfig) -> list[TensorSpec]:
    """The declarative path <-> HF name table for ``config`` (every parameter exactly once)."""
    table = []
    for path, var in nnx.to_flat_state(abstract_params(config)):
        shape = tuple(var.get_value().shape)
        dotted = ".".join(str(p) for p in path)
        if path[0] == "lm_head":
            names: tuple[str, ...] = (dotted,)
        elif len(path) >= 2 and path[-2] == "experts":
            prefix = "model." + ".".join(str(p) for p in path[:-1])
            names = tuple(f"{prefix}.{e}.{path[-1]}.weight" for e in range(shape[0]))
        else:
            names = (f"model.{dotted}",)
        table.append(TensorSpec(tuple(path), names, shape))
    return table


# ------------------------------------------------------------------------------------ config


def load_config(path: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    """(ModelConfig, the raw config dict) of a HF folder."""
    file = Path(path) / CONFIG
    if not file.is_file():
        raise CheckpointError(f"{file}: not found ({path} is not a Hugging Face model folder)")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: invalid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    try:
        return ModelConfig.from_hf_dict(raw, source=str(file)), raw
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def load_tokenizer(path: str | Path):
    """The ``tokenizers.Tokenizer`` of ``tokenizer.json`` in the folder, or None if absent."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises a bare Exception on parse errors
        raise CheckpointError(f"{file}: cannot be read as a tokenizer ({e})") from None


# ------------------------------------------------------------------------------------ loading


def weight_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: malformed index ({e!r}); expected a 'weight_map' object") from None
        files = sorted({folder / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: lists shard files that do not exist: {missing}")
        return files, weight_map
    if (folder / SINGLE).is_file():
        return [folder / SINGLE], None
    raise CheckpointError(f"{folder}: no {SINGLE} or {INDEX} found")


def _fmt(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" ... ({len(names)} in all)" if len(names) > limit else "")


SCALE_SUFFIX = "_scale_inv"


def _quantizable(spec: TensorSpec) -> bool:
    """Weights a block-FP8 checkpoint may store in FP8: every matrix but the embedding."""
    return len(spec.hf_shape) == 2 and spec.path[0] != "embed_tokens"


def load_params(
    path: str | Path,
    config: ModelConfig | None = None,
    *,
    dtype: Any = jnp.bfloat16,
    fp8: bool = False,
    check_finite: bool = False,
    device: jax.Device | jax.sharding.Sharding | None = None,
) -> nnx.State:
    """Streams the weights of a HF folder into a params ``nnx.State`` of ``dtype``.

    Block-FP8 checkpoints (``quantization_config`` with ``weight_block_size``; FP8 ``.weight``
    plus float32 ``.weight_scale_inv``) load as ``QuantizedWeight`` leaves when ``fp8=True``
    (for the W8A8 policy), else dequantized to ``dtype``. Raises CheckpointError for missing,
    extra, mis-shaped or wrongly typed tensors, for an index that disagrees with its shards,
    and (``check_finite=True``) for NaN/Inf values.
    """
    folder = Path(path)
    if config is None:
        config, raw_cfg = load_config(folder)
    else:
        raw_cfg = json.loads((folder / CONFIG).read_text()) if (folder / CONFIG).is_file() else {}
    block = fp8_block_size(raw_cfg.get("quantization_config"), str(folder / CONFIG))
    dtype = jnp.dtype(dtype)
    files, weight_map = weight_files(folder)
    table = param_table(config)

    headers = [SafetensorsFile(f) for f in files]
    where: dict[str, SafetensorsFile] = {}
    for h in headers:
        for name in h.keys():
            if name in where:
                raise CheckpointError(f"tensor {name!r} appears in both {where[name].path} and {h.path}")
            where[name] = h
    if weight_map is not None:
        wrong = [n for n, f in weight_map.items() if n not in where or where[n].path != folder / f]
        if wrong:
            raise CheckpointError(
                f"{folder / INDEX}: tensors not found in the shard the index names: {_fmt(sorted(wrong))}"
            )
    # name -> (spec, index within the spec, is_scale); a spec is FP8 iff its first tensor has a scale.
    by_name: dict[str, tuple[TensorSpec, int, bool]] = {}
    quantized: set[tuple] = set()
    for spec in table:
        is_q = block is not None and _quantizable(spec) and spec.hf_names[0] + SCALE_SUFFIX in where
        if is_q:
            quantized.add(spec.path)
        for i, name in enumerate(spec.hf_names):
            by_name[name] = (spec, i, False)
            if is_q:
                by_name[name + SCALE_SUFFIX] = (spec, i, True)
    tied_extra = {"lm_head.weight"} if config.tie_word_embeddings else set()
    extra = sorted(
        n for n in where if n not in by_name and n not in tied_extra and not n.endswith(IGNORED_SUFFIXES)
    )
    if extra:
        first = extra[0]
        hint = " (a quantized checkpoint? quantization_config is not set in config.json)" if block is None and any(
            n.endswith(SCALE_SUFFIX) for n in extra) else ""
        raise CheckpointError(
            f"{where[first].path}: unexpected tensor {first!r} for a {config.architecture} with this config; "
            f"unexpected: {_fmt(extra)}{hint}"
        )
    missing = sorted(n for n in by_name if n not in where)
    if missing:
        raise CheckpointError(f"{folder}: missing tensor {missing[0]!r}; missing: {_fmt(missing)}")

    def checked(name: str) -> np.ndarray:
        """The validated memory-mapped tensor ``name``."""
        h = where[name]
        spec, _, is_scale = by_name[name]
        is_q = spec.path in quantized
        N, K = spec.hf_shape[-2:] if len(spec.hf_shape) == 2 else (None, None)
        shape = ((-(-N // block[0])), -(-K // block[1])) if is_scale else spec.hf_shape
        allowed = ("float32",) if is_scale else ("float8_e4m3fn",) if is_q else _FLOAT_DTYPES
        if h.shape(name) != shape:
            raise CheckpointError(f"{h.path}: tensor {name!r} has shape {h.shape(name)}, expected {shape} for this config")
        if h.dtype(name).name not in allowed:
            raise CheckpointError(f"{h.path}: tensor {name!r} has dtype {h.dtype(name).name}; expected one of {allowed}")
        view = h.get(name)
        if check_finite:
            bad = int(np.size(view) - np.count_nonzero(np.isfinite(view)))
            if bad:
                raise CheckpointError(f"{h.path}: tensor {name!r} has {bad} NaN/Inf values")
        return view

    put = (lambda a: jax.device_put(a, device)) if device is not None else jax.device_put

    def assemble(spec: TensorSpec, parts: dict[tuple[int, bool], np.ndarray]) -> Any:
        def gather(is_scale: bool, out_dtype) -> np.ndarray:
            views = [parts[(i, is_scale)] for i in range(len(spec.hf_names))]
            if not spec.stacked:
                return np.asarray(views[0], dtype=out_dtype)
            buf = np.empty((len(views), *views[0].shape), out_dtype)
            for i, v in enumerate(views):
                buf[i] = v
            return buf

        if spec.path not in quantized:
            return put(gather(False, dtype))
        qw = QuantizedWeight(q=put(gather(False, np.dtype(ml_dtypes.float8_e4m3fn))),
                             scale_inv=put(gather(True, np.float32)), block_size=block)
        return qw if fp8 else qw.dequantize(dtype)

    values: dict[tuple, Any] = {}
    pending: dict[tuple, dict[tuple[int, bool], np.ndarray]] = {}
    # Shard by shard; a parameter is assembled and placed as soon as its last part arrives
    # (waiting parts are memory maps, which cost no host memory until read).
    for h in headers:
        for name in h.keys():
            if name not in by_name:
                continue
            spec, idx, is_scale = by_name[name]
            parts = pending.setdefault(spec.path, {})
            parts[(idx, is_scale)] = checked(name)
            if len(parts) == len(spec.hf_names) * (2 if spec.path in quantized else 1):
                values[spec.path] = assemble(spec, pending.pop(spec.path))
    abstract = nnx.to_flat_state(abstract_params(config, dtype))
    return nnx.from_flat_state([(p, v.replace(values[tuple(p)])) for p, v in abstract])


@dataclasses.dataclass
class HFCheckpoint:
    """What a HF folder holds, loaded: config, params, the raw config.json and the tokenizer."""

    config: ModelConfig
    params: nnx.State
    hf_config: dict[str, Any]
    tokenizer: Any
    path: Path


def load_checkpoint(
    path: str | Path, *, dtype: Any = jnp.bfloat16, fp8: bool = False, check_finite: bool = False
) -> HFCheckpoint:
    """Config, params (see ``load_params`` for ``fp8``), raw config.json and tokenizer of a folder."""
    folder = Path(path)
    config, raw = load_config(folder)
    params = load_params(folder, config, dtype=dtype, fp8=fp8, check_finite=check_finite)
    return HFCheckpoint(config, params, raw, load_tokenizer(folder), folder)


# ------------------------------------------------------------------------------------ saving


def save_checkpoint(
    path: str | Path,
    params: nnx.State,
    config: ModelConfig,
    *,
    hf_config: dict[str, Any] | None = None,
    max_shard_bytes: int = 5 * 1024**3,
    copy_files_from: str | Path | None = None,
) -> Path:
    """Writes a HF folder: config.json, safetensors (sharded with an index past max_shard_bytes).

    Tensors keep the dtype of ``params``; a ``QuantizedWeight`` leaf is written as the FP8
    ``.weight`` plus its float32 ``.weight_scale_inv`` and config.json gains the block-FP8
    ``quantization_config`` (the format vLLM, SGLang and the public Qwen3-*-FP8 use).
    ``hf_config`` (the raw config.json of the source) is written back with only its dtype (and
    quantization) updated, so keys we do not model survive the round trip; without it,
    ``config.to_hf_dict()`` is written. ``copy_files_from`` copies tokenizer and generation files.
    Each file is written to a temporary file renamed into place, with the modes ``open()`` gives.
    """
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    flat = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(params)}
    table = param_table(config)
    missing = [s.path for s in table if s.path not in flat]
    if missing:
        raise ValueError(f"params lack the parameters {missing[:4]} required by the config")

    def nbytes(spec: TensorSpec) -> int:
        return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(flat[spec.path]))

    def hf_tensors(spec: TensorSpec):
        """(name, host array) pairs of one parameter, FP8 scales included."""
        value = jax.device_get(flat[spec.path])
        arrays = [("", value)] if not isinstance(value, QuantizedWeight) else [
            ("", value.q), (SCALE_SUFFIX, value.scale_inv)]
        for suffix, host in arrays:
            host = np.asarray(host)
            for i, name in enumerate(spec.hf_names):
                yield name + suffix, np.ascontiguousarray(host[i] if spec.stacked else host)

    blocks = {v.block_size for v in flat.values() if isinstance(v, QuantizedWeight)}
    if len(blocks) > 1:
        raise ValueError(f"quantized weights use several block sizes {sorted(blocks)}; a checkpoint holds one")

    # Whole parameters go to one shard (the E tensors of a stacked expert projection stay together).
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in table:
        n = nbytes(spec)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    names = [SINGLE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    for old in list(folder.glob("model*.safetensors")) + [folder / INDEX]:
        old.unlink(missing_ok=True)
    weight_map = {}
    for fname, shard in zip(names, shards):
        tensors = {}
        for spec in shard:
            for name, host in hf_tensors(spec):
                tensors[name] = host
                weight_map[name] = fname
        save_tensors(tensors, folder / fname, metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        total = sum(nbytes(s) for s in table)
        write_text_atomic(folder / INDEX,
                          json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    out_cfg = dict(hf_config) if hf_config is not None else config.to_hf_dict()
    out_cfg.pop("quantization_config", None)
    if blocks:
        out_cfg["quantization_config"] = fp8_quantization_config(blocks.pop())
    dtype_name = jnp.dtype(flat[table[0].path].dtype).name
    for key in ("torch_dtype", "dtype"):
        if key in out_cfg or (key == "torch_dtype" and "dtype" not in out_cfg):
            out_cfg[key] = dtype_name
    write_text_atomic(folder / CONFIG, json.dumps(out_cfg, indent=2) + "\n")
    if copy_files_from is not None:
        for aux in AUX_FILES:
            src = Path(copy_files_from) / aux
            if src.is_file() and src.resolve() != (folder / aux).resolve():
                shutil.copyfile(src, folder / aux)
    return folder
