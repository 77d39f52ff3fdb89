"""The AIME24 experiments (``experiments/aime24_qwen3_8b.py``, ``..._30b_a3b.py``) on the CPU: the
no-weights message, the tiny preset end to end (train, evaluate, checkpoint, resume; one run shared
by two tests) on the AIME24 file in ../shared/data when it is present, else on jsonl files written
here, and a Hugging Face folder through ``--model-path`` on jsonl files written here."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.rl.loop import read_metrics

REPO = Path(__file__).resolve().parents[1]
from conftest import load_experiment as _load

EXPERIMENTS = REPO / "experiments"
AIME24 = REPO.parent / "shared" / "data" / "aime24.jsonl"
QUIET = ["logging.progress=false", "logging.tensorboard=false", "logging.plot=false"]




@pytest.fixture(scope="module")
def exp8b():
    return _load("aime24_qwen3_8b")


# Problems longer than the tiny prompt budget (184 tokens) are truncated, so every batch has the
# same shape and the tests share compilations (the CPU budget is compile-bound); 2 evaluation
# problems x 2 samples = the 4 sequences of a training step. Characters outside the tokenizer's
# alphabet map to <pad>. Short prompts and the chat format are covered by the fit_prompts test.
LONG = ("Let $x$ be the number of ordered pairs $(a,b)$ of positive integers with $a \\le b \\le 20$ such that "
        "$a^2 + b^2$ is divisible by $5$ and $a + b$ is odd; the answer is the value of $x$ modulo $1000$ "
        "written as an integer, with no leading zeros. Variant {i}.")
TRAIN_ROWS = [{"question": LONG.format(i=i), "answer": str(10 + i)} for i in range(3)]
EVAL_ROWS = [{"problem": LONG.format(i=9), "answer": "42"},
             {"question": "\u00c9valuez $2 \\cdot 3$ \u2014 en entier. " + LONG.format(i=8), "answer": "6"}]


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ------------------------------------------------------------------------------------ no weights


def test_without_weights_the_script_exits_2_telling_what_to_pass():
    proc = subprocess.run([sys.executable, str(EXPERIMENTS / "aime24_qwen3_8b.py")], capture_output=True, text=True,
                          cwd=REPO, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "error: no model weights: pass --model-path DIR (a Hugging Face Qwen3-8B folder" in proc.stderr
    assert "huggingface-cli download Qwen/Qwen3-8B" in proc.stderr
    assert "error: no training data: pass --train-data" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_inputs_are_clear_errors(exp8b, tmp_path, capsys):
    def err(exp, *argv):
        capsys.readouterr()
        rc = exp.cli(list(argv))
        return rc, capsys.readouterr().err

    empty = tmp_path / "empty"
    empty.mkdir()
    train = _jsonl(tmp_path / "train.jsonl", TRAIN_ROWS)
    rc, msg = err(exp8b, "--model-path", str(empty), "--train-data", train)
    assert rc == 2 and "no model weights in" in msg and "no config.json and no *.safetensors" in msg
    assert "no training data" not in msg
    rc, msg = err(exp8b, "--model-path", str(tmp_path / "missing"), "--train-data", train)
    assert rc == 2 and "is not a folder" in msg
    exp30 = _load("aime24_qwen3_30b_a3b")
    rc, msg = err(exp30)
    assert rc == 2 and "Qwen3-30B-A3B folder" in msg and "huggingface-cli download Qwen/Qwen3-30B-A3B" in msg
    # the recipe's algorithm, with the overlong punishment's buffer fitted to the tiny run's 8 new tokens
    assert exp30.TINY.model.num_experts > 0 and exp30.TINY.algorithm == dataclasses.replace(
        exp30.PRESET.algorithm, overlong_buffer=2) and exp30.PRESET.algorithm.overlong_buffer == 4096
    # MoE routing replay: the engine records the experts, the loop's batches carry them to the trainer
    assert exp30.PRESET.engine_config().record_routing and exp30.TINY.engine_config().record_routing
    assert not exp8b.PRESET.engine_config().record_routing
    rc, msg = err(exp8b, "--preset", "tiny", "--resume", "--out", str(tmp_path / "nothing"),
                  "--train-data", train, "--eval-data", train)
    assert rc == 2 and "--resume: no checkpoint under" in msg
    rc, msg = err(exp8b, "--preset", "tiny", "--train-data", str(tmp_path / "nope.jsonl"), "--eval-data", train)
    assert rc == 2 and "--train-data: dataset file" in msg and "does not exist" in msg
    if importlib.util.find_spec("datasets") is None:  # with it installed this would download: not in tests
        rc, msg = err(exp8b, "--preset", "tiny", "--train-data", train, "--eval-data", "hf:HuggingFaceH4/aime_2024")
        assert rc == 2 and "needs the `datasets` package" in msg
    rc, msg = err(exp8b, "--model-path", str(empty), "--train-data", train, "--set", "model.num_layers=3")
    assert rc == 2 and "model section comes from DIR/config.json" in msg
    rc, msg = err(exp8b, "--preset", "tiny", "--set", "rollout.n_sample=3")
    assert rc == 2 and "unknown key 'rollout.n_sample'; did you mean rollout.n_samples?" in msg
    rc, msg = err(exp8b, "--preset", "tiny", "--set", "rl.rollout.max_seq_len=64")  # moved into the engine's section
    assert rc == 2 and "did you mean rollout.engine.max_seq_len?" in msg
    rc, msg = err(exp8b, "--preset", "tiny", "--set", "overflow=squeeze")
    assert rc == 2 and "'squeeze' is not one of" in msg
    cfg = exp8b.aime24.AimeConfig(rl=exp8b.TINY, random_init=True)  # default SKIP: every training prompt is too long
    cfg = exp8b.aime24.apply_overrides(cfg, [f"data.train_path={train}", f"data.eval_path={train}",
                                             f"logging.out_dir={tmp_path / 'skip'}"])
    with pytest.raises(exp8b.aime24.UsageError, match="no training prompt fits in 184 tokens"):
        exp8b.main(cfg)


def test_prompts_template_chat_and_overflow(exp8b):
    aime = exp8b.aime24
    from fp8rl_jax.tasks import Example

    def encode(text):
        return list(text)

    def render(q):
        return aime.chat_prompt(aime.PROMPT_TEMPLATE.format(question=q))

    examples = [Example("short?", "1"), Example("x" * 500, "2")]
    kept = aime.fit_prompts(examples, render=render, encode=encode, budget=200, overflow=aime.Overflow.TRUNCATE,
                            what="test")
    assert [len(e.prompt) <= 200 for e in kept] == [True, True] and len(kept[1].prompt) == 200
    assert kept[0].prompt.startswith("<|im_start|>user\nshort?") and kept[0].prompt.endswith("<|im_start|>assistant\n")
    assert "\\boxed{}" in kept[1].prompt and kept[1].answer == "2"
    skipped = aime.fit_prompts(examples, render=render, encode=encode, budget=200, overflow=aime.Overflow.SKIP,
                               what="test")
    assert [e.answer for e in skipped] == ["1"]


def test_eos_ids_join_config_and_generation_config(exp8b, tmp_path):
    model_cfg = dataclasses.replace(exp8b.TINY.model, vocab_size=99, eos_token_ids=(1,))
    assert exp8b.aime24._eos_ids(tmp_path, model_cfg) == (1,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5, 1000]}))
    assert exp8b.aime24._eos_ids(tmp_path, model_cfg) == (1, 5)  # ids outside the vocabulary are dropped
    with pytest.raises(exp8b.aime24.UsageError, match="names an eos_token_id"):
        exp8b.aime24._eos_ids(tmp_path / "none", dataclasses.replace(model_cfg, eos_token_ids=()))


# ------------------------------------------------------------------------------------ tiny preset


@pytest.fixture(scope="module")
def tiny_demo(exp8b, tmp_path_factory):
    """``--preset tiny`` end to end through the command line, once for the module (the tiny run is
    the expensive part of both tests below): train to the first checkpoint as if interrupted, resume
    from it and finish (``aime24.tiny_demo``). On ../shared/data/aime24.jsonl with the preset's
    defaults when it is present (the acceptance command), else on the jsonl files of this module.
    Each ``main`` call's config and result are recorded with the metrics rows and summary.json it
    left behind."""
    tmp = tmp_path_factory.mktemp("tiny_demo")
    out = tmp / "run"
    argv = ["--preset", "tiny", "--out", str(out), *[a for s in QUIET for a in ("--set", s)]]
    if AIME24.is_file():
        n_eval = sum(1 for line in AIME24.read_text().splitlines() if line.strip())
    else:
        argv += ["--train-data", _jsonl(tmp / "train.jsonl", TRAIN_ROWS),
                 "--eval-data", _jsonl(tmp / "eval.jsonl", EVAL_ROWS)]
        n_eval = len(EVAL_ROWS)
    aime, calls = exp8b.aime24, []
    original = aime.main

    def recorded(config):
        result = original(config)
        calls.append(SimpleNamespace(config=config, result=result, rows=read_metrics(out / "metrics.jsonl"),
                                     summary=json.loads((out / "summary.json").read_text())))
        return result

    aime.main = recorded
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            rc = exp8b.cli(argv)
    finally:
        aime.main = original
    return SimpleNamespace(rc=rc, out=stdout.getvalue(), err=stderr.getvalue(), calls=calls, dir=out, n_eval=n_eval)


def test_tiny_preset_trains_evaluates_checkpoints_and_resumes(exp8b, tiny_demo):
    assert tiny_demo.rc == 0, tiny_demo.err
    first_call, second_call = tiny_demo.calls  # to the checkpoint at step 2, then resumed from it to step 4
    first, second, out = first_call.result, second_call.result, tiny_demo.dir
    train_rows = [r for r in first_call.rows if "reward/mean" in r]
    eval_rows = [r for r in first_call.rows if "eval/accuracy" in r]
    assert [r["step"] for r in train_rows] == [1, 2] and [r["step"] for r in eval_rows] == [0, 2]
    for key in ("reward/accuracy", "mismatch/kl_k3", "rollout/tokens_per_s", "time/weight_sync_s", "train/loss"):
        assert all(r.get(key) is not None for r in train_rows), key
    assert all(0 <= r["eval/accuracy"] <= r["eval/pass_at_k"] <= 1 and r["eval/k"] == 2 for r in eval_rows)
    assert first.summary["eval_prompts"] == tiny_demo.n_eval and first.summary["precision"] == "all"
    assert first.summary["checkpoints"] == [2]
    assert first.cursor["data_cursor"] == 4 and int(first.state.step) == 2
    assert first_call.summary["final_step"] == 2

    # the resume at step 2: the restored state is the saved one, the cursor and the step too
    assert second.summary["start_step"] == 2 and second.summary["resumed_cursor"] == 4
    assert second.summary["resumed_state_fingerprint"] == first.summary["state_fingerprint"]
    # ... and it continued to data.steps = 4: the rows continue the file, the cursor advances
    assert second.summary["final_step"] == 4
    assert second.summary["steps_this_run"] == 2 and second.cursor["data_cursor"] == 8
    assert int(second.state.step) == 4 and second.summary["checkpoints"] == [2, 4]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2, 4]
    changed = jax.tree.map(lambda a, b: not bool(jnp.array_equal(a, b)), second.state.params, first.state.params)
    assert any(jax.tree.leaves(changed))

    # resume at the saved step (4): nothing to train, the restored state equals the saved one leaf for leaf
    same = exp8b.main(second_call.config)
    assert second_call.config.resume and (out / "checkpoints" / "4").is_dir()
    assert same.summary["start_step"] == 4 and same.summary["steps_this_run"] == 0
    assert same.summary["resumed_cursor"] == 8 and same.summary["resumed_state_fingerprint"] == \
        second.summary["state_fingerprint"]
    assert jax.tree.structure(same.state) == jax.tree.structure(second.state)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), same.state, second.state)))
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r] == [1, 2, 3, 4]


def test_model_path_folder_end_to_end(exp8b, tmp_path, capsys):
    """The real-weights path on a tiny Hugging Face folder (config.json + safetensors +
    tokenizer.json + generation_config.json), chat format auto (off: the character tokenizer
    has no <|im_start|>), one step, evaluation, checkpoint. The model equals the tiny preset's,
    so the compiled steps of the previous test are reused."""
    from fp8rl_jax.checkpoint import save_checkpoint
    from fp8rl_jax.models import init_params
    from fp8rl_jax.tokenization import char_tokenizer

    tok = char_tokenizer(exp8b.aime24.TINY_ALPHABET)
    model_cfg = dataclasses.replace(exp8b.TINY.model, vocab_size=tok.get_vocab_size(), eos_token_ids=(1,))
    folder = tmp_path / "hf"
    save_checkpoint(folder, init_params(model_cfg, jax.random.key(3), jnp.float32), model_cfg)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1]}))
    train = _jsonl(tmp_path / "train.jsonl", TRAIN_ROWS)
    out = tmp_path / "run"
    sizes = ["trainer.micro_batches=1", "trainer.remat=false", "rollout.n_samples=2", "rollout.max_new_tokens=8",
             "algorithm.overlong_buffer=2",
             "rollout.engine.max_seq_len=192", "rollout.engine.max_slots=16", "rollout.engine.kv_budget_gib=0.001",
             "rollout.engine.kv_budget_fraction=0",
             "rollout.engine.steps_per_call=8", "rollout.engine.prefill_batch=16", "optimizer.lr=1e-4", "optimizer.warmup_steps=0",
             "data.prompts_per_step=2", "data.steps=1", "data.eval_every=1", "data.eval_samples=2",
             "logging.checkpoint_every=1", "overflow=truncate", *QUIET]
    evals = _jsonl(tmp_path / "eval.jsonl", EVAL_ROWS)
    argv = ["--model-path", str(folder), "--train-data", train, "--eval-data", evals, "--out", str(out)]
    capsys.readouterr()
    assert exp8b.cli(argv + [a for s in sizes for a in ("--set", s)]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "chat format off" in printed and "3 truncated" in printed and "2 truncated" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_step"] == 1 and summary["checkpoints"] == [1] and summary["eval_prompts"] == 2
    saved = json.loads((out / "config.json").read_text())
    assert saved["rl"]["model"]["eos_token_ids"] == [1] and saved["model_path"] == str(folder)
    # a second fresh run into the same folder would overwrite a real run's checkpoints: refused
    capsys.readouterr()
    assert exp8b.cli(argv) == 2 and "already holds checkpoints (latest step 1)" in capsys.readouterr().err


@pytest.mark.skipif(not AIME24.is_file(), reason=f"{AIME24} is absent (AIME24 evaluation data, not in the repo)")
def test_tiny_preset_on_aime24_from_shared_data(tiny_demo):
    """The acceptance command: ``--preset tiny`` with its defaults reads ../shared/data/aime24.jsonl for
    training prompts and evaluation, checkpoints, then resumes and finishes (the ``tiny_demo`` run)."""
    assert tiny_demo.rc == 0, tiny_demo.err
    assert f"30 evaluation prompts from {AIME24}" in tiny_demo.out and \
        "resume check: step 2, data cursor 4" in tiny_demo.out
    rows = read_metrics(tiny_demo.dir / "metrics.jsonl")
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2, 4]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3, 4]
    assert np.isfinite([r["mismatch/kl_k3"] for r in rows if "reward/mean" in r]).all()
