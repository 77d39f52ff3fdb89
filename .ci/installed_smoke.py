"""The installed wheel, used from outside the repository: its package data is there and the
``fp8rl`` commands work end to end on a tiny checkpoint made here (score, quantize, generate with
token-id and text prompts through ``--tokenizer``, and a refused ``--out``).

    python .ci/installed_smoke.py REPO   # run with the fresh venv's python, from a folder outside REPO
"""

from __future__ import annotations

import importlib.resources
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import configs
import fp8rl_jax
import pallas_kernels
from configs.models import tiny_qwen3
from fp8rl_jax.checkpoint import load_tokenizer, save_checkpoint
from fp8rl_jax.models import DensePolicy, forward, init_params
from fp8rl_jax.tokenization import char_tokenizer


def check(cond: bool, what: str) -> None:
    if not cond:
        sys.exit(f"installed smoke: FAILED: {what}")
    print(f"ok  {what}")


def run(*args: str, expect: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run([FP8RL, *args], capture_output=True, text=True)
    if proc.returncode != expect:
        print(proc.stdout, proc.stderr, file=sys.stderr)
    return proc


FP8RL = shutil.which("fp8rl", path=str(Path(sys.executable).parent))


def main(repo: Path) -> None:
    check(FP8RL is not None, "the fp8rl console script is installed beside this python")
    for pkg in (fp8rl_jax, pallas_kernels, configs):
        check(repo not in Path(pkg.__file__).resolve().parents, f"{pkg.__name__} is imported from the install")
    for pkg, folder in (("pallas_kernels", "pallas_kernels"), ("fp8rl_jax.quant", "fp8rl_jax/quant")):
        shipped = {p.name for p in importlib.resources.files(pkg).iterdir() if p.name.endswith(".json")}
        tracked = {p.name for p in (repo / folder).glob("*.json")}
        check(tracked <= shipped, f"{pkg} ships its tables {sorted(tracked)}")

    work = Path(tempfile.mkdtemp(prefix="fp8rl-installed-"))
    model, cfg = work / "tiny", tiny_qwen3
    params = init_params(cfg, jax.random.key(0), jnp.float32)
    save_checkpoint(model, params, cfg)
    char_tokenizer().save(str(model / "tokenizer.json"))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 7)).astype(np.int32)
    np.save(work / "tokens.npy", tokens)

    proc = run("score", "--model", str(model), "--tokens", str(work / "tokens.npy"), "--out", str(work / "logits.npy"),
               "--dtype", "float32", "--quiet")
    check(proc.returncode == 0, "fp8rl score exits 0")
    ref = np.asarray(forward(params, tokens, config=cfg, policy=DensePolicy("float32"))[0])
    logits = np.load(work / "logits.npy")
    check(logits.shape == ref.shape and np.allclose(logits, ref, rtol=1e-5, atol=1e-5),
          "fp8rl score's logits equal the in-process forward")

    proc = run("quantize", "--model", str(model), "--out", str(work / "fp8"), "--quiet")
    check(proc.returncode == 0 and (work / "fp8" / "config.json").exists(), "fp8rl quantize writes a checkpoint")
    quant = json.loads((work / "fp8" / "config.json").read_text()).get("quantization_config", {})
    check(quant.get("quant_method") == "fp8", "its config.json says block FP8")

    # one request as token ids, one as text (the tokenizer.json quantize copied along)
    (work / "prompts.json").write_text(json.dumps([[1, 2, 3], "12 + 3"]))
    proc = run("generate", "--model", str(work / "fp8"), "--prompts", str(work / "prompts.json"), "--max-new-tokens",
               "4", "--temperature", "0", "--ignore-eos", "--dtype", "float32", "--out", str(work / "gen.json"),
               "--tokenizer", str(work / "fp8"), "--quiet")
    check(proc.returncode == 0, "fp8rl generate --tokenizer on the FP8 checkpoint exits 0")
    out = json.loads((work / "gen.json").read_text())
    check([len(t) for t in out["tokens"]] == [4, 4] and [len(lp) for lp in out["logprobs"]] == [4, 4],
          "fp8rl generate writes 4 tokens and logprobs per prompt")
    tok = load_tokenizer(work / "fp8")
    check(out["prompt_tokens"] == [[1, 2, 3], tok.encode("12 + 3").ids]
          and out["text"] == [tok.decode(t, skip_special_tokens=True) for t in out["tokens"]],
          "fp8rl generate encodes the text prompt and decodes the generations")

    proc = run("score", "--model", str(work / "nope"), "--tokens", str(work / "tokens.npy"), "--out",
               str(work / "x.npy"), expect=2)
    check(proc.returncode == 2 and proc.stderr.startswith("error: ") and not (work / "x.npy").exists(),
          "bad input: exit 2, an error line, nothing written")
    before = (work / "tokens.npy").read_bytes()
    proc = run("score", "--model", str(model), "--tokens", str(work / "tokens.npy"), "--out", str(work / "tokens.npy"),
               expect=2)
    check(proc.returncode == 2 and "refusing to overwrite an input" in proc.stderr
          and (work / "tokens.npy").read_bytes() == before, "an --out naming the --tokens file is refused, input kept")
    shutil.rmtree(work)


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
