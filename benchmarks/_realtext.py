"""Real text for benchmarks: docstring paragraphs of installed Python packages.

Read from the sources with :mod:`ast` (nothing imported), so the texts are the same on
every machine with the same packages. Used by ``gpu_prepare.py`` and the tests.
"""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path


def docstring_paragraphs(n: int, *, max_chars: int = 2000) -> list[str]:
    """``n`` paragraphs of docstrings from site-packages (files in sorted order; cycled with a suffix if short)."""
    site = Path(sysconfig.get_paths()["purelib"])
    out: list[str] = []
    for path in sorted(site.rglob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError, OSError, RecursionError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    out += [p.strip()[:max_chars] for p in doc.split("\n\n") if p.strip()]
        if len(out) >= n:
            return out[:n]
    base = list(out) or ["empty"]
    i = 0
    while len(out) < n:  # too few installed docstrings: repeat them, told apart by a suffix
        out.append(f"{base[i % len(base)]} ({i // len(base)})")
        i += 1
    return out[:n]
