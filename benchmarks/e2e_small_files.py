"""End to end on many small files: ``ddf.surge.encode`` against one process of the reference library's own encode.

Usage::

    python -m benchmarks.e2e_small_files [--n 60000] [--files 2237] [--sigma 1.72]
                                         [--minilm-n 3000] [--minilm-files 112] [--repeats 2]
                                         [--models tiny,minilm] [--decoder-n 3000] [--decoder-files 400]
                                         [--sparse-n 3000] [--sparse-files 400]
                                         [--multivector-n 3000] [--multivector-files 400]
                                         [--workers 2] [--warm] [--profile]
                                         [--out benchmarks/results/e2e_small_files.json]

Issue 17's "simplest alternative" comparison, side by side in one run, per model:

- ``tiny``: the compute-light random 2-layer BERT of ``dask_surge.testing.make_tiny_model``
  (the real MiniLM tokenizer), as cheap per text relative to overhead as MiniLM is on a GPU;
  ``--n`` real texts (docstring paragraphs of installed packages, see ``_realtext.py``) in
  ``--files`` Parquet files of log-normal sizes (sigma 1.72: a median of a few rows a file);
- ``minilm``: the packaged all-MiniLM-L6-v2 (compute-bound here) on ``--minilm-n`` texts;
- ``decoder``: the random Qwen3-shaped decoder embedder of ``dask_surge.testing.make_tiny_decoder_model``
  (2 layers, width 32, last-token pooling, left padding) on ``--decoder-n`` texts in
  ``--decoder-files`` files, with one more arm, ``surge_st``: the same surge run with
  ``engine="sentence-transformers"`` (the fallback decoders took before the fast engine ran
  them), so the fallback and the engine are measured in the same run;
- ``sparse``: the random SPLADE model of ``dask_surge.testing.make_tiny_sparse_model`` (written
  as ``indices``/``values``) on ``--sparse-n`` texts in ``--sparse-files`` files;
- ``multivector``: the random ColBERT-style model of ``dask_surge.testing.make_tiny_multivector_model``
  (written as ``vectors``/``tokens``) on ``--multivector-n`` texts in ``--multivector-files`` files.

Every model but ``tiny`` has its own ``--<model>-n`` and ``--<model>-files``. ``--models`` picks
which run (``--models decoder`` runs the decoder alone). Where ``--out`` already holds this
benchmark's figures of the same mode (cold or warm) for a model not run now, they are kept (with
the command, commit and date of the run that made them, under ``from_run``).

Each measurement runs in a fresh Python process, after its imports. Two modes:

- cold (the default, ``e2e_small_files.json``): the model load is inside the clock on both sides;
- ``--warm`` (default ``--out`` ``e2e_small_files_warm.json``, ``"warm": true`` in each summary
  and record): the reference process loads its model and encodes the same texts once before its
  clock (its clock: read, encode, write); the surge process runs one untimed encode of the same
  files on its cluster first, into another output, so its workers hold the model loaded and have
  run it (``warmup_s``), then the timed one. Both sides are warmed the same way.

The arms:

- ``st``: read every file with pyarrow, load the model with the class of its family
  (``SentenceTransformer``, ``SparseEncoder`` or ``MultiVectorEncoder``, ``device="cpu"``; the
  family from ``dask_surge.engine.family.family_of_files``), encode with the library's own method
  at ``batch_size=32`` (dense: ``encode``; sparse: ``encode_document(convert_to_sparse_tensor=True)``
  then ``dask_surge.io.sparse.sparse_arrays``; multi-vector: ``encode_document(convert_to_numpy=True)``
  then ``dask_surge.io.multivector.multivector_arrays``) and write one Parquet file of the same
  columns surge writes; torch uses every core of the process. ``st1``: the same with
  ``torch.set_num_threads(1)``; on a
  machine shared with other work, torch's default threads can run several times slower
  (OpenMP waits), so the ratio is taken against the faster of the two (ST at its best).
- ``surge``: ``dd.read_parquet(dir).surge.encode("text", output=...)`` on a
  ``LocalCluster`` of ``--workers`` single-threaded worker processes started before the
  clock, with torch and sentence-transformers imported in them (as the ST process has them
  imported before its clock; reported apart as ``cluster_start_s``); the workers load the
  model inside the timed call (cold) or in the untimed run before it (warm). ``surge.encode``
  picks the family's columns itself; each record lists its output's (``output_columns``). ``dask_surge.api`` (which the lazy package imports on the
  accessor's first use) is imported before the clock too, as ``sentence_transformers`` is.

Runs alternate (st, st1, surge, st, st1, surge...); medians are reported with the ratio
surge texts/s / best st texts/s (issue 17's target: >= 1.2 for tiny and MiniLM; issue 55's for the
decoder: >= 2 on a warm cluster). Each surge run
also reports the CPU seconds of the client process (the scheduler and the planning run there)
and of the workers, and the share of the machine they used (on 2 cores the run is CPU-bound);
before its clock starts, the cores its cluster keeps busy while idle for a second
(``cluster_idle_cores``: the scheduler, nannies, heartbeats and monitors, which tick through
the run as well; on 2 cores every tenth of a core is 5% of the machine).

``--profile`` adds one more surge run per model (after the untimed one when ``--warm``), not timed, with ``py-spy record`` sampling
every running thread of each worker, and reports where the workers' CPU went
(:func:`breakdown`): the model's forward pass, loading the model, tokenizing and packing,
reading the input, committing the output, the event loop, and the rest.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from . import _results

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def one(method: str, model: str, data: str, workers: int, profile: bool = False, warm: bool = False) -> dict:
    """One measurement in this (fresh) process (``profile``: a surge run sampled by py-spy, untimed);
    ``surge_st`` is a surge run with ``engine="sentence-transformers"``; ``warm``: see the module
    docstring."""
    return _one(method, model, data, workers, profile, warm)


def _reference(one_thread: bool, model: str, data: str, out: Path, warm: bool) -> dict:
    """The reference arm: the reference library's own ``encode`` for the model's family in this
    process, from the Parquet files to one Parquet file of the same columns surge writes; the model
    loads inside the clock, or before it when ``warm``."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from dask_surge.engine.family import family_of_files

    family = family_of_files(model)
    if one_thread:
        torch.set_num_threads(1)
    encoder = _load_reference(family, model) if warm else None
    if encoder is not None:  # as surge's warm-up: one untimed encode of the same texts, then the clock
        _reference_columns(family, encoder, pq.read_table(data, columns=["text"]).column("text").to_pylist())
    t0, c0 = time.perf_counter(), time.process_time()
    table = pq.read_table(data, columns=["text", "doc_id"])
    if encoder is None:
        encoder = _load_reference(family, model)
    columns = _reference_columns(family, encoder, table.column("text").to_pylist())
    pq.write_table(pa.table({"doc_id": table.column("doc_id"), **columns}), out / "embeddings.parquet")
    return {
        "seconds": time.perf_counter() - t0,
        "rows": table.num_rows,
        "family": family,
        "torch_threads": torch.get_num_threads(),
        "cpu_s": round(time.process_time() - c0, 3),
    }


