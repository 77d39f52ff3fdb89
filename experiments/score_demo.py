"""Scoring demo: the tiny checkpoint the README's ``fp8rl`` walk-through uses, and a check of it.

Builds a tiny random Qwen3 and a character tokenizer in-process and writes them as a Hugging Face
folder ``OUT/model`` (config.json, model.safetensors, tokenizer.json), the token ids of a few
sentences as ``OUT/tokens.npy`` (int32 [B, T], what ``fp8rl score --tokens`` reads) and two text
prompts as ``OUT/prompts.txt`` (one a line, what ``fp8rl generate --tokenizer`` reads); then
scores the sentences with the ``fp8rl score`` command and checks the logits against the
in-process JAX forward. Runs on the CPU in well under a minute.

    python experiments/score_demo.py [--out runs/score_demo] [--preset tiny_qwen3]
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from configs.models import PRESETS
from fp8rl_jax.checkpoint import load_checkpoint, save_checkpoint
from fp8rl_jax.models import DensePolicy, ModelConfig, forward, init_params
from fp8rl_jax.tokenization import char_tokenizer

SENTENCES = ["12 + 34 = 46", "The answer is 42.", "FP8 rollout, BF16 learning."]
PROMPTS = ["12 + 34 =", "The answer is"]


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    model: ModelConfig = PRESETS["tiny_qwen3"]
    out: Path = Path("runs/score_demo")
    seed: int = 0


def main(config: DemoConfig) -> dict:
    tok = char_tokenizer()
    # the vocabulary and EOS are the tokenizer's, so that every id the random model generates decodes to text
    model_cfg = dataclasses.replace(config.model, vocab_size=tok.get_vocab_size(), bos_token_id=None,
                                    eos_token_ids=(tok.token_to_id("<eos>"),))
    model_dir = config.out / "model"
    params = init_params(model_cfg, jax.random.key(config.seed), jnp.bfloat16)
    save_checkpoint(model_dir, params, model_cfg)
    tok.save(str(model_dir / "tokenizer.json"))
    ckpt = load_checkpoint(model_dir, dtype=jnp.float32)
    ids = [ckpt.tokenizer.encode(s).ids for s in SENTENCES]
    T = max(len(i) for i in ids)
    tokens = np.zeros((len(ids), T), np.int32)
    for b, row in enumerate(ids):
        tokens[b, : len(row)] = row
    np.save(config.out / "tokens.npy", tokens)
    (config.out / "prompts.txt").write_text("".join(f"{p}\n" for p in PROMPTS))

    cmd = [sys.executable, "-m", "fp8rl_jax.cli", "score", "--model", str(model_dir), "--tokens",
           str(config.out / "tokens.npy"), "--out", str(config.out / "logits.npy"), "--dtype", "float32"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - start
    logits = np.load(config.out / "logits.npy")
    ref = np.asarray(forward(ckpt.params, tokens, config=ckpt.config, policy=DensePolicy("float32"))[0])
    rel = float(np.linalg.norm(logits - ref) / np.linalg.norm(ref))
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -np.take_along_axis(np.asarray(logp[:, :-1]), tokens[:, 1:, None], -1)[..., 0]
    mask = np.zeros_like(nll, bool)
    for b, row in enumerate(ids):
        mask[b, : len(row) - 1] = True
    summary = {
        "model": f"{model_cfg.architecture} {ckpt.config.num_layers}L D={model_cfg.hidden_size} V={model_cfg.vocab_size}",
        "params": int(sum(x.size for x in jax.tree.leaves(ckpt.params))),
        "logits_shape": list(logits.shape),
        "cli_vs_inprocess_rel_err": rel,
        "mean_nll": float(nll[mask].mean()),
        "uniform_nll": float(np.log(model_cfg.vocab_size)),
        "cli_wall_s": round(wall, 2),
    }
    print("\nfp8rl score demo")
    for k, v in summary.items():
        print(f"  {k:26s} {v}")
    if rel > 1e-5:
        raise SystemExit(f"CLI logits differ from the in-process forward (rel err {rel:.2e})")
    return summary


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DemoConfig.out)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny_qwen3")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    main(DemoConfig(model=PRESETS[a.preset], out=a.out, seed=a.seed))
