"""The ``fp8rl`` command line.

  fp8rl score --model DIR --tokens IN.npy --out OUT.npy [--dtype float32|bfloat16] [--fp8 none|w8a8|kv|all]
  fp8rl quantize --model DIR --out DIR2 [--bf16-first-layers N] [--bf16-last-layers N]
  fp8rl generate --model DIR --prompts IN.json --max-new-tokens N [--temperature T] [--top-p P] [--top-k K]
                 [--seed S] [--ignore-eos] [--dtype float32|bfloat16] [--fp8 none|w8a8|kv|all] --out OUT.json
                 [--tokenizer DIR [--no-chat-template]]
  fp8rl plan --preset NAME --devices N --hbm-gib G [--set KEY=VALUE ...] [--offload-optimizer] [--table]

``score`` writes float32 logits [B, T, V] for int32 tokens [B, T] (full-sequence causal forward,
positions 0..T-1 in every row). ``--fp8 w8a8`` runs the FP8 linears of the rollout (weights
quantized in 128x128 blocks unless the checkpoint already is block FP8, activations per token in
1x128 groups); ``--fp8 kv`` reads K/V through the engine's E4M3 paged cache with scales
calibrated on the scored tokens; ``all`` does both. ``--dtype`` is the precision of the rest. ``quantize`` writes the
block-FP8 Hugging Face checkpoint that vLLM, SGLang and ``score`` load; ``--bf16-*-layers`` that
leave no FP8 layer are an error. ``generate`` takes token-id prompts (a JSON list of lists) and,
with ``--tokenizer DIR`` (a folder with tokenizer.json), text prompts too (JSON strings, a .jsonl
or a .txt file, one prompt a line), wrapped in Qwen's chat format when the tokenizer has
``<|im_start|>``; it then also writes the decoded text. A request whose prompt plus
``--max-new-tokens`` exceeds the model's positions is an error, not a shorter answer. The summary
line says what ran: the checkpoint's own precision (block FP8 or its dtype) and what ``--fp8``
and ``--dtype`` made of it.

Any bad input (missing folder, malformed checkpoint, unreadable tokens or prompts, token ids
outside the vocabulary, sequences longer than the model's limit) prints one ``error: ...`` line
and exits with status 2 without writing the output. ``--out`` must not be (or be a link of) an
input file or lie inside the ``--model`` folder, and its location must accept a new file; this
is checked before any computing. Every output is written to a temporary file (or folder) beside
it and renamed into place, with the modes a plain ``open()`` gives under the umask.
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

from fp8rl_jax.checkpoint import CheckpointError, load_checkpoint, load_config, load_tokenizer
from fp8rl_jax.checkpoint.atomic import write_atomic
from fp8rl_jax.checkpoint.quantize import quantize_checkpoint
from fp8rl_jax.environment import enable_compilation_cache
from fp8rl_jax.models import DensePolicy, PagedKVCache, calibrate_kv_scales, forward
from fp8rl_jax.models.policy import Fp8Mode
from fp8rl_jax.quant.policy import LayerPolicy, W8A8Policy, quantize_params
from fp8rl_jax.rl.memory import add_plan_arguments
from fp8rl_jax.rollout.config import EngineConfig
from fp8rl_jax.rollout.engine import JaxEngine
from fp8rl_jax.rollout.sampling import SamplingConfig
from fp8rl_jax.tasks.datasets import chat_prompt

EXIT_BAD_INPUT = 2
NPY_MAGIC = b"\x93NUMPY"
CHAT_TOKEN = "<|im_start|>"  # a tokenizer with it is a chat model's: text prompts get Qwen's chat format


class CliError(Exception):
    """A user-facing error: printed as ``error: <message>``, exit status 2."""


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file: the same resolved path, or one inode (a hard link)."""
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return False


