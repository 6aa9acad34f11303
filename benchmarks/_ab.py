"""Plumbing for A/B scripts that compare this checkout with a base git revision side by side
(``base_checkout``, ``alternating``, ``run_child``, ``this_revision``; the finished studies that
used them are summarized in ``docs/ab_studies.md``), and ``script_header`` for the GPU
session's scripts, which run as files (``python benchmarks/host_ceiling.py``) and import this
module as ``_ab``. New scripts save their report with ``benchmarks._results`` (one schema).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def script_header(argv: list[str] | None) -> dict:
    """The header of a script's report: the command that reproduces it (``argv``: what its
    ``main`` was given, None for the process's own) and the machine it ran on."""
    args = sys.argv[1:] if argv is None else argv
    return {
        "command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *args]),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg": os.getloadavg(),
        },
    }


def this_revision() -> str:
    """``HEAD``'s short hash, marked when the package has uncommitted changes."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + (
        "+uncommitted" if git("status", "--porcelain", "dask_surge") else ""
    )


@contextlib.contextmanager
def base_checkout(revision: str, folder: Path) -> Iterator[str]:
    """A ``git worktree`` of ``revision`` in ``folder`` (removed afterwards); yields its path."""
    path = str(folder / "base")
    subprocess.run(
        ["git", "worktree", "add", "--detach", path, revision], cwd=ROOT, check=True, capture_output=True
    )
    try:
        yield path
    finally:
        subprocess.run(
            ["git", "worktree", "remove", "--force", path], cwd=ROOT, check=False, capture_output=True
        )


def alternating(rounds: int, base_src: str) -> Iterator[list[tuple[str, str]]]:
    """Per round, the ``(name, source tree)`` variants to run, base first in even rounds."""
    for r in range(rounds):
        order = [("base", base_src), ("this", str(ROOT))]
        yield order[::-1] if r % 2 else order


def run_child(script: str, src: str, spec: dict) -> dict:
    """Run ``script`` (``python -c``) in a fresh process on the source tree ``src`` with
    ``spec`` (plus ``src``) as JSON in ``argv[1]``; return the JSON its last line prints."""
    env = dict(os.environ, PYTHONPATH=src)
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(dict(spec, src=src))],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        cwd=tempfile.gettempdir(),
    )
    if out.returncode:
        raise RuntimeError(f"variant in {src} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
