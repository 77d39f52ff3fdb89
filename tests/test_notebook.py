"""experiments/quickstart.ipynb: valid nbformat v4, stored without outputs, and it runs top to bottom.

No Jupyter is installed (nor needed): the notebook is read as JSON and its code cells run in order
in one fresh interpreter, each cell's last expression evaluated and printed like a kernel would.
``FP8RL_NOTEBOOK_TINY=1`` makes the notebook's own sizes tiny (its cell 2), so the run is a smoke
test of the cells, not of learning (``experiments/quickstart.py`` is where the reward gain is
stated).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "experiments" / "quickstart.ipynb"
TINY_STEPS = 3  # data.steps of the notebook's tiny mode

SUMMARY_KEYS = {"eval_accuracy_before_rl", "eval_accuracy_after_rl", "train_reward_first_step",
                "train_reward_last_step", "mismatch_kl_k3_mean", "prob_mult_error_mean",
                "rollout_tokens_per_s_mean", "weight_sync_s_mean", "rl_steps", "precision", "plot"}

# Runs the code cells of argv[1] in one namespace like a kernel; dumps `summary` to argv[2].
# Once a cell has imported the QUICKSTART preset, the runner sizes the preset's rollout engine for
# the tiny run (16 sequences of up to 32 tokens) in the namespace: the preset's 256 slots and
# 2k-page FP8 KV pool make every rollout take longer on the CPU (each FP8 decode step touches the
# whole pool there), and no cell depends on them. It also cuts the model to one decoder layer:
# the run's cost is XLA compiling the SFT, train, logprob and engine programs, which grows with
# the depth, and the cells run the same code at any depth.
RUNNER = r"""
import ast, dataclasses, json, sys
nb = json.load(open(sys.argv[1], encoding="utf-8"))
ns = {"__name__": "__main__"}
code = [c for c in nb["cells"] if c["cell_type"] == "code"]
sized = False
for i, cell in enumerate(code):
    name = f"<cell {i} {cell.get('id', '')}>"
    tree = ast.parse("".join(cell["source"]), filename=name)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, name, "exec"), ns)
    if not sized and "QUICKSTART" in ns:
        q = ns["QUICKSTART"]
        ns["QUICKSTART"] = dataclasses.replace(q, model=dataclasses.replace(q.model, num_layers=1),
            rollout=dataclasses.replace(q.rollout, engine=dataclasses.replace(
                q.rollout.engine, max_slots=16, prefill_batch=16, kv_budget_gib=0.001)))
        sized = True
    if last is not None:
        value = eval(compile(ast.Expression(last.value), name, "eval"), ns)
        if value is not None:
            print(repr(value))
    print(f"[cell {i} ok]", flush=True)
