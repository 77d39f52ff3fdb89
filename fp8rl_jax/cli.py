"""The ``fp8rl`` command line.

  fp8rl score --model DIR --tokens IN.npy --out OUT.npy [--dtype float32|bfloat16] [--fp8 none|w8a8|kv|all]
  fp8rl quantize --model DIR --out DIR2 [--bf16-first-layers N] [--bf16-last-layers N]
  fp8rl generate --model DIR --prompts IN.json --max-new-tokens N [--temperature T] [--top-p P] [--top-k K]
                 [--seed S] [--ignore-eos] [--dtype float32|bfloat16] [--fp8 none|w8a8|kv|all] --out OUT.json

``score`` writes float32 logits [B, T, V] for int32 tokens [B, T] (full-sequence causal forward,
positions 0..T-1 in every row). ``--fp8 w8a8`` runs the FP8 linears of the rollout (weights
quantized in 128x128 blocks unless the checkpoint already is block FP8, activations per token in
1x128 groups); ``--fp8 kv`` reads K/V through the engine's E4M3 paged cache with scales
calibrated on the scored tokens; ``all`` does both. ``--dtype`` is the precision of the rest. ``quantize`` writes the
block-FP8 Hugging Face checkpoint that vLLM, SGLang and ``score`` load. Any bad input (missing folder, malformed checkpoint, token ids
outside the vocabulary, sequences longer than the model's limit) prints ``error: ...`` and exits
with status 2 without writing the output; the output is written atomically.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.checkpoint import CheckpointError, load_checkpoint
from fp8rl_jax.checkpoint.quantize import quantize_checkpoint
from fp8rl_jax.environment import enable_compilation_cache
from fp8rl_jax.models import DensePolicy, PagedKVCache, calibrate_kv_scales, forward
from fp8rl_jax.models.policy import Fp8Mode
from fp8rl_jax.quant.policy import LayerPolicy, W8A8Policy, quantize_params
from fp8rl_jax.rollout.config import EngineConfig
from fp8rl_jax.rollout.engine import JaxEngine
from fp8rl_jax.rollout.sampling import SamplingConfig

EXIT_BAD_INPUT = 2


class CliError(Exception):
    """A user-facing error: printed as ``error: <message>``, exit status 2."""


def _save_npy_atomic(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_tokens(path: Path, vocab_size: int, max_len: int) -> np.ndarray:
    try:
        tokens = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise CliError(f"--tokens {path}: file not found") from None
    except ValueError as e:
        raise CliError(f"--tokens {path}: not a .npy array ({e})") from None
    if not np.issubdtype(tokens.dtype, np.integer):
        raise CliError(f"--tokens {path}: expected an integer (int32) array, got {tokens.dtype}")
    if tokens.ndim != 2 or 0 in tokens.shape:
        raise CliError(f"--tokens {path}: expected a non-empty [B, T] array, got shape {tokens.shape}")
    if tokens.shape[1] > max_len:
        raise CliError(
            f"--tokens {path}: sequence length {tokens.shape[1]} exceeds the model's "
            f"max_position_embeddings {max_len}"
        )
    bad = np.argwhere((tokens < 0) | (tokens >= vocab_size))
    if bad.size:
        b, t = bad[0]
        raise CliError(
            f"--tokens {path}: token id {int(tokens[b, t])} at [{b}, {t}] is outside the vocabulary "
            f"[0, {vocab_size}) ({len(bad)} such ids)"
        )
    return tokens.astype(np.int32)


def score(args: argparse.Namespace) -> int:
    mode = Fp8Mode(args.fp8)
    model_dir = _model_dir(args.model)
    fp8 = mode.fp8_weights
    fp8_kv = mode.fp8_kv
    try:
        ckpt = load_checkpoint(model_dir, dtype=jnp.dtype(args.dtype), fp8=fp8, check_finite=args.check_finite)
    except CheckpointError as e:
        raise CliError(str(e)) from None
    cfg = ckpt.config
    params = ckpt.params
    if fp8 and not ckpt.hf_config.get("quantization_config"):  # an FP8 checkpoint keeps its own layer choice
        params = jax.jit(lambda p: quantize_params(p, cfg))(params)
    if args.batch_size is not None and args.batch_size < 1:
        raise CliError(f"--batch-size must be >= 1, got {args.batch_size}")
    tokens = _read_tokens(Path(args.tokens), cfg.vocab_size, cfg.max_position_embeddings)
    B, T = tokens.shape
    bs = min(args.batch_size or B, B)
    policy = W8A8Policy(args.dtype) if fp8 else DensePolicy(args.dtype)

    def score_chunk(p, t):
        if not fp8_kv:
            return forward(p, t, config=cfg, policy=policy)[0]
        # FP8 KV: the causal forward through an E4M3 paged cache, as the rollout engine reads it,
        # with per-layer scales calibrated on this chunk (p99.9 x 1.05 / 448 of |K| and |V|).
        n, page = t.shape[0], 16
        pages = -(-T // page)
        k_scale, v_scale = calibrate_kv_scales(p, t, jnp.full((n,), T), config=cfg, policy=policy)
        cache = PagedKVCache.init(cfg.num_layers, n * pages, page, cfg.num_kv_heads, cfg.head_dim, n, pages,
                                  jnp.float8_e4m3fn)
        cache = cache.replace(page_table=jnp.arange(n * pages, dtype=jnp.int32).reshape(n, pages),
                              k_scale=k_scale, v_scale=v_scale)
        return forward(p, t, config=cfg, policy=policy, cache=cache)[0]

    fwd = jax.jit(score_chunk)
    out = np.empty((B, T, cfg.vocab_size), np.float32)
    start = time.perf_counter()
    for i in range(0, B, bs):
        chunk = tokens[i : i + bs]
        n = len(chunk)
        if n < bs:  # pad the last chunk so every call has one shape (one compilation)
            chunk = np.concatenate([chunk, np.zeros((bs - n, T), np.int32)])
        out[i : i + n] = np.asarray(fwd(params, chunk))[:n]
    elapsed = time.perf_counter() - start
    if not np.isfinite(out).all():
        print("warning: the logits contain NaN/Inf values", file=sys.stderr)
    _save_npy_atomic(Path(args.out), out)
    if not args.quiet:
        print(
            f"scored {B}x{T} tokens with {cfg.architecture} ({args.dtype}, fp8 {mode.value}) in {elapsed:.2f}s "
            f"(compile included) -> {args.out} float32 {list(out.shape)}"
        )
    return 0


def _model_dir(path: str) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise CliError(f"--model {folder}: not a directory")
    return folder


def quantize(args: argparse.Namespace) -> int:
    try:
        layer_policy = LayerPolicy(bf16_first_layers=args.bf16_first_layers, bf16_last_layers=args.bf16_last_layers)
        start = time.perf_counter()
        summary = quantize_checkpoint(_model_dir(args.model), Path(args.out), layer_policy)
    except (CheckpointError, ValueError) as e:
        raise CliError(str(e)) from None
    if not args.quiet:
        print(f"wrote {args.out}: {summary['quantized']} weights in FP8 (E4M3, 128x128 blocks), "
              f"{summary['copied']} tensors kept, {summary['files']} files, {time.perf_counter() - start:.1f}s")
    return 0


def _read_prompts(path: Path) -> list[list[int]]:
    try:
        prompts = json.loads(path.read_text())
    except FileNotFoundError:
        raise CliError(f"--prompts {path}: file not found") from None
    except json.JSONDecodeError as e:
        raise CliError(f"--prompts {path}: not JSON ({e})") from None
    if not isinstance(prompts, list) or not prompts:
        raise CliError(f"--prompts {path}: expected a non-empty JSON list of token-id lists")
    for i, p in enumerate(prompts):
        if not isinstance(p, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise CliError(f"--prompts {path}: request {i} is not a list of integer token ids")
    return prompts


def generate(args: argparse.Namespace) -> int:
    mode = Fp8Mode(args.fp8)
    prompts = _read_prompts(Path(args.prompts))
    try:
        sampling = [SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                   max_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos, seed=args.seed + i)
                    for i in range(len(prompts))]
    except ValueError as e:
        raise CliError(f"sampling settings (--max-new-tokens, --temperature, --top-p, --top-k, --seed): {e}") from None
    try:
        ckpt = load_checkpoint(_model_dir(args.model), dtype=jnp.dtype(args.dtype),
                               fp8=mode.fp8_weights)
    except CheckpointError as e:
        raise CliError(str(e)) from None
    steps, page = 8, 16
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    max_len = min(longest, ckpt.config.max_position_embeddings)
    pages = sum(math.ceil((min(len(p) + args.max_new_tokens, max_len) + steps) / page) for p in prompts)
    config = EngineConfig(max_slots=min(len(prompts), 64), page_size=page, num_pages=pages, max_seq_len=max_len,
                          steps_per_call=steps, precision=mode, dtype=args.dtype)
    start = time.perf_counter()
    try:
        batch = JaxEngine(ckpt.config, ckpt.params, config).generate(prompts, sampling)
    except ValueError as e:
        raise CliError(str(e)) from None
    elapsed = time.perf_counter() - start
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps({"tokens": batch.token_lists(), "logprobs": batch.logprob_lists()}))
    tmp.replace(out)
    if not args.quiet:
        print(f"generated {int(batch.lengths.sum())} tokens for {len(prompts)} prompts in {elapsed:.2f}s "
              f"(compile included, fp8 {mode.value}) -> {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fp8rl", description="fp8rl_jax: FP8 RL for Qwen3 in JAX")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("score", help="float32 logits [B, T, V] of int32 tokens [B, T]")
    s.add_argument("--model", required=True, help="Hugging Face model folder")
    s.add_argument("--tokens", required=True, help="input .npy, int32 [B, T]")
    s.add_argument("--out", required=True, help="output .npy, float32 [B, T, V]")
    s.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16",
                   help="parameter and compute dtype (default bfloat16)")
    s.add_argument("--fp8", choices=[m.value for m in Fp8Mode], default="none",
                   help="FP8 mode: none, w8a8 (FP8 linears), kv (FP8 KV cache) or all")
    s.add_argument("--batch-size", type=int, default=None, help="rows per forward call (default: all)")
    s.add_argument("--check-finite", action="store_true", help="reject weights holding NaN/Inf")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(func=score)

    q = sub.add_parser("quantize", help="write the block-FP8 (E4M3, 128x128) Hugging Face checkpoint")
    q.add_argument("--model", required=True, help="Hugging Face model folder (BF16/FP16/FP32)")
    q.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    q.add_argument("--bf16-first-layers", type=int, default=0, help="keep the first N decoder layers in BF16")
    q.add_argument("--bf16-last-layers", type=int, default=0, help="keep the last N decoder layers in BF16")
    q.add_argument("--quiet", action="store_true")
    q.set_defaults(func=quantize)

    g = sub.add_parser("generate", help="generate with the JAX rollout engine (paged KV, continuous batching)")
    g.add_argument("--model", required=True, help="Hugging Face model folder (BF16 or block FP8)")
    g.add_argument("--prompts", required=True, help="input JSON: a list of token-id lists (ragged)")
    g.add_argument("--max-new-tokens", type=int, required=True)
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=0, help="request i samples with seed S + i")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    g.add_argument("--fp8", choices=[m.value for m in Fp8Mode], default="none")
    g.add_argument("--out", required=True, help='output JSON: {"tokens": [[...]], "logprobs": [[...]]}')
    g.add_argument("--quiet", action="store_true")
    g.set_defaults(func=generate)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    enable_compilation_cache()  # the next call of the same model loads its programs
    try:
        return args.func(args)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
