"""Hugging Face checkpoint I/O: round trips, sharding, tokenizer, and every bad-input error."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from configs.models import tiny_qwen3, tiny_qwen3_moe
from fp8rl_jax.checkpoint import (CheckpointError, SafetensorsFile, load_checkpoint, load_config, load_params,
                                  param_table, save_checkpoint)
from fp8rl_jax.checkpoint import quantize as quantize_module
from fp8rl_jax.checkpoint.atomic import write_atomic
from fp8rl_jax.models import init_params
from fp8rl_jax.quant.policy import LayerPolicy
from fp8rl_jax.tokenization import char_tokenizer


def _bits(tree):
    return [np.asarray(x).view(np.uint8) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A bf16 tiny MoE checkpoint written by us, with a tokenizer."""
    folder = tmp_path_factory.mktemp("ckpt") / "moe"
    params = init_params(tiny_qwen3_moe, jax.random.key(0), jnp.bfloat16)
    save_checkpoint(folder, params, tiny_qwen3_moe)
    char_tokenizer().save(str(folder / "tokenizer.json"))
    return folder, params


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shard", [None, 20_000], ids=["single", "sharded"])
def test_round_trip_is_bit_identical(tmp_path, dtype, shard):
    cfg = tiny_qwen3_moe
    params = init_params(cfg, jax.random.key(1), dtype)
    kw = {} if shard is None else {"max_shard_bytes": shard}
    save_checkpoint(tmp_path / "a", params, cfg, **kw)
    files = sorted(p.name for p in (tmp_path / "a").glob("*.safetensors"))
    assert (files == ["model.safetensors"]) == (shard is None)
    assert (tmp_path / "a" / "model.safetensors.index.json").exists() == (shard is not None)
    loaded = load_checkpoint(tmp_path / "a", dtype=dtype)
    assert loaded.config == cfg
    chex.assert_trees_all_equal_shapes_and_dtypes(loaded.params, params)
    for a, b in zip(_bits(loaded.params), _bits(params)):
        np.testing.assert_array_equal(a, b)
    save_checkpoint(tmp_path / "b", loaded.params, loaded.config, hf_config=loaded.hf_config, **kw)
    again = load_params(tmp_path / "b", dtype=dtype)
    for a, b in zip(_bits(again), _bits(params)):
        np.testing.assert_array_equal(a, b)


def test_hf_written_checkpoints_round_trip(hf_models, tmp_path):
    """transformers-written folders (sharded, tied, bf16): load -> save -> load is bit-identical,
    and the saved tensor names/shapes/dtypes equal the originals (public per-expert layout)."""
    for name, (folder, _, _) in hf_models.items():
        ckpt = load_checkpoint(folder, dtype=jnp.float32 if "bf16" not in name else jnp.bfloat16)
        out = save_checkpoint(tmp_path / name, ckpt.params, ckpt.config, hf_config=ckpt.hf_config,
                              max_shard_bytes=30_000, copy_files_from=folder)
        again = load_checkpoint(out, dtype=ckpt.params["embed_tokens"]["weight"].get_value().dtype)
        for a, b in zip(_bits(again.params), _bits(ckpt.params)):
            np.testing.assert_array_equal(a, b)

        def inventory(d):
            inv = {}
            for f in Path(d).glob("*.safetensors"):
                h = SafetensorsFile(f)
                inv.update({k: (h.shape(k), h.dtype(k)) for k in h.keys()})
            return inv

        assert inventory(out) == inventory(folder)
        src_cfg = json.loads((folder / "config.json").read_text())
        out_cfg = json.loads((out / "config.json").read_text())
        assert {k: v for k, v in out_cfg.items() if k not in ("dtype", "torch_dtype")} == {
            k: v for k, v in src_cfg.items() if k not in ("dtype", "torch_dtype")}
        assert (out / "generation_config.json").exists()


def test_param_table_covers_every_tensor_once():
    for cfg in (tiny_qwen3, tiny_qwen3_moe):
        table = param_table(cfg)
        names = [n for spec in table for n in spec.hf_names]
        assert len(names) == len(set(names))
        assert len(table) == len(jax.tree.leaves(init_params(cfg, jax.random.key(0))))
    moe_names = {n for s in param_table(tiny_qwen3_moe) for n in s.hf_names}
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in moe_names
    assert "model.layers.0.mlp.gate.weight" in moe_names


