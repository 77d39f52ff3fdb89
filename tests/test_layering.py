"""The import layering of the tree, read from the source (AST), not from what happens to import.

Floors, lowest first; a module may import its own floor and the floors below, never one above::

    pallas_kernels < fp8rl_jax.numerics (+ the leaf helpers) < fp8rl_jax.models
      < fp8rl_jax.quant, fp8rl_jax.parallel < fp8rl_jax.checkpoint < fp8rl_jax.rollout
      < fp8rl_jax.rl < fp8rl_jax.cli < configs < experiments

Every import statement counts: at module top, inside functions and under ``if TYPE_CHECKING``;
relative imports are resolved. On top of the floors: no import cycle between modules (all
imports counted, so a loop hidden inside a function is still a loop), ``pallas_kernels`` imports
only jax, jaxlib, numpy, ml_dtypes, the standard library and itself, and no source file in
``fp8rl_jax/`` or ``pallas_kernels/`` exceeds ``MAX_LINES``.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("pallas_kernels", "fp8rl_jax", "configs", "experiments")
MAX_LINES = 700

# (floor, module prefixes); a module's floor is that of its longest matching prefix.
FLOORS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (0, ("pallas_kernels",)),
    (1, ("fp8rl_jax", "fp8rl_jax.numerics", "fp8rl_jax.tokenization", "fp8rl_jax.tasks", "fp8rl_jax.rewards",
         "fp8rl_jax.environment", "fp8rl_jax.fields")),
    (2, ("fp8rl_jax.models",)),
    (3, ("fp8rl_jax.quant", "fp8rl_jax.parallel")),
    (4, ("fp8rl_jax.checkpoint",)),
    (5, ("fp8rl_jax.rollout",)),
    (6, ("fp8rl_jax.rl",)),
    (7, ("fp8rl_jax.cli", "fp8rl_jax.__main__")),
    (8, ("configs",)),
    (9, ("experiments",)),
)
# Prefixes that place only the module itself, not its submodules: ``fp8rl_jax/__init__.py`` sits on
# floor 1, while every subpackage of fp8rl_jax must be listed above.
_EXACT_ONLY = {"fp8rl_jax"}
KERNEL_ALLOWED = frozenset({"jax", "jaxlib", "numpy", "ml_dtypes", "pallas_kernels"}) | frozenset(
    sys.stdlib_module_names)


@dataclasses.dataclass(frozen=True)
class Import:
    """One import edge: ``importer`` imports ``target`` at ``path:line``."""

    importer: str
    target: str
    path: str
    line: int


def module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def floor_of(module: str) -> int | None:
    """The floor of a project module, or None when it is on no floor."""
    best, best_len = None, -1
    for floor, prefixes in FLOORS:
        for p in prefixes:
            exact_only = p in _EXACT_ONLY
            if module == p or (not exact_only and module.startswith(p + ".")):
                if len(p) > best_len:
                    best, best_len = floor, len(p)
    return best


def _resolve_relative(importer: str, is_package: bool, level: int, module: str | None) -> str:
    package = importer if is_package else importer.rpartition(".")[0]
    parts = package.split(".") if package else []
    if level - 1 > len(parts):
        raise ValueError(f"relative import beyond the top package in {importer}")
    base = parts[: len(parts) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def collect_imports(base: Path, roots: Iterable[str] = ROOTS) -> tuple[set[str], list[Import], dict[str, Path]]:
    """``(modules, imports, files)`` of every ``.py`` file under ``base/<root>`` for each root.

    An ``import a.b`` or ``from a.b import c`` gives an edge to ``a.b``, and to ``a.b.c`` when that
    is a module of the tree. Imports of modules outside the roots (third-party, standard library)
    are kept with their full dotted name."""
    files: dict[str, Path] = {}
    for root in roots:
        for path in sorted((base / root).rglob("*.py")):
            files[module_name(path, base)] = path
    modules = set(files)
    imports: list[Import] = []
    for mod, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = str(path.relative_to(base))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    imports.append(Import(mod, alias.name, rel, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                target = (_resolve_relative(mod, is_package, node.level, node.module) if node.level
                          else node.module or "")
                subs = [f"{target}.{alias.name}" if target else alias.name for alias in node.names]
                # `from pkg import submodule` inside pkg itself does not re-enter pkg's __init__.
                inside = mod == target or mod.startswith(target + ".")
                if not (inside and all(sub in modules for sub in subs)):
                    imports.append(Import(mod, target, rel, node.lineno))
                for alias in node.names:
                    sub = f"{target}.{alias.name}" if target else alias.name
                    if sub in modules:
                        imports.append(Import(mod, sub, rel, node.lineno))
    return modules, imports, files


def _implicit_parents(importer: str, target: str, modules: set[str]) -> list[str]:
    """The packages importing ``target`` initializes first (those not already above ``importer``)."""
    parts = target.split(".")
    out = []
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if parent in modules and not (importer == parent or importer.startswith(parent + ".")):
            out.append(parent)
    return out


def _cycles(modules: set[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (or a self-loop), by Tarjan."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # iterative to stay clear of the recursion limit
        work = [(v, iter(sorted(edges.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    advanced = True
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1 or node in edges.get(node, ()):
                    out.append(sorted(comp))

    for v in sorted(modules):
        if v not in index:
            visit(v)
    return sorted(out)


def check_layering(base: Path, roots: Iterable[str] = ROOTS) -> list[str]:
    """Every layering violation of the tree under ``base``, one readable line each (empty: clean)."""
    modules, imports, _ = collect_imports(base, roots)
    problems: list[str] = []
    for mod in sorted(modules):
        if floor_of(mod) is None:
            problems.append(f"{mod}: on no floor (add its package to FLOORS in tests/test_layering.py)")
    edges: dict[str, set[str]] = {m: set() for m in modules}
    kernel_bad: dict[str, Import] = {}  # one report per statement
    upward: dict[str, tuple[int, str, Import]] = {}  # per statement, the highest floor it reaches
    for imp in imports:
        where = f"{imp.path}:{imp.line}"
        top = imp.target.split(".")[0]
        if imp.importer.split(".")[0] == "pallas_kernels" and top not in KERNEL_ALLOWED:
            kernel_bad.setdefault(where, imp)
        if top not in {r.split(".")[0] for r in roots}:
            continue
        target = imp.target
        while target and target not in modules:  # `import pkg.missing`: its nearest existing package
            target = target.rpartition(".")[0]
        if not target:
            continue
        lo, hi = floor_of(imp.importer), floor_of(target)
        if lo is not None and hi is not None and hi > lo:
            prev = upward.get(where)
            if prev is None or (hi, len(target)) > (prev[0], len(prev[1])):
                upward[where] = (hi, target, imp)
        if target != imp.importer:
            edges[imp.importer].add(target)
        for parent in _implicit_parents(imp.importer, target, modules):
            edges[imp.importer].add(parent)
    for where, imp in kernel_bad.items():
        problems.append(f"{where}: {imp.importer} imports {imp.target}: pallas_kernels may import only "
                        f"jax, jaxlib, numpy, ml_dtypes, the standard library and itself")
    for where, (hi, target, imp) in upward.items():
        problems.append(f"{where}: upward import: {imp.importer} (floor {floor_of(imp.importer)}) imports "
                        f"{target} (floor {hi})")
    where_of: dict[tuple[str, str], str] = {}
    for imp in imports:
        target = imp.target
        while target and target not in modules:
            target = target.rpartition(".")[0]
        where_of.setdefault((imp.importer, target), f"{imp.path}:{imp.line}")
    for comp in _cycles(modules, edges):
        members = set(comp)
        links = sorted(f"{a} -> {b} ({where_of.get((a, b), 'package import')})"
                       for a in comp for b in edges[a] if b in members)
        problems.append(f"import cycle between {', '.join(comp)}: " + "; ".join(links))
    return sorted(problems, key=_sort_key)


def _sort_key(problem: str) -> tuple:
    path, _, rest = problem.partition(":")
    line = rest.split(":")[0]
    return (path.startswith("import cycle"), path, int(line) if line.isdigit() else 0, problem)


def long_files(base: Path, roots: Iterable[str] = ("fp8rl_jax", "pallas_kernels"),
               max_lines: int = MAX_LINES) -> list[str]:
    """``path: N lines`` for every ``.py`` file under ``roots`` longer than ``max_lines``."""
    out = []
    for root in roots:
        for path in sorted((base / root).rglob("*.py")):
            n = len(path.read_text().splitlines())
            if n > max_lines:
                out.append(f"{path.relative_to(base)}: {n} lines (> {max_lines})")
    return out


# --------------------------------------------------------------------------- the tree


def test_tree_is_layered():
    problems = check_layering(REPO)
    assert not problems, "layering violations:\n" + "\n".join(problems)


def test_no_long_files():
    too_long = long_files(REPO)
    assert not too_long, "files over the size limit:\n" + "\n".join(too_long)


def test_tree_has_the_floors():
    """The checker sees the real tree (guards against a silently empty walk)."""
    modules, imports, _ = collect_imports(REPO)
    for m in ("pallas_kernels.fp8_gemm", "fp8rl_jax.models.qwen3", "fp8rl_jax.rl.trainer", "fp8rl_jax.cli",
              "configs.rl"):
        assert m in modules
    assert any(i.importer == "fp8rl_jax.rl.trainer" and i.target.startswith("fp8rl_jax.models") for i in imports)


# --------------------------------------------------------------------------- the checker itself


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, src in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(src))
    for root in ROOTS:
        (tmp_path / root).mkdir(exist_ok=True)
    return tmp_path


CLEAN = {
    "pallas_kernels/__init__.py": "",
    "pallas_kernels/gemm.py": """\
        from __future__ import annotations
        import functools
        import jax.numpy as jnp
        from jax.experimental import pallas as pl
        import numpy as np
        from pallas_kernels import common
        """,
    "pallas_kernels/common.py": "import os\n",
    "fp8rl_jax/__init__.py": "",
    "fp8rl_jax/numerics/__init__.py": "",
    "fp8rl_jax/numerics/fp8.py": "from pallas_kernels.gemm import jnp\n",
    "fp8rl_jax/models/__init__.py": "from fp8rl_jax.models.qwen3 import forward\n",
    "fp8rl_jax/models/qwen3.py": """\
        from typing import TYPE_CHECKING
        from ..numerics import fp8
        from . import policy
        if TYPE_CHECKING:
            from fp8rl_jax.numerics.fp8 import QuantizedWeight
        def forward():
            import torch  # optional third-party, lazily
        """,
    "fp8rl_jax/models/policy.py": "import pallas_kernels.gemm\n",
    "fp8rl_jax/rl/__init__.py": "",
    "fp8rl_jax/rl/trainer.py": "from fp8rl_jax.models import forward\nfrom fp8rl_jax.models.qwen3 import policy\n",
    "configs/__init__.py": "",
    "configs/rl.py": "from fp8rl_jax.rl import trainer\n",
    "experiments/run.py": "import configs.rl\nfrom fp8rl_jax.models import qwen3\n",
}


def test_checker_accepts_clean_tree(tmp_path):
    base = _tree(tmp_path, CLEAN)
    assert check_layering(base) == []
    modules, imports, _ = collect_imports(base)
    # Relative imports resolve, submodules named in `from pkg import mod` count as modules.
    assert Import("fp8rl_jax.models.qwen3", "fp8rl_jax.numerics.fp8", "fp8rl_jax/models/qwen3.py", 2) in imports
    assert Import("fp8rl_jax.models.qwen3", "fp8rl_jax.models.policy", "fp8rl_jax/models/qwen3.py", 3) in imports


def test_checker_finds_upward_import(tmp_path):
    base = _tree(tmp_path, CLEAN | {"fp8rl_jax/models/policy.py": "import pallas_kernels.gemm\n\n"
                                    "from fp8rl_jax.rl.trainer import forward\n"})
    problems = check_layering(base)
    up = [p for p in problems if "upward" in p]
    assert up == ["fp8rl_jax/models/policy.py:3: upward import: fp8rl_jax.models.policy (floor 2) imports "
                  "fp8rl_jax.rl.trainer (floor 6)"]
    # rl.trainer imports the models, so this also closes a loop.
    assert any(p.startswith("import cycle between") and "fp8rl_jax.rl.trainer" in p for p in problems)


def test_checker_finds_upward_import_in_function_relative_and_type_checking(tmp_path):
    base = _tree(tmp_path, CLEAN | {
        "fp8rl_jax/numerics/fp8.py": """\
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from fp8rl_jax.models.policy import X
            def f():
                from ..rl import trainer
            """,
        "pallas_kernels/common.py": "def g():\n    import configs\n",
    })
    problems = check_layering(base)
    assert "fp8rl_jax/numerics/fp8.py:3: upward import: fp8rl_jax.numerics.fp8 (floor 1) imports " \
           "fp8rl_jax.models.policy (floor 2)" in problems
    assert "fp8rl_jax/numerics/fp8.py:5: upward import: fp8rl_jax.numerics.fp8 (floor 1) imports " \
           "fp8rl_jax.rl.trainer (floor 6)" in problems
    assert any(p.startswith("pallas_kernels/common.py:2: upward import: pallas_kernels.common (floor 0) imports "
                            "configs") for p in problems)


def test_checker_finds_loop_hidden_in_function(tmp_path):
    # models.qwen3 -> models.policy at the top; models.policy -> models.qwen3 inside a function:
    # same floor, so only the cycle check can see it.
    base = _tree(tmp_path, CLEAN | {"fp8rl_jax/models/policy.py": """\
        import pallas_kernels.gemm
        def calibrate():
            from fp8rl_jax.models.qwen3 import forward
            return forward
        """})
    problems = check_layering(base)
    assert len(problems) == 1, problems
    assert problems[0].startswith("import cycle between fp8rl_jax.models.policy, fp8rl_jax.models.qwen3: ")
    assert "fp8rl_jax.models.policy -> fp8rl_jax.models.qwen3 (fp8rl_jax/models/policy.py:3)" in problems[0]


def test_checker_finds_loop_through_package_init(tmp_path):
    # numerics.fp8 -> models.qwen3 initializes fp8rl_jax.models, whose __init__ imports qwen3,
    # which imports numerics.fp8: a loop through the package (besides the upward import).
    base = _tree(tmp_path, CLEAN | {"fp8rl_jax/numerics/fp8.py": "import fp8rl_jax.models.qwen3\n"})
    problems = check_layering(base)
    assert any(p.startswith("fp8rl_jax/numerics/fp8.py:1: upward import") for p in problems)
    cycles = [p for p in problems if p.startswith("import cycle")]
    assert len(cycles) == 1 and "fp8rl_jax.numerics.fp8" in cycles[0] and "fp8rl_jax.models.qwen3" in cycles[0]


def test_checker_limits_kernel_imports(tmp_path):
    base = _tree(tmp_path, CLEAN | {"pallas_kernels/gemm.py": "import jax\nimport scipy.linalg\n"
                                                              "from fp8rl_jax.numerics import fp8\n"})
    problems = check_layering(base)
    assert "pallas_kernels/gemm.py:2: pallas_kernels.gemm imports scipy.linalg: pallas_kernels may import only " \
           "jax, jaxlib, numpy, ml_dtypes, the standard library and itself" in problems
    assert any(p.startswith("pallas_kernels/gemm.py:3: pallas_kernels.gemm imports fp8rl_jax.numerics")
               for p in problems)
    assert any(p.startswith("pallas_kernels/gemm.py:3: upward import") for p in problems)


def test_checker_places_every_module(tmp_path):
    base = _tree(tmp_path, CLEAN | {"fp8rl_jax/newpkg/__init__.py": ""})
    assert check_layering(base) == ["fp8rl_jax.newpkg: on no floor (add its package to FLOORS in "
                                    "tests/test_layering.py)"]


def test_long_files(tmp_path):
    base = _tree(tmp_path, CLEAN | {"fp8rl_jax/models/big.py": "x = 1\n" * 701,
                                    "fp8rl_jax/models/ok.py": "x = 1\n" * 700})
    assert long_files(base) == ["fp8rl_jax/models/big.py: 701 lines (> 700)"]


@pytest.mark.parametrize(("module", "floor"), [
    ("pallas_kernels.fp8_gemm", 0), ("fp8rl_jax", 1), ("fp8rl_jax.numerics.fp8", 1), ("fp8rl_jax.tasks.datasets", 1),
    ("fp8rl_jax.models.qwen3", 2), ("fp8rl_jax.quant.policy", 3), ("fp8rl_jax.parallel.rules", 3),
    ("fp8rl_jax.checkpoint.hf", 4), ("fp8rl_jax.rollout.engine", 5), ("fp8rl_jax.rl.loop", 6),
    ("fp8rl_jax.cli", 7), ("configs.rl", 8), ("experiments.bench.record", 9), ("fp8rl_jax.unplaced", None),
])
def test_floor_of(module, floor):
    assert floor_of(module) == floor
