"""Issue 62's acceptance story, end to end, as a new user would walk it.

For each table format (Lance, Delta, Iceberg): ``ddf.surge.encode("text", output="s3://.../emb.<fmt>",
format=..., storage_options=...)`` in a user's own process (a subprocess) on a 2-worker
``LocalCluster`` (processes) against a loopback S3 endpoint (moto), with a small real model and
docstring texts; the process is SIGKILLed twice (right after its first table commit, then later in
the rerun), then rerun to completion with ``build_index=True``. Then: every (partition, row) exactly
once, embeddings as an undisturbed encode of the same texts gave, no SuperBatch twice in the table's
own history, and a search over the table returns the right neighbours (those of exact search over
the embeddings read back): Lance through LanceDB, Delta read with ``deltalake``, Iceberg with
pyiceberg's scan (their FAISS index: ``open_index``).

Last, the backfill story (Lance and Delta on the same S3): a table with a text column and a key and
no embedding is backfilled, gets 100 new rows, and a second backfill encodes only those 100.

Behind the ``slow`` marker; ``SURGE_SWEEP=reduced`` runs fewer rows and two kills per format, else
more rows and four kills.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pandas as pd
import pytest

from dask_surge.io.index import exact_neighbours, recall_at_k

pytest.importorskip("lance")
pytest.importorskip("lancedb")
pytest.importorskip("deltalake")
pytest.importorskip("pyiceberg")
pytest.importorskip("faiss")
pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

pytestmark = pytest.mark.slow

REDUCED = os.environ.get("SURGE_SWEEP") == "reduced"
ROWS = 360 if REDUCED else 1200
KILLS = 2 if REDUCED else 4
NPART = 6
BUCKET = "surge-story"
QUERIES = [
    "Return a copy of the string with leading and trailing whitespace removed.",
    "Open a file and return a stream.",
    "Return the number of items in a container.",
    "Raise an exception when the queue is empty.",
    "Compile a regular expression pattern into a pattern object.",
]


def docstring_texts(n: int) -> list[str]:
    """``n`` distinct real texts: the first paragraphs of the standard library's docstrings, sorted.

    Only stable within one moment of a process (a module's attributes grow as its submodules are
    imported): call it once and keep the list."""
    import argparse
    import collections
    import datetime
    import decimal
    import functools
    import inspect
    import itertools
    import json as json_module
    import logging
    import os as os_module
    import pathlib
    import re
    import statistics
    import string
    import textwrap
    import zipfile

    seen: set[str] = set()
    for module in (
        argparse,
        collections,
        datetime,
        decimal,
        logging,
        zipfile,
        functools,
        inspect,
        itertools,
        json_module,
        os_module,
        pathlib,
        re,
        statistics,
        string,
        textwrap,
        str,
        list,
        dict,
        set,
        bytes,
    ):
        for _, obj in sorted(vars(module).items()):
            members = list(vars(obj).values()) if isinstance(obj, type) else []
            for doc in [getattr(o, "__doc__", None) for o in (obj, *members)]:
                if isinstance(doc, str):
                    para = " ".join(doc.strip().split("\n\n")[0].split())[:300]
                    if len(para) >= 20:
                        seen.add(para)
    texts = sorted(seen)
    assert len(texts) >= n, f"only {len(texts)} docstrings here, {n} wanted"
    return texts[:n]


# The user's process. A test hook prints each table commit's version as it returns (the commit is in
# the table's history then) and pauses a moment after it, so the test can SIGKILL the process there.
DRIVER = """
import json, os, sys, time
import dask, dask.dataframe as dd
import dask_surge
fmt, src, out, model, options, catalog, final = sys.argv[1:8]
options, catalog, final = json.loads(options), json.loads(catalog), final == "1"
from dask_surge.io.tables import DeltaOutput, IcebergTable, LanceTable
Table = {"lance": LanceTable, "delta": DeltaOutput, "iceberg": IcebergTable}[fmt]
real = Table.commit
def commit(self, *a, **k):
    v = real(self, *a, **k)
    print("commit", v, flush=True)
    time.sleep(0.3)
    return v
Table.commit = commit
from distributed import Client, LocalCluster
with dask.config.set({"surge.iceberg-catalog": catalog}), \\
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as lc, Client(lc):
    print("started", flush=True)
    res = dd.read_parquet(src).surge.encode(
        "text", output=out, format=fmt, storage_options=options, model=model, keep=["doc_id"],
        b_min=30, b_max=60, progress=False, build_index="cosine" if final else False)
