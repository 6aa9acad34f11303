"""The README's and the quick start's Python snippets, run as pasted: each fenced ``python``
block is written to a script and run in a fresh process, in a directory laid out as the
snippet expects it after ``dask-surge demo`` (its dataset under ``surge-demo/input/``).

A snippet that starts a local cluster must carry the ``if __name__ == "__main__":`` guard
(Dask's worker processes import the script again); a script without it is refused in one
line that says so.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("README.md", "docs/quickstart.md")
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def snippets() -> list[tuple[str, str]]:
    """``(where, code)`` of every fenced Python block of :data:`PAGES`, each distinct code once
    (the README repeats the quick start's first snippet)."""
    found: dict[str, str] = {}
    for page in PAGES:
        text = (ROOT / page).read_text()
        for m in FENCE.finditer(text):
            line = text[: m.start()].count("\n") + 1
            found.setdefault(m.group(1), f"{page}:{line}")
    return [(where, code) for code, where in found.items()]


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["DASK_SURGE_CACHE_DIR"] = str(tmp_path / "cache")  # a fresh user: no calibration cached
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["TQDM_DISABLE"] = "1"
    return env


def _demo_layout(where: Path, rows: int = 240) -> None:
    """``surge-demo/input/`` as ``dask-surge demo`` writes it (log-normal partition sizes, columns
    ``text`` and ``doc_id``), smaller."""
    from dask_surge.synthetic import lognormal_sizes, write_partitioned_parquet

    write_partitioned_parquet(
        where / "surge-demo" / "input", lognormal_sizes(rows, 12, sigma=1.0, seed=0), seed=0
    )


def test_every_page_has_python_snippets():
    assert all(FENCE.search((ROOT / page).read_text()) for page in PAGES)
    assert len(snippets()) >= 2


@pytest.mark.slow  # 40-80 s each on 2 cores: a calibration probe and a local cluster per snippet
@pytest.mark.parametrize(
    "where,code", snippets(), ids=[f"{w}-{hashlib.sha256(c.encode()).hexdigest()[:6]}" for w, c in snippets()]
)
def test_snippet_runs_as_pasted(tmp_path, where, code):
    work = tmp_path / "work"
    work.mkdir()
    _demo_layout(work)
    script = work / "snippet.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=work,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{where} failed as pasted:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-5000:]


def test_an_unguarded_script_is_refused_in_one_line(tmp_path):
    """Without the guard, distributed's spawned workers re-ran the script: "An attempt has been made
    to start a new process before the current process has finished its bootstrapping phase",
    "Nanny failed to start" and 100+ lines of traceback. Now: one line, before any process starts."""
    from dask_surge.execution.preflight import IN_PROCESS_ROWS

    work = tmp_path / "work"
    work.mkdir()
    _demo_layout(work, rows=IN_PROCESS_ROWS + 100)  # too large to run in this process: a cluster starts
    script = work / "unguarded.py"
    script.write_text(
        textwrap.dedent("""\
        import dask.dataframe as dd
        import dask_surge

        ddf = dd.read_parquet("surge-demo/input/")
        try:
            ddf.surge.encode("text", output="emb/", keep=["doc_id"], progress=False)
        except dask_surge.errors.SurgeError as err:
            print(err)
            raise SystemExit(3)
        """)
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=work,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 3, done.stdout + done.stderr
    line = done.stdout.strip()
    assert len(line.splitlines()) == 1, line
    assert f"{script}, line 6," in line and 'outside the `if __name__ == "__main__":` guard' in line, line
    assert "Fix: " in line
    assert "bootstrapping phase" not in done.stderr and "Nanny failed" not in done.stderr
    assert not (work / "emb").exists()


def test_a_guarded_call_inside_a_function_passes_the_check(tmp_path):
    """The check looks at the script's top-level line that led to the call: a ``main()`` called
    under the guard is fine; the same call at the top level is refused."""
    import ast

    from dask_surge.execution.cluster import _guarded

    src = textwrap.dedent("""\
        def main():
            start()

        if __name__ == "__main__":
            main()
        main()
        """)
    tree = ast.parse(src)
    assert _guarded(tree, 5) and not _guarded(tree, 6)
