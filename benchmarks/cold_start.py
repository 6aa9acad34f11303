"""Cold start as a notebook user meets it: the timeline from the call to the first committed file.

Usage::

    python -m benchmarks.cold_start [--files 2000] [--n 20000] [--workers 2] [--repeats 3]
                                    [--tree LABEL=PATH[:first=ROWS][:ramp=ROWS] ...]
                                    [--out benchmarks/results/cold_start.json]

Issue 27's target: first output <= 5 s on 2,000 small files on a 2-core machine.
``dd.read_parquet(dir).surge.encode("text", output=..., model="default")`` with the packaged
all-MiniLM-L6-v2 and its **real forward** on ``--n`` texts of real text (docstring paragraphs,
``_realtext.py``) in ``--files`` Parquet files, on a ``LocalCluster`` of ``--workers``
single-threaded worker processes started before the clock with torch imported in them but no
model loaded: the model load (importing sentence-transformers, building the model and the
fast engine) is inside the clock, as in a notebook's first call on a fresh cluster.

Every measurement runs in a fresh Python process (so the client pays its first planning
imports, as a notebook does) on a fresh cluster. ``--tree LABEL=PATH`` runs the
``dask_surge`` package found under ``PATH`` (e.g. a ``git archive`` of an earlier commit)
instead of this checkout's, so before and after run side by side, alternating
(``LABEL=.`` is this checkout); the default is this checkout alone. A ``:first=ROWS`` suffix
sets ``surge.first-superbatch`` (``DASK_SURGE__FIRST_SUPERBATCH``; ``None``: no ramp) in that
tree's runs, so first-SuperBatch sizes compare side by side (``--tree f32=.:first=32 --tree
f256=.:first=256``); ``:ramp=ROWS`` is the benchmark's own ramp (a prototype, for trees
older than the planner's).

The timeline comes from timestamps of the functions that do each step, wrapped in the client
(register the plugin, fingerprint, Parquet footers, thresholds, manifest, graph, first
submit) and in the workers through an import hook, so nothing is imported there before the
clock that the run would not import itself (the model load and its parts: importing
sentence-transformers, building the model, building the engine; the first unit task:
reading its files, waiting for the model, tokenizing, forward passes, writing and
committing). Reported per run: ``ttfo_s`` (:attr:`~dask_surge.results.EncodeResult.ttfo_s`,
the first committed file), the rows of the first SuperBatch, and the events as
``[side, where, step, start_s, end_s]`` relative to the call; medians per tree and their ratio.
"""

from __future__ import annotations

import argparse
import functools
import importlib.abc
import importlib.machinery
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from . import _results

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]

#: client steps: (module, attribute) -> step name; attribute "Class.method" wraps a method
CLIENT_STEPS = {
    ("dask_surge.api", "_register"): "register plugin",
    ("dask_surge.api", "fingerprint"): "fingerprint",
    ("dask_surge.planning.sizes", "known_sizes"): "footers",
    ("dask_surge.api", "_resolve"): "thresholds",
    ("dask_surge.io.manifest", "open_run"): "open run",
    ("dask_surge.execution.inputs", "InputGraph.__init__"): "graph",
    ("dask_surge.execution.inputs", "InputGraph.task"): "unit task built",
}

#: worker steps, wrapped when their module is first imported in the worker
WORKER_STEPS = {
    ("dask_surge.execution.plugins", "EncoderPlugin._load"): "preload (plugin thread)",
    ("dask_surge.models.cache", "_load"): "model load",
    ("dask_surge.models.loader", "choose_backend"): "build engine",
    ("dask_surge.models.loader", "direct_backend"): "direct load (transformers, model, engine)",
    ("dask_surge.models.encoders", "Encoder._loaded"): "get model",
    ("dask_surge.models.encoders", "Encoder.encode_long"): "encode",
    ("dask_surge.execution.unit", "UnitRunner.__call__"): "unit task",
    ("dask_surge.io.parquet", "ParquetPartitions._tables"): "read files",
    ("dask_surge.execution.superbatch", "SuperBatchTask.gather"): "gather texts",
    ("dask_surge.execution.superbatch", "text_hashes"): "hash texts",
    ("dask_surge.execution.sink", "SuperBatchWriter.__call__"): "superbatch (encode+write+commit)",
}