print("done", json.dumps({"rows": res.rows, "resumed": bool(res.resumed), "index": res.index}, default=str),
      flush=True)
"""

# What the user reads back, each table with its own library, and searches.
READ = """
import json, os, sys
import numpy as np
import dask, dask.dataframe as dd, pandas as pd
import dask_surge
from dask_surge.io.index import open_index
from dask_surge.io.tables.locations import object_store_options
fmt, out, model, options, catalog, queries = sys.argv[1:7]
options, catalog, queries = json.loads(options), json.loads(catalog), json.loads(queries)
store = object_store_options(out, options)
q = dd.from_pandas(pd.DataFrame({"text": queries}), npartitions=1).surge.encode(
    "text", model=model, scheduler="threads").compute().sort_values("row")
qv = np.stack(q.embedding.to_numpy()).astype(np.float32)
if fmt == "lance":
    import lance, lancedb
    ds = lance.dataset(out, storage_options=store)
    df = ds.to_table().to_pandas()
    props = [ds.read_transaction(v["version"]).transaction_properties or {} for v in ds.versions()]
    db = lancedb.connect(out.rsplit("/", 1)[0], storage_options=store)
    table = db.open_table(out.rsplit("/", 1)[1].removesuffix(".lance"))
    indexes = [str(i.index_type) for i in table.list_indices()]
    found = []
    for v in qv:
        hits = table.search(v).distance_type("cosine").nprobes(20).refine_factor(10).limit(10).to_pandas()
        found.append([[int(p), int(r)] for p, r in zip(hits.partition, hits.row)])
else:
    if fmt == "delta":
        import deltalake
        dt = deltalake.DeltaTable(out, storage_options=store)
        df, props = dt.to_pandas(), dt.history()
    else:
        from pyiceberg.catalog import load_catalog
        cat = dict(catalog)
        ep = options["client_kwargs"]["endpoint_url"]
        cat.update({"s3.endpoint": ep, "s3.access-key-id": "testing", "s3.secret-access-key": "testing"})
        table = load_catalog(cat.pop("name"), **cat).load_table("default.emb")
        df = table.scan().to_pandas()
        props = [dict(s.summary.additional_properties) for s in table.metadata.snapshots]
    with dask.config.set({"surge.iceberg-catalog": catalog}):
        index = open_index(out, storage_options=options)
    indexes = [index.kind]
    _, keys = index.search(qv, k=10)
    found = [[[int(p), int(r)] for p, r in zip(g.partition, g.row)] for _, g in keys.groupby("query", sort=True)]
sbs = [sb for p in props if "dask-surge.run" in p for sb in json.loads(p.get("dask-surge.superbatches") or "[]")]
df = df.sort_values(["partition", "row"])
print(json.dumps({"keys": df[["partition", "row"]].values.tolist(), "doc_id": df.doc_id.tolist(),
                  "embedding": np.stack(df.embedding.to_numpy()).tolist(), "superbatches": sbs,
                  "queries": qv.tolist(), "found": found, "indexes": indexes}), flush=True)