def test_tokenizer_is_loaded_and_copied(saved, tmp_path):
    folder, params = saved
    ckpt = load_checkpoint(folder)
    assert ckpt.tokenizer is not None
    assert ckpt.tokenizer.decode(ckpt.tokenizer.encode("12+30=42").ids) == "12+30=42"
    save_checkpoint(tmp_path / "copy", ckpt.params, ckpt.config, copy_files_from=folder)
    assert load_checkpoint(tmp_path / "copy").tokenizer.get_vocab() == ckpt.tokenizer.get_vocab()
    (tmp_path / "copy" / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_checkpoint(tmp_path / "copy")


def _rewrite(folder: Path, mutate) -> None:
    """Loads model.safetensors of ``folder`` into a dict, lets ``mutate`` edit it, writes it back."""
    f = SafetensorsFile(folder / "model.safetensors")
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    del f
    mutate(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor(saved, tmp_path):
    folder = _copy(saved[0], tmp_path / "m")
    _rewrite(folder, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight'"):
        load_checkpoint(folder)


def test_extra_tensor(saved, tmp_path):
    folder = _copy(saved[0], tmp_path / "m")
    _rewrite(folder, lambda t: t.update({"model.layers.9.self_attn.q_proj.weight": np.zeros((2, 2), np.float32)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.9"):
        load_checkpoint(folder)


def test_wrong_shape(saved, tmp_path):
    folder = _copy(saved[0], tmp_path / "m")
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(folder, lambda t: t.update({name: np.zeros((3, 64), ml_dtypes.bfloat16)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(3, 64\), expected \(32, 64\)"):
        load_checkpoint(folder)


def test_non_float_tensor(saved, tmp_path):
    folder = _copy(saved[0], tmp_path / "m")
    _rewrite(folder, lambda t: t.update({"model.norm.weight": np.ones(64, np.int32)}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has dtype int32"):
        load_checkpoint(folder)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_weights_rejected_with_check_flag(saved, tmp_path, bad):
    folder = _copy(saved[0], tmp_path / "m")
    name = "model.layers.1.mlp.experts.5.gate_proj.weight"

    def poison(t):
        w = t[name].astype(np.float32)
        w[3, 7] = bad
        w[0, 0] = bad
        t[name] = w.astype(ml_dtypes.bfloat16)

    _rewrite(folder, poison)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.experts\.5\.gate_proj\.weight' has 2 NaN/Inf values"):
        load_checkpoint(folder, check_finite=True)
    load_checkpoint(folder)  # the check is optional: without it the weights load as they are


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c.update(architectures=["LlamaForCausalLM"], model_type="llama"), "unsupported architecture"),
        (lambda c: c.update(attention_bias=True), "attention_bias"),
        (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope scaling of type 'yarn'"),
        (lambda c: c.update(use_sliding_window=True), "use_sliding_window"),
        (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
        (lambda c: c.update(num_key_value_heads=3), "num_kv_heads"),
        (lambda c: c.update(num_experts_per_tok=0), "num_experts_per_tok"),
        (lambda c: c.pop("hidden_size"), "required key 'hidden_size'"),
        (lambda c: c.update(quantization_config={"quant_method": "awq", "bits": 4}), "quantization_config"),
        (lambda c: c.update(quantization_config={"quant_method": "fp8"}), "weight_block_size"),
        (lambda c: c.update(tie_word_embeddings="false"), 'tie_word_embeddings must be true or false, got "false"'),
        (lambda c: c.update(hidden_size=64.5), "hidden_size must be an integer, got 64.5"),
        (lambda c: c.update(num_hidden_layers=2.0), "num_hidden_layers must be an integer, got 2.0"),
        (lambda c: c.update(num_hidden_layers=True), "num_hidden_layers must be an integer, got true"),
        (lambda c: c.update(vocab_size=None), "vocab_size must be an integer, got null"),
        (lambda c: c.update(rms_norm_eps="1e-6"), 'rms_norm_eps must be a number, got "1e-6"'),
        (lambda c: c.update(eos_token_id=[1, "2"]), r'eos_token_id must be an integer or a list of integers, got \[1, "2"\]'),
    ],
    ids=["arch", "bias", "yarn", "sliding", "act", "gqa", "topk", "missing_key", "awq", "fp8_no_block", "bool_as_string",
         "fractional_int", "float_int", "bool_as_int", "null", "number_as_string", "eos_list"],
)
def test_config_the_model_cannot_express(saved, tmp_path, edit, match):
    folder = _copy(saved[0], tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match) as e:
        load_checkpoint(folder)
    assert "config.json" in str(e.value)


def test_malformed_files(saved, tmp_path):
    folder = _copy(saved[0], tmp_path / "m")
    (folder / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"config\.json: invalid JSON"):
        load_config(folder)
    folder = _copy(saved[0], tmp_path / "n")
    (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a safetensors file"):
        load_checkpoint(folder)
    folder = _copy(saved[0], tmp_path / "o")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="past the end of the file"):
        load_checkpoint(folder)
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        (folder / "model.safetensors").unlink()
        load_checkpoint(folder)
    with pytest.raises(CheckpointError, match="not a Hugging Face model folder"):
        load_checkpoint(tmp_path / "does_not_exist")


def test_index_errors(tmp_path):
    params = init_params(tiny_qwen3, jax.random.key(2))
    folder = save_checkpoint(tmp_path / "s", params, tiny_qwen3, max_shard_bytes=40_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match="lists shard files that do not exist"):
        load_checkpoint(folder)
    folder = save_checkpoint(tmp_path / "t", params, tiny_qwen3, max_shard_bytes=40_000)
    name = "model.norm.weight"
    other = next(f for f in set(index["weight_map"].values()) if f != index["weight_map"][name])
    index["weight_map"][name] = other
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"not found in the shard the index names: model\.norm\.weight"):
        load_checkpoint(folder)


def _tree(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() if p.is_file() else "dir" for p in sorted(folder.rglob("*"))}


def test_quantize_refuses_policies_and_outputs_that_cannot_be_right(saved, tmp_path):
    """A layer policy that leaves no FP8 layer, and an output inside the source, are errors that write nothing."""
    folder = saved[0]
    before = _tree(folder)
    with pytest.raises(CheckpointError, match="keep all 2 decoder layers .* no FP8 weight"):
        quantize_module.quantize_checkpoint(folder, tmp_path / "fp8", LayerPolicy(bf16_first_layers=1,
                                                                                   bf16_last_layers=1))
    with pytest.raises(CheckpointError, match="keep all 2 decoder layers"):
        quantize_module.quantize_checkpoint(folder, tmp_path / "fp8", LayerPolicy(bf16_first_layers=99))
    with pytest.raises(CheckpointError, match="lies inside the source folder"):
        quantize_module.quantize_checkpoint(folder, folder / "fp8")
    assert _tree(folder) == before and not list(tmp_path.iterdir())


def test_racing_quantizes_stage_apart_and_one_wins(saved, tmp_path, monkeypatch):
    """Two writers of one output, both past the up-front checks and both done writing before either renames:
    each staged in a folder of its own beside the output; the first rename wins, the second fails naming the
    output and removes its staging folder. (`tests/test_cli.py` races two processes.)"""
    barrier = threading.Barrier(2, timeout=120)
    staged: list[Path] = []
    write = quantize_module._write

    def write_then_wait(src, dst, *args):
        staged.append(dst)
        summary = write(src, dst, *args)
        barrier.wait()
        return summary

    monkeypatch.setattr(quantize_module, "_write", write_then_wait)
    out, results = tmp_path / "fp8", [None, None]

    def run(i):
        try:
            results[i] = quantize_module.quantize_checkpoint(saved[0], out)
        except CheckpointError as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(staged)) == 2 and {p.parent for p in staged} == {tmp_path}
    errors = [r for r in results if isinstance(r, CheckpointError)]
    assert len(errors) == 1 and "filled by another writer" in str(errors[0]), results
    assert sorted(os.listdir(tmp_path)) == ["fp8"]
    assert load_checkpoint(out, fp8=True).hf_config["quantization_config"]["quant_method"] == "fp8"


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")

    def fail_midway(f):
        f.write(b"new, half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_atomic(target, fail_midway)
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["out.bin"]
    write_atomic(target, lambda f: f.write(b"new"))
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["out.bin"]
