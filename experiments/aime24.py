"""The AIME24 RL recipe of the FP8-RL paper, shared by ``aime24_qwen3_8b.py`` and ``aime24_qwen3_30b_a3b.py``.

DAPO-style GRPO with FP8 rollout and token-level TIS (``configs/rl.py``: ``AIME24_QWEN3_8B`` /
``AIME24_QWEN3_30B_A3B``: n samples per prompt, clip-higher, token-mean loss, TIS cap 2):

1. the prompt asks for step-by-step reasoning and a ``\\boxed{}`` final answer
   (``PROMPT_TEMPLATE``), wrapped in Qwen's chat format when the tokenizer has ``<|im_start|>``
   (``--chat-template on|off|auto``); prompts longer than ``rollout.engine.max_seq_len -
   rollout.max_new_tokens`` tokens are skipped (or, with ``overflow=truncate``, their question
   is cut; the answer instruction stays), with a printed note;
2. each step (``fp8rl_jax.rl.loop.run``) samples ``rollout.n_samples`` responses per prompt from
   the JAX engine (or vLLM: ``--set rollout.backend=vllm``, with the ``fp8rl_jax[vllm]`` extra, one
   GPU) in FP8 (W8A8 + FP8 KV by default), stopping at the model's EOS ids
   (``config.json`` and ``generation_config.json``), scores them with ``math_reward``,
   computes the trainer's logprobs, updates with the DAPO loss reweighted by TIS, and syncs
   the re-quantized weights into the engine;
3. AIME24 evaluation every ``data.eval_every`` steps (and at the start and the end):
   ``eval/accuracy`` is the mean accuracy over ``data.eval_samples`` samples per problem
   (avg@k), ``eval/pass_at_k`` the fraction solved by at least one;
4. Orbax checkpoints of the whole TrainState plus the data cursor every
   ``logging.checkpoint_every`` steps under ``OUT/checkpoints``, each with a checksum; ``--resume``
   restores the newest intact one (state, data cursor, step; a damaged newer one is named and moved
   to ``checkpoints/damaged/``) and continues to ``data.steps``, after checking that ``OUT/config.json``
   is the same run (``RUN_IDENTITY``; ``--set resume_other_config=true`` skips the check). The run
   owns ``OUT`` while it lasts (``OUT/run.lock``: a second run there exits with status 2); a fresh
   run never deletes checkpoints: it refuses, or for ``--preset tiny`` moves the previous tiny run
   to ``OUT.<date>-<time>``;
5. metrics to ``OUT/metrics.jsonl`` (+ TensorBoard, + ``OUT/aime24.png``), ``OUT/summary.json``.

    python experiments/aime24_qwen3_8b.py --model-path DIR --train-data dapo.parquet \\
        [--eval-data aime24.jsonl | hf:HuggingFaceH4/aime_2024] [--out runs/x] [--resume] \\
        [--set rollout.n_samples=8 --set data.eval_every=10 ...]
    python experiments/aime24_qwen3_8b.py --preset tiny      # the CPU demo, no weights needed

``--preset tiny`` runs the same code on a tiny random Qwen3 (Qwen3-MoE for the 30B-A3B script)
built in-process with a character tokenizer: a few steps on AIME24 problems (or
``--train-data``), an AIME24 evaluation pass, a checkpoint, then a resume from it that checks
the restored state, step and data cursor and continues. Evaluation data default to
``../shared/data/aime24.jsonl`` (next to the repository) when that file exists.

``--set`` takes ``section.field=value`` for the RL config (``rollout``, ``rollout.engine``,
``algorithm``, ``optimizer``, ``trainer``, ``precision``, ``data``, ``logging``, ``seed``; the
same keys as the quickstart's) or a field of :class:`AimeConfig` (``overflow=truncate``,
``chat_template=false``). With real weights the ``model`` section comes from the checkpoint's
config.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import functools
import hashlib
import json
import string
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fp8rl_jax.environment import enable_compilation_cache
from fp8rl_jax.checkpoint import CheckpointError as HFCheckpointError
from fp8rl_jax.checkpoint import load_config, load_params, load_tokenizer
from fp8rl_jax.models import ModelConfig, abstract_params, init_params
from fp8rl_jax.models.policy import MatmulPolicy
from fp8rl_jax.parallel.mesh import MeshConfig, make_mesh
from fp8rl_jax.rewards import math_reward
from fp8rl_jax.rl import config as rlconfig
from fp8rl_jax.rl.checkpointing import (CheckpointConfig, Checkpointer, CheckpointError, latest_step,
                                         open_run_notes, reduce_leaves)
from fp8rl_jax.rl.generator import apply_generator_environment, make_generator
from fp8rl_jax.rl.loop import MetricsLogger, Task, plot_metrics, read_metrics, run
from fp8rl_jax.rl.memory import device_bytes_limit, plan_memory
from fp8rl_jax.rl.run_dir import RunFolderError, RunLock, config_differences, move_aside, read_config
from fp8rl_jax.rl.sharded import abstract_sharded_state, init_sharded_state, make_mesh_trainer
from fp8rl_jax.rl.offload import make_step, offload_moments
from fp8rl_jax.rl.trainer import TrainerConfig, TrainState, init_train_state, make_logprob_fn, make_optimizer
from fp8rl_jax.tasks import Example, PromptDataset
from fp8rl_jax.tasks.datasets import (
    PROMPT_TEMPLATE,
    chat_prompt,
    examples_from_rows,
    load_examples,
)
from fp8rl_jax.tokenization import DEFAULT_ALPHABET, char_tokenizer

DEFAULT_EVAL_DATA = ROOT.parent / "shared" / "data" / "aime24.jsonl"
CHAT_TOKEN = "<|im_start|>"
# The character tokenizer of the tiny preset: the default alphabet plus the rest of printable
# ASCII (AIME problems are LaTeX: $ \ ^ _ | & ...); other characters become <pad>.
TINY_ALPHABET = DEFAULT_ALPHABET + "".join(c for c in string.printable if c not in DEFAULT_ALPHABET + "\r\x0b\x0c")


class UsageError(Exception):
    """An input the run cannot use (missing weights or data, a bad flag); the command line
    prints each line as ``error: ...`` and exits with status 2."""


class Overflow(enum.Enum):
    """What happens to a prompt longer than ``rollout.engine.max_seq_len - rollout.max_new_tokens`` tokens."""

    SKIP = "skip"  # leave it out (the DAPO recipe filters long prompts the same way)
    TRUNCATE = "truncate"  # cut the end of the question; the template and its \boxed{} instruction stay


@dataclasses.dataclass(frozen=True)
class AimeConfig:
    """One run of the recipe.

    Attributes:
      rl: the RL config tree (a preset from ``configs/rl.py`` or :func:`tiny_preset`);
        ``rl.data.train_path`` / ``rl.data.eval_path`` are the prompt files (eval: a path or
        ``hf:NAME[:SPLIT]``; None: ``DEFAULT_EVAL_DATA`` when it exists).
      model_path: a Hugging Face Qwen3 folder (config.json, *.safetensors, tokenizer.json).
      random_init: build a random ``rl.model`` and a character tokenizer in-process instead of
        loading ``model_path`` (the tiny preset).
      model_name: the Hugging Face repository the preset is for (messages only).
      chat_template: wrap prompts in Qwen's chat format; None: when the tokenizer has ``<|im_start|>``.
      overflow: what happens to prompts that do not fit.
      resume: continue from the latest checkpoint under ``rl.logging.out_dir/checkpoints``.
      memory_check: on a GPU, stop before loading anything when the memory plan
        (``fp8rl_jax.rl.memory.plan_memory``, printed at the start) says the run does not fit; false runs
        anyway (the plan is an estimate).
      resume_other_config: resume even when the folder's config.json names another seed, model or
        training data (``RUN_IDENTITY``).
    """

    rl: rlconfig.RLConfig
    model_path: str | None = None
    random_init: bool = False
    model_name: str = "Qwen3-8B"
    chat_template: bool | None = None
    overflow: Overflow = Overflow.SKIP
    resume: bool = False
    resume_other_config: bool = False
    memory_check: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.overflow, Overflow):
            raise rlconfig.ConfigError(f"overflow must be an Overflow ({[m.value for m in Overflow]}), "
                                       f"got {self.overflow!r}")


def tiny_preset(base: rlconfig.RLConfig, model: ModelConfig, out_dir: str) -> rlconfig.RLConfig:
    """``base``'s recipe (loss, correction, FP8 rollout) on a tiny model and a CPU-sized run: 2
    prompts x 2 samples, 8 new tokens (the overlong punishment over the last 2), 192-token sequences, 4
    steps, evaluation (2 samples per problem) and a checkpoint every 2 steps. The KV pool (1 MiB: 256 BF16 / 512 FP8 pages of 16 tokens)
    holds all 16 slots at full length; a larger one would only slow the CPU's FP8 decode, whose cost
    grows with the pool. The vocabulary is set from the tokenizer at run time."""
    return dataclasses.replace(
        base,
        model=dataclasses.replace(model, max_position_embeddings=256),
        rollout=dataclasses.replace(base.rollout, n_samples=2, max_new_tokens=8, engine=dataclasses.replace(
            base.rollout.engine, max_seq_len=192, max_slots=16, page_size=16, kv_budget_gib=0.001,
            kv_budget_fraction=0.0, steps_per_call=8, prefill_batch=16)),
        algorithm=dataclasses.replace(base.algorithm, overlong_buffer=min(base.algorithm.overlong_buffer, 2)),
        optimizer=dataclasses.replace(base.optimizer, lr=1e-4, warmup_steps=0),
        trainer=rlconfig.TrainConfig(),
        data=rlconfig.DataConfig(prompts_per_step=2, steps=4, eval_every=2, eval_samples=2),
        logging=dataclasses.replace(base.logging, out_dir=out_dir, checkpoint_every=2, keep_checkpoints=2),
    )


# ------------------------------------------------------------------------------------ inputs


def _weights_hint(model_name: str) -> str:
    return (f"pass --model-path DIR (a Hugging Face {model_name} folder, e.g. from "
            f"`huggingface-cli download Qwen/{model_name} --local-dir DIR`), or --preset tiny for the CPU demo")


def check_model_path(path: str | None, model_name: str) -> list[str]:
    """Problems with ``path`` as a Hugging Face model folder (empty if it looks usable)."""
    hint = _weights_hint(model_name)
    if path is None:
        return [f"no model weights: {hint}"]
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return [f"no model weights: {folder} is not a folder; {hint}"]
    missing = [name for name, ok in (("config.json", (folder / "config.json").is_file()),
                                     ("*.safetensors", any(folder.glob("*.safetensors")))) if not ok]
    if missing:
        return [f"no model weights in {folder} (no {' and no '.join(missing)}): {hint}"]
    if not (folder / "tokenizer.json").is_file():
        return [f"{folder} has no tokenizer.json: copy it from the Hugging Face {model_name} repository"]
    return []


def read_examples(spec: str, what: str) -> list[Example]:
    """Raw (question, answer) examples of a jsonl/parquet path or ``hf:NAME[:SPLIT]`` (a Hugging Face
    dataset, read with the ``datasets`` package at run time)."""
    if spec.startswith("hf:"):
        name, _, split = spec[3:].partition(":")
        try:
            import datasets
        except ImportError:
            raise UsageError(f"{what} {spec}: reading a Hugging Face dataset needs the `datasets` package "
                             "(pip install datasets); or pass a local jsonl/parquet path") from None
        try:
            rows = datasets.load_dataset(name, split=split or "train")
        except Exception as e:  # noqa: BLE001  (datasets raises many types: network, missing split, ...)
            raise UsageError(f"{what} {spec}: could not load the dataset ({type(e).__name__}: {e})") from None
        try:
            return examples_from_rows(rows, source=spec, template=None)
        except ValueError as e:
            raise UsageError(f"{what}: {e}") from None
    try:
        return load_examples(Path(spec).expanduser(), template=None)
    except ValueError as e:
        raise UsageError(f"{what}: {e}") from None


def fit_prompts(examples: list[Example], *, render, encode, budget: int, overflow: Overflow, what: str) -> list[Example]:
    """``examples`` with each question rendered into the full prompt; prompts over ``budget``
    tokens are skipped or have their question cut from the end until they fit."""
    out, skipped, cut = [], 0, 0
    for e in examples:
        text = render(e.prompt)
        n = len(encode(text))
        if n > budget and overflow is Overflow.TRUNCATE:
            q = e.prompt
            while n > budget and q:  # each pass drops at least as many characters as tokens are over
                q = q[: max(0, len(q) - (n - budget))]
                text = render(q)
                n = len(encode(text))
            cut += n <= budget
        if n > budget:
            skipped += 1
            continue
        out.append(Example(text, e.answer))
    if cut or skipped:
        print(f"note: {cut + skipped} of {len(examples)} {what} prompts exceed {budget} tokens "
              f"(rollout.engine.max_seq_len - rollout.max_new_tokens): {cut} truncated (question cut), {skipped} skipped")
    if not out:
        raise UsageError(f"no {what} prompt fits in {budget} tokens (rollout.engine.max_seq_len - rollout.max_new_tokens): "
                         "raise --set rollout.engine.max_seq_len=..., or --set overflow=truncate")
    return out


def _eos_ids(folder: Path, model_cfg: ModelConfig) -> tuple[int, ...]:
    """config.json's EOS ids plus generation_config.json's (Qwen3 lists <|im_end|> and <|endoftext|>)."""
    ids = list(model_cfg.eos_token_ids)
    gen = folder / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError):
            eos = None
        for t in eos if isinstance(eos, list) else [] if eos is None else [eos]:
            if isinstance(t, int) and 0 <= t < model_cfg.vocab_size and t not in ids:
                ids.append(t)
    if not ids:
        raise UsageError(f"{folder}: neither config.json nor generation_config.json names an eos_token_id "
                         "(Qwen3: 151645, <|im_end|>); add it to config.json")
    return tuple(ids)


@dataclasses.dataclass(frozen=True)
class _Trainer:
    """The trainer's functions for the run's devices: ``init(params, key)`` builds a fresh state in its
    layout, ``target(key)`` the abstract state a checkpoint restores into, ``place(state)`` puts a restored
    state where the step wants it (the optimizer moments in host memory with ``trainer.offload_optimizer``)."""

    optimizer: Any
    train_step: Any
    logprob_fn: Any
    init: Any
    target: Any
    place: Any


@functools.lru_cache(maxsize=4)
def _trainer(model_cfg: ModelConfig, trainer_cfg: TrainerConfig, policy: MatmulPolicy, mesh_cfg: MeshConfig,
             devices: tuple) -> _Trainer:
    """The jitted train step and logprob pass, on one device or sharded on the ``mesh_cfg`` mesh; cached
    so a resume in the same process (the tiny demo) reuses the compiled functions. ``policy`` is BF16 or
    FP8 training (RLConfig.train_policy)."""
    if len(devices) > 1:
        mt = make_mesh_trainer(model_cfg, policy, trainer_cfg, make_mesh(mesh_cfg, devices))
        return _Trainer(mt.optimizer, mt.train_step, mt.logprob_fn, functools.partial(init_sharded_state, mt),
                        functools.partial(abstract_sharded_state, mt, model_cfg), lambda state: state)
    optimizer = make_optimizer(trainer_cfg.optimizer)
    place = offload_moments if trainer_cfg.offload_optimizer else (lambda state: state)

    def init(params, key):  # committed like a restored state, so a resume in the same process reuses the steps
        return place(jax.device_put(init_train_state(params, optimizer, key), devices[0]))

    def target(key):
        return jax.eval_shape(lambda p: init_train_state(p, optimizer, key), abstract_params(model_cfg, jnp.float32))

    return _Trainer(optimizer, make_step(model_cfg, policy, trainer_cfg), make_logprob_fn(model_cfg, policy, trainer_cfg),
                    init, target, place)


@jax.jit
def _leaf_sums(leaves: list) -> jax.Array:
    return jnp.stack([jnp.sum(jnp.abs(x.astype(jnp.float32))) for x in leaves] or [jnp.zeros(())])


def fingerprint(state: TrainState) -> str:
    """A cheap checksum of the state: a digest of every leaf's sum of |x| (reduced on the device, so
    an 8B state is not copied to the host). Equal states give equal fingerprints."""
    sums = reduce_leaves(_leaf_sums, jax.tree.leaves(state))
    return hashlib.sha256(np.asarray(sums, np.float32).tobytes()).hexdigest()[:16]


# ------------------------------------------------------------------------------------ main


@dataclasses.dataclass
class RunResult:
    """What :func:`main` did: ``summary`` (JSON, also in ``OUT/summary.json``), the final state,
    the data cursor at the end."""

    summary: dict[str, Any]
    state: TrainState
    cursor: dict[str, Any]


def main(config: AimeConfig) -> RunResult:
    """One run of the recipe in ``rl.logging.out_dir``, which it owns (``run.lock``) until it returns."""
    with contextlib.ExitStack() as cleanup:
        return _run(config, cleanup)


def _run(config: AimeConfig, cleanup: contextlib.ExitStack) -> RunResult:
    t_start = time.perf_counter()
    cfg = config.rl
    apply_generator_environment(cfg)  # rollout.backend=vllm: the GPU's memory split, before JAX starts on it
    out = Path(cfg.logging.out_dir)
    ckpt_dir = out / "checkpoints"

    # 1. inputs: everything that can be wrong is reported before anything big is loaded
    errors = []
    if config.random_init and config.model_path is not None:
        errors.append("--preset tiny builds a random model in-process: drop --model-path")
    elif not config.random_init:
        errors += check_model_path(config.model_path, config.model_name)
        if cfg.data.train_path is None:
            errors.append("no training data: pass --train-data PATH.jsonl|parquet (rows with a question and an answer, "
                          "e.g. DAPO-Math-17k from `huggingface-cli download --repo-type dataset "
                          "BytedTsinghua-SIA/DAPO-Math-17k`), or --preset tiny")
    eval_spec = cfg.data.eval_path
    if eval_spec is None and DEFAULT_EVAL_DATA.is_file():
        eval_spec = str(DEFAULT_EVAL_DATA)
    if eval_spec is None and cfg.data.eval_every:
        errors.append(f"no evaluation data ({DEFAULT_EVAL_DATA} is absent): pass --eval-data PATH.jsonl or "
                      "hf:NAME (e.g. hf:HuggingFaceH4/aime_2024), or --set data.eval_every=0")
    budget = cfg.rollout.engine.max_seq_len - cfg.rollout.max_new_tokens  # >= 1: RolloutConfig checks it
    if errors:
        raise UsageError("\nerror: ".join(errors))
    train_spec = cfg.data.train_path or eval_spec
    if train_spec is None:
        raise UsageError("--preset tiny needs prompts: pass --train-data or --eval-data")

    try:
        lock = cleanup.enter_context(RunLock(out))  # released when main returns or raises
    except RunFolderError as e:
        raise UsageError(f"{e}; pass another --out") from None
    for note in open_run_notes(lock, ckpt_dir):
        print(f"note: {note}")
    latest = _latest_checkpoint(ckpt_dir)
    if config.resume and latest is None:
        raise UsageError(f"--resume: no checkpoint under {ckpt_dir}")
    if not config.resume and latest is not None:
        if config.random_init and _was_tiny_run(out):
            print(f"note: moved the previous tiny run in {out} (checkpoints up to step {latest}) to {move_aside(out)}")
        else:
            raise UsageError(f"{out} already holds checkpoints (latest step {latest}): pass --resume to continue "
                             "that run, or another --out (a fresh run never replaces them)")

    # 2. tokenizer and model
    if config.random_init:
        tok = char_tokenizer(TINY_ALPHABET)
        model_cfg = dataclasses.replace(cfg.model, vocab_size=tok.get_vocab_size(),
                                        eos_token_ids=(tok.token_to_id("<eos>"),))
    else:
        folder = Path(config.model_path).expanduser()
        try:
            model_cfg, _ = load_config(folder)
            tok = load_tokenizer(folder)
        except HFCheckpointError as e:
            raise UsageError(str(e)) from None
        model_cfg = dataclasses.replace(model_cfg, eos_token_ids=_eos_ids(folder, model_cfg))
        if (model_cfg.num_layers, model_cfg.hidden_size) != (cfg.model.num_layers, cfg.model.hidden_size):
            print(f"note: {folder} holds a {model_cfg.num_layers}-layer, {model_cfg.hidden_size}-wide model; this "
                  f"script's preset is for {config.model_name} (the run uses the folder's config)")
    try:
        cfg = dataclasses.replace(cfg, model=model_cfg)
    except ValueError as e:
        raise UsageError(str(e)) from None
    has_chat = tok.token_to_id(CHAT_TOKEN) is not None
    chat = has_chat if config.chat_template is None else config.chat_template
    if chat and not has_chat:
        print(f"note: the tokenizer has no {CHAT_TOKEN} token; the chat format is spelled out as plain text")

    @functools.lru_cache(maxsize=1 << 16)
    def _ids(text: str) -> tuple[int, ...]:
        return tuple(tok.encode(text).ids)

    def encode(text: str) -> list[int]:
        return list(_ids(text))

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    def render(question: str) -> str:
        prompt = PROMPT_TEMPLATE.format(question=question)
        return chat_prompt(prompt) if chat else prompt

    fit = functools.partial(fit_prompts, render=render, encode=encode, budget=budget, overflow=config.overflow)
    train = fit(read_examples(train_spec, "--train-data"), what="training")
    evals = []
    if cfg.data.eval_every and eval_spec is not None:
        evals = fit(read_examples(eval_spec, "--eval-data"), what="evaluation")
        evals = evals[: cfg.data.eval_prompts or None]

    # 3. trainer state: fresh (weights from the folder or random) or restored from a checkpoint
    devices = tuple(jax.devices())
    if jax.process_count() > 1:
        raise UsageError(f"this run spans {jax.process_count()} processes: the RL recipe runs on the GPUs of one "
                         "host (rollout across hosts is not implemented); start it on one host")
    try:
        mesh_cfg = cfg.parallel.mesh_config(len(devices))
    except rlconfig.ConfigError as e:
        raise UsageError(str(e)) from None
    batch = cfg.data.prompts_per_step * cfg.rollout.n_samples
    if cfg.trainer.offload_optimizer and len(devices) > 1:
        raise UsageError(f"trainer.offload_optimizer is for one device, this run has {len(devices)}: the mesh "
                         "trainer shards the optimizer state with parallel.fsdp instead")
    if batch % mesh_cfg.batch_shards:
        raise UsageError(f"the batch (data.prompts_per_step x rollout.n_samples = {batch}) does not split over the "
                         f"{mesh_cfg.batch_shards} batch shards of the mesh ({mesh_cfg}); change "
                         "data.prompts_per_step or parallel.*")
    limit = device_bytes_limit()
    engine_cfg = cfg.rollout.engine
    if limit is None and engine_cfg.kv_budget_fraction and not engine_cfg.num_pages:
        raise UsageError(f"rollout.engine.kv_budget_fraction = {engine_cfg.kv_budget_fraction:g} sizes the KV pool from "
                         f"free GPU memory, which the {jax.default_backend()} backend does not report: set "
                         "rollout.engine.kv_budget_fraction=0 and rollout.engine.kv_budget_gib=...")
    if limit is not None:  # a GPU: the per-device memory plan, before anything big is allocated
        try:
            plan = plan_memory(cfg, len(devices), limit, name=config.model_name)
        except rlconfig.ConfigError as e:
            raise UsageError(str(e)) from None
        print(plan.table())
        if not plan.fits and config.memory_check:
            raise UsageError(f"{plan.problem()} (the plan is an estimate: --set memory_check=false runs anyway)")
    trainer = _trainer(model_cfg, cfg.trainer_config(), cfg.train_policy(), mesh_cfg, devices)
    train_step, logprob_fn = trainer.train_step, trainer.logprob_fn
    checkpointer = Checkpointer(ckpt_dir, CheckpointConfig(max_to_keep=cfg.logging.keep_checkpoints))
    cursor: dict[str, Any] = {}
    start_step, resumed_fp = 0, None
    state_key = jax.random.key(cfg.seed + 1)
    if config.resume:
        if not config.resume_other_config:
            _check_same_run(out, dataclasses.replace(config, rl=cfg))
        target = trainer.target(state_key)
        try:
            restored = checkpointer.restore_latest(target)
        except CheckpointError as e:
            raise UsageError(f"--resume: {' '.join(str(e).split())}") from None
        for line in restored.messages():
            print(line)
        cursor, latest, restored_path = restored.cursor, restored.step, restored.path
        state = trainer.place(restored.state)
        del restored  # with offload, the restored moments' device copy goes now
        start_step = int(cursor.get("step", latest))
        resumed_fp = fingerprint(state)
        n_train = cursor.get("train_examples")
        if n_train is not None and n_train != len(train):
            print(f"note: the checkpoint's training set had {n_train} prompts, this run has {len(train)}: the data "
                  "cursor points into a different order")
        print(f"resumed from {restored_path}: step {start_step}, data cursor {cursor.get('data_cursor', 0)}")
        if start_step >= cfg.data.steps:
            print(f"note: the checkpoint is at step {start_step} >= data.steps = {cfg.data.steps}; nothing to train "
                  f"(raise --set data.steps=N to continue)")
    else:
        if config.random_init:
            params = init_params(model_cfg, jax.random.key(cfg.seed), jnp.float32)
        else:
            params = load_params(folder, model_cfg, dtype=cfg.trainer.compute_dtype.value)
        state = trainer.init(params, state_key)
        del params

    dataset = PromptDataset(train, seed=cfg.data.seed, cursor=int(cursor.get("data_cursor", 0)))
    task = Task(next_batch=dataset.next_batch, encode=encode, decode=decode, reward_fn=math_reward,
                eval_examples=evals,
                cursor=lambda: {"data_cursor": dataset.cursor, "data_seed": dataset.seed, "train_examples": len(train)})
    # rollout.backend: our JAX engine (one replica per device group on several devices) or vLLM
    engine = make_generator(cfg, model_cfg, state.params, out, devices)

    # 4. the loop, logging
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    if not config.resume:
        metrics_path.unlink(missing_ok=True)
    elif metrics_path.exists():  # drop rows a killed run wrote after its last checkpoint
        kept = [r for r in read_metrics(metrics_path) if r["step"] <= start_step]
        metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    (out / "config.json").write_text(json.dumps(rlconfig.to_dict(dataclasses.replace(config, rl=cfg)), indent=1) + "\n")
    what = (f"tiny random Qwen3{'-MoE' if model_cfg.num_experts else ''} ({model_cfg.num_layers} layers, hidden "
            f"{model_cfg.hidden_size}, {model_cfg.vocab_size} character tokens)" if config.random_init else config.model_path)
    print(f"{what}: "
          f"{len(train)} training prompts from {train_spec}, {len(evals)} evaluation prompts from {eval_spec}, "
          f"chat format {'on' if chat else 'off'}, rollout precision {cfg.precision.rollout.value}, "
          f"steps {start_step} -> {cfg.data.steps}")
    with MetricsLogger(out, tensorboard=cfg.logging.tensorboard) as logger:
        state = run(cfg, state=state, task=task, engine=engine, train_step=train_step, logprob_fn=logprob_fn,
                    model_config=model_cfg, logger=logger, start_step=start_step, checkpointer=checkpointer)
    checkpointer.close()

    rows = read_metrics(metrics_path)
    steps = [r for r in rows if "reward/mean" in r]
    evals_rows = [r for r in rows if "eval/accuracy" in r]
    png = None
    if cfg.logging.plot and rows:
        png = plot_metrics(metrics_path, out / "aime24.png", [
            ("reward (train) and AIME24 avg@k", ["reward/mean", "eval/accuracy", "eval/pass_at_k"]),
            ("rollout vs trainer mismatch", ["mismatch/kl_k3", "mismatch/kl_k1"]),
            ("response length", ["rollout/response_len_mean"]),
        ])
    final_cursor = {"step": max(start_step, cfg.data.steps), **task.cursor()}
    summary = {
        "start_step": start_step,
        "final_step": final_cursor["step"],
        "steps_this_run": sum(start_step < r["step"] for r in steps),
        "data_cursor": dataset.cursor,
        "resumed_cursor": cursor.get("data_cursor") if config.resume else None,
        "resumed_state_fingerprint": resumed_fp,
        "state_fingerprint": fingerprint(state),
        "checkpoints": checkpointer.all_steps() if ckpt_dir.exists() else [],
        "train_reward_last": steps[-1]["reward/mean"] if steps else None,
        "eval_accuracy_last": evals_rows[-1]["eval/accuracy"] if evals_rows else None,
        "eval_pass_at_k_last": evals_rows[-1]["eval/pass_at_k"] if evals_rows else None,
        "eval_samples": cfg.data.eval_samples,
        "eval_prompts": len(evals),
        "mismatch_kl_k3_last": steps[-1].get("mismatch/kl_k3") if steps else None,
        "precision": cfg.precision.rollout.value,
        "seconds": time.perf_counter() - t_start,
        "plot": str(png) if png else None,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\nAIME24 run summary ({out})")
    for k, v in summary.items():
        print(f"  {k:28s} {v:.4g}" if isinstance(v, float) else f"  {k:28s} {v}")
    return RunResult(summary, state, final_cursor)


def _latest_checkpoint(ckpt_dir: Path) -> int | None:
    return latest_step(ckpt_dir)  # the newest complete step (intact or not: restore_latest checks)


# What makes a folder's checkpoints this run's: a resume with another value stops (UsageError) unless
# resume_other_config is set. data.steps, evaluation, logging and the recipe's knobs may change.
RUN_IDENTITY = ("rl.seed", "rl.model", "model_path", "random_init", "rl.data.train_path", "rl.data.seed",
                "rl.data.prompts_per_step")


def _check_same_run(out: Path, config: AimeConfig) -> None:
    try:
        saved = read_config(out)
    except RunFolderError as e:
        raise UsageError(f"--resume: {e}; pass --set resume_other_config=true to resume anyway") from None
    if saved is None:
        raise UsageError(f"--resume: {out} has checkpoints but no config.json to check them against; pass "
                         "--set resume_other_config=true to resume anyway")
    diffs = config_differences(saved, rlconfig.to_dict(config), RUN_IDENTITY)
    if diffs:
        raise UsageError(f"--resume: {out} holds another run's checkpoints ({'; '.join(diffs[:4])}"
                         f"{'; ...' if len(diffs) > 4 else ''}): pass the same settings, another --out, or "
                         "--set resume_other_config=true to resume anyway")


def _was_tiny_run(out: Path) -> bool:
    try:
        return bool(json.loads((out / "config.json").read_text()).get("random_init"))
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def tiny_demo(config: AimeConfig) -> tuple[RunResult, RunResult]:
    """The tiny preset end to end: train to the first checkpoint as if interrupted there, then
    resume from it (checking the restored step, data cursor and state) and finish the run."""
    every = config.rl.logging.checkpoint_every
    if not every or every >= config.rl.data.steps:
        raise UsageError("the tiny demo needs 0 < logging.checkpoint_every < data.steps (it resumes from the first "
                         "checkpoint)")
    first = main(rlconfig.override(config, [f"data.steps={every}"]))
    print(f"\n--- resuming from the checkpoint at step {every} ---\n")
    second = main(dataclasses.replace(config, resume=True))
    s = second.summary
    problems = [f"{name}: saved {a}, resumed {b}" for name, a, b in (
        ("step", first.summary["final_step"], s["start_step"]),
        ("data cursor", first.cursor["data_cursor"], s["resumed_cursor"]),
        ("state fingerprint", first.summary["state_fingerprint"], s["resumed_state_fingerprint"])) if a != b]
    if problems:
        raise RuntimeError("resume did not restore the saved run: " + "; ".join(problems))
    print(f"resume check: step {s['start_step']}, data cursor {s['resumed_cursor']} and the TrainState "
          f"(fingerprint {s['resumed_state_fingerprint']}) match the checkpoint; continued to step {s['final_step']}")
    return first, second


# ------------------------------------------------------------------------------------ command line


def apply_overrides(config: AimeConfig, assignments: list[str]) -> AimeConfig:
    """``key=value`` assignments: RL keys (``rollout.n_samples=8``) or AimeConfig fields
    (``overflow=truncate``), as ``fp8rl_jax.rl.config.override`` takes them everywhere."""
    return rlconfig.override(config, assignments)


def cli(argv: list[str] | None, *, preset: rlconfig.RLConfig, tiny: rlconfig.RLConfig, model_name: str,
        description: str) -> int:
    """The scripts' command line (``preset`` for real weights, ``tiny`` for ``--preset tiny``); returns
    the exit status (2 for unusable inputs)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help=f"Hugging Face {model_name} folder (config.json, *.safetensors, tokenizer.json)")
    ap.add_argument("--train-data", help="training prompts: jsonl or parquet with a question and an answer per row")
    ap.add_argument("--eval-data", help=f"evaluation set: jsonl/parquet path or hf:NAME[:SPLIT] (default {DEFAULT_EVAL_DATA} "
                                        "when present)")
    ap.add_argument("--out", help="output folder (metrics, checkpoints, plot); default logging.out_dir of the preset")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint under OUT/checkpoints")
    ap.add_argument("--preset", choices=("full", "tiny"), default="full",
                    help="tiny: a random tiny model on the CPU, no weights needed (trains, evaluates, checkpoints, resumes)")
    ap.add_argument("--chat-template", choices=("auto", "on", "off"), default="auto",
                    help=f"wrap prompts in Qwen's chat format (auto: when the tokenizer has {CHAT_TOKEN})")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="override a config field, e.g. rollout.n_samples=8, data.eval_every=10, overflow=truncate")
    args = ap.parse_args(argv)
    enable_compilation_cache()  # a --resume after a stall exit loads the programs instead of compiling them
    is_tiny = args.preset == "tiny"
    config = AimeConfig(rl=tiny if is_tiny else preset, model_path=args.model_path, random_init=is_tiny, model_name=model_name,
                        chat_template={"auto": None, "on": True, "off": False}[args.chat_template],
                        overflow=Overflow.TRUNCATE if is_tiny else Overflow.SKIP, resume=args.resume)
    sets = [f"data.train_path={args.train_data}"] if args.train_data else []
    sets += [f"data.eval_path={args.eval_data}"] if args.eval_data else []
    sets += [f"logging.out_dir={args.out}"] if args.out else []
    try:
        if not is_tiny and any(a.strip().startswith("model.") for a in args.set):
            raise UsageError("with --model-path the model section comes from DIR/config.json; edit that file "
                             "instead of --set model.*")
        config = apply_overrides(config, sets + args.set)
        if is_tiny and not config.resume:
            tiny_demo(config)
        else:
            main(config)
    except (UsageError, rlconfig.ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
