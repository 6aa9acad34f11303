"""The supported range (issue 53): pyproject.toml's lower bounds are what .ci/run's lowest-versions leg pins."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the packages whose lower bound the lowest-versions leg runs
LEG = ("dask", "distributed", "numpy", "pandas", "pyarrow", "torch")


def _lower_bounds(requirements: list[str]) -> dict[str, str]:
    """``name: version`` of each ``name[extras]>=version...`` requirement."""
    found = {}
    for req in requirements:
        m = re.match(r"([A-Za-z0-9_.-]+)(\[[^]]*\])?\s*>=\s*([0-9][^,;\s]*)", req)
        if m:
            found[m.group(1).lower()] = m.group(3)
    return found


def _names(requirements: list[str]) -> list[str]:
    """The package name of each requirement, lower-cased."""
    return [re.match(r"[A-Za-z0-9_.-]+", req.strip()).group(0).lower() for req in requirements]


def test_the_lowest_leg_pins_the_declared_lower_bounds():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = _lower_bounds(project["dependencies"])
    pinned = dict(
        line.split("==")
        for line in (ROOT / ".ci" / "lowest.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    assert {name: pinned.get(name) for name in LEG} == {name: declared.get(name) for name in LEG}
    # any other pin holds an extra back to a build that works on the leg's versions (faiss-cpu on NumPy 1):
    # it names a package of an extra, never a core dependency the leg does not mean to pin
    extras = {name for reqs in project["optional-dependencies"].values() for name in _names(reqs)}
    assert set(pinned) - set(LEG) <= extras - set(_names(project["dependencies"]))


def test_lower_bounds_are_read_from_requirements():
    assert _lower_bounds(["dask[dataframe,distributed]>=2026.8.0,<2026.12", "pyyaml", "numpy >= 1.26.0"]) == {
        "dask": "2026.8.0",
        "numpy": "1.26.0",
    }