def _load_reference(family: str, model: str):
    """The sentence-transformers class of ``family`` (``SparseEncoder``, ``MultiVectorEncoder``,
    else ``SentenceTransformer``) loaded from ``model`` on the CPU."""
    import sentence_transformers as st

    cls = {"sparse": st.SparseEncoder, "multivector": st.MultiVectorEncoder}.get(
        family, st.SentenceTransformer
    )
    return cls(model, device="cpu")


def _reference_columns(family: str, encoder, texts: list[str]) -> dict:
    """``texts`` encoded by ``encoder``'s own method, batches of 32, as the output columns of
    ``family`` (:mod:`dask_surge.io.layout`): ``indices``/``values``, ``vectors``/``tokens``, or
    ``embedding``."""
    import numpy as np

    if family == "sparse":
        from dask_surge.io.sparse import sparse_arrays

        emb = encoder.encode_document(
            texts, batch_size=32, convert_to_sparse_tensor=True, show_progress_bar=False
        )
        indices, values = sparse_arrays(emb)
        return {"indices": indices, "values": values}
    if family == "multivector":
        from dask_surge.io.multivector import multivector_arrays

        emb = encoder.encode_document(texts, batch_size=32, convert_to_numpy=True, show_progress_bar=False)
        vectors, tokens = multivector_arrays(emb)
        return {"vectors": vectors, "tokens": tokens}
    from dask_surge.io.arrow import embedding_array

    emb = encoder.encode(texts, batch_size=32, convert_to_numpy=True, show_progress_bar=False)
    return {"embedding": embedding_array(np.asarray(emb, dtype=np.float32))}


