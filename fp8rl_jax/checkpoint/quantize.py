"""``fp8rl quantize``: a Hugging Face checkpoint -> its block-FP8 twin, streamed shard by shard.

The output is the format of the public Qwen3-*-FP8 releases, which vLLM and SGLang load as is:
every weight the layer policy selects becomes ``<name>.weight`` float8_e4m3fn [out, in] plus
``<name>.weight_scale_inv`` float32 [ceil(out/128), ceil(in/128)]; everything else (embeddings,
norms, lm_head, MoE router, layers kept in BF16) is copied bit for bit. Tensor names, shard files
and config keys are kept; config.json gains ``quantization_config``. MoE experts stay one 2-D
tensor per expert projection, as in the public checkpoints.

Each source shard is read through memory maps and written before the next is read, so peak host
memory is about one shard, not the model. The output is built in a staging folder of its own
beside ``dst`` (a unique name per call, so concurrent writers never share one) and renamed to
``dst`` at the end; a ``dst`` filled meanwhile by another writer is left as it is and the call
fails. Nothing is left behind on failure.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np

from fp8rl_jax.checkpoint.atomic import make_parents, publish_dir, remove_empty, staging_dir
from fp8rl_jax.checkpoint.hf import (IGNORED_SUFFIXES, AUX_FILES, CONFIG, INDEX, SCALE_SUFFIX, weight_files,
                                     load_config, param_table)
from fp8rl_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsFile, save_tensors
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
    if src.resolve() in dst.resolve().parents:
        raise CheckpointError(f"--out {dst} lies inside the source folder {src}; write the FP8 checkpoint elsewhere")
    files, weight_map = weight_files(src)
    to_quantize = {
        name for spec in param_table(config)
        if layer_policy.quantizes(site_of(spec.path), config.num_layers) for name in spec.hf_names
    }
    if not to_quantize:
        raise CheckpointError(
            f"bf16_first_layers={layer_policy.bf16_first_layers} and bf16_last_layers={layer_policy.bf16_last_layers} "
            f"keep all {config.num_layers} decoder layers of {src} in BF16: the checkpoint would hold no FP8 weight")
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
    try:
        created = make_parents(dst)
    except OSError as e:
        raise CheckpointError(f"--out {dst}: cannot create its folder ({e.strerror or e})") from None
    try:
        staging = staging_dir(dst)
    except OSError as e:
        remove_empty(created)
        raise CheckpointError(f"--out {dst}: cannot write in {dst.parent} ({e.strerror or e})") from None
    try:
        summary = _write(src, staging, raw, headers, weight_map is not None, to_quantize, layer_policy)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        remove_empty(created)
        raise
    try:
        publish_dir(staging, dst)  # removes the staging folder when it fails
    except OSError as e:
        remove_empty(created)
        if isinstance(e, FileExistsError):
            raise CheckpointError(f"--out {dst} was filled by another writer while this one ran; it is left as it "
                                  "is and nothing was written") from None
        raise CheckpointError(f"--out {dst}: cannot move the checkpoint into place ({e.strerror or e})") from None
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
        save_tensors(out, dst / h.path.name, metadata={"format": "pt"})
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
