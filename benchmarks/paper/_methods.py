"""One benchmark measurement: a method run on one workload, in a fresh process.

``benchmarks/paper/run.py`` starts ``python -m benchmarks.paper._methods '<json spec>'`` once per
(method, encoder, workload) so that every run gets a fresh cluster and a clean
memory baseline; the result is printed as one JSON line prefixed with ``RESULT``.

Methods (all with the same :class:`dask_surge.Encoder`, the same worker count and
the same Parquet input read with ``dd.read_parquet``, each written the way a
competent Dask user would):

``surge``   ``ddf.surge.encode("text", output=..., keep=["doc_id"])``.
``pbp``     ``ddf["text"].map_partitions(enc.embed, meta=enc.meta)`` assigned next to
            ``doc_id`` and written with ``to_parquet`` (one encode call per partition).
``fb``      the frame computed to the client (all N rows in one process), split into
            fixed batches of ``B``, the batches scattered to the workers and encoded
            there, all embeddings gathered back and written at the end.
``pbplb``   fixed groups of ``k`` consecutive partitions (``ddf.to_delayed()``), one
            encode call and one output file per group; groups assigned to workers
            by LPT on their row counts (sizes from Parquet footers) and pinned with
            ``client.compute(..., workers=[addr])``.
``st``      single-process reference: ``SentenceTransformer.encode`` on one list of
            all texts read with pyarrow, written with pyarrow (no Dask).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

METHODS = ("surge", "pbp", "fb", "pbplb", "st")


# --------------------------------------------------------------------------- monitors
class MemorySampler:
    """Peak of the summed RSS of this process and all its descendants, every ``interval`` s."""

    def __init__(self, interval: float = 0.05) -> None:
        import psutil

        self.psutil = psutil
        self.root = psutil.Process(os.getpid())
        self.interval = interval
        self.peak = 0
        self.peak_by_role: dict[str, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def total(self) -> tuple[int, int, int]:
        """(total, this process, descendants) RSS in bytes."""
        own = self.root.memory_info().rss
        kids = 0
        for child in self.root.children(recursive=True):
            try:
                kids += child.memory_info().rss
            except (self.psutil.NoSuchProcess, self.psutil.AccessDenied):
                pass
        return own + kids, own, kids

    def _loop(self) -> None:
        while not self._stop.is_set():
            total, own, kids = self.total()
            self.samples += 1
            if total > self.peak:
                self.peak = total
                self.peak_by_role = {"client_and_scheduler": own, "workers_and_children": kids}
            self._stop.wait(self.interval)

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        total, own, kids = self.total()
        if total > self.peak:
            self.peak, self.peak_by_role = total, {"client_and_scheduler": own, "workers_and_children": kids}


class OutputWatcher:
    """Time from ``start`` to the first readable Parquet file in ``path`` (footer parses)."""

    def __init__(self, path: str, start: float, interval: float = 0.02) -> None:
        self.path, self.start, self.interval = path, start, interval
        self.first: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        import pyarrow.parquet as pq

        tried: set[str] = set()
        while not self._stop.is_set() and self.first is None:
            for root, _dirs, files in os.walk(self.path):
                for f in files:
                    if f.startswith(".") or not f.endswith(".parquet") or f in tried:
                        continue
                    try:
                        pq.read_metadata(os.path.join(root, f))
                    except Exception:
                        continue  # not complete yet
                    self.first = time.perf_counter() - self.start
                    return
            self._stop.wait(self.interval)

    def __enter__(self) -> "OutputWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# --------------------------------------------------------------------------- helpers
def encoder_for(spec: dict):
    from dask_surge import Encoder

    return Encoder(spec["model_path"], device=spec["device"])


def _warm(enc) -> None:
    """Load the model in this process and run it once (thread pools, allocators)."""
    enc.load()
    enc.encode(["warm up the encoder with a short text"] * 8)


def start_cluster(spec: dict):
    from distributed import Client

    if spec["gpu"]:
        try:
            from dask_cuda import LocalCUDACluster
        except ImportError:
            LocalCUDACluster = None
        if LocalCUDACluster is not None:
            kw = {"dashboard_address": ":0"}
            if spec.get("workers"):
                kw["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(spec["workers"]))
            cluster = LocalCUDACluster(**kw)
            return cluster, Client(cluster)
    from distributed import LocalCluster

    cluster = LocalCluster(
        n_workers=spec["workers"], threads_per_worker=1, dashboard_address=":0", processes=True
    )
    return cluster, Client(cluster)


def read_input(spec: dict):
    import dask.dataframe as dd

    return dd.read_parquet(spec["data_dir"], columns=["text", "doc_id"])


def _encode_batch(texts, enc):
    return enc.encode(texts)


def _write_atomic(table, path: str, row_group_size: int | None = None) -> None:
    import pyarrow.parquet as pq

    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    pq.write_table(table, tmp, row_group_size=row_group_size, compression="zstd")
    os.replace(tmp, path)


def _encode_group(parts, enc, path):
    """PB-PBP-LB task: one encode call for k consecutive partitions, one output file."""
    import pandas as pd
    import pyarrow as pa

    from dask_surge.io.arrow import embedding_array

    df = pd.concat(parts, ignore_index=True) if len(parts) > 1 else parts[0]
    emb = enc.encode(df["text"].tolist())
    table = pa.table({"doc_id": pa.array(df["doc_id"].to_numpy()), "embedding": embedding_array(emb)})
    _write_atomic(table, path)
    return len(df)


def lpt(loads, bins: int) -> list[int]:
    """Longest-processing-time-first: assignment (bin index per item) of ``loads`` to ``bins``."""
    import heapq

    heap = [(0, b) for b in range(bins)]
    out = [0] * len(loads)
    for i in sorted(range(len(loads)), key=lambda i: -loads[i]):
        load, b = heapq.heappop(heap)
        out[i] = b
        heapq.heappush(heap, (load + loads[i], b))
    return out


def footer_sizes(data_dir: str) -> list[int]:
    import pyarrow.dataset as ds

    dataset = ds.dataset(data_dir, format="parquet")
    frags = sorted(dataset.get_fragments(), key=lambda f: f.path)
    return [f.metadata.num_rows for f in frags]


# --------------------------------------------------------------------------- methods
def run_surge(spec, client, enc, out):
    ddf = read_input(spec)
    res = ddf.surge.encode(
        "text",
        output=out,
        model=enc,
        b_min=spec["b_min"],
        b_max=spec["b_max"],
        keep=["doc_id"],
        progress=False,
        scheduler=client,
    )
    return {
        "calls": len(res.records),
        "library_ttfo_s": res.ttfo_s,
        "superbatches": res.superbatches,
        "encode_s_sum": float(sum(r.encode_s for r in res.records)),
        "write_s_sum": float(sum(r.write_s for r in res.records)),
        "library_seconds": res.seconds,
        "sizes_source": res.sizes_source,
    }


def run_pbp(spec, client, enc, out):
    ddf = read_input(spec)
    frame = ddf[["doc_id"]].assign(embedding=ddf["text"].map_partitions(enc.embed, meta=enc.meta))
    parts = frame.optimize().npartitions
    frame.to_parquet(out, write_index=False, compute_kwargs={"scheduler": client})
    return {"calls": int(parts), "graph_partitions": int(parts)}


def run_fb(spec, client, enc, out):
    import pyarrow as pa

    from dask_surge.io.arrow import embedding_array

    pdf = read_input(spec).compute()  # every row lands in the client: O(N) memory
    texts = pdf["text"].tolist()
    B = spec["fb_batch"]
    batches = [texts[i : i + B] for i in range(0, len(texts), B)]
    futures = client.map(_encode_batch, client.scatter(batches, hash=False), enc=enc, pure=False)
    emb = np.concatenate(client.gather(futures)) if batches else np.zeros((0, enc.dimension), np.float32)
    table = pa.table({"doc_id": pa.array(pdf["doc_id"].to_numpy()), "embedding": embedding_array(emb)})
    _write_atomic(table, os.path.join(out, "part-0.parquet"), row_group_size=B)
    return {"calls": len(batches), "fb_batch": B}


def run_pbplb(spec, client, enc, out):
    import dask

    sizes = footer_sizes(spec["data_dir"])
    parts = read_input(spec).to_delayed()
    if len(parts) != len(sizes):
        raise RuntimeError(f"read_parquet gave {len(parts)} partitions for {len(sizes)} files")
    k = spec["k"]
    groups = [list(range(i, min(i + k, len(parts)))) for i in range(0, len(parts), k)]
    loads = [sum(sizes[p] for p in g) for g in groups]
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    assign = lpt(loads, len(workers))
    futures = []
    for gi in sorted(range(len(groups)), key=lambda g: -loads[g]):  # big groups first (LPT order)
        g = groups[gi]
        task = dask.delayed(_encode_group)(
            [parts[p] for p in g], enc, os.path.join(out, f"group-{gi:05d}.parquet")
        )
        futures.append(client.compute(task, workers=[workers[assign[gi]]], allow_other_workers=False))
    client.gather(futures)
    per_worker = [sum(l for l, a in zip(loads, assign) if a == w) for w in range(len(workers))]
    return {"calls": len(groups), "k": k, "rows_per_worker": per_worker}


def run_st(spec, enc, out):
    """Plain sentence-transformers in this process: one list, one ``encode`` call."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dask_surge.io.arrow import embedding_array

    model = spec["_st_model"]
    table = pq.read_table(spec["data_dir"], columns=["text", "doc_id"])
    texts = table.column("text").to_pylist()
    emb = model.encode(texts, batch_size=spec["st_batch"], convert_to_numpy=True, show_progress_bar=False)
    out_table = pa.table(
        {"doc_id": table.column("doc_id"), "embedding": embedding_array(np.asarray(emb, np.float32))}
    )
    _write_atomic(out_table, os.path.join(out, "part-0.parquet"))
    return {"calls": 1, "st_batch": spec["st_batch"]}


