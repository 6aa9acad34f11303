"""The package's layout: layers kept, no import cycles, a light import, private Dask names in one place."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
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
    done = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    contracts = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert f"{len(contracts)} kept, 0 broken" in done.stdout


def _lint_with(tmp_path: Path, plant: dict[str, str]) -> str:
    """``lint-imports`` on a copy of the package with ``plant`` (module path -> a line) appended."""
    import shutil

    root = PACKAGE.parent
    shutil.copytree(PACKAGE, tmp_path / "dask_surge", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(root / "pyproject.toml", tmp_path / "pyproject.toml")
    for module, line in plant.items():
        with open(tmp_path / "dask_surge" / module, "a") as f:
            f.write(f"\n{line}\n")
    done = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    return done.stdout


@pytest.mark.parametrize(
    "module, line, broken",
    [
        # the host side of the engine imports torch (even inside a function)
        ("engine/tokenizing.py", "def f():\n    import torch", "engine, the host side"),
        ("engine/long_texts.py", "import transformers", "engine, the host side"),
        # a rule the engine is built on imports the machinery above it
        ("engine/batching.py", "from . import forward", "engine: backends > transformer"),
        # the engine reaches up into the models a user holds
        ("engine/transformer.py", "from ..models import encoders", "Layers: public API"),
    ],
)
def test_a_planted_violation_breaks_its_contract(tmp_path, module, line, broken):
    pytest.importorskip("importlinter")
    out = " ".join(_lint_with(tmp_path, {module: line}).split())
    summary = out[out.index("Contracts ---") : out.index("Contracts:")]  # "<name> KEPT|BROKEN" per contract
    status = re.search(re.escape(broken) + r".*?(KEPT|BROKEN)", summary)
    assert status is not None and status.group(1) == "BROKEN", out[-2000:]


def test_importing_the_package_loads_no_model_library():
    code = (
        "import sys, dask_surge, dask_surge.cli; "
        "print(sorted(m for m in ('torch', 'sentence_transformers', 'transformers', 'tokenizers', "
        "'matplotlib') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_private_dask_names_are_imported_in_compat_only():
    private = ("dask._task_spec", "dask._expr", "dask.dataframe.dask_expr")
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            offenders += [f"{path.relative_to(PACKAGE)}: {n}" for n in names if n.startswith(private)]
    assert offenders == []


#: private attributes of Dask and distributed objects: read in ``_compat.py`` only (issue 70)
_PRIVATE_DASK_ATTRIBUTES = {
    "_parameters",  # a dask-expr expression's operand names
    "_determ_token",
    "periodic_callbacks",  # a worker's profiler and heartbeat callbacks
    "thread_state",  # distributed's marks on its pool threads
    "_dataset_info",  # dask-expr's Parquet reader
    "_partitions",
    "_series",
    "_locations",
}
#: attributes of a worker's private ``WorkerState`` (``worker.state.<name>``)
_WORKER_STATE = {"nthreads", "tasks", "executing", "ready", "long_running", "executed_count"}
#: private Dask attributes still read outside ``_compat.py``, each to be moved there (never added to)
_KNOWN_PRIVATE_ATTRIBUTES = {
    ("execution/inputs.py", "_dataset_info"),
    ("io/parquet.py", "_dataset_info"),
    ("io/parquet.py", "_partitions"),
    ("io/parquet.py", "_series"),
    ("planning/sizes.py", "_locations"),
}


def _private_dask_attributes(source: str) -> list[tuple[int, str]]:
    """Where ``source`` reads a private Dask or distributed attribute (``x._parameters``,
    ``worker.periodic_callbacks``, ``worker.state.nthreads``) or imports ``thread_state``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            if node.attr in _PRIVATE_DASK_ATTRIBUTES:
                found.append((node.lineno, node.attr))
            elif (
                node.attr in _WORKER_STATE
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "state"
            ):
                found.append((node.lineno, f"state.{node.attr}"))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found += [(node.lineno, a.name) for a in node.names if a.name in _PRIVATE_DASK_ATTRIBUTES]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            args = node.args
            if (
                len(args) >= 2
                and isinstance(args[1], ast.Constant)
                and args[1].value in _PRIVATE_DASK_ATTRIBUTES
            ):
                found.append((node.lineno, str(args[1].value)))
    return sorted(found)


