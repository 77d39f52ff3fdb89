"""The `fp8rl` contract: exact flags, float32 [B, T, V] logits, generated tokens (and text with --tokenizer),
and bad input of every kind answered by exit status 2 and one `error:` line, with no output written and
no input changed."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.models import tiny_qwen3 as _tiny_qwen3
from conftest import REPO, run_cli, run_cli_here
from fp8rl_jax.checkpoint import load_checkpoint, save_checkpoint
from fp8rl_jax.models import DensePolicy, forward, init_params
from fp8rl_jax.tasks.datasets import chat_prompt
from fp8rl_jax.tokenization import char_tokenizer

# The tiny preset with one decoder layer: the CLI's contracts (flags, shapes, dtypes, errors) do not depend on
# depth, and every `fp8rl` call here compiles its programs (XLA's CPU compile grows with the layers).
tiny_qwen3 = dataclasses.replace(_tiny_qwen3, num_layers=1)


def _snapshot(*roots: Path) -> dict:
    """(bytes, mtime, mode) of every file under ``roots`` (hidden temporaries included), by path."""
    files = [f for r in roots for f in ([r] if r.is_file() else sorted(r.rglob("*"))) if f.is_file()]
    return {f: (f.read_bytes(), f.stat().st_mtime_ns, f.stat().st_mode) for f in files} | {
        d: "dir" for r in roots if r.is_dir() for d in r.rglob("*") if d.is_dir()}


def _one_line(err: str) -> bool:
    return err.startswith("error: ") and err.count("\n") == 1 and err.endswith("\n")


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
        ([[1] * 600], [], "request 0: prompt of 600 tokens .* exceeds the model's max_position_embeddings 512"),
        ([[1, 2]], ["--max-new-tokens", "1000"],
         r"request 0: prompt of 2 tokens \+ --max-new-tokens 1000 = 1002 exceeds the model's max_position_embeddings 512"),
        ([[1] * 500], ["--max-new-tokens", "13"], r"= 513 exceeds"),
        (["some text"], [], r"request 0 is text; pass --tokenizer DIR"),
        ([[1, True]], [], r"request 0 is not a list of integer token ids"),
        ([[1, 2]], ["--max-new-tokens", "0"], "max_tokens"),
        ("not a list", [], "expected a non-empty JSON list"),
    ],
    ids=["empty", "vocab", "too_long", "past_positions", "one_past", "text_without_tokenizer", "bool", "max_tokens",
         "format"],
)
def test_generate_bad_input(model_dir, tmp_path, capsys, prompts, extra, match):
    """A request longer than the model's positions is refused, not clipped (a clip would return fewer tokens
    than asked with exit 0)."""
    (tmp_path / "in.json").write_text(json.dumps(prompts))
    args = ["generate", "--model", str(model_dir[0]), "--prompts", str(tmp_path / "in.json"), "--max-new-tokens", "4",
            "--out", str(tmp_path / "out.json")]
    if "--max-new-tokens" in extra:
        args[args.index("--max-new-tokens") + 1] = extra[1]
        extra = []
    before = _snapshot(tmp_path)
    rc, err = run_cli_here(capsys, *args, *extra)
    assert rc == 2 and re.search(match, err), err
    assert _one_line(err) and _snapshot(tmp_path) == before


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


@pytest.fixture
def own_model(model_dir, tmp_path):
    """A copy of the tiny checkpoint in this test's folder (tests that try to clobber it cannot harm the others)."""
    return Path(shutil.copytree(model_dir[0], tmp_path / "model"))