def _one(method: str, model: str, data: str, workers: int, profile: bool = False, warm: bool = False) -> dict:
    import shutil

    out = Path(tempfile.mkdtemp(prefix=f"e2e-{method}-"))
    try:
        if method in ("st", "st1"):
            return _reference(method == "st1", model, data, out, warm)
        import dask.dataframe as dd
        from distributed import Client, LocalCluster

        import dask_surge  # noqa: F401 - registers the .surge accessor
        import dask_surge.api  # noqa: F401 - what the accessor imports on first use, before the clock as ST's import

        t0 = time.perf_counter()
        cluster = LocalCluster(
            n_workers=workers, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0"
        )
        client = Client(cluster)

        # the imports, as on the ST side (whose clock starts after them); the model loads inside the clock
        def engine_imports() -> (
            None
        ):  # the engine's module, here or (before engine/ existed) in an older tree
            import importlib
            import os

            import dask_surge as package

            here = os.path.isdir(os.path.join(os.path.dirname(package.__file__), "engine"))
            importlib.import_module("dask_surge.engine.transformer" if here else "dask_surge.models.engine")
            importlib.import_module("sentence_transformers")

        client.run(engine_imports)
        start_s = time.perf_counter() - t0
        try:

            def run(output: str = "emb"):
                engine = {"engine": "sentence-transformers"} if method == "surge_st" else {}
                return dd.read_parquet(data).surge.encode(
                    "text",
                    output=str(out / output),
                    model=model,
                    device="cpu",
                    keep=["doc_id"],
                    progress=False,
                    scheduler=client,
                    **engine,
                )

            from .host_ceiling import gil_seconds, run_cpu

            warmup_s = None
            if warm:  # one untimed run first, same model: the workers keep it loaded
                t0 = time.perf_counter()
                run("warmup")
                warmup_s = time.perf_counter() - t0

            if profile:
                sampled = gil_seconds(client, run, threads=True, gil=False, top=None)
                return {"breakdown": breakdown(sampled["profile_by_worker"]), "rate_hz": sampled["rate_hz"]}

            def timed():
                t0 = time.perf_counter()
                return run(), time.perf_counter() - t0

            _, idle = run_cpu(client, lambda: time.sleep(IDLE_S))  # Dask's own ticking, before the clock
            faults = client.run(minor_faults)
            (res, seconds), spent = run_cpu(client, timed)
            faults = sum(n - faults.get(w, n) for w, n in client.run(minor_faults).items())
            client_cpu, workers_cpu = spent["client"], spent["workers"]
            return {
                "seconds": seconds,
                "rows": int(sum(r.rows for r in res.records)),
                "output_columns": output_columns(out / "emb"),
                "warmup_s": warmup_s,
                "cluster_start_s": start_s,
                "ttfo_s": res.ttfo_s,
                "superbatches": res.superbatches,
                "engine": sorted({r.engine for r in res.records}),
                "client_cpu_s": client_cpu,
                "workers_cpu_s": workers_cpu,
                "workers_minflt": faults,
                "cluster_idle_cores": round(sum(idle.values()) / IDLE_S, 3),
                "machine_busy": (client_cpu + workers_cpu) / (seconds * (os.cpu_count() or 1)),
            }
        finally:
            client.close()
            cluster.close()
    finally:
        shutil.rmtree(out, ignore_errors=True)


