"""Shared fixtures: the Hugging Face reference (a subprocess in its own venv) and GPU markers."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
# entry points turn on a persistent compilation cache in ~/.cache (fp8rl_jax.environment); tests
# (and the CLI subprocesses they start) compile fresh and write nothing outside their tmp folders
os.environ.setdefault("FP8RL_COMPILATION_CACHE", "off")
HF_REFERENCE = REPO / "tests" / "hf_reference.py"
# The H200 image has no math-verify and nothing installs there: on a GPU the reward tests (which import it) are left
# out, so `pytest -m gpu tests` collects instead of stopping at that import. On the CPU a missing
# math-verify is still a collection error, as a broken install should be.
# (math-verify is looked up first, so where it is installed, as in CI, this starts no backend at import)
collect_ignore = (["test_rewards.py"] if importlib.util.find_spec("math_verify") is None and jax.default_backend() == "gpu"
                  else [])


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU; run on the device (README: GPU tests)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def cpu_devices_env(n: int, **extra: str) -> dict:
    """This process's environment for a child JAX process on the CPU with ``n`` host devices
    (multi-device tests need the flag before jax initializes, hence a subprocess)."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags, **extra}


def run_device_child(script: Path | str, out: Path, devices: int, timeout: int = 600) -> dict:
    """Runs ``python script out`` on ``devices`` CPU devices; returns the JSON it wrote to ``out``."""
    proc = subprocess.run([sys.executable, str(script), str(out)], check=False, capture_output=True, text=True,
                          env=cpu_devices_env(devices), cwd=REPO, timeout=timeout)
    assert proc.returncode == 0, f"{devices}-device child failed:\n{proc.stderr[-6000:]}"
    return json.loads(Path(out).read_text())


def ref_python() -> str:
    """The Python of the reference venv (CPU torch + transformers). Missing it is a failure:
    the parity tests are the point of the suite, so they never skip silently."""
    path = Path(os.environ.get("FP8RL_REF_PYTHON", REPO / ".venv-ref" / "bin" / "python"))
    if not path.exists():
        pytest.fail(f"HF reference interpreter {path} not found: run `make test` (it builds .venv-ref) "
                    "or point FP8RL_REF_PYTHON at a Python with torch and transformers")
    return str(path)


def hf_reference(*jobs: list[str], workdir: Path) -> None:
    """Runs ``hf_reference.py`` jobs (each the argument list of one of its commands) in one
    reference process: torch and transformers load once (seconds), however many jobs."""
    workdir.mkdir(parents=True, exist_ok=True)
    fd, jobs_file = tempfile.mkstemp(prefix="hf_jobs_", suffix=".json", dir=workdir)
    with os.fdopen(fd, "w") as f:
        json.dump([[str(a) for a in job] for job in jobs], f)
    cmd = [ref_python(), str(HF_REFERENCE), "batch", jobs_file]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode:
        raise RuntimeError(f"HF reference failed ({' '.join(cmd)}: {jobs}):\n{proc.stderr[-4000:]}")


