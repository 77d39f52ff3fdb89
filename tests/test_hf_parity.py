"""Our Qwen3 / Qwen3-MoE against Hugging Face transformers' float32 logits (independent reference).

The `fp8rl score` cases run the command in this process (``run_cli_here``: the same parser and
code, no interpreter start and JAX import per case); ``tests/test_cli.py`` runs it as a separate
process."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import HF_CASES, rel_err, run_cli_here
from fp8rl_jax.checkpoint import load_checkpoint
from fp8rl_jax.models import DensePolicy, forward

CASES = sorted(HF_CASES)


@pytest.mark.parametrize("name", CASES)
def test_logits_match_hf_float32(hf_models, name):
    folder, tokens, ref = hf_models[name]
    ckpt = load_checkpoint(folder, dtype=jnp.float32)
    assert ckpt.config.is_moe == ("moe" in name)
    logits, cache = jax.jit(lambda p, t: forward(p, t, config=ckpt.config, policy=DensePolicy("float32")))(
        ckpt.params, tokens)
    assert cache is None
    assert logits.dtype == jnp.float32 and logits.shape == ref.shape
    assert rel_err(logits, ref) < 1e-4
    assert float(np.max(np.abs(np.asarray(logits) - ref)) / np.max(np.abs(ref))) < 1e-4


@pytest.mark.parametrize("name", ["dense_tied_mqa_sharded", "moe_sharded"])
def test_score_cli_matches_hf(hf_models, name, tmp_path, capsys):
    folder, tokens, ref = hf_models[name]
    np.save(tmp_path / "in.npy", tokens)
    rc, err = run_cli_here(capsys, "score", "--model", str(folder), "--tokens", str(tmp_path / "in.npy"),
                           "--out", str(tmp_path / "out.npy"), "--dtype", "float32", "--batch-size", "2")
    assert rc == 0, err
    out = np.load(tmp_path / "out.npy")
    assert out.dtype == np.float32 and out.shape == ref.shape
    assert rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("name", ["dense", "moe_bf16_step2"])
def test_score_cli_bfloat16_close_to_hf(hf_models, name, tmp_path, capsys):
    """bf16 weights and compute: about 3 significant digits, so a loose but meaningful bound."""
    folder, tokens, ref = hf_models[name]
    np.save(tmp_path / "in.npy", tokens)
    rc, err = run_cli_here(capsys, "score", "--model", str(folder), "--tokens", str(tmp_path / "in.npy"),
                           "--out", str(tmp_path / "out.npy"))
    assert rc == 0, err
    err = rel_err(np.load(tmp_path / "out.npy"), ref)
    assert 1e-4 < err < 5e-2, err  # bf16 really ran (not float32), and stays close
