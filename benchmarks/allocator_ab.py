"""The C allocator of a Dask worker, side by side: how much of the CPU forward pass its settings cost.

Usage::

    python -m benchmarks.allocator_ab [--n 20000] [--minilm-n 1500] [--rounds 3]
                                      [--out benchmarks/results/allocator_ab.json]

A Dask nanny starts each worker with ``MALLOC_TRIM_THRESHOLD_=65536``, which also freezes
glibc's mmap threshold at 128 KiB (see :mod:`dask_surge.engine.allocator`). Each measurement
runs in a fresh Python process with one torch thread (as a Dask worker on a CPU runs), loads
the model through :class:`dask_surge.Encoder` (``device="cpu"``, the fast engine) and encodes
real text (docstring paragraphs, ``_realtext.py``) in calls of 2,857 texts, the SuperBatch
size ``e2e_small_files`` sees. Four arms:

- ``glibc``: no variable; glibc's own dynamic thresholds (a process outside Dask);
- ``dask``: the variable as a nanny sets it, the allocator left as it is;
- ``mmap``: the variable, and the mmap threshold raised to 32 MiB only (what dask-surge
  did before the trim threshold was raised too);
- ``kept``: the variable, and :func:`~dask_surge.engine.allocator.keep_large_blocks` as a
  CPU worker plugin applies it (mmap threshold 32 MiB, trim threshold 64 MiB).

Arms run in a rotating order each round, for the narrow test encoder (``tiny``, where the
allocator's share is largest) and the packaged all-MiniLM-L6-v2 (``--minilm-n`` texts; 0
skips it). Each result holds the encode seconds (the model load excluded), the engine's
``device`` seconds (the forward passes) and the process's minor page faults during the
encode; the summary gives medians and each arm's speed over ``dask``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from . import _results

ARMS = ("glibc", "dask", "mmap", "kept")
#: Texts per encode call: e2e_small_files' 60,000 texts over its 21 SuperBatches.
CALL_TEXTS = 2857


def one(arm: str, model: str, data: str) -> dict:
    """One measurement in this (fresh) process, started with the arm's environment."""
    import ctypes
    import resource
    import time

    import torch

    torch.set_num_threads(1)
    from dask_surge import Encoder
    from dask_surge.engine import allocator

    from ._realtext import read_texts

    if arm == "kept":  # as the worker plugin does in a CPU worker; loading a model leaves the allocator alone
        allocator.keep_large_blocks()
    if arm == "mmap":
        ctypes.CDLL(None).mallopt(allocator._M_MMAP_THRESHOLD, allocator.MMAP_THRESHOLD)
    texts = read_texts(Path(data))
    n = len(texts)
    encoder = Encoder(model, device="cpu")
    encoder.load()
    engine = encoder.engine
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    for i in range(0, n, CALL_TEXTS):
        encoder.encode(texts[i : i + CALL_TEXTS])
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "device_s": engine.stats["device"] if engine is not None else None,
        "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
        "engine": type(engine).__name__ if engine is not None else None,
    }


def measure(arm: str, model: str, data: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    if arm != "glibc":
        env["MALLOC_TRIM_THRESHOLD_"] = "65536"  # as distributed.nanny.pre-spawn-environ sets it
    cmd = [sys.executable, "-m", __spec__.name, "--one", arm, "--model-path", model, "--data", str(data)]
    return _results.run_one(cmd, what=arm, env=env)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=20_000, help="texts for the tiny encoder")
    parser.add_argument("--minilm-n", type=int, default=1500, help="texts for MiniLM (0: skip it)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(_results.RESULTS / "allocator_ab.json"))
    parser.add_argument("--one", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        _results.emit(one(args.one, args.model_path, args.data))
        return {}

    from dask_surge.testing import packaged_model_dir

    from ._realtext import small_files, tiny_model

    tiny = tiny_model()
    suites = {"tiny": (str(tiny), args.n)}
    if args.minilm_n:
        suites["minilm"] = (str(packaged_model_dir()), args.minilm_n)
    report = _results.new_report(__spec__.name, argv, args)
    for name, (model, n) in suites.items():
        data, _ = small_files(n, max(1, n // 64))
        runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        for r in range(args.rounds):
            order = ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]  # each arm takes each place in turn
            for arm in order:
                res = measure(arm, model, data)
                runs[arm].append(res)
                report["results"].append({"encoder": name, "arm": arm, "round": r, "n": n, **res})
                print(
                    f"{name:6s} {arm:5s} {n / res['seconds']:8,.0f} texts/s  device {res['device_s']:.2f} s  "
                    f"faults {res['minor_faults']:,}",
                    flush=True,
                )
        med = {arm: statistics.median(x["seconds"] for x in runs[arm]) for arm in ARMS}
        report["summary"][name] = {
            "model": model,
            "n": n,
            "median_s": med,
            "median_device_s": {arm: statistics.median(x["device_s"] for x in runs[arm]) for arm in ARMS},
            "median_minor_faults": {
                arm: statistics.median(x["minor_faults"] for x in runs[arm]) for arm in ARMS
            },
            "speed_over_dask": {arm: med["dask"] / med[arm] for arm in ARMS},
        }
        print(f"{name:6s} speed over dask: " + ", ".join(f"{a} {med['dask'] / med[a]:.2f}x" for a in ARMS))
    return _results.save(report, args.out)


if __name__ == "__main__":
    main()
