"""``import dask_surge`` is light and lazy, and still registers ``.surge`` in either import order.

Each case runs in a fresh interpreter: what a module imports depends on what was imported before.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def _hooks() -> str:
    return "sum(type(f).__name__ == '_AfterImport' for f in sys.meta_path)"


def test_import_loads_neither_dask_dataframe_nor_the_api():
    out = _run("""
        import sys, dask_surge
        print(sorted(m for m in ("dask.dataframe", "pandas", "dask_surge.api", "dask_surge.accessor",
                                 "dask_surge.execution") if m in sys.modules))
    """)
    assert out == "[]"


def test_the_worker_side_plugin_module_does_not_import_dask_dataframe():
    # what a fresh Dask worker imports to unpickle the encoder plugin, before it starts loading the model
    out = _run("""
        import sys
        import dask_surge.execution.plugins
        print(sorted(m for m in ("dask.dataframe", "pandas", "dask_surge.api") if m in sys.modules))
    """)
    assert out == "[]"


def test_a_small_run_in_this_process_does_not_import_distributed(tmp_path, tiny_model):
    # the CLI's small path (encoding in this process, no Client) has no use for distributed: importing it
    # would only delay the first output of a cold run (issue 63)
    data, out = tmp_path / "input", tmp_path / "out"
    data.mkdir()
    code = f"""
        import pathlib, sys
        import pandas as pd
        pd.DataFrame({{"text": ["a first text", "a second one", "and a third"]}}).to_parquet(
            {str(data / "part-0.parquet")!r})
        from dask_surge import cli
        code = cli.main(["encode", {str(data)!r}, "--text-column", "text", "--output", {str(out)!r},
                         "--model", {tiny_model!r}])
        print(code, len(list(pathlib.Path({str(out)!r}).glob("part-*.parquet"))), "distributed" in sys.modules)
    """
    assert _run(code).splitlines()[-1] == "0 1 False"  # exit code, part files, distributed imported


@pytest.mark.parametrize("order", ["dask_surge first", "dask.dataframe first"])
def test_the_accessor_is_registered_in_either_import_order(order):
    imports = (
        "import dask_surge\nimport dask.dataframe as dd"
        if order == "dask_surge first"
        else "import dask.dataframe as dd\nimport dask_surge"
    )
    out = _run(
        imports
        + f"""
import sys, pandas as pd
ddf = dd.from_pandas(pd.DataFrame({{"text": ["a", "b", "c"]}}), npartitions=2)
print(ddf.surge.plan("text", b_min=1, b_max=2).summary()["superbatches"], {_hooks()})
"""
    )
    assert out == "2 0"  # the plan works through the accessor; no import hook is left behind


def test_dask_dataframe_imported_while_a_dask_surge_module_is_importing():
    # a worker's task: dask_surge's runner imports dask.dataframe half-way through its own import
    out = _run(f"""
        import sys
        import dask_surge
        import dask_surge.execution.runner
        import dask.dataframe as dd
        print(hasattr(dd.DataFrame, "surge"), {_hooks()})
    """)
    assert out == "True 0"


def test_public_names_and_submodules_resolve_to_their_modules():
    out = _run("""
        import dask_surge
        from dask_surge import api, models, planning
        checks = [dask_surge.encode is api.encode, dask_surge.EncodeResult is api.EncodeResult,
                  dask_surge.Encoder is models.encoders.Encoder,
                  dask_surge.plan_superbatches is planning.policy.plan_superbatches,
                  dask_surge.api is api, set(dask_surge.__all__) <= set(dir(dask_surge))]
        ns = {}
        exec("from dask_surge import *", ns)
        checks.append(all(n in ns for n in dask_surge.__all__))
        try:
            dask_surge.no_such_name
        except AttributeError as err:
            checks.append("no_such_name" in str(err))
        print(checks)
    """)
    assert out == str([True] * 8)


def test_reloading_the_package_leaves_one_hook():
    out = _run(f"""
        import importlib, sys, dask_surge
        importlib.reload(dask_surge)
        print({_hooks()})
        import dask.dataframe as dd
        print(hasattr(dd.DataFrame, "surge"), {_hooks()})
    """)
    assert out.split() == ["1", "True", "0"]
