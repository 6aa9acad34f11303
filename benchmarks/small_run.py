"""A small run as a new user meets it: a cold ``dask-surge encode`` of 1,000 short texts.

Usage::

    python -m benchmarks.small_run [--texts 1000] [--files 10] [--repeats 3]
                                   [--tree LABEL=PATH ...] [--python PATH ...]
                                   [--out benchmarks/results/small_run.json]

Each measurement is a fresh ``python -m dask_surge.cli encode DIR --text-column text --output
OUT --json`` process (nothing imported or started before the clock: the process start, the
imports, the cluster start if any, the model load are all inside), with the packaged
all-MiniLM-L6-v2, no ``--scheduler`` (the CLI's default), on ``--texts`` short texts (the first
sentence of docstring paragraphs of installed packages, 40-120 characters) in ``--files``
Parquet files. Measured from the process start: ``first_file_s`` (the first ``part-*`` file
visible in the output, polled every 20 ms), ``wall_s`` (the process's end); and the run's own
``ttfo_s`` (from the encode call). Then the same command again on the complete output
(``rerun_wall_s``: "complete: N rows, nothing to do").

``--tree LABEL=PATH`` runs the ``dask_surge`` package under ``PATH`` (a ``git archive`` of an
earlier commit: ``git archive 188e679 dask_surge | tar -x -C /tmp/before``) instead of this
checkout's, so before and after run side by side, alternating (``LABEL=.`` is this checkout);
the default compares ``before`` (a ``git archive`` of ``--before``, made here) and ``after``
(this checkout). Medians per tree and their ratios are in the summary.

``--python PATH`` (repeatable) runs the CLI with that interpreter instead of this one (a user's
own install: ``python -m venv /tmp/venv-base && /tmp/venv-base/bin/pip install torch==2.13.0 &&
/tmp/venv-base/bin/pip install -e .``, no test extra); with more than one, every tree runs under
every interpreter and the labels become ``TREE@PYTHON``. Each record names its interpreter
(``python``) and whether ``scipy`` was importable there (``scipy``: ``dask.array`` imports it
when it is, on the CLI's import path).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import _results
from benchmarks._realtext import docstring_paragraphs

ROOT = _results.ROOT


def short_texts(n: int) -> list[str]:
    """``n`` short texts: the first sentence of docstring paragraphs, 40-120 characters."""
    found: dict[str, None] = {}
    for para in docstring_paragraphs(20 * n):
        first = " ".join(para.split(". ")[0].split())
        if 40 <= len(first) <= 120:
            found[first] = None
            if len(found) == n:
                return list(found)
    return (list(found) * (n // max(1, len(found)) + 1))[:n]


def write_input(where: Path, texts: list[str], files: int) -> Path:
    import pandas as pd

    data = where / "input"
    data.mkdir(parents=True)
    per = -(-len(texts) // files)
    for i in range(files):
        chunk = texts[i * per : (i + 1) * per]
        pd.DataFrame({"doc_id": range(i * per, i * per + len(chunk)), "text": chunk}).to_parquet(
            data / f"part-{i:05d}.parquet", index=False
        )
    return data


def has_scipy(python: str) -> bool:
    """Whether ``python`` can import scipy (found, not imported)."""
    code = "import importlib.util as u; print(u.find_spec('scipy') is not None)"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.strip() == "True"


def one(tree: Path, data: Path, out: Path, python: str = sys.executable) -> dict[str, Any]:
    """One cold CLI encode of ``data`` into ``out`` with the package under ``tree`` and the
    interpreter ``python``, then a rerun."""
    env = dict(
        os.environ,
        PYTHONPATH=str(tree),
        TQDM_DISABLE="1",
        HF_HUB_OFFLINE="1",
        DASK_SURGE_CACHE_DIR=str(out.parent / f"cache-{out.name}"),
    )
    cmd = [
        python,
        "-m",
        "dask_surge.cli",
        "encode",
        str(data),
        "--text-column",
        "text",
        "--output",
        str(out),
        "--json",
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=env, cwd=str(out.parent), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    first = None
    while proc.poll() is None:
        if first is None and out.is_dir() and any(out.glob("part-*.parquet")):
            first = time.perf_counter() - t0
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed ({proc.returncode}): {stderr[-2000:]}")
    if first is None:
        first = wall
    result = json.loads(stdout[stdout.index("{") :])
    t1 = time.perf_counter()
    again = subprocess.run(cmd, env=env, cwd=str(out.parent), capture_output=True, text=True, check=True)
    rerun = time.perf_counter() - t1
    return {
        "first_file_s": round(first, 3),
        "wall_s": round(wall, 3),
        "ttfo_s": result.get("ttfo_s"),
        "seconds": result.get("seconds"),
        "rows": result.get("rows"),
        "rerun_wall_s": round(rerun, 3),
        "rerun_said": (again.stdout.strip().splitlines() or [""])[0][:120],
        "stderr_lines": [line for line in stderr.splitlines() if line.strip()][:5],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=1000)
    ap.add_argument("--files", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", default="188e679", help="commit whose dask_surge is 'before' (default trees)")
    ap.add_argument(
        "--tree", action="append", default=[], help="LABEL=PATH (repeatable); default before, after"
    )
    ap.add_argument(
        "--python",
        action="append",
        default=[],
        help="interpreter that runs the CLI (repeatable); default this one",
    )
    ap.add_argument("--out", default=str(_results.RESULTS / "small_run.json"))
    args = ap.parse_args(argv)
    pythons = args.python or [sys.executable]
    scipy = {python: has_scipy(python) for python in pythons}
    work = Path(tempfile.mkdtemp(prefix="surge-small-run-"))
    trees: list[tuple[str, Path]] = []
    for spec in args.tree:
        label, _, path = spec.partition("=")
        trees.append((label, ROOT if path in ("", ".") else Path(path).resolve()))
    if not trees:
        before = work / "before"
        before.mkdir()
        archive = subprocess.run(
            ["git", "archive", args.before, "dask_surge"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
        trees = [("before", before), ("after", ROOT)]
    runs = [  # each tree under each interpreter
        (f"{label}@{python}" if len(pythons) > 1 else label, tree, python)
        for python in pythons
        for label, tree in trees
    ]
    data = write_input(work, short_texts(args.texts), args.files)
    records = []
    for repeat in range(args.repeats):
        for n, (label, tree, python) in enumerate(runs):  # alternating: the machine's load drifts
            r = one(tree, data, work / f"out-{n}-{repeat}", python)
            r.update(
                tree=label, repeat=repeat, python=python, scipy=scipy[python], loadavg=list(os.getloadavg())
            )
            records.append(r)
            print(
                f"[{label} #{repeat}] first file {r['first_file_s']:.2f} s after the process start "
                f"(ttfo {r['ttfo_s']}), done {r['wall_s']:.2f} s; rerun {r['rerun_wall_s']:.2f} s; "
                f"load {r['loadavg'][0]:.2f}",
                flush=True,
            )
    report = _results.new_report(__spec__.name, argv, args)
    report["results"] = records
    keys = ("first_file_s", "wall_s", "rerun_wall_s")
    medians = {
        k: {label: statistics.median(r[k] for r in records if r["tree"] == label) for label, _, _ in runs}
        for k in keys
    }
    summary: dict[str, Any] = {
        "medians": medians,
        "texts": args.texts,
        "files": args.files,
        "target_first_file_s": 3.0,
        "scipy_importable": scipy,
    }
    if len(trees) > 1:  # each tree against the first under the same interpreter
        first = {python: label for label, _, python in reversed(runs)}
        base = {label: first[python] for label, _, python in runs}
        summary["ratio_vs_" + trees[0][0]] = {
            k: {label: round(v / m[base[label]], 3) for label, v in m.items()} for k, m in medians.items()
        }
    report["summary"] = summary
    saved = _results.save(report, args.out)
    for k in keys:
        print(f"median {k}: " + ", ".join(f"{label} {v:.2f} s" for label, v in medians[k].items()))
    return saved


if __name__ == "__main__":
    main()