EVENTS: list[tuple[str, str, float, float]] = []  # (step, thread, start, end): this process's
_LOCK = threading.Lock()


def _record(step: str, t0: float) -> None:
    with _LOCK:
        EVENTS.append((step, threading.current_thread().name, t0, time.time()))


def _wrapped(real: Any, step: str, after: Any = None) -> Any:
    @functools.wraps(real)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.time()
        try:
            out = real(*args, **kwargs)
        finally:
            _record(step, t0)
        if after is not None:
            after(out)
        return out

    return wrapper


def _instrument_engine(result: Any) -> None:
    """After the backend is built: time its tokenizing and forward passes (where it has them)."""
    if result is None:
        return
    backend = result[0] if isinstance(result, tuple) else result
    engine = getattr(backend, "engine", None)
    packer = getattr(engine, "_packer", None)
    if packer is not None and hasattr(packer, "tokenize"):
        packer.tokenize = _wrapped(packer.tokenize, "tokenize")
    if engine is not None and hasattr(engine, "_forward"):
        engine._forward = _wrapped(engine._forward, "forward")


def _patch(module: Any, attribute: str, step: str) -> None:
    owner_name, _, name = attribute.rpartition(".")
    owner = getattr(module, owner_name) if owner_name else module
    real = getattr(owner, name, None)
    if real is None:
        return
    after = (
        _instrument_engine
        if step in ("build engine", WORKER_STEPS[("dask_surge.models.loader", "direct_backend")])
        else None
    )
    setattr(owner, name, _wrapped(real, step, after))


#: modules whose first import is timed in the workers (where the run imports them, if it does)
TIMED_IMPORTS = ("sentence_transformers", "transformers")


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Wraps the :data:`WORKER_STEPS` of a module right after the module is first executed, and
    times the import of :data:`TIMED_IMPORTS`."""

    def __init__(self, steps: dict) -> None:
        self.by_module: dict[str, list[tuple[str, str]]] = {m: [] for m in TIMED_IMPORTS}
        for (module, attribute), step in steps.items():
            self.by_module.setdefault(module, []).append((attribute, step))

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.by_module:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                real_exec = spec.loader.exec_module

                def exec_module(module: Any, _real: Any = real_exec, _name: str = fullname) -> None:
                    t0 = time.time()
                    _real(module)
                    if _name in TIMED_IMPORTS:
                        _record(f"import {_name}", t0)
                    for attribute, step in self.by_module[_name]:
                        _patch(module, attribute, step)

                spec.loader.exec_module = exec_module  # type: ignore[method-assign]
                return spec
        return None


def ramp_plan(real: Any, first: int) -> Any:
    """``plan_superbatches`` with a ramp (a proposal, measured here; benchmark only): SuperBatches of whole
    partitions of at least ``first`` rows, then ``2 * first``... up to ``b_min``, then the real plan of the rest."""
    from dask_surge.planning.policy import Span, SuperBatch

    def plan(sizes: Any, b_min: int, b_max: int, **kwargs: Any) -> list:
        sizes = list(sizes)
        out: list = []
        p, target = 0, first
        while target < b_min and p < len(sizes):
            spans, rows = [], 0
            while p < len(sizes) and rows < target and rows + sizes[p] <= b_max:
                spans.append(Span(p, 0, sizes[p]))
                rows += sizes[p]
                p += 1
            if not spans:
                break
            out.append(SuperBatch(len(out), tuple(spans)))
            target *= 2
        rest = real(
            sizes[p:],
            b_min,
            b_max,
            **{k: (list(v)[p:] if k == "nbytes" and v is not None else v) for k, v in kwargs.items()},
        )
        for sb in rest:
            out.append(SuperBatch(len(out), tuple(Span(s.partition + p, s.start, s.stop) for s in sb.spans)))
        return out

    return plan


def prepare_worker() -> dict:
    """Run in each worker before the clock: import torch (the scenario), hook the timed steps."""
    import torch  # noqa: F401 - the notebook's workers have torch imported, nothing else of the run

    already = sorted(m for m in {m for m, _ in WORKER_STEPS} if m in sys.modules)
    sys.meta_path.insert(0, _PatchOnImport(WORKER_STEPS))
    return {
        "pid": os.getpid(),
        "preimported": already,
        "sentence_transformers": "sentence_transformers" in sys.modules,
    }


def worker_events() -> dict:
    """This worker's events and where its ``dask_surge`` came from."""
    import dask_surge

    return {"events": list(EVENTS), "dask_surge": dask_surge.__file__}