def hf_build_job(out: Path, hf_config: dict, *, seed: int, dtype: str = "float32", max_shard_size: str | None = None,
                 tokens: np.ndarray | None = None) -> list[str]:
    """The ``hf_reference.py build`` job of a random HF checkpoint written with transformers'
    save_pretrained (and, with ``tokens``, HF's float32 logits of them from the saved folder:
    ``hf_logits``)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg_file = out.parent / f"{out.name}.config.json"
    cfg_file.write_text(json.dumps(hf_config))
    cmd = ["build", "--config", str(cfg_file), "--out", str(out), "--seed", str(seed), "--dtype", dtype]
    if max_shard_size:
        cmd += ["--max-shard-size", max_shard_size]
    if tokens is not None:
        np.save(out.parent / f"{out.name}.tokens.npy", tokens)
        cmd += ["--tokens", str(out.parent / f"{out.name}.tokens.npy"),
                "--logits-out", str(out.parent / f"{out.name}.logits.npy")]
    return cmd


def hf_logits(out: Path) -> np.ndarray:
    """HF's logits written by the ``hf_build_job`` of ``out``."""
    return np.load(out.parent / f"{out.name}.logits.npy")


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs ``fp8rl ARGS`` as a separate process, the way users and outside checks call it
    (``env``: variables added to this process's environment)."""
    return subprocess.run([sys.executable, "-m", "fp8rl_jax.cli", *args], capture_output=True, text=True,
                          cwd=REPO, env=None if env is None else {**os.environ, **env})


def run_cli_here(capsys, *args: str) -> tuple[int, str]:
    """Runs ``fp8rl ARGS`` in this process (for error paths: no interpreter start, no jax import);
    returns (exit status, stderr)."""
    from fp8rl_jax.cli import main

    capsys.readouterr()
    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse rejects its own arguments this way
        rc = e.code
    return rc, capsys.readouterr().err


def load_experiment(name: str):
    """The module ``experiments/<name>.py`` (scripts, not a package), registered in sys.modules."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


# Tiny HF configs covering: GQA, MQA (one kv head), head_dim != hidden/heads, tied and untied
# embeddings, single-file and sharded checkpoints, bf16 storage, MoE with renormalized and raw
# top-k weights, dense layers inside an MoE model (mlp_only_layers, decoder_sparse_step).
HF_CASES = {
    "dense": dict(
        hf={"architectures": ["Qwen3ForCausalLM"], "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "max_position_embeddings": 128, "rope_theta": 10000.0, "tie_word_embeddings": False},
        seed=1, dtype="float32", shard=None),
    "dense_tied_mqa_sharded": dict(
        hf={"architectures": ["Qwen3ForCausalLM"], "vocab_size": 80, "hidden_size": 48, "intermediate_size": 80,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
            "max_position_embeddings": 64, "rope_theta": 1000000.0, "tie_word_embeddings": True},
        seed=2, dtype="float32", shard="24KB"),
    "moe_sharded": dict(
        hf={"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
            "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [1], "max_position_embeddings": 128,
            "rope_theta": 10000.0, "tie_word_embeddings": False},
        seed=3, dtype="float32", shard="40KB"),
    "moe_bf16_step2": dict(
        hf={"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 72, "hidden_size": 32, "intermediate_size": 64,
            "moe_intermediate_size": 24, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 8, "num_experts": 6, "num_experts_per_tok": 3, "norm_topk_prob": False,
            "decoder_sparse_step": 2, "max_position_embeddings": 64, "rope_theta": 10000.0,
            "tie_word_embeddings": False},
        seed=4, dtype="bfloat16", shard=None),
}


# transformers' own greedy generate of these HF_CASES models (tests/test_engine.py compares the engine
# with it): prompts of these lengths drawn by ``hf_greedy_prompts``, this many new tokens, EOS ignored
HF_GREEDY_MODELS = ("dense", "moe_sharded")
HF_GREEDY_LENGTHS = (5, 11, 2)
HF_GREEDY_NEW_TOKENS = 8


def hf_greedy_prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(2, vocab, n).tolist() for n in HF_GREEDY_LENGTHS]


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_hf_models(root: Path) -> None:
    """The HF_CASES checkpoints, their tokens and logits, and the greedy continuations of
    HF_GREEDY_MODELS, in one reference process (torch and transformers load once)."""
    rng = np.random.default_rng(1234)
    jobs = []
    for name, case in HF_CASES.items():
        tokens = rng.integers(0, case["hf"]["vocab_size"], (3, 12)).astype(np.int32)
        jobs.append(hf_build_job(root / name, case["hf"], seed=case["seed"], dtype=case["dtype"],
                                 max_shard_size=case["shard"], tokens=tokens))
    for name in HF_GREEDY_MODELS:
        prompts = root / f"{name}.greedy_prompts.json"
        prompts.write_text(json.dumps(hf_greedy_prompts(HF_CASES[name]["hf"]["vocab_size"])))
        jobs.append(["greedy", "--model", root / name, "--prompts", prompts, "--max-new-tokens",
                     HF_GREEDY_NEW_TOKENS, "--out", root / f"{name}.greedy.json"])
    hf_reference(*jobs, workdir=root)


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """name -> (folder, tokens [3, 12] int32, HF float32 logits); built once per test run, all in
    one reference process. Under pytest-xdist the first worker that needs them builds them in the
    run's shared temporary folder and the others reuse them (the build is deterministic)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root = shared / "hf_models"
    with _file_lock(shared / "hf_models.lock"):
        if not (root / "complete").exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            _build_hf_models(root)
            (root / "complete").write_text("ok\n")
    return {name: (root / name, np.load(root / f"{name}.tokens.npy"), hf_logits(root / name)) for name in HF_CASES}


def hf_greedy(hf_models: dict, name: str) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, transformers' greedy continuations) of HF_GREEDY_MODELS ``name``, computed with the
    ``hf_models`` build."""
    root = hf_models[name][0].parent
    return (json.loads((root / f"{name}.greedy_prompts.json").read_text()),
            json.loads((root / f"{name}.greedy.json").read_text()))