os._exit(0)  # deltalake's runtime, torn down at interpreter exit, aborts the process now and then (exit -6)
"""


def _start(args: list[str], log) -> subprocess.Popen:
    env = {**os.environ, "DASK_SURGE__TABLE_COMMIT_EVERY": "2", "DASK_SURGE__TABLE_COMMIT_SECONDS": "0.5"}
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=log,  # a file: a pipe nobody reads could fill and stall the process
        text=True,
        start_new_session=True,  # its own process group: the cluster it starts goes with it
    )


def _reap(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of the user's process group: the orphaned scheduler and workers of its
    LocalCluster (they share its session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _kill_after_commits(proc: subprocess.Popen, commits: int, delay: float, log) -> None:
    """SIGKILL the user's process ``delay`` seconds after its ``commits``-th table commit returned.
    Its cluster (its process group) is reaped after it; a run stuck for 300 s is reaped too."""
    assert proc.stdout is not None
    watchdog = threading.Timer(300, _reap, (proc,))
    watchdog.start()
    lines, seen = [], 0
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            seen += line.startswith("commit ")
            if seen == commits:
                time.sleep(delay)
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(timeout=60)
    finally:
        watchdog.cancel()
        _reap(proc)
        proc.stdout.close()
    log.seek(0)
    assert proc.returncode == -signal.SIGKILL, (lines, log.read()[-3000:])
    assert seen == commits, f"the run ended before its commit {commits}: {lines}"


def _history(fs, fmt: str, out: str) -> list[str]:
    """The files of the table's history as the store lists them: Lance versions, Delta log entries,
    Iceberg metadata files (one more per snapshot)."""
    path = out.removeprefix("s3://")
    where, suffix = {
        "lance": ("_versions", ".manifest"),
        "delta": ("_delta_log", ".json"),
        "iceberg": ("metadata", ".metadata.json"),
    }[fmt]
    try:
        return [f for f in fs.ls(f"{path}/{where}", detail=False, refresh=True) if f.endswith(suffix)]
    except FileNotFoundError:
        return []


@pytest.fixture(scope="module")
def story(tmp_path_factory, tiny_model):
    """The input (docstring texts, Parquet), the model, an undisturbed encode of it, and the S3 server."""
    import dask.dataframe as dd

    import dask_surge
    from dask_surge.testing import loopback_s3

    root = tmp_path_factory.mktemp("story")
    texts = docstring_texts(ROWS)
    frame = pd.DataFrame({"text": texts, "doc_id": np.arange(ROWS)})
    src = root / "in"
    dd.from_pandas(frame, npartitions=NPART).to_parquet(src)
    clean = dd.read_parquet(src).surge.encode(
        "text",
        output=str(root / "clean"),
        model=tiny_model,
        keep=["doc_id"],
        b_min=30,
        b_max=60,
        scheduler="threads",
        progress=False,
    )
    reference = (
        dask_surge.read_embeddings(clean.output)
        .compute(scheduler="threads")
        .sort_values(["partition", "row"])
        .reset_index(drop=True)
    )
    assert len(reference) == ROWS
    with loopback_s3(BUCKET) as (_, options, fs):
        yield {
            "root": root,
            "src": src,
            "texts": texts,
            "model": tiny_model,
            "reference": reference,
            "options": options,
            "fs": fs,
        }


@pytest.mark.parametrize("fmt", ["lance", "delta", "iceberg"])
def test_encode_to_a_table_on_s3_killed_twice_rerun_then_searched(story, fmt):
    t0 = time.perf_counter()
    out = f"s3://{BUCKET}/{fmt}/emb.{fmt}"
    catalog = {"name": "story", "type": "sql", "uri": f"sqlite:///{story['root']}/{fmt}-catalog.db"}
    args = [fmt, str(story["src"]), out, story["model"], json.dumps(story["options"]), json.dumps(catalog)]

    # killed right after its first table commit, then (each rerun) later: after two more commits and a pause
    fs, history = story["fs"], []
    with open(story["root"] / f"{fmt}-driver.log", "w+") as log:
        _kill_after_commits(_start([*args, "0"], log), 1, 0.0, log)
        history.append(len(_history(fs, fmt, out)))
        for k in range(1, KILLS):
            _kill_after_commits(_start([*args, "0"], log), 2, 0.1 * k, log)
            history.append(len(_history(fs, fmt, out)))
        killed = time.perf_counter() - t0
        done = _start([*args, "1"], log)
        try:
            stdout, _ = done.communicate(timeout=300)
        finally:
            _reap(done)
        log.seek(0)
        assert done.returncode == 0, log.read()[-3000:]
    # each kill came after commits visible in the table's history, each later than the one before
    assert history[0] >= 1 and all(a < b for a, b in itertools.pairwise(history)), history
    result = json.loads(stdout.strip().splitlines()[-1].removeprefix("done "))
    assert result["rows"] == ROWS and result["resumed"]
    assert result["index"]["built"] is True
    encoded = time.perf_counter() - t0

    read = subprocess.run(
        [
            sys.executable,
            "-c",
            READ,
            fmt,
            out,
            story["model"],
            json.dumps(story["options"]),
            json.dumps(catalog),
            json.dumps(QUERIES),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert read.returncode == 0, read.stderr[-3000:]
    got = json.loads(read.stdout)
    reference = story["reference"]
    # every (partition, row) exactly once, the embeddings of an undisturbed encode of the same texts
    assert got["keys"] == reference[["partition", "row"]].values.tolist()
    assert got["doc_id"] == reference.doc_id.tolist()
    x = np.array(got["embedding"], dtype=np.float32)
    np.testing.assert_allclose(x, np.stack(reference.embedding.to_numpy()), rtol=1e-5, atol=1e-6)
    # the table's own history names each SuperBatch once, and all of them
    assert len(got["superbatches"]) == len(set(got["superbatches"])) > 0
    # the right neighbours: those of exact search over the embeddings read back
    pos = {tuple(key): i for i, key in enumerate(got["keys"])}
    found = np.array([[pos[tuple(key)] for key in hits] for hits in got["found"]])
    exact = exact_neighbours(x, np.array(got["queries"], dtype=np.float32), 10)
    recall = recall_at_k(found, exact)
    assert got["indexes"] == (["IvfFlat"] if fmt == "lance" else ["faiss"])  # what build_index=True built
    assert recall >= 0.9, (recall, got["indexes"])
    print(
        f"{fmt}: {ROWS} rows, {KILLS} kills ({killed:.1f} s), rerun ({encoded:.1f} s), "
        f"search recall@10 {recall:.2f} ({time.perf_counter() - t0:.1f} s in all), history files {history}"
    )


BACKFILL = """
import json, os, sys
import numpy as np, pandas as pd, pyarrow as pa
import dask.dataframe as dd
from distributed import Client, LocalCluster
from dask_surge.backfill import backfill
from dask_surge.io.tables.locations import object_store_options
model, options, texts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
report = {}
with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as lc, Client(lc):
    for fmt, url in json.loads(sys.argv[4]):
        store = object_store_options(url, options)
        if fmt == "lance":
            import lance
            write = lambda data, mode: lance.write_dataset(data, url, mode=mode, storage_options=store)
            read = lambda: lance.dataset(url, storage_options=store).to_table()
        else:
            import deltalake
            write = lambda data, mode: deltalake.write_deltalake(
                url, data, mode="append" if mode == "append" else "error", storage_options=store)
            read = lambda: deltalake.DeltaTable(url, storage_options=store).to_pyarrow_table()
        n = len(texts) - 100
        write(pa.table({"id": pa.array(range(n), pa.int64()), "text": texts[:n]}), "create")
        run = lambda: backfill(url, "text", key="id", model=model, chunk_rows=max(1, n // 3),
                               storage_options=options)
        first = run()
        schema = read().schema
        write(pa.table({"id": pa.array(range(n, n + 100), pa.int64()), "text": texts[n:],
                        "embedding": pa.nulls(100, schema.field("embedding").type),
                        "embedding_text_hash": pa.nulls(100, schema.field("embedding_text_hash").type)}), "append")
        second = run()
        df = read().to_pandas().sort_values("id")
        report[fmt] = {"first": [first.rows, first.encoded], "second": [second.rows, second.encoded],
                       "id": df.id.tolist(), "text": df.text.tolist(),
                       "embedding": np.stack(df.embedding.to_numpy()).tolist()}
print(json.dumps(report), flush=True)
os._exit(0)  # as the reader above: deltalake's runtime torn down at exit aborts now and then
"""


def test_backfill_an_existing_table_then_only_its_100_new_rows(story):
    t0 = time.perf_counter()
    reference = story["reference"]
    n = len(reference)
    places = [[fmt, f"s3://{BUCKET}/backfill/t.{fmt}"] for fmt in ("lance", "delta")]
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            BACKFILL,
            story["model"],
            json.dumps(story["options"]),
            json.dumps(story["texts"]),
            json.dumps(places),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    texts = story["texts"]
    by_id = reference.sort_values("doc_id")
    assert by_id.doc_id.tolist() == list(range(n))
    want = np.stack(by_id.embedding.to_numpy())  # the undisturbed encode of texts[i], row i
    for fmt, _ in places:
        got = report[fmt]
        assert got["first"] == [n - 100, n - 100]
        assert got["second"] == [n, 100]  # only the 100 new rows encoded
        assert got["id"] == list(range(n)) and got["text"] == texts
        np.testing.assert_allclose(
            np.array(got["embedding"], np.float32), want, rtol=1e-5, atol=1e-6, err_msg=fmt
        )
    print(f"backfill (lance, delta): {time.perf_counter() - t0:.1f} s")
