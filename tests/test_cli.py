"""`fp8rl score` contract: exact flags, float32 [B, T, V] output, clear errors that write nothing."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.models import tiny_qwen3
from conftest import run_cli
from fp8rl_jax.checkpoint import save_checkpoint
from fp8rl_jax.models import DensePolicy, forward, init_params


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli") / "tiny"
    params = init_params(tiny_qwen3, jax.random.key(0), jnp.float32)
    save_checkpoint(folder, params, tiny_qwen3)
    return folder, params


def test_score_writes_float32_logits(model_dir, tmp_path):
    folder, params = model_dir
    tokens = np.random.default_rng(0).integers(0, tiny_qwen3.vocab_size, (5, 9)).astype(np.int32)
    np.save(tmp_path / "in.npy", tokens)
    proc = run_cli("score", "--model", str(folder), "--tokens", str(tmp_path / "in.npy"), "--out",
                   str(tmp_path / "out.npy"), "--dtype", "float32", "--batch-size", "2")
    assert proc.returncode == 0, proc.stderr
    out = np.load(tmp_path / "out.npy")
    assert out.dtype == np.float32 and out.shape == (5, 9, tiny_qwen3.vocab_size)
    ref = np.asarray(forward(params, tokens, config=tiny_qwen3, policy=DensePolicy("float32"))[0])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "tokens, match",
    [
        (np.array([[1, 2, 256]], np.int32), r"token id 256 at \[0, 2\] is outside the vocabulary \[0, 256\)"),
        (np.array([[1, -1]], np.int32), r"token id -1 at \[0, 1\]"),
        (np.array([1, 2, 3], np.int32), r"expected a non-empty \[B, T\] array, got shape \(3,\)"),
        (np.zeros((2, 0), np.int32), r"non-empty"),
        (np.array([[1.0, 2.0]], np.float32), r"expected an integer \(int32\) array, got float32"),
        (np.zeros((1, 513), np.int32), r"sequence length 513 exceeds the model's max_position_embeddings 512"),
    ],
    ids=["too_big", "negative", "rank", "empty", "float", "too_long"],
)
def test_score_bad_tokens(model_dir, tmp_path, tokens, match):
    np.save(tmp_path / "in.npy", tokens)
    proc = run_cli("score", "--model", str(model_dir[0]), "--tokens", str(tmp_path / "in.npy"),
                   "--out", str(tmp_path / "out.npy"))
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and re.search(match, proc.stderr), proc.stderr
    assert not (tmp_path / "out.npy").exists()


def test_score_bad_paths_and_modes(model_dir, tmp_path):
    np.save(tmp_path / "in.npy", np.zeros((1, 4), np.int32))
    common = ["--tokens", str(tmp_path / "in.npy"), "--out", str(tmp_path / "out.npy")]
    proc = run_cli("score", "--model", str(tmp_path / "nope"), *common)
    assert proc.returncode == 2 and "not a directory" in proc.stderr
    proc = run_cli("score", "--model", str(tmp_path), *common)
    assert proc.returncode == 2 and "config.json" in proc.stderr
    proc = run_cli("score", "--model", str(model_dir[0]), "--tokens", str(tmp_path / "missing.npy"),
                   "--out", str(tmp_path / "out.npy"))
    assert proc.returncode == 2 and "missing.npy: file not found" in proc.stderr
    for mode in ("kv", "all"):
        proc = run_cli("score", "--model", str(model_dir[0]), *common, "--fp8", mode)
        assert proc.returncode == 2 and "not yet supported" in proc.stderr
    proc = run_cli("score", "--model", str(model_dir[0]), *common, "--fp8", "fp4")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
    assert not (tmp_path / "out.npy").exists()