def rows_written(out: str) -> int:
    import pyarrow.parquet as pq

    n = 0
    for root, _dirs, files in os.walk(out):
        for f in files:
            if f.endswith(".parquet") and not f.startswith("."):
                n += pq.read_metadata(os.path.join(root, f)).num_rows
    return n


def measure(spec: dict, shared: dict | None = None) -> dict:
    """Run ``spec["method"]`` once and return its record (see module docstring).

    ``shared`` (a dict) lets several measurements in one process reuse one cluster
    (``--quick``); by default each measurement starts and closes its own.
    """
    import torch

    method = spec["method"]
    out = spec["out_dir"]
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    enc = encoder_for(spec)
    cluster = client = None
    setup0 = time.perf_counter()
    sampler = MemorySampler()
    if method != "st" and shared is not None and shared.get("client") is not None:
        cluster, client = shared["cluster"], shared["client"]
        _warm(enc)
        client.run(_warm, enc)
    elif method == "st":
        from sentence_transformers import SentenceTransformer

        spec["_st_model"] = SentenceTransformer(
            spec["model_path"], device=spec["device"], local_files_only=True
        )
        spec["_st_model"].encode(["warm up"] * 8)
    else:
        cluster, client = start_cluster(spec)
        client.wait_for_workers(spec["workers"])
        if shared is not None:
            shared.update(cluster=cluster, client=client)
        _warm(enc)  # client side (meta/dimension), as every method needs
        client.run(_warm, enc)  # each worker loads the model once, before the clock
    setup_s = time.perf_counter() - setup0
    baseline = sampler.total()[0]
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    try:
        with sampler, OutputWatcher(out, t0) as watcher:
            if method == "surge":
                extra = run_surge(spec, client, enc, out)
            elif method == "pbp":
                extra = run_pbp(spec, client, enc, out)
            elif method == "fb":
                extra = run_fb(spec, client, enc, out)
            elif method == "pbplb":
                extra = run_pbplb(spec, client, enc, out)
            elif method == "st":
                extra = run_st(spec, enc, out)
            else:
                raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
            seconds = time.perf_counter() - t0
        n_out = rows_written(out)
    finally:
        if client is not None and shared is None:
            client.close()
            cluster.close()
        shutil.rmtree(out, ignore_errors=True)
    n = spec["n"]
    ttfo = extra.pop("library_ttfo_s", None) if method == "surge" else None
    watched = watcher.first
    if ttfo is None:
        ttfo = watched if watched is not None else seconds
    rec = {
        "method": method,
        "encoder": spec["encoder"],
        "n": n,
        "partitions": spec["partitions"],
        "sigma": spec["sigma"],
        "b_min": spec["b_min"] if method == "surge" else None,
        "b_max": spec["b_max"] if method == "surge" else None,
        "workers": 1 if method == "st" else spec["workers"],
        "device": spec["device"],
        "seconds": seconds,
        "texts_per_s": n / seconds,
        "tokens": spec["tokens"],
        "tokens_per_s": spec["tokens"] / seconds,
        "peak_rss_bytes": int(sampler.peak),
        "baseline_rss_bytes": int(baseline),
        "peak_over_baseline_bytes": int(sampler.peak - baseline),
        "peak_rss_by_role": sampler.peak_by_role,
        "rss_samples": sampler.samples,
        "ttfo_s": ttfo,
        "watched_ttfo_s": watched,
        "rows_written": n_out,
        "setup_s": setup_s,
        "torch_threads": torch.get_num_threads(),
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
        "suite": spec.get("suite"),
    }
    rec.update(extra)
    if n_out != n:
        rec["error"] = f"wrote {n_out} rows for {n} input rows"
    return rec


def main(argv: list[str]) -> None:
    """``argv[0]``: a JSON spec, or a JSON list of specs run on one shared cluster."""
    specs = json.loads(argv[0])
    shared = {} if isinstance(specs, list) else None
    for spec in specs if isinstance(specs, list) else [specs]:
        try:
            rec = measure(spec, shared)
        except Exception as err:  # report and go on: one failed method must not hide the others
            import traceback

            traceback.print_exc()
            rec = {"key": spec.get("key"), "error": f"{type(err).__name__}: {err}"}
        rec["key"] = spec.get("key")
        print("RESULT " + json.dumps(rec), flush=True)
    if shared and shared.get("client") is not None:
        shared["client"].close()
        shared["cluster"].close()


if __name__ == "__main__":
    main(sys.argv[1:])