@pytest.mark.parametrize(
    "content, match",
    [
        (b"", "the file is empty"),
        (b"[[1, 2, 3]]\n", "a text file, not a .npy file"),
        (b"\x00\x01\x02\x03\x04\x05\x06", "not a .npy file"),
        ("npz", "a .npz archive"),
        ("object", r"Python objects \(pickled data\)"),
        ("truncated", "truncated|not a readable .npy array"),
        ("dir", "is a directory"),
    ],
    ids=["empty", "json", "binary", "npz", "object", "truncated", "dir"],
)
def test_score_unreadable_tokens_file(model_dir, tmp_path, capsys, content, match):
    """One line naming the file and what was expected, never a traceback (EOFError, pickle messages)."""
    path = tmp_path / "in.npy"
    if content == "npz":
        np.savez(tmp_path / "in", a=np.zeros((1, 2), np.int32))
        path = tmp_path / "in.npz"
    elif content == "object":
        np.save(path, np.array([[1, "a"]], dtype=object), allow_pickle=True)
    elif content == "truncated":
        np.save(path, np.zeros((4, 64), np.int32))
        path.write_bytes(path.read_bytes()[:200])
    elif content == "dir":
        path.mkdir()
    else:
        path.write_bytes(content)
    before = _snapshot(tmp_path)
    rc, err = run_cli_here(capsys, "score", "--model", str(model_dir[0]), "--tokens", str(path), "--out",
                           str(tmp_path / "out.npy"))
    assert rc == 2 and _one_line(err) and f"--tokens {path}: " in err and re.search(match, err), err
    assert "expected an int32 [B, T] array saved by numpy.save" in err, err
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "content, name, match",
    [
        ("", "in.json", "not JSON"),
        (b"\xff\xfe\x00", "in.json", "not UTF-8 text"),
        ("[[1, 2]]\n{oops\n", "in.jsonl", "line 2 is not JSON"),
        ("\n  \n", "in.txt", "no request"),
        ("[]", "in.json", "no request"),
        ('[{"text": "x"}]', "in.json", "request 0 is not a list of integer token ids"),
        (None, "in.json", "is a directory"),
    ],
    ids=["empty", "binary", "jsonl_line", "txt_blank", "json_empty_list", "object_without_prompt", "dir"],
)
def test_generate_unreadable_prompts_file(model_dir, tmp_path, capsys, content, name, match):
    path = tmp_path / name
    if content is None:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    before = _snapshot(tmp_path)
    rc, err = run_cli_here(capsys, "generate", "--model", str(model_dir[0]), "--prompts", str(path),
                           "--max-new-tokens", "2", "--out", str(tmp_path / "out.json"))
    assert rc == 2 and _one_line(err) and f"--prompts {path}: " in err and re.search(match, err), err
    assert _snapshot(tmp_path) == before


def _clobber_cases():
    """(id, command, how --out is made from the test folder) of every way an --out can name an input."""
    return [
        ("score_out_is_tokens", "score", lambda d: d / "in.npy"),
        ("score_out_is_tokens_spelled_otherwise", "score", lambda d: d / "model" / ".." / "in.npy"),
        ("score_out_symlink_to_tokens", "score", lambda d: _link(d / "link.npy", d / "in.npy", hard=False)),
        ("score_out_hard_link_of_tokens", "score", lambda d: _link(d / "hard.npy", d / "in.npy", hard=True)),
        ("score_out_is_weights", "score", lambda d: d / "model" / "model.safetensors"),
        ("score_out_new_file_in_model", "score", lambda d: d / "model" / "logits.npy"),
        ("score_out_hard_link_of_weights", "score",
         lambda d: _link(d / "w.npy", d / "model" / "model.safetensors", hard=True)),
        ("generate_out_is_prompts", "generate", lambda d: d / "in.json"),
        ("generate_out_is_config", "generate", lambda d: d / "model" / "config.json"),
        ("generate_out_is_tokenizer", "generate", lambda d: d / "tok" / "tokenizer.json"),
        ("generate_out_symlink_to_prompts", "generate", lambda d: _link(d / "o.json", d / "in.json", hard=False)),
        ("quantize_out_is_model", "quantize", lambda d: d / "model"),
        ("quantize_out_symlink_to_model", "quantize", lambda d: _link(d / "m2", d / "model", hard=False)),
        ("quantize_out_inside_model", "quantize", lambda d: d / "model" / "fp8"),
    ]


def _link(link: Path, target: Path, hard: bool) -> Path:
    if hard:
        os.link(target, link)
    else:
        link.symlink_to(target)
    return link


@pytest.mark.parametrize("case", _clobber_cases(), ids=lambda c: c[0])
def test_out_never_overwrites_an_input(own_model, tmp_path, capsys, case):
    """An --out that resolves to an input (path, symlink or hard link), to a file of the model folder or into
    that folder is refused before any work: exit 2, one line, every file as it was."""
    _, command, make_out = case
    np.save(tmp_path / "in.npy", np.ones((1, 4), np.int32))
    (tmp_path / "in.json").write_text("[[1, 2]]")
    (tmp_path / "tok").mkdir()
    char_tokenizer().save(str(tmp_path / "tok" / "tokenizer.json"))
    out = make_out(tmp_path)
    args = {
        "score": ["score", "--model", str(own_model), "--tokens", str(tmp_path / "in.npy")],
        "generate": ["generate", "--model", str(own_model), "--prompts", str(tmp_path / "in.json"),
                     "--max-new-tokens", "2", "--tokenizer", str(tmp_path / "tok")],
        "quantize": ["quantize", "--model", str(own_model)],
    }[command]
    before = _snapshot(tmp_path)
    rc, err = run_cli_here(capsys, *args, "--out", str(out))
    assert rc == 2 and _one_line(err) and f"--out {out}" in err, err
    assert re.search("refusing to overwrite|inside the --model folder", err), err
    assert _snapshot(tmp_path) == before


