"""``fp8rl quantize``: a Hugging Face checkpoint -> its block-FP8 twin, streamed shard by shard.

The output is the format of the public Qwen3-*-FP8 releases, which vLLM and SGLang load as is:
every weight the layer policy selects becomes ``<name>.weight`` float8_e4m3fn [out, in] plus
``<name>.weight_scale_inv`` float32 [ceil(out/128), ceil(in/128)]; everything else (embeddings,
norms, lm_head, MoE router, layers kept in BF16) is copied bit for bit. Tensor names, shard files
and config keys are kept; config.json gains ``quantization_config``. MoE experts stay one 2-D
tensor per expert projection, as in the public checkpoints.

Each source shard is read through memory maps and written before the next is read, so peak host
memory is about one shard, not the model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file

from fp8rl_jax.checkpoint.hf import (IGNORED_SUFFIXES, AUX_FILES, CONFIG, INDEX, SCALE_SUFFIX, weight_files,
                                     load_config, param_table)
from fp8rl_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsFile
from fp8rl_jax.models.config import fp8_quantization_config
from fp8rl_jax.quant.policy import LayerPolicy, quantize_weight, site_of

_quantize = jax.jit(quantize_weight, static_argnames=("block_size", "kernels"))


def quantize_checkpoint(src: str | Path, dst: str | Path, layer_policy: LayerPolicy = LayerPolicy()) -> dict:
    """Writes the block-FP8 version of the HF folder ``src`` to ``dst``; returns a summary.

    The source is validated (names, shapes) before anything is written; NaN/Inf in any tensor
    is an error naming it (an FP8 scale would silently turn it into garbage).
    """
    src, dst = Path(src), Path(dst)
    config, raw = load_config(src)
    if raw.get("quantization_config"):
        raise CheckpointError(f"{src / CONFIG}: the checkpoint is already quantized ({raw['quantization_config']})")
    if src.resolve() == dst.resolve():
        raise CheckpointError(f"--out {dst} is the source folder; write the FP8 checkpoint elsewhere")
    files, weight_map = weight_files(src)
    to_quantize = {
        name for spec in param_table(config)
        if layer_policy.quantizes(site_of(spec.path), config.num_layers) for name in spec.hf_names
    }
    expected = {name: spec.hf_shape for spec in param_table(config) for name in spec.hf_names}
    headers = [SafetensorsFile(f) for f in files]
    present = {name: h for h in headers for name in h.keys()}
    tied_extra = {"lm_head.weight"} if config.tie_word_embeddings else set()
    for name, h in present.items():
        if name in tied_extra or name.endswith(IGNORED_SUFFIXES):
            continue
        if name not in expected:
            raise CheckpointError(f"{h.path}: unexpected tensor {name!r} for a {config.architecture} with this config")
        if h.shape(name) != expected[name]:
            raise CheckpointError(f"{h.path}: tensor {name!r} has shape {h.shape(name)}, expected {expected[name]}")
    missing = sorted(set(expected) - set(present))
    if missing:
        raise CheckpointError(f"{src}: missing tensor {missing[0]!r} ({len(missing)} missing)")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"--out {dst} exists and is not an empty folder; refusing to overwrite it")
    final, dst = dst, dst.with_name(f".{dst.name}.partial")
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    try:
        summary = _write(src, dst, raw, headers, weight_map is not None, to_quantize, layer_policy)
    except BaseException:
        shutil.rmtree(dst, ignore_errors=True)
        raise
    if final.exists():
        final.rmdir()
    dst.rename(final)
    return summary


def _write(src: Path, dst: Path, raw: dict, headers: list[SafetensorsFile], indexed: bool, to_quantize: set[str],
           layer_policy: LayerPolicy) -> dict:
    """Writes the shards, index, config and tokenizer files of the FP8 checkpoint into ``dst``."""
    new_map: dict[str, str] = {}
    n_quantized = n_copied = 0
    for h in headers:
        out: dict[str, np.ndarray] = {}
        for name in h.keys():
            view = h.get(name)
            bad = int(view.size - np.count_nonzero(np.isfinite(view)))
            if bad:
                raise CheckpointError(f"{h.path}: tensor {name!r} has {bad} NaN/Inf values; no output written")
            if name in to_quantize:
                qw = _quantize(np.asarray(view), block_size=layer_policy.block_size)
                out[name] = np.asarray(qw.q)
                out[name + SCALE_SUFFIX] = np.asarray(qw.scale_inv)
                n_quantized += 1
            else:
                out[name] = np.array(view)
                n_copied += 1
        save_file(out, str(dst / h.path.name), metadata={"format": "pt"})
        new_map.update({n: h.path.name for n in out})
        del out
    if indexed:
        index = json.loads((src / INDEX).read_text())
        index["weight_map"] = dict(sorted(new_map.items()))
        index.setdefault("metadata", {})["total_size"] = sum((dst / fn).stat().st_size for fn in set(new_map.values()))
        (dst / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    cfg = dict(raw)
    cfg["quantization_config"] = fp8_quantization_config(layer_policy.block_size)
    (dst / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    for aux in AUX_FILES:
        if (src / aux).is_file():
            shutil.copyfile(src / aux, dst / aux)
    return {"quantized": n_quantized, "copied": n_copied, "files": len(headers)}
