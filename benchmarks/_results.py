"""One result schema for every benchmark script.

Each script saves one JSON object of this shape (``SCHEMA`` lists the keys, in order)::

    {"benchmark": "store_output",                       # the script's module name
     "command": "python -m benchmarks.store_output ...", # reproduces the run from the repo root
     "machine": {"platform", "cpus", "memory_bytes", "python", "versions", "loadavg_start",
                 "loadavg_end"},
     "git": "ad8dc60+uncommitted",                     # HEAD, marked when dask_surge/ or benchmarks/ differ
     "created": "2026-12-01T10:56:04+00:00",           # when the report was saved (UTC)
     "args": {...},                                    # every option the run used, defaults included
     "results": [{...}, ...],                          # one flat record per measurement
     "summary": {...}}                                 # what the run concludes (ratios, targets); may be {}

``results`` is always a list of records (dicts); a record names what it measured in its
own fields (``method``, ``encoder``, ``codec``, ``phase``...), so tables and asv-like
comparisons across runs need no per-script code. The JSON files written before this schema
(the measured record in ``benchmarks/results/``) keep their own shapes.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SCHEMA = ("benchmark", "command", "machine", "git", "created", "args", "results", "summary")
_VERSIONS = (
    "dask-surge",
    "dask",
    "distributed",
    "torch",
    "transformers",
    "sentence-transformers",
    "tokenizers",
    "pyarrow",
    "pandas",
    "numpy",
    "dask-cuda",  # where installed (the GPU session); a package that is not is left out
    "nvidia-ml-py",
)


def git_revision() -> str:
    """``HEAD``'s short hash, with ``+uncommitted`` when ``dask_surge/`` or ``benchmarks/``
    differ from it (``unknown`` outside a git checkout)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--untracked-files=no", "dask_surge", "benchmarks")
        return git("rev-parse", "--short", "HEAD") + ("+uncommitted" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict:
    """Platform, CPUs, memory, Python and library versions, load average now."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = None
    versions = {}
    for name in _VERSIONS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "memory_bytes": memory,
        "python": platform.python_version(),
        "versions": versions,
        "loadavg_start": list(os.getloadavg()),
    }


def command(module: str, argv: list[str] | None = None) -> str:
    """The command line that reproduces this run from the repository root: ``python -m
    <module>`` with ``argv`` (what ``main`` was given; None for the process's own)."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(shlex.quote(a) for a in ["python", "-m", module, *args])


def new_report(module: str, argv: list[str] | None = None, args: object = None) -> dict:
    """An empty report of the schema for the script ``module`` (pass ``__spec__.name``: the
    dotted name under ``python -m`` too); ``args`` an ``argparse.Namespace`` or a dict."""
    name = module.rsplit(".", 1)[-1]
    options = vars(args) if args is not None and not isinstance(args, dict) else dict(args or {})
    return {
        "benchmark": name,
        "command": command(module, argv),
        "machine": machine(),
        "git": git_revision(),
        "created": None,
        "args": options,
        "results": [],
        "summary": {},
    }


def save(report: dict, out: str | os.PathLike) -> dict:
    """Check the report's shape, stamp the time and the end load, write it as JSON to ``out``
    (folders created) and return it."""
    missing = [k for k in SCHEMA if k not in report]
    extra = [k for k in report if k not in SCHEMA]
    if missing or extra or not isinstance(report["results"], list):
        raise ValueError(
            f"report does not follow benchmarks/_results.py: missing {missing}, extra {extra}, "
            f"results is {type(report.get('results')).__name__}"
        )
    report["machine"]["loadavg_end"] = list(os.getloadavg())
    report["created"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    ordered = {k: report[k] for k in SCHEMA}
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(ordered) + "\n")
    return ordered


def dumps(obj: object, depth: int = 0) -> str:
    """JSON with the report's fields on lines of their own and one line per record, so that a rerun's
    diff reads record by record (a value that fits in 100 characters stays on one line)."""
    flat = json.dumps(obj, default=str)
    if depth >= 2 or len(flat) <= 100 or not isinstance(obj, dict | list) or not obj:
        return flat
    pad = " " * (depth + 1)
    if isinstance(obj, dict):
        lines = [f"{pad}{json.dumps(k)}: {dumps(v, depth + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(lines) + "\n" + " " * depth + "}"
    return "[\n" + ",\n".join(pad + dumps(v, depth + 1) for v in obj) + "\n" + " " * depth + "]"


#: How a measurement run in a fresh process (``--one``) hands its record to the parent: one stdout line.
RESULT_PREFIX = "RESULT "


def emit(record: dict) -> None:
    """Print ``record`` as the one line :func:`run_one` reads (in the child process)."""
    print(RESULT_PREFIX + json.dumps(record), flush=True)


def run_one(cmd: list[str], *, what: str, env: dict[str, str] | None = None, cwd: str | None = None) -> dict:
    """Run ``cmd`` (a fresh Python process that calls :func:`emit`) from ``cwd`` (default: the repository
    root) and return its record; a child that emits none raises, with its exit code and the end of its stderr."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd or str(ROOT), check=False)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    raise RuntimeError(f"{what} run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