def test_private_dask_attributes_are_read_in_compat_only():
    """issue 70: not only the imports; the private attributes of Dask's expressions and of a distributed
    worker are read in ``_compat.py`` too, so a Dask release that renames one breaks one module."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = str(path.relative_to(PACKAGE))
        if rel == "_compat.py":
            continue
        found += [
            f"{rel}:{line} {attr}"
            for line, attr in _private_dask_attributes(path.read_text())
            if (rel, attr) not in _KNOWN_PRIVATE_ATTRIBUTES
        ]
    assert found == []


def test_the_private_attribute_check_can_fail():
    source = (
        "params = dict(zip(expr._parameters, expr.operands))\n"
        "cb = worker.periodic_callbacks.get('profile')\n"
        "from distributed.threadpoolexecutor import thread_state\n"
        "n = worker.state.nthreads\n"
        "x = getattr(w, 'periodic_callbacks', None)\n"
        "ok = worker.nthreads + self.state + expr.operands\n"
    )
    assert _private_dask_attributes(source) == [
        (1, "_parameters"),
        (2, "periodic_callbacks"),
        (3, "thread_state"),
        (4, "state.nthreads"),
        (5, "periodic_callbacks"),
    ]


def test_compat_names_exist_in_the_pinned_dask():
    from dask_surge import _compat

    for name in _compat.__all__:
        assert getattr(_compat, name) is not None, name
    # what dask_surge subclasses and inspects is what this Dask has
    assert issubclass(_compat.Expr, _compat.BaseExpr)
    assert hasattr(_compat.ReadParquetFSSpec, "_dataset_info") and hasattr(_compat.Task, "fuse")


#: the modules of the package imported inside functions, where they are needed: each imports a heavy
#: dependency at its top (torch: the engine's transformer, the BERT encoder; distributed: the worker
#: plugins, which only a run with a Client needs, so a small run in this process never imports it)
HEAVY_MODULES = {
    "dask_surge.engine.transformer",
    "dask_surge.engine.bert",
    "dask_surge.execution.plugins",
    "dask_surge.execution.quiet",
}


def _lazy_imports(path: Path, source: str) -> list[str]:
    """The package's modules other than :data:`HEAVY_MODULES` that ``source`` (the module at ``path``)
    imports inside a function."""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    lazy = []
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.level > 0:
                    base = package[: len(package) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                    if target not in HEAVY_MODULES:
                        lazy.append(
                            f"{path.relative_to(PACKAGE)}:{node.lineno} from {'.' * node.level}{node.module}"
                        )
    return lazy


def test_function_level_imports_are_for_heavy_dependencies_only():
    """Inside functions, only :data:`HEAVY_MODULES` (the modules that import torch or distributed) and
    third-party modules are imported."""
    lazy = []
    for path in PACKAGE.rglob("*.py"):
        lazy += _lazy_imports(path, path.read_text())
    assert lazy == []


def test_the_function_level_import_check_can_fail():
    source = (
        "def f():\n    from .plugins import register_encoder\n    from .runner import write_run\n"
        "    from ..engine.bert import load_bert\n    from ..engine import tuning\n"
    )
    assert _lazy_imports(PACKAGE / "execution" / "x.py", source) == [
        "execution/x.py:3 from .runner",
        "execution/x.py:5 from ..engine",
    ]


#: calls that delete or move files, and where they may stand outside ``io/store.py`` (what they touch is
#: not an output: shared memory, the model-digest and calibration caches, a reuse index's private spill
#: directory under the system's temporary folder)
_DELETES = {"rm", "rm_file", "rmdir", "mv", "unlink", "remove", "rename", "replace", "rmtree", "delete"}
_ALLOWED_DELETES = {
    ("engine/tokenpool.py", "unlink"),  # a shared-memory block, not a file of an output
    ("models/modelid.py", "replace"),  # the model digest cache (~/.cache/dask-surge)
    ("execution/calibrate.py", "replace"),  # the calibration cache
    ("io/hashindex.py", "unlink"),  # the index builder's spill files in its own temporary directory
    ("io/hashindex.py", "rmtree"),  # that temporary directory
}


def _delete_calls(source: str) -> list[tuple[int, str]]:
    calls = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _DELETES:
            owner = node.func.value
            name = (
                owner.id
                if isinstance(owner, ast.Name)
                else owner.attr
                if isinstance(owner, ast.Attribute)
                else ""
            )
            if node.func.attr == "replace" and name != "os":  # str.replace, dataclasses' replace
                continue
            if name in ("os", "shutil", "fs", "self", "manifest") or name.endswith("fs"):
                calls.append((node.lineno, node.func.attr))
    return calls


def test_every_delete_and_move_of_an_output_goes_through_one_module():
    """``io/store.py`` (reached through the manifest's ``discard`` / ``relocate``, which check the layout) is
    the only place that deletes or moves a file; nothing else calls ``fs.rm``, ``os.unlink``, ``rmtree``..."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = str(path.relative_to(PACKAGE))
        if rel == "io/store.py":
            continue
        found += [
            f"{rel}:{line} .{attr}()"
            for line, attr in _delete_calls(path.read_text())
            if (rel, attr) not in _ALLOWED_DELETES
        ]
    assert found == []


def test_the_delete_check_can_fail():
    assert _delete_calls("import os\nos.unlink(p)\nself.fs.rm(p)\nx.replace('a', 'b')\n") == [
        (2, "unlink"),
        (3, "rm"),
    ]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


#: what asks which kind of filesystem it holds: only the store object (``io/store.py``) may
_KIND_QUESTIONS = re.compile(
    r"LocalFileSystem|isinstance\(fs\b|\.protocol\b|\bis_local\(|\bprotocols\("
    r"|store\.kind\s*[!=]=|\"(?:memory|file|s3)\" in "
)


def test_only_the_store_object_asks_what_kind_of_filesystem_it_holds():
    """issue 61: whether an output is local, in memory or an object store was decided in four places;
    now io/store.py alone decides (a new kind of store is one subclass there)."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = str(path.relative_to(PACKAGE))
        if rel == "io/store.py":
            continue
        found += [
            f"{rel}:{i}: {line.strip()}"
            for i, line in enumerate(path.read_text().splitlines(), 1)
            if _KIND_QUESTIONS.search(line)
        ]
    assert found == []


def test_the_kind_check_can_fail():
    assert _KIND_QUESTIONS.search("if isinstance(fs, LocalFileSystem):")
    assert _KIND_QUESTIONS.search("proto = fs.protocol[0]") and _KIND_QUESTIONS.search(
        'if store.kind == "posix":'
    )


#: the values of ``format=`` (an output's format): asked only inside the output package (``io/tables/``)
_FORMAT_NAMES = frozenset({"parquet", "lance", "delta", "iceberg", "pgvector"})
#: comparisons with a format name that are not about an output's format: the CLI's *input* formats
#: (``--format parquet|csv|json``), which share the word "parquet"
_INPUT_FORMAT_CHECKS = frozenset({("cli.py", "fmt == 'parquet'"), ("cli.py", "fmt != 'parquet'")})


def _format_branches(source: str) -> list[tuple[int, str]]:
    """``(line, expression)`` of every comparison of something with an output format's name (``fmt ==
    "delta"``, ``kind in ("lance", ...)``) and every mapping keyed by two or more of them, in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(isinstance(c, ast.Constant) and c.value in _FORMAT_NAMES for c in sides) or any(
                isinstance(c, ast.Tuple | ast.Set | ast.List)
                and any(isinstance(e, ast.Constant) and e.value in _FORMAT_NAMES for e in c.elts)
                for c in sides
            )
            if named:
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            if len(keys & _FORMAT_NAMES) >= 2:
                found.append((node.lineno, "a mapping keyed by format names"))
    return found