def one(data: str, workers: int, ramp: int = 0) -> dict:
    """One cold call in this fresh process on a fresh cluster (see module docstring)."""
    import dask.dataframe as dd
    from distributed import Client, LocalCluster

    import dask_surge  # noqa: F401 - the notebook imported it: registers the .surge accessor

    for (module, attribute), step in CLIENT_STEPS.items():
        home = importlib.import_module(module)
        real = getattr(home, attribute.partition(".")[0])
        _patch(home, attribute, step)
        if "." not in attribute:  # and in every module that imported the function by name
            for mod in [
                m for n, m in list(sys.modules.items()) if n.startswith("dask_surge") and m is not None
            ]:
                if getattr(mod, attribute, None) is real:
                    setattr(mod, attribute, getattr(home, attribute))
    if ramp:
        runner = importlib.import_module("dask_surge.execution.runner")
        runner.plan_superbatches = ramp_plan(runner.plan_superbatches, ramp)  # type: ignore[attr-defined]
    out = Path(tempfile.mkdtemp(prefix="cold-start-"))
    cluster = LocalCluster(
        n_workers=workers, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0"
    )
    client = Client(cluster)
    try:
        prepared = client.run(prepare_worker)
        load0 = os.getloadavg()
        wall0 = time.time()
        res = dd.read_parquet(data).surge.encode(
            "text", output=str(out / "emb"), model="default", device="cpu", progress=False, scheduler=client
        )
        total = time.time() - wall0
        got = client.run(worker_events)
    finally:
        client.close()
        cluster.close()
        shutil.rmtree(out, ignore_errors=True)
    events = [["client", "client", step, t0 - wall0, t1 - wall0] for step, _, t0, t1 in EVENTS]
    for i, (address, w) in enumerate(sorted(got.items())):
        events += [
            ["worker", f"w{i}:{thread}", step, t0 - wall0, t1 - wall0] for step, thread, t0, t1 in w["events"]
        ]
    events.sort(key=lambda e: e[3])
    first = min(res.records, key=lambda r: r.committed_at)
    import dask_surge as ds

    return {
        "ttfo_s": res.ttfo_s,
        "seconds": total,
        "rows": res.rows,
        "superbatches": res.superbatches,
        "b_min": res.b_min,
        "b_max": res.b_max,
        "first_sb_rows": first.rows,
        "first_sb_encode_s": first.encode_s,
        "first_sb_write_s": first.write_s,
        "loadavg_at_call": load0,
        "dask_surge": ds.__file__,
        "worker_dask_surge": sorted({w["dask_surge"] for w in got.values()}),
        "worker_preimported": [p["preimported"] for p in prepared.values()],
        "events": events,
    }