def output_columns(path: Path) -> list[str]:
    """The column names of the first Parquet file under ``path`` (surge's output), sorted."""
    import pyarrow.parquet as pq

    first = next(iter(sorted(path.rglob("*.parquet"))), None)
    return sorted(pq.read_schema(first).names) if first else []


#: What ``--models`` can name.
MODELS = ("tiny", "minilm", "decoder", "sparse", "multivector")

#: Seconds the cluster is left idle before a timed surge run, to measure what it costs doing nothing.
IDLE_S = 1.0


def minor_faults() -> int:
    """This process's minor page faults so far (memory it touched for the first time, each a trip
    into the kernel)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


#: Where a worker's CPU goes, by the first of these frames (py-spy's qualified names) under a sample;
#: a sample under none of them is the event loop's when its thread is ``MainThread``, else ``other``.
CATEGORIES = (
    ("forward", ("DeviceRunner.forward",)),
    ("model load", ("Encoder.load",)),
    ("tokenize and pack", ("prepared",)),
    ("read", ("UnitSource.iterate",)),
    ("commit", ("SuperBatchWriter.commit",)),
)
#: Leaf frames of a thread that waits (py-spy can sample one on its way in or out).
WAITS = ("EpollSelector.select", "Condition.wait", "Event.wait", "_worker", "sleep", "poll")


def breakdown(profiles: dict[str, dict]) -> dict:
    """Shares of the workers' sampled CPU by :data:`CATEGORIES`, from :func:`host_ceiling.gil_profile`'s
    ``inclusive`` and ``threads`` counts of each worker (samples of waiting leaves left out).

    >>> p = {"w": {"samples": 10, "threads": [("Dask-Default-Threads", 8), ("MainThread", 2)],
    ...            "inclusive": [("DeviceRunner.forward", 6), ("Encoder.load", 1)], "self": [],
    ...            "self_by_thread": {"MainThread": [("EpollSelector.select", 1)]}}}
    >>> breakdown(p)["share"]
    {'forward': 0.667, 'model load': 0.111, 'event loop': 0.111, 'other': 0.111}
    """
    counts: dict[str, float] = {}
    busy = 0
    for profile in profiles.values():
        inclusive: dict[str, int] = {}
        for frame, n in profile["inclusive"]:  # py-spy's frame: "Qualified.name (path:line)"
            key = frame.split(" (")[0]
            inclusive[key] = inclusive.get(key, 0) + n
        waits = {
            name: sum(n for leaf, n in leaves if leaf.split(" (")[0].endswith(WAITS))
            for name, leaves in profile["self_by_thread"].items()
        }
        loop = dict(profile["threads"]).get("MainThread", 0) - waits.get("MainThread", 0)
        mine = profile["samples"] - sum(waits.values())
        busy += mine
        left = mine
        for name, frames in CATEGORIES:
            n = sum(inclusive.get(f, 0) for f in frames)
            counts[name] = counts.get(name, 0) + n
            left -= n
        loop = max(0, loop)
        counts["event loop"] = counts.get("event loop", 0) + loop
        counts["other"] = counts.get("other", 0) + max(0, left - loop)
    share = {k: round(v / busy, 3) for k, v in counts.items() if v} if busy else {}
    return {"busy_samples": busy, "share": share}


def measure(
    method: str, model: str, data: Path, workers: int, profile: bool = False, warm: bool = False
) -> dict:
    cmd = [
        sys.executable,
        "-m",
        __spec__.name,
        "--one",
        method,
        "--model-path",
        model,
        "--data",
        str(data),
        "--workers",
        str(workers),
        *(["--profile"] if profile else []),
        *(["--warm"] if warm else []),
    ]
    return _results.run_one(cmd, what=method)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=60_000)
    parser.add_argument("--files", type=int, default=2237)
    parser.add_argument("--sigma", type=float, default=1.72)
    parser.add_argument("--minilm-n", type=int, default=3000, help="texts for MiniLM (0: skip it)")
    parser.add_argument("--minilm-files", type=int, default=112)
    parser.add_argument(
        "--models",
        default="tiny,minilm",
        help="comma-separated: " + ", ".join(MODELS) + " (decoder, sparse, multivector: the tiny ones)",
    )
    parser.add_argument("--decoder-n", type=int, default=3000)
    parser.add_argument("--decoder-files", type=int, default=400)
    parser.add_argument("--sparse-n", type=int, default=3000)
    parser.add_argument("--sparse-files", type=int, default=400)
    parser.add_argument("--multivector-n", type=int, default=3000)
    parser.add_argument("--multivector-files", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--warm",
        action="store_true",
        help="model loaded before the clock on both sides (see the docstring); default --out: "
        "e2e_small_files_warm.json",
    )
    parser.add_argument(
        "--out", help="default: benchmarks/results/e2e_small_files.json (_warm.json with --warm)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="one more surge run per model, untimed, sampled by py-spy: where the workers' CPU goes",
    )
    parser.add_argument("--one", choices=("st", "st1", "surge", "surge_st"), help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        _results.emit(one(args.one, args.model_path, args.data, args.workers, args.profile, args.warm))
        return {}
    if args.out is None:
        args.out = str(
            _results.RESULTS / ("e2e_small_files_warm.json" if args.warm else "e2e_small_files.json")
        )

    from dask_surge.testing import packaged_model_dir

    from ._realtext import TMP, small_files, tiny_model
    from .host_ceiling import cpu_split

    chosen = {m.strip() for m in args.models.split(",") if m.strip()}
    unknown = chosen - set(MODELS)
    if unknown:
        parser.error(f"--models {args.models!r}: {sorted(unknown)} are not among {', '.join(MODELS)}")
    suites = {}
    if "tiny" in chosen:
        suites["tiny"] = (str(tiny_model()), args.n, args.files)
    if "minilm" in chosen and args.minilm_n:
        suites["minilm"] = (str(packaged_model_dir()), args.minilm_n, args.minilm_files)
    if "decoder" in chosen:
        from dask_surge.testing import make_tiny_decoder_model

        suites["decoder"] = (
            make_tiny_decoder_model(TMP / "tiny-decoder"),
            args.decoder_n,
            args.decoder_files,
        )
    if "sparse" in chosen:
        from dask_surge.testing import make_tiny_sparse_model

        suites["sparse"] = (make_tiny_sparse_model(TMP / "tiny-sparse"), args.sparse_n, args.sparse_files)
    if "multivector" in chosen:
        from dask_surge.testing import make_tiny_multivector_model

        suites["multivector"] = (
            make_tiny_multivector_model(TMP / "tiny-multivector"),
            args.multivector_n,
            args.multivector_files,
        )
    report = _results.new_report(__spec__.name, argv, args)
    for name, (model, n, files) in suites.items():
        data, layout = small_files(n, files, sigma=args.sigma)
        methods = ("st", "st1", "surge", "surge_st") if name == "decoder" else ("st", "st1", "surge")
        runs: dict[str, list[dict]] = {method: [] for method in methods}
        for _ in range(args.repeats):
            for method in methods:
                r = measure(method, model, data, args.workers, warm=args.warm)
                assert r["rows"] == n, r
                runs[method].append(r)
                report["results"].append(
                    {"encoder": name, "method": method, "n": n, "files": files, "warm": args.warm, **r}
                )
                print(
                    f"{name:6s} {method:5s} {n / r['seconds']:9,.0f} texts/s  ({r['seconds']:.2f} s)",
                    flush=True,
                )
        st_default = statistics.median(r["seconds"] for r in runs["st"])
        st_one = statistics.median(r["seconds"] for r in runs["st1"])
        st = min(st_default, st_one)  # the baseline at its best thread setting
        best = runs["st" if st == st_default else "st1"]
        su = statistics.median(r["seconds"] for r in runs["surge"])
        su_start = statistics.median(r["seconds"] + r["cluster_start_s"] for r in runs["surge"])
        report["summary"][name] = {
            "layout": layout,
            "model": model,
            "warm": args.warm,
            "family": runs["st"][0]["family"],
            "surge_output_columns": runs["surge"][0]["output_columns"],
            "st_texts_per_s": n / st,
            "st_default_threads_texts_per_s": n / st_default,
            "st_one_thread_texts_per_s": n / st_one,
            "surge_texts_per_s": n / su,
            "ratio_surge_over_st": st / su,
            "ratio_with_cluster_start": st / su_start,
            # issue 17's target, for the models it named (the families came later, with no target of their own)
            "target_ratio": 1.2 if name in ("tiny", "minilm", "decoder") else None,
            "met": st / su >= 1.2 if name in ("tiny", "minilm", "decoder") else None,
            # issue 27: 3x with the tiny encoder, no loss with MiniLM
            "issue27_target_ratio": {"tiny": 3.0, "minilm": 1.0}.get(name),
            "machine_busy": statistics.median(r["machine_busy"] for r in runs["surge"]),
            "client_cpu_s": statistics.median(r["client_cpu_s"] for r in runs["surge"]),
            "workers_cpu_s": statistics.median(r["workers_cpu_s"] for r in runs["surge"]),
            # CPU per text (a: the faster ST arm, every thread; b: surge's client and workers) and the
            # share of the machine each kept busy, then the cores the surge cluster keeps busy doing
            # nothing (see the module docstring)
            "cpu": cpu_split(
                [r["seconds"] for r in best],
                [r["cpu_s"] for r in best],
                [r["seconds"] for r in runs["surge"]],
                [{"workers": r["workers_cpu_s"], "client": r["client_cpu_s"]} for r in runs["surge"]],
                n,
            ),
            "cluster_idle_cores": statistics.median(r["cluster_idle_cores"] for r in runs["surge"]),
        }
        if runs.get("surge_st"):  # the fallback, measured in the same run
            fallback = statistics.median(r["seconds"] for r in runs["surge_st"])
            report["summary"][name].update(
                fallback_texts_per_s=n / fallback,
                ratio_fallback_over_st=st / fallback,
                ratio_surge_over_fallback=fallback / su,
                issue55_target_ratio=2.0,
                issue55_met=st / su >= 2.0,
                engines={m: sorted({e for r in runs[m] for e in r["engine"]}) for m in ("surge", "surge_st")},
            )
            print(f"{name:6s} ratio fallback (engine='sentence-transformers')/st {st / fallback:.2f}")
        print(
            f"{name:6s} ratio surge/st {st / su:.2f} (with cluster start {st / su_start:.2f})"
            f"{' warm' if args.warm else ''}"
        )
        summary = report["summary"][name]
        cpu, idle = summary["cpu"], summary["cluster_idle_cores"]
        print(
            f"{name:6s} CPU per text: st {cpu['a_cpu_us_per_text']:.0f} us, "
            f"surge {cpu['b_cpu_us_per_text']:.0f} us; idle cluster {idle:.2f} cores"
        )
        if args.profile:
            sampled = measure("surge", model, data, args.workers, profile=True, warm=args.warm)
            report["summary"][name]["workers_cpu_breakdown"] = sampled["breakdown"]
            print(f"{name:6s} workers' CPU: {sampled['breakdown']['share']}")
    _keep_other_models(report, args.out, set(suites))
    return _results.save(report, args.out)


def _keep_other_models(report: dict, out: str, ran: set[str]) -> None:
    """Copy into ``report`` the summary and records of the models ``out`` (an earlier report of this
    benchmark) holds and this run did not measure, each summary marked with the run that made it."""
    path = Path(out)
    if not path.is_file():
        return
    import json

    try:
        old = json.loads(path.read_text())
    except ValueError:
        return
    if (
        old.get("benchmark") != report["benchmark"]
        or bool((old.get("args") or {}).get("warm")) != report["args"]["warm"]
    ):
        return  # another benchmark's, or the other mode's (cold and warm figures are never mixed)
    for name, summary in (old.get("summary") or {}).items():
        if name in ran:
            continue
        origin = summary.get("from_run") or {k: old.get(k) for k in ("command", "git", "created")}
        report["summary"][name] = {**summary, "from_run": origin}
        report["results"].extend(r for r in old.get("results", []) if r.get("encoder") == name)


if __name__ == "__main__":
    main()