def test_nothing_outside_the_output_package_asks_which_format_an_output_is():
    """issue 68: Parquet was the case ``table is None`` and the format of an output was detected three
    times with three rules; now every format is a class of ``dask_surge/io/tables/`` and what differs is
    what the classes declare (``batched``, ``native_index``, ``merges_columns``...)."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = str(path.relative_to(PACKAGE))
        if rel.startswith("io/tables/"):
            continue
        found += [
            f"{rel}:{line}: {expr}"
            for line, expr in _format_branches(path.read_text())
            if (rel, expr) not in _INPUT_FORMAT_CHECKS
        ]
    assert found == []


def test_the_format_check_can_fail():
    assert _format_branches('if fmt == "delta":\n    pass\n') == [(1, "fmt == 'delta'")]
    assert _format_branches('x = kind in ("lance", "iceberg")\n') == [(1, "kind in ('lance', 'iceberg')")]
    assert _format_branches('m = {"lance": 1, "delta": 2}\n') == [(1, "a mapping keyed by format names")]
    assert _format_branches('if fmt == "csv":\n    pass\n') == []


def _private_imports(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Every private name one module of ``sources`` (module name -> its source and whether it is a package's
    ``__init__``) takes from another: ``from X import _name`` and ``X._name``, X a module of ``sources``.

    A private *module* (``_compat``, ``_version``, ``engine/_tokenhelper``) may be imported; the names it
    gives others must be public. Dunders (``__version__``) are public.
    """
    modules = set(sources)
    found = []
    for name, (source, package) in sorted(sources.items()):
        here = name.split(".") if package else name.split(".")[:-1]
        bound: dict[str, str] = {}  # a local name -> the module of ``sources`` it stands for
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                src = (
                    ".".join(base + ([node.module] if node.module else []))
                    if node.level
                    else node.module or ""
                )
                for alias in node.names:
                    if f"{src}.{alias.name}" in modules:  # a module: ``from . import cache``
                        bound[alias.asname or alias.name] = f"{src}.{alias.name}"
                    elif src in modules and src != name and _is_private(alias.name):
                        found.append(f"{name}:{node.lineno} from {src} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules or alias.name.split(".")[0] in {
                        m.split(".")[0] for m in modules
                    }:
                        local = alias.asname or alias.name.split(".")[0]
                        bound[local] = alias.name if alias.asname else local
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
                continue
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if not isinstance(value, ast.Name) or value.id not in bound:
                continue
            target = ".".join([bound[value.id], *reversed(chain)])
            if target in modules and target != name and f"{target}.{node.attr}" not in modules:
                found.append(f"{name}:{node.lineno} {target}.{node.attr}")
    return found


