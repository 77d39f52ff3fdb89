"""The user documentation stays true: the configuration reference is the dataclasses' own output, every
relative link in README.md and docs/ resolves, and no page reads as a work log. CPU only."""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from experiments import config_reference  # noqa: E402
from experiments.bench import plans  # noqa: E402

from fp8rl_jax.rl.config import RLConfig  # noqa: E402
from fp8rl_jax.rollout.config import EngineConfig  # noqa: E402

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_configuration_page_is_generated():
    page = ROOT / "docs" / "configuration.md"
    assert page.read_text() == config_reference.render(), (
        "docs/configuration.md differs from the dataclasses; regenerate it: "
        "python experiments/config_reference.py --out docs/configuration.md")


def test_reference_covers_every_field():
    """Every leaf field of RLConfig and EngineConfig has a row under its dotted key."""
    text = config_reference.render()
    keys = set(re.findall(r"^\| `([a-z0-9_.]+)` \|", text, flags=re.M))

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            sub = config_reference._nested_class(typing.get_type_hints(cls)[f.name])
            if sub is not None:
                yield from walk(sub, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}"

    expected = set(walk(RLConfig, ""))
    engine_keys = {k for k in keys if k.startswith("engine.") or ".engine." in k}
    if not engine_keys:
        pytest.fail("the reference has no EngineConfig section")
    assert expected <= keys, sorted(expected - keys)
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= {k.rsplit(".", 1)[1] for k in engine_keys}


def test_docstring_attributes_are_parsed():
    class Doc:
        """Summary.

        Attributes:
          alpha: first line
            continued.
          beta, gamma: shared text.
        Returns nothing.
        """

    got = config_reference.docstring_attributes(Doc)
    assert got == {"alpha": "first line continued.", "beta": "shared text.", "gamma": "shared text."}


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of the headings of a markdown page: lower case, punctuation dropped, spaces -> '-'."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), flags=re.M)
    return {re.sub(r"[^a-z0-9_\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_anchors_follow_github():
    assert anchors(ROOT / "docs" / "recipes.md") >= {"several-hosts", "the-vllm-backend", "fp8-modes"}
    assert "rolloutengine-engineconfig" in anchors(ROOT / "docs" / "configuration.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, fragment = target.partition("#")
        dest = page if not path else page.parent / path
        if not dest.exists() or (fragment and dest.suffix == ".md" and fragment not in anchors(dest)):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} has links to missing files or headings: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_work_log_words(page):
    text = page.read_text()
    # the word for a work period, spelled with a class so that this file does not contain it either
    assert not re.search(r"\bs[e]ssions?\b", text, flags=re.I), f"{page.relative_to(ROOT)} reads as a work log"


DOTTED = re.compile(r"`((?:fp8rl_jax|pallas_kernels|configs|experiments)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`")


def resolve(dotted: str) -> bool:
    """Whether ``a.b.c`` names an importable module or an attribute of one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_modules_and_objects_exist(page):
    """Every `fp8rl_jax.x.y` (or pallas_kernels, configs, experiments) a page names in backticks exists."""
    missing = sorted({d for d in DOTTED.findall(page.read_text()) if not resolve(d)})
    assert not missing, f"{page.relative_to(ROOT)} names what does not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_examples_import(page):
    """The import lines of every python example on the page run."""
    for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S):
        imports = "\n".join(line for line in block.splitlines() if re.match(r"(from \S+ )?import ", line))
        exec(compile(imports, f"{page.name} example", "exec"), {})


def test_results_name_plan_steps():
    """Every `step NAME` in docs/results.md is a step of the plan of the GPU whose section it is in."""
    text = (ROOT / "docs" / "results.md").read_text()
    sections = re.split(r"^## ", text, flags=re.M)
    checked = 0
    for section in sections:
        gpu = "h200" if section.startswith("NVIDIA H200") else "h100" if section.startswith("NVIDIA H100") else None
        if gpu is None:
            continue
        names = {s.name for s in plans.plan(gpu)}
        for row in re.findall(r"^\|.*$", section, flags=re.M):
            for step in re.findall(r"step(?:s)? ((?:`[A-Za-z0-9_]+`(?:, )?)+)", row):
                for name in re.findall(r"`([A-Za-z0-9_]+)`", step):
                    assert name in names, f"docs/results.md ({gpu}) names step {name!r}, not in the {gpu} plan"
                    checked += 1
    assert checked > 10


def _pct(x: float, digits: int = 0) -> str:
    return f"{100 * x:.{digits}f}".rstrip("0").rstrip(".") + "%" if digits else f"{100 * x:.0f}%"


def test_quoted_demo_numbers_are_the_recorded_run():
    """The README, docs/quickstart.md and docs/results.md quote the demo's numbers from its recorded
    summary (``python experiments/quickstart.py --record`` writes experiments/results/cpu/quickstart.json)."""
    import json

    rec = json.loads((ROOT / "experiments/results/cpu/quickstart.json").read_text())
    s = rec["summary"]
    first, first10, last10 = s["train_reward_first_step"], s["train_reward_first_10_mean"], s["train_reward_last_10_mean"]
    before, after, kl = s["eval_accuracy_before_rl"], s["eval_accuracy_after_rl"], f"{s['mismatch_kl_k3_mean']:.1e}".replace("e-0", "e-")
    text = {p: " ".join((ROOT / p).read_text().split()) for p in ("README.md", "docs/quickstart.md", "docs/results.md")}
    quotes = {
        "README.md": [f"from ~{_pct(first)} at the first step to ~{_pct(last10)} over the last 10",
                      f"from {_pct(before, 1)} to {_pct(after, 1)}", f"averages {kl}"],
        "docs/quickstart.md": [f"from {_pct(first)} at the first step ({_pct(first10)} over the first 10) to "
                               f"{_pct(last10)} over the last 10 steps", f"from {_pct(before, 1)} to {_pct(after, 1)}",
                               f"averages {kl}"],
        "docs/results.md": [f"{_pct(first, 1)} -> {_pct(last10, 1)} (greedy held-out accuracy {_pct(before, 1)} -> "
                            f"{_pct(after, 1)}), mean K3 KL {kl} | `python experiments/quickstart.py --record` | "
                            f"{rec['environment']['commit'][:7]} | {rec['environment']['date'][:10]}"],
    }
    for page, wanted in quotes.items():
        for quote in wanted:
            assert quote in text[page], (page, quote)
    assert "+dirty" not in rec["environment"]["commit"], "record the demo from a clean checkout"