def _read_only_dir(tmp_path: Path) -> Path:
    """A folder where no file can be created. Root ignores file modes, so there it is sysfs, which refuses
    new files to everyone."""
    if os.geteuid() == 0:
        return Path("/sys")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    return ro


@pytest.mark.parametrize("command", ["score", "generate", "quantize"])
@pytest.mark.parametrize("where", ["read_only", "a_directory", "under_a_file"])
def test_out_location_checked_before_any_work(own_model, tmp_path, capsys, command, where):
    """Unwritable or impossible --out: exit 2, one line, before loading weights; no temporary file left (an --out
    that was a directory used to leave `.NAME.tmp` behind)."""
    np.save(tmp_path / "in.npy", np.ones((1, 4), np.int32))
    (tmp_path / "in.json").write_text("[[1, 2]]")
    if where == "read_only":
        out, match = _read_only_dir(tmp_path) / "sub" / "out", "cannot create files in"
    elif where == "a_directory":
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "keep").write_text("x")
        out, match = tmp_path / "d", "is a directory|not an empty folder"
    else:
        out, match = tmp_path / "in.json" / "out", "is not a directory"
    args = {
        "score": ["score", "--model", str(own_model), "--tokens", str(tmp_path / "in.npy")],
        "generate": ["generate", "--model", str(own_model), "--prompts", str(tmp_path / "in.json"),
                     "--max-new-tokens", "2"],
        "quantize": ["quantize", "--model", str(own_model)],
    }[command]
    before = _snapshot(tmp_path)
    try:
        rc, err = run_cli_here(capsys, *args, "--out", str(out))
    finally:
        if out.parents[1] == tmp_path / "ro":
            out.parents[1].chmod(0o755)
    assert rc == 2 and _one_line(err) and f"--out {out}" in err and re.search(match, err), err
    assert _snapshot(tmp_path) == before
    if where == "read_only":
        assert not out.parent.exists()


def test_quantize_refuses_layer_counts_that_leave_no_fp8(model_dir, tmp_path, capsys):
    """`--bf16-first-layers 99` used to write an 'FP8' checkpoint without one FP8 weight."""
    before = _snapshot(tmp_path)
    for flags in (["--bf16-first-layers", "99"], ["--bf16-last-layers", "1"],
                  ["--bf16-first-layers", "1", "--bf16-last-layers", "1"]):
        rc, err = run_cli_here(capsys, "quantize", "--model", str(model_dir[0]), "--out", str(tmp_path / "fp8"), *flags)
        assert rc == 2 and _one_line(err) and "keep all 1 decoder layers" in err and "no FP8 weight" in err, err
    rc, err = run_cli_here(capsys, "quantize", "--model", str(model_dir[0]), "--out", str(tmp_path / "fp8"),
                           "--bf16-first-layers", "-1")
    assert rc == 2 and _one_line(err) and ">= 0" in err
    assert _snapshot(tmp_path) == before


def test_score_reports_what_the_checkpoint_is(model_dir, tmp_path, capsys):
    """The summary line names the checkpoint's precision: an FP8 checkpoint scored with --fp8 none used to read
    `fp8 none`, as if no FP8 were involved."""
    fp8 = tmp_path / "fp8"
    assert run_cli_here(capsys, "quantize", "--model", str(model_dir[0]), "--out", str(fp8))[0] == 0
    np.save(tmp_path / "in.npy", np.ones((1, 4), np.int32))
    lines = {}
    for name, model, mode in [("fp8_none", fp8, "none"), ("fp8_w8a8", fp8, "w8a8"), ("f32_all", model_dir[0], "all")]:
        capsys.readouterr()
        from fp8rl_jax.cli import main

        assert main(["score", "--model", str(model), "--tokens", str(tmp_path / "in.npy"), "--out",
                     str(tmp_path / f"{name}.npy"), "--fp8", mode, "--dtype", "float32"]) == 0
        lines[name] = capsys.readouterr().out
    assert "a block-FP8 checkpoint: its FP8 weights dequantized to float32; --fp8 none" in lines["fp8_none"]
    assert "a block-FP8 checkpoint: its FP8 weights, FP8 activations (W8A8); --fp8 w8a8" in lines["fp8_w8a8"]
    assert ("a float32 checkpoint: weights quantized to FP8 on load, FP8 activations (W8A8), FP8 KV cache; "
            "--fp8 all") in lines["f32_all"]