def test_no_private_name_is_used_across_modules():
    """A name another module uses is public where it lives (or the code moves to where it is used): no
    ``from X import _name``, no ``X._name``, X another module of the package."""
    sources = {_module_name(p): (p.read_text(), p.name == "__init__.py") for p in PACKAGE.rglob("*.py")}
    found = [f.split(":", 1)[0] + " " + f.split(" ", 1)[1] for f in _private_imports(sources)]
    assert sorted(set(found)) == []


def test_the_private_import_check_can_fail():
    sources = {
        "pkg": ("", True),
        "pkg._compat": ("Public = 1\n_hidden = 2\n", False),
        "pkg.a": ("_helper = 1\nx = _helper\n", False),
        "pkg.sub": ("", True),
        "pkg.sub.b": (
            "from ..a import _helper\nfrom .. import a\nfrom .._compat import Public\n"
            "from .. import _compat\nimport pkg.a as alias\n"
            "y = a._helper + alias._helper + _compat._hidden + a.__name__\n",
            False,
        ),
    }
    assert sorted(_private_imports(sources)) == [
        "pkg.sub.b:1 from pkg.a import _helper",
        "pkg.sub.b:6 pkg._compat._hidden",
        "pkg.sub.b:6 pkg.a._helper",
        "pkg.sub.b:6 pkg.a._helper",
    ]


def _api_reference_names(text: str) -> list[str]:
    """The dotted names listed under the ``autosummary`` directives of ``docs/api.rst``."""
    return re.findall(r"^ {3}(dask_surge(?:\.\w+)*)\s*$", text, flags=re.MULTILINE)


def test_every_name_in_the_api_reference_imports():
    """The docs build (``sphinx -W``) fails on a name that no longer imports; this finds it in seconds, in the
    default leg, instead of in CI's docs step: a module moved or deleted must leave ``docs/api.rst`` too."""
    import importlib

    names = _api_reference_names((PACKAGE.parent / "docs" / "api.rst").read_text())
    assert len(names) > 50, "docs/api.rst lists the package's modules"
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            module, _, attr = name.rpartition(".")
            if not hasattr(importlib.import_module(module), attr):
                missing.append(name)
    assert missing == []


def test_the_api_reference_check_reads_the_listed_names():
    text = ".. autosummary::\n   :toctree: _autosummary\n\n   dask_surge.encode\n   dask_surge.io.gone\n"
    assert _api_reference_names(text) == ["dask_surge.encode", "dask_surge.io.gone"]