json.dump(ns["summary"], open(sys.argv[2], "w"))
"""


def _load() -> dict:
    return json.loads(NOTEBOOK.read_text(encoding="utf-8"))


def test_notebook_is_valid_nbformat_v4():
    nb = _load()
    assert set(nb) == {"cells", "metadata", "nbformat", "nbformat_minor"}
    assert nb["nbformat"] == 4 and isinstance(nb["nbformat_minor"], int) and nb["nbformat_minor"] >= 5
    ks = nb["metadata"]["kernelspec"]
    assert ks["name"] == "python3" and ks["language"] == "python" and isinstance(ks["display_name"], str)
    ids = []
    for i, cell in enumerate(nb["cells"]):
        where = f"cell {i}"
        assert cell["cell_type"] in ("markdown", "code"), where
        assert isinstance(cell["metadata"], dict), where
        src = cell["source"]
        assert isinstance(src, list) and src and all(isinstance(s, str) for s in src), where
        assert all(s.endswith("\n") for s in src[:-1]) and all("\n" not in s[:-1] for s in src), \
            f"{where}: source must be a list of lines"
        assert re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", cell["id"]), where
        ids.append(cell["id"])
        if cell["cell_type"] == "code":
            assert set(cell) == {"cell_type", "execution_count", "id", "metadata", "outputs", "source"}, where
        else:
            assert set(cell) <= {"cell_type", "id", "metadata", "source", "attachments"}, where
    assert len(set(ids)) == len(ids), "cell ids must be unique"


def test_notebook_is_stored_clean_and_runs_without_a_kernel():
    nb = _load()
    # Jupyter's own serialization (nbformat.write), so saving it from Jupyter leaves no spurious diff
    assert NOTEBOOK.read_text(encoding="utf-8") == json.dumps(
        nb, indent=1, sort_keys=True, separators=(",", ": "), ensure_ascii=False) + "\n"
    cells = nb["cells"]
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            assert cell["execution_count"] is None and cell["outputs"] == [], f"cell {i} has stored outputs"
            assert cells[i - 1]["cell_type"] == "markdown", f"code cell {i} has no markdown cell above it"
            for line in cell["source"]:
                assert not line.lstrip().startswith(("%", "!")), f"cell {i}: IPython magic {line!r} needs a kernel"
            compile("".join(cell["source"]), f"<cell {i}>", "exec")
    assert cells[-1]["cell_type"] == "markdown"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    out = tmp_path_factory.mktemp("notebook")
    summary_path = out / "summary_from_namespace.json"
    env = dict(os.environ, FP8RL_NOTEBOOK_TINY="1", FP8RL_NOTEBOOK_OUT=str(out / "run"), MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(NOTEBOOK), str(summary_path)],
                          cwd=NOTEBOOK.parent, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"notebook failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return out / "run", json.loads(summary_path.read_text()), proc.stdout


def test_notebook_runs_headless_in_tiny_mode(executed):
    out, summary, stdout = executed
    n_code = sum(c["cell_type"] == "code" for c in _load()["cells"])
    assert all(f"[cell {i} ok]" in stdout for i in range(n_code))
    assert "tiny mode True" in stdout and "sweep arm: none none" in stdout and "rejected: " in stdout
    assert re.search(r"^1 layers, D=", stdout, re.M)  # the runner's one-layer model reached the cells

    # the final summary: expected keys, sane values, the same as summary.json
    assert set(summary) == SUMMARY_KEYS
    assert json.loads((out / "summary.json").read_text()) == summary
    assert summary["rl_steps"] == TINY_STEPS and summary["precision"] == "all"
    for k in SUMMARY_KEYS - {"rl_steps", "precision", "plot"}:
        assert isinstance(summary[k], float) and math.isfinite(summary[k]), k
    for k in ("eval_accuracy_before_rl", "eval_accuracy_after_rl", "train_reward_first_step", "train_reward_last_step"):
        assert 0.0 <= summary[k] <= 1.0, k
    assert summary["mismatch_kl_k3_mean"] >= 0.0 and summary["prob_mult_error_mean"] >= 1.0
    assert summary["rollout_tokens_per_s_mean"] > 0 and summary["weight_sync_s_mean"] >= 0

    # the stage-by-stage step printed its shapes, reward, mismatch and times
    for pattern in (r"rollout   tokens \(16, \d\), \d+ generated", r"score     rewards \(16,\), mean",
                    r"batch     tokens/loss_mask/advantages \(16, 32\)",
                    r"mismatch  K3 KL -?\d\.\d\de[-+]\d+, prob\. mult\. error",
                    r"seconds   rollout .* weight_sync \d"):
        assert re.search(pattern, stdout), pattern

    # metrics.jsonl: eval at 0 and at the end, one row per RL step with reward, mismatch and stage times
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == list(range(1, TINY_STEPS + 1))
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, TINY_STEPS]
    for r in steps:
        for k in ("mismatch/kl_k3", "mismatch/prob_mult_error", "rollout/tokens_per_s", "time/rollout_s",
                  "time/trainer_logprobs_s", "time/update_s", "time/weight_sync_s", "train/loss"):
            assert r.get(k) is not None and math.isfinite(r[k]), (r["step"], k)
    assert json.loads((out / "config.json").read_text())["rl"]["data"]["steps"] == TINY_STEPS

    # the plot
    png = Path(summary["plot"])
    assert png == out / "quickstart.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