def test_outputs_follow_the_umask(model_dir, tmp_path, capsys):
    """Logits, generations and quantized checkpoints get the modes of a plain open()/mkdir: 0644/0755 under umask
    022 (the temporary-file path used to leave them 0600), 0640/0750 under 027."""
    np.save(tmp_path / "in.npy", np.ones((1, 4), np.int32))
    (tmp_path / "in.json").write_text("[[1, 2]]")
    for mask, fmode, dmode in [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)]:
        old = os.umask(mask)
        try:
            d = tmp_path / f"u{mask:o}"
            common = ["--model", str(model_dir[0]), "--quiet"]
            assert run_cli_here(capsys, "score", *common, "--tokens", str(tmp_path / "in.npy"), "--out",
                                str(d / "logits.npy"))[0] == 0
            assert run_cli_here(capsys, "generate", *common, "--prompts", str(tmp_path / "in.json"),
                                "--max-new-tokens", "2", "--out", str(d / "gen.json"))[0] == 0
            assert run_cli_here(capsys, "quantize", *common, "--out", str(d / "fp8"))[0] == 0
            save_checkpoint(d / "saved", load_checkpoint(model_dir[0], dtype=jnp.float32).params, tiny_qwen3)
        finally:
            os.umask(old)
        files = [d / "logits.npy", d / "gen.json", *(d / "fp8").iterdir(), *(d / "saved").iterdir()]
        assert {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == {f.name: oct(fmode) for f in files}
        for folder in (d, d / "fp8", d / "saved"):
            assert stat.S_IMODE(folder.stat().st_mode) == dmode, folder
        assert not [p for p in d.rglob(".*")], "temporary files left behind"


def test_two_quantizes_into_one_output(model_dir, tmp_path):
    """Two `fp8rl quantize` processes racing for one --out: each stages in a folder of its own, so one finishes and
    the other refuses (or finds the output written); the result is a valid FP8 checkpoint and nothing is left
    beside it."""
    out = tmp_path / "fp8"
    cmd = [sys.executable, "-m", "fp8rl_jax.cli", "quantize", "--model", str(model_dir[0]), "--out", str(out)]
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    assert sorted(rc for rc, _ in results)[0] == 0 and {rc for rc, _ in results} <= {0, 2}, results
    for rc, err in results:
        if rc == 2:
            assert _one_line(err) and re.search("not an empty folder|filled by another writer", err), err
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    load_checkpoint(out, fp8=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Two character tokenizers: one of a chat model (it has <|im_start|>; <|im_end|> is id 1, the tiny model's
    EOS) and a plain one."""
    root = tmp_path_factory.mktemp("tok")
    (root / "chat").mkdir()
    (root / "plain").mkdir()
    char_tokenizer(special_tokens=("<pad>", "<|im_end|>", "<|im_start|>")).save(str(root / "chat" / "tokenizer.json"))
    char_tokenizer().save(str(root / "plain" / "tokenizer.json"))
    return root


def test_generate_text_prompts(model_dir, tokenizers, tmp_path, capsys):
    """`--tokenizer DIR`: text prompts (.txt, .jsonl, JSON strings) are encoded, in Qwen's chat format when the
    tokenizer has <|im_start|>; the output adds the decoded text and the prompt ids, and the generation is the one
    the same ids give through the token-id contract."""
    from fp8rl_jax.checkpoint import load_tokenizer

    (tmp_path / "in.txt").write_text("12 + 34 =\n\nThe answer is\n")
    common = ["--model", str(model_dir[0]), "--max-new-tokens", "3", "--temperature", "0", "--ignore-eos",
              "--dtype", "float32", "--quiet"]
    chat_tok = load_tokenizer(tokenizers / "chat")
    rc, err = run_cli_here(capsys, "generate", *common, "--prompts", str(tmp_path / "in.txt"), "--tokenizer",
                           str(tokenizers / "chat"), "--out", str(tmp_path / "chat.json"))
    assert rc == 0, err
    out = json.loads((tmp_path / "chat.json").read_text())
    assert set(out) == {"tokens", "logprobs", "text", "prompt_tokens"}
    assert out["prompt_tokens"] == [chat_tok.encode(chat_prompt(q)).ids for q in ("12 + 34 =", "The answer is")]
    assert out["prompt_tokens"][0][0] == chat_tok.token_to_id("<|im_start|>")
    assert out["text"] == [chat_tok.decode(t, skip_special_tokens=True) for t in out["tokens"]]
    assert [len(t) for t in out["tokens"]] == [3, 3]
    # the model's 256 ids outnumber the tokenizer's: ids past them decode to nothing, and that is said
    known = chat_tok.get_vocab_size()
    unknown = sum(t >= known for row in out["tokens"] for t in row)
    assert (f"warning: {unknown} of 6 generated ids are past the tokenizer's {known} tokens" in err) == (unknown > 0)
    # the same requests as token ids (the unchanged contract) generate the same tokens
    (tmp_path / "ids.json").write_text(json.dumps(out["prompt_tokens"]))
    rc, err = run_cli_here(capsys, "generate", *common, "--prompts", str(tmp_path / "ids.json"), "--out",
                           str(tmp_path / "ids_out.json"))
    assert rc == 0, err
    ids_out = json.loads((tmp_path / "ids_out.json").read_text())
    assert set(ids_out) == {"tokens", "logprobs"} and ids_out["tokens"] == out["tokens"]
    # .jsonl (a string, an object, token ids); a plain tokenizer or --no-chat-template encodes the text as given
    (tmp_path / "in.jsonl").write_text('"12 + 34 ="\n{"prompt": "The answer is"}\n[5, 6, 7]\n')
    plain_tok = load_tokenizer(tokenizers / "plain")
    for tok_dir, flags, tok in [("plain", [], plain_tok), ("chat", ["--no-chat-template"], chat_tok)]:
        rc, err = run_cli_here(capsys, "generate", *common, *flags, "--prompts", str(tmp_path / "in.jsonl"),
                               "--tokenizer", str(tokenizers / tok_dir), "--out", str(tmp_path / f"{tok_dir}.json"))
        assert rc == 0, err
        got = json.loads((tmp_path / f"{tok_dir}.json").read_text())
        assert got["prompt_tokens"] == [tok.encode("12 + 34 =").ids, tok.encode("The answer is").ids, [5, 6, 7]]
        assert got["text"] == [tok.decode(t, skip_special_tokens=True) for t in got["tokens"]]


def test_generate_tokenizer_errors(model_dir, tokenizers, tmp_path, capsys):
    (tmp_path / "in.txt").write_text("hello\n")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    (tmp_path / "long.txt").write_text("x" * 500 + "\n")
    before = _snapshot(tmp_path)
    for tok, match in [(tmp_path / "nope", "not a directory"), (tmp_path, "no tokenizer.json in it"),
                       (tmp_path / "broken", "cannot be read as a tokenizer")]:
        rc, err = run_cli_here(capsys, "generate", "--model", str(model_dir[0]), "--prompts", str(tmp_path / "in.txt"),
                               "--max-new-tokens", "2", "--tokenizer", str(tok), "--out", str(tmp_path / "o.json"))
        assert rc == 2 and _one_line(err) and "--tokenizer " in err and match in err, err
    rc, err = run_cli_here(capsys, "generate", "--model", str(model_dir[0]), "--prompts", str(tmp_path / "in.txt"),
                           "--max-new-tokens", "2", "--out", str(tmp_path / "o.json"))
    assert rc == 2 and _one_line(err) and "request 0 is text; pass --tokenizer DIR" in err, err
    # a text prompt past the positions once encoded (chat format included)
    rc, err = run_cli_here(capsys, "generate", "--model", str(model_dir[0]), "--prompts", str(tmp_path / "long.txt"),
                           "--max-new-tokens", "2", "--tokenizer", str(tokenizers / "chat"), "--out",
                           str(tmp_path / "o.json"))
    assert rc == 2 and _one_line(err) and re.search(r"request 0: prompt of 5\d\d tokens .* exceeds", err), err
    assert _snapshot(tmp_path) == before