def summarize(events: list) -> dict[str, float]:
    """Per step: the first start and, summed over workers and calls, seconds spent (for the table)."""
    steps: dict[str, dict[str, float]] = {}
    for _side, _where, step, t0, t1 in events:
        s = steps.setdefault(step, {"first_start_s": t0, "first_end_s": t1, "total_s": 0.0, "calls": 0})
        s["first_start_s"] = min(s["first_start_s"], t0)
        s["first_end_s"] = min(s["first_end_s"], t1)
        s["total_s"] += t1 - t0
        s["calls"] += 1
    return steps


#: the environment variable that sets ``surge.first-superbatch`` in a run's process (and its workers)
FIRST_ENV = "DASK_SURGE__FIRST_SUPERBATCH"


def _run_child(tree: Path | None, data: str, workers: int, ramp: int = 0, first: str | None = None) -> dict:
    paths = ([str(tree)] if tree is not None else []) + [str(ROOT)]
    code = (
        f"import sys, json; sys.path[:0] = {paths!r}; from benchmarks import cold_start as m; "
        f"print('@@' + json.dumps(m.one({data!r}, {workers}, {ramp})))"
    )
    env = dict(os.environ)
    if first is not None:
        env[FIRST_ENV] = first
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("@@")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"the cold-start child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(line[2:])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="LABEL=PATH[:ramp=ROWS][:first=ROWS]",
        help="a dask_surge tree to run ('.': this checkout), with ':ramp=ROWS' the first "
        "SuperBatches ramped up from ROWS rows (a prototype of the planner's ramp), with "
        "':first=ROWS' surge.first-superbatch set to ROWS ('None': no ramp) in the run's "
        "process; repeat to compare, alternating",
    )
    parser.add_argument("--out", default=str(_results.RESULTS / "cold_start.json"))
    args = parser.parse_args(argv)
    from ._realtext import small_files

    trees: list[tuple[str, Path | None, int, str | None]] = []
    for spec in args.tree or ["this=."]:
        label, _, rest = spec.partition("=")
        path, *suffixes = rest.split(":")
        options = dict(s.partition("=")[::2] for s in suffixes)
        unknown = set(options) - {"ramp", "first"}
        if unknown:
            parser.error(f"--tree {spec!r}: unknown suffix {sorted(unknown)} (ramp=ROWS, first=ROWS)")
        trees.append(
            (
                label,
                None if path in ("", ".") else Path(path).resolve(),
                int(options.get("ramp") or 0),
                options.get("first"),
            )
        )
    data, layout = small_files(args.n, args.files)
    records = []
    for repeat in range(args.repeats):
        for label, tree, ramp, first in trees:  # alternating: the machine's load drifts over minutes
            r = _run_child(tree, str(data), args.workers, ramp, first)
            r.update(tree=label, repeat=repeat, first_superbatch=first, steps=summarize(r["events"]))
            records.append(r)
            print(
                f"[{label} #{repeat}] ttfo {r['ttfo_s']:.2f} s, total {r['seconds']:.2f} s, first SB "
                f"{r['first_sb_rows']} rows (encode {r['first_sb_encode_s']:.2f} s), load "
                f"{r['loadavg_at_call'][0]:.2f}",
                flush=True,
            )
    report = _results.new_report(__spec__.name, argv, args)
    report["results"] = records
    medians = {
        label: statistics.median(r["ttfo_s"] for r in records if r["tree"] == label) for label, *_ in trees
    }
    summary: dict[str, Any] = {
        "layout": layout,
        "workers": args.workers,
        "forward": "real",
        "ttfo_s_median": medians,
        "target_s": 5.0,
        "met": {k: v <= 5.0 for k, v in medians.items()},
    }
    if len(trees) > 1:
        base = trees[0][0]
        summary["ttfo_ratio_vs_" + base] = {k: v / medians[base] for k, v in medians.items()}
    report["summary"] = summary
    out = _results.save(report, args.out)
    print("median ttfo: " + ", ".join(f"{k} {v:.2f} s" for k, v in medians.items()) + " (target <= 5 s)")
    return out


if __name__ == "__main__":
    main()
