"""What registering ``.surge`` at ``import dask_surge`` would cost a fresh Dask worker (issue 61, item 4).

Usage::

    python -m benchmarks.accessor_import [--repeats 15] [--out benchmarks/results/accessor_import.json]

The accessor is registered through Dask's extension API
(``dask.dataframe.extensions.register_dataframe_accessor``), which imports ``dask.dataframe``
(and pandas, pyarrow, dask's expression layer). A fresh Dask worker imports ``dask_surge`` to
unpickle the encoder plugin and its first task, before it starts loading the model; a worker
imports ``distributed`` but not ``dask.dataframe``. So the two ways of registering differ in
what that worker imports:

- ``deferred`` (the package as shipped): ``import dask_surge.execution.plugins`` in a process
  that has imported ``distributed``: the accessor is registered when ``dask.dataframe`` is
  first imported, by whoever imports it;
- ``plain``: the same, then ``import dask_surge.accessor`` (the registration a plain
  ``from . import accessor`` in ``dask_surge/__init__.py`` would run at import).

Each measurement is a fresh interpreter (imports are cached per process), the two arms
alternating (ABBA); reported: per arm the median seconds of the timed imports (after
``import distributed``, before the clock), and the median difference and ratio plain / deferred.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from . import _results

_ARMS = {
    "deferred": ("dask_surge.execution.plugins",),
    "plain": ("dask_surge.execution.plugins", "dask_surge.accessor"),
}


def _one(arm: str) -> None:
    """In a fresh process: the timed imports of ``arm``."""
    import importlib

    import distributed  # noqa: F401  (a worker has it before it unpickles anything)

    start = time.perf_counter()
    for module in _ARMS[arm]:
        importlib.import_module(module)
    seconds = time.perf_counter() - start
    _results.emit({"arm": arm, "seconds": seconds, "dask_dataframe": "dask.dataframe" in sys.modules})


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="benchmarks/results/accessor_import.json")
    parser.add_argument("--one", choices=sorted(_ARMS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        _one(args.one)
        return {}
    report = _results.new_report(__spec__.name, argv, args)  # type: ignore[name-defined]
    for i in range(args.repeats):
        order = ("deferred", "plain") if i % 2 == 0 else ("plain", "deferred")
        for arm in order:
            record = _results.run_one(
                [sys.executable, "-m", "benchmarks.accessor_import", "--one", arm], what=arm
            )
            report["results"].append({"round": i, **record})
            print(f"round {i} {arm:8s} {record['seconds']:.3f} s", flush=True)
    by_arm = {arm: [r["seconds"] for r in report["results"] if r["arm"] == arm] for arm in _ARMS}
    rounds = range(args.repeats)
    pairs = [
        (
            next(r["seconds"] for r in report["results"] if r["round"] == i and r["arm"] == "plain"),
            next(r["seconds"] for r in report["results"] if r["round"] == i and r["arm"] == "deferred"),
        )
        for i in rounds
    ]
    report["summary"] = {
        "median_s": {arm: round(statistics.median(v), 3) for arm, v in by_arm.items()},
        "median_extra_s": round(statistics.median(p - d for p, d in pairs), 3),
        "median_ratio_plain_over_deferred": round(statistics.median(p / d for p, d in pairs), 2),
        "imports_dask_dataframe": {
            arm: any(r["dask_dataframe"] for r in report["results"] if r["arm"] == arm) for arm in _ARMS
        },
    }
    print(report["summary"])
    return _results.save(report, args.out)


if __name__ == "__main__":
    main()
