"""`fp8rl score` contract: exact flags, float32 [B, T, V] output, clear errors that write nothing."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.models import tiny_qwen3 as _tiny_qwen3
from conftest import run_cli, run_cli_here
from fp8rl_jax.checkpoint import save_checkpoint
from fp8rl_jax.models import DensePolicy, forward, init_params

# The tiny preset with one decoder layer: the CLI's contracts (flags, shapes, dtypes, errors) do not depend on
# depth, and every `fp8rl` call here compiles its programs (XLA's CPU compile grows with the layers).
tiny_qwen3 = dataclasses.replace(_tiny_qwen3, num_layers=1)


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
    ref = np.asarray(jax.jit(lambda p, t: forward(p, t, config=tiny_qwen3, policy=DensePolicy("float32"))[0])(
        params, tokens))
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
def test_score_bad_tokens(model_dir, tmp_path, capsys, tokens, match):
    np.save(tmp_path / "in.npy", tokens)
    rc, err = run_cli_here(capsys, "score", "--model", str(model_dir[0]), "--tokens", str(tmp_path / "in.npy"),
                           "--out", str(tmp_path / "out.npy"))
    assert rc == 2
    assert err.startswith("error: ") and re.search(match, err), err
    assert not (tmp_path / "out.npy").exists()


def test_score_bad_paths_and_modes(model_dir, tmp_path, capsys):
    np.save(tmp_path / "in.npy", np.zeros((1, 4), np.int32))
    common = ["--tokens", str(tmp_path / "in.npy"), "--out", str(tmp_path / "out.npy")]
    rc, err = run_cli_here(capsys, "score", "--model", str(tmp_path / "nope"), *common)
    assert rc == 2 and "not a directory" in err
    rc, err = run_cli_here(capsys, "score", "--model", str(tmp_path), *common)
    assert rc == 2 and "config.json" in err
    rc, err = run_cli_here(capsys, "score", "--model", str(model_dir[0]), "--tokens", str(tmp_path / "missing.npy"),
                           "--out", str(tmp_path / "out.npy"))
    assert rc == 2 and "missing.npy: file not found" in err
    rc, err = run_cli_here(capsys, "score", "--model", str(model_dir[0]), *common, "--fp8", "fp4")
    assert rc == 2 and "invalid choice" in err
    assert not (tmp_path / "out.npy").exists()


def test_generate_contract(model_dir, tmp_path, capsys):
    """`fp8rl generate` writes only the generated tokens and their logprobs, as the engine does."""
    import json

    from fp8rl_jax.rollout.engine import EngineConfig, JaxEngine
    from fp8rl_jax.rollout.sampling import SamplingConfig

    folder, params = model_dir
    prompts = [[5, 6, 7], [9], [10, 11, 12, 13, 14, 15]]
    (tmp_path / "in.json").write_text(json.dumps(prompts))
    proc = run_cli("generate", "--model", str(folder), "--prompts", str(tmp_path / "in.json"), "--max-new-tokens", "6",
                   "--temperature", "0.9", "--top-p", "0.95", "--top-k", "50", "--seed", "3", "--ignore-eos",
                   "--dtype", "float32", "--out", str(tmp_path / "out.json"))
    assert proc.returncode == 0, proc.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    assert set(out) == {"tokens", "logprobs"}
    assert [len(t) for t in out["tokens"]] == [6, 6, 6] and [len(lp) for lp in out["logprobs"]] == [6, 6, 6]
    sampling = [SamplingConfig(temperature=0.9, top_p=0.95, top_k=50, max_tokens=6, ignore_eos=True, seed=3 + i)
                for i in range(3)]
    # the engine as `fp8rl generate` sizes it (slots, pages, lengths): the CLI's compiled programs, from the
    # compilation cache the child filled, and a pool of 5 pages (the default 1 GiB pool: seconds per decode call)
    ref = JaxEngine(tiny_qwen3, params, EngineConfig(max_slots=3, page_size=16, num_pages=5, max_seq_len=12,
                                                     steps_per_call=8, dtype="float32")).generate(prompts, sampling)
    assert out["tokens"] == ref.token_lists()
    np.testing.assert_allclose(out["logprobs"], ref.logprob_lists(), atol=1e-5)
    for mode in ("w8a8", "kv", "all"):  # the other precisions, in this process (no interpreter start each)
        rc, err = run_cli_here(capsys, "generate", "--model", str(folder), "--prompts", str(tmp_path / "in.json"),
                               "--max-new-tokens", "3", "--fp8", mode, "--out", str(tmp_path / f"{mode}.json"))
        assert rc == 0, err
        assert [len(t) for t in json.loads((tmp_path / f"{mode}.json").read_text())["tokens"]] == [3, 3, 3]


@pytest.mark.parametrize(
    "prompts, extra, match",
    [
        ([[1, 2], []], [], "request 1: the prompt is empty"),
        ([[1, 300]], [], r"request 0: token id 300 is outside the vocabulary \[0, 256\)"),
        ([[1] * 600], [], "request 0: .*max_seq_len"),
        ([[1, 2]], ["--max-new-tokens", "0"], "max_tokens"),
        ("not a list", [], "expected a non-empty JSON list"),
    ],
    ids=["empty", "vocab", "too_long", "max_tokens", "format"],
)
def test_generate_bad_input(model_dir, tmp_path, capsys, prompts, extra, match):
    import json

    (tmp_path / "in.json").write_text(json.dumps(prompts))
    args = ["generate", "--model", str(model_dir[0]), "--prompts", str(tmp_path / "in.json"), "--max-new-tokens", "4",
            "--out", str(tmp_path / "out.json")]
    if "--max-new-tokens" in extra:
        args[args.index("--max-new-tokens") + 1] = extra[1]
        extra = []
    rc, err = run_cli_here(capsys, *args, *extra)
    assert rc == 2 and re.search(match, err), err
    assert not (tmp_path / "out.json").exists()


def test_generate_fills_and_reuses_the_compilation_cache(model_dir, tmp_path):
    """Entry points turn on JAX's persistent compilation cache (``fp8rl_jax.environment``): the
    first `fp8rl generate` stores its programs in ``$FP8RL_COMPILATION_CACHE``, the second loads
    them (no new entry) and writes the same output."""
    import json

    folder, _ = model_dir
    (tmp_path / "in.json").write_text(json.dumps([[5, 6, 7], [9, 10]]))
    cache = tmp_path / "cache"
    # JAX_COMPILATION_CACHE_DIR (CI sets one for the suite) would take precedence: unset it here
    env = {"FP8RL_COMPILATION_CACHE": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_COMPILATION_CACHE_DIR": ""}
    args = ["generate", "--model", str(folder), "--prompts", str(tmp_path / "in.json"), "--max-new-tokens", "4",
            "--seed", "1", "--dtype", "float32"]
    outs = []
    for i in range(2):
        proc = run_cli(*args, "--out", str(tmp_path / f"o{i}.json"), env=env)
        assert proc.returncode == 0, proc.stderr
        outs.append(json.loads((tmp_path / f"o{i}.json").read_text()))
        entries = sorted(p.name for p in cache.iterdir())
        if i == 0:
            first = entries
    assert len(first) > 3 and entries == first and outs[0] == outs[1]


def test_compilation_cache_choice(tmp_path, monkeypatch):
    """``off`` leaves the cache off and a folder already given to JAX is kept (no subprocess: the
    choice is made before anything is configured)."""
    from fp8rl_jax.environment import CACHE_ENV, enable_compilation_cache

    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "given"))
        assert enable_compilation_cache(tmp_path / "mine") == tmp_path / "given"
        assert not (tmp_path / "mine").exists()
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv(CACHE_ENV, "off")
        assert enable_compilation_cache() is None and enable_compilation_cache("off") is None
        assert not jax.config.jax_compilation_cache_dir
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
