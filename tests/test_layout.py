"""The package's layout: layers kept, no import cycles, a light import, private Dask names in one place."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dask_surge"


def _import_graph() -> dict[str, set[str]]:
    grimp = pytest.importorskip("grimp")  # import-linter's graph builder
    graph = grimp.build_graph("dask_surge")
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles():
    assert _cycles(_import_graph()) == []


def test_the_cycle_check_can_fail():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_layers_contract_is_kept():
    pytest.importorskip("importlinter")
    root = PACKAGE.parent
    done = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                           "lint_imports_command()"], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 kept, 0 broken" in done.stdout


def test_importing_the_package_loads_no_model_library():
    code = ("import sys, dask_surge, dask_surge.cli; "
            "print(sorted(m for m in ('torch', 'sentence_transformers', 'transformers', 'tokenizers', "
            "'matplotlib') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_private_dask_names_are_imported_in_compat_only():
    private = ("dask._task_spec", "dask._expr", "dask.dataframe.dask_expr")
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            offenders += [f"{path.relative_to(PACKAGE)}: {n}" for n in names if n.startswith(private)]
    assert offenders == []


def test_compat_names_exist_in_the_pinned_dask():
    from dask_surge import _compat

    for name in _compat.__all__:
        assert getattr(_compat, name) is not None, name
    # what dask_surge subclasses and inspects is what this Dask has
    assert issubclass(_compat.Expr, _compat.BaseExpr)
    assert hasattr(_compat.ReadParquetFSSpec, "_dataset_info") and hasattr(_compat.Task, "fuse")


def test_function_level_imports_are_for_heavy_dependencies_only():
    """Inside functions, only the torch-importing modules (the engine, the BERT encoder) and third-party modules
    are imported."""
    torch_modules = {"engine", "bert"}
    lazy = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, ast.ImportFrom) and node.level > 0 and node.module not in torch_modules:
                        lazy.append(f"{path.relative_to(PACKAGE)}:{node.lineno} from {'.' * node.level}{node.module}")
    assert lazy == []