def _check_out(value: str, *, inputs: dict[str, Path], model: Path, folder: bool = False) -> Path:
    """``--out`` resolved (symlinks followed), once it is known to be safe and writable; CliError if not.

    Refused: an ``--out`` that is, or is a hard link of, one of ``inputs`` ({flag: path}) or of a
    file in the ``model`` folder, or that lies inside that folder; a file output (``folder``
    False) that is a folder; a location where no new file can be made (tried by making and
    removing one, so read-only mounts count whatever the user's privileges).
    """
    out = Path(value)
    target = out.resolve()
    for flag, path in inputs.items():
        if _same_file(target, path):
            raise CliError(f"--out {out} is the {flag} file {path}; refusing to overwrite an input")
    root = model.resolve()
    if target == root or root in target.parents:
        raise CliError(f"--out {out} lies inside the --model folder {model}; write outputs elsewhere")
    if target.is_file():
        for f in root.rglob("*"):
            if f.is_file() and _same_file(target, f):
                raise CliError(f"--out {out} is a hard link of {f} in the --model folder; refusing to overwrite it")
    if not folder and target.is_dir():
        raise CliError(f"--out {out} is a directory; expected a file path")
    existing = next(p for p in target.parents if p.exists())
    if not existing.is_dir():
        raise CliError(f"--out {out}: {existing} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".fp8rl-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CliError(f"--out {out}: cannot create files in {existing} ({e.strerror or e})") from None
    return target


def _write_out(target: Path, value: str, write) -> None:
    """Writes ``--out`` (resolved to ``target``) through a temporary file beside it."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, write)
    except OSError as e:
        raise CliError(f"--out {value}: cannot write it ({e.strerror or e})") from None


def _read_tokens(path: Path, vocab_size: int, max_len: int) -> np.ndarray:
    expected = "expected an int32 [B, T] array saved by numpy.save"
    try:
        with open(path, "rb") as f:
            head = f.read(len(NPY_MAGIC))
            if head != NPY_MAGIC:
                what = ("the file is empty" if not head else "a .npz archive, not a .npy file" if head.startswith(b"PK")
                        else "a text file, not a .npy file" if all(32 <= c < 127 or c in b"\t\n\r" for c in head)
                        else "not a .npy file")
                raise CliError(f"--tokens {path}: {what}; {expected}")
            f.seek(0)
            tokens = np.load(f, allow_pickle=False)
    except FileNotFoundError:
        raise CliError(f"--tokens {path}: file not found") from None
    except IsADirectoryError:
        raise CliError(f"--tokens {path}: is a directory; {expected}") from None
    except OSError as e:
        raise CliError(f"--tokens {path}: cannot be read ({e.strerror or e})") from None
    except EOFError:
        raise CliError(f"--tokens {path}: the .npy file is truncated; {expected}") from None
    except ValueError as e:
        what = ("it holds Python objects (pickled data)" if "pickle" in str(e) else
                f"not a readable .npy array ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
        raise CliError(f"--tokens {path}: {what}; {expected}") from None
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


def _precision(hf_config: dict, mode: Fp8Mode, dtype: str) -> str:
    """What a run computes with: the checkpoint's own precision and what ``--fp8``/``--dtype`` make of it."""
    if hf_config.get("quantization_config"):
        what = "a block-FP8 checkpoint: " + ("its FP8 weights, FP8 activations (W8A8)" if mode.fp8_weights else
                                             f"its FP8 weights dequantized to {dtype}")
    else:
        stored = hf_config.get("torch_dtype") or hf_config.get("dtype") or "unspecified dtype"
        what = f"a {stored} checkpoint: " + ("weights quantized to FP8 on load, FP8 activations (W8A8)"
                                             if mode.fp8_weights else f"weights in {dtype}")
    kv = ", FP8 KV cache" if mode.fp8_kv else ""
    return f"{what}{kv}; --fp8 {mode.value}, --dtype {dtype}"


def _load_config(model_dir: Path):
    try:
        return load_config(model_dir)
    except CheckpointError as e:
        raise CliError(str(e)) from None


def score(args: argparse.Namespace) -> int:
    mode = Fp8Mode(args.fp8)
    model_dir = _model_dir(args.model)
    fp8 = mode.fp8_weights
    fp8_kv = mode.fp8_kv
    cfg, _ = _load_config(model_dir)
    target = _check_out(args.out, inputs={"--tokens": Path(args.tokens)}, model=model_dir)
    if args.batch_size is not None and args.batch_size < 1:
        raise CliError(f"--batch-size must be >= 1, got {args.batch_size}")
    tokens = _read_tokens(Path(args.tokens), cfg.vocab_size, cfg.max_position_embeddings)
    try:
        ckpt = load_checkpoint(model_dir, dtype=jnp.dtype(args.dtype), fp8=fp8, check_finite=args.check_finite)
    except CheckpointError as e:
        raise CliError(str(e)) from None
    cfg = ckpt.config
    params = ckpt.params
    if fp8 and not ckpt.hf_config.get("quantization_config"):  # an FP8 checkpoint keeps its own layer choice
        params = jax.jit(lambda p: quantize_params(p, cfg))(params)
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
    _write_out(target, args.out, lambda f: np.save(f, out))
    if not args.quiet:
        print(
            f"scored {B}x{T} tokens with {cfg.architecture}, {_precision(ckpt.hf_config, mode, args.dtype)}, in "
            f"{elapsed:.2f}s (compile included) -> {args.out} float32 {list(out.shape)}"
        )
    return 0


def _model_dir(path: str) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise CliError(f"--model {folder}: not a directory")
    return folder


def quantize(args: argparse.Namespace) -> int:
    model_dir = _model_dir(args.model)
    config, _ = _load_config(model_dir)
    _check_out(args.out, inputs={}, model=model_dir, folder=True)
    first, last, layers = args.bf16_first_layers, args.bf16_last_layers, config.num_layers
    if first < 0 or last < 0:
        raise CliError(f"--bf16-first-layers and --bf16-last-layers must be >= 0, got {first} and {last}")
    if first + last >= layers:
        raise CliError(f"--bf16-first-layers {first} and --bf16-last-layers {last} keep all {layers} decoder layers "
                       f"of {model_dir} in BF16: no FP8 weight would be written (together they must stay below "
                       f"{layers})")
    try:
        layer_policy = LayerPolicy(bf16_first_layers=first, bf16_last_layers=last)
        start = time.perf_counter()
        summary = quantize_checkpoint(model_dir, Path(args.out), layer_policy)
    except (CheckpointError, ValueError) as e:
        raise CliError(str(e)) from None
    if not args.quiet:
        print(f"wrote {args.out}: {summary['quantized']} weights in FP8 (E4M3, 128x128 blocks), "
              f"{summary['copied']} tensors kept, {summary['files']} files, {time.perf_counter() - start:.1f}s")
    return 0


def _read_prompts(path: Path) -> list[list[int] | str]:
    """The requests of ``--prompts``: token-id lists or text (encoded later, with ``--tokenizer``).

    A ``.txt`` file holds one text prompt per non-empty line, a ``.jsonl`` file one JSON value per
    line, any other file one JSON list (the token-id contract: a list of token-id lists). A value
    is a list of token ids, a string, or an object with a ``"prompt"`` string.
    """
    expected = "expected a JSON list of token-id lists (or of strings), a .jsonl or a .txt file"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CliError(f"--prompts {path}: file not found") from None
    except IsADirectoryError:
        raise CliError(f"--prompts {path}: is a directory; {expected}") from None
    except UnicodeDecodeError:
        raise CliError(f"--prompts {path}: not UTF-8 text; {expected}") from None
    except OSError as e:
        raise CliError(f"--prompts {path}: cannot be read ({e.strerror or e})") from None
    if path.suffix == ".txt":
        items: list = [line for line in text.splitlines() if line.strip()]
    elif path.suffix == ".jsonl":
        items = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise CliError(f"--prompts {path}: line {n} is not JSON ({e})") from None
    else:
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise CliError(f"--prompts {path}: not JSON ({e})") from None
        if not isinstance(items, list):
            items = []
    if not items:
        raise CliError(f"--prompts {path}: no request; expected a non-empty JSON list of token-id lists "
                       "(or of strings, with --tokenizer), a .jsonl or a .txt file")
    prompts: list[list[int] | str] = []
    for i, p in enumerate(items):
        if isinstance(p, dict) and isinstance(p.get("prompt"), str):
            p = p["prompt"]
        if not isinstance(p, str) and (
                not isinstance(p, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in p)):
            raise CliError(f"--prompts {path}: request {i} is not a list of integer token ids (nor a text prompt)")
        prompts.append(p)
    return prompts


def _load_tokenizer(value: str):
    folder = Path(value)
    if not folder.is_dir():
        raise CliError(f"--tokenizer {folder}: not a directory; expected a folder with tokenizer.json")
    try:
        tok = load_tokenizer(folder)
    except CheckpointError as e:
        raise CliError(f"--tokenizer {e}") from None
    if tok is None:
        raise CliError(f"--tokenizer {folder}: no tokenizer.json in it")
    return tok


def _encode(prompts: list[list[int] | str], tok, chat: bool, path: Path) -> list[list[int]]:
    """Token ids of every request: id lists as given, text encoded (in the chat format when ``chat``)."""
    if tok is None:
        text = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        if text:
            raise CliError(f"--prompts {path}: request {text[0]} is text; pass --tokenizer DIR (a folder with "
                           "tokenizer.json) to encode it")
        return prompts  # type: ignore[return-value]
    return [p if isinstance(p, list) else tok.encode(chat_prompt(p) if chat else p).ids for p in prompts]


def generate(args: argparse.Namespace) -> int:
    mode = Fp8Mode(args.fp8)
    prompts_path = Path(args.prompts)
    prompts = _read_prompts(prompts_path)
    try:
        sampling = [SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                   max_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos, seed=args.seed + i)
                    for i in range(len(prompts))]
    except ValueError as e:
        raise CliError(f"sampling settings (--max-new-tokens, --temperature, --top-p, --top-k, --seed): {e}") from None
    model_dir = _model_dir(args.model)
    model_config, _ = _load_config(model_dir)
    inputs = {"--prompts": prompts_path}
    tok = None
    if args.tokenizer is not None:
        tok = _load_tokenizer(args.tokenizer)
        inputs["--tokenizer"] = Path(args.tokenizer) / "tokenizer.json"
    target = _check_out(args.out, inputs=inputs, model=model_dir)
    chat = tok is not None and not args.no_chat_template and tok.token_to_id(CHAT_TOKEN) is not None
    ids = _encode(prompts, tok, chat, prompts_path)
    limit = model_config.max_position_embeddings
    for i, p in enumerate(ids):
        if len(p) + args.max_new_tokens > limit:
            raise CliError(f"request {i}: prompt of {len(p)} tokens + --max-new-tokens {args.max_new_tokens} = "
                           f"{len(p) + args.max_new_tokens} exceeds the model's max_position_embeddings {limit}")
    try:
        ckpt = load_checkpoint(model_dir, dtype=jnp.dtype(args.dtype), fp8=mode.fp8_weights)
    except CheckpointError as e:
        raise CliError(str(e)) from None
    steps, page = 8, 16
    max_len = max(len(p) for p in ids) + args.max_new_tokens
    pages = sum(math.ceil((len(p) + args.max_new_tokens + steps) / page) for p in ids)
    config = EngineConfig(max_slots=min(len(ids), 64), page_size=page, num_pages=pages, max_seq_len=max_len,
                          steps_per_call=steps, precision=mode, dtype=args.dtype)
    start = time.perf_counter()
    try:
        batch = JaxEngine(ckpt.config, ckpt.params, config).generate(ids, sampling)
    except ValueError as e:
        raise CliError(str(e)) from None
    elapsed = time.perf_counter() - start
    result = {"tokens": batch.token_lists(), "logprobs": batch.logprob_lists()}
    if tok is not None:
        result["text"] = [tok.decode(t, skip_special_tokens=True) for t in result["tokens"]]
        result["prompt_tokens"] = [list(p) for p in ids]
        known = tok.get_vocab_size(with_added_tokens=True)
        unknown = sum(t >= known for row in result["tokens"] for t in row)
        if unknown:  # ids of the model's padded vocabulary: the tokenizer decodes them to nothing
            print(f"warning: {unknown} of {int(batch.lengths.sum())} generated ids are past the tokenizer's {known} "
                  "tokens and are missing from \"text\"", file=sys.stderr)
    _write_out(target, args.out, lambda f: f.write(json.dumps(result).encode()))
    if not args.quiet:
        fmt = " (text in the chat format)" if chat else ""
        print(f"generated {int(batch.lengths.sum())} tokens for {len(ids)} prompts{fmt} with "
              f"{_precision(ckpt.hf_config, mode, args.dtype)}, in {elapsed:.2f}s (compile included) -> {args.out}")
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
    g.add_argument("--prompts", required=True,
                   help="input JSON: a list of token-id lists (ragged); with --tokenizer also strings, or a .jsonl "
                        "(one JSON string, id list or {\"prompt\": ...} a line) or .txt (one prompt a line) file")
    g.add_argument("--max-new-tokens", type=int, required=True)
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=0, help="request i samples with seed S + i")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    g.add_argument("--fp8", choices=[m.value for m in Fp8Mode], default="none")
    g.add_argument("--out", required=True, help='output JSON: {"tokens": [[...]], "logprobs": [[...]]} (with '
                                                '--tokenizer also "text" and "prompt_tokens")')
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a folder with tokenizer.json (e.g. the model's): encodes text prompts, decodes the output")
    g.add_argument("--no-chat-template", action="store_true",
                   help=f"encode text prompts as given (default: in Qwen's chat format when the tokenizer has "
                        f"{CHAT_TOKEN})")
    g.add_argument("--quiet", action="store_true")
    g.set_defaults(func=generate)
    add_plan_arguments(sub.add_parser("plan", help="per-device memory plan of an RL preset (exit 2: does not fit)"))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    enable_compilation_cache()  # the next call of the same model loads its programs
    try:
        return args.func(args)
    except CliError as e:
        print("error: " + " ".join(str(e).split("\n")), file=sys.stderr)  # one line, whatever a library said
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
