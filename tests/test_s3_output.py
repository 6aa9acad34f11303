"""Output on an object store (issue 52), against a real S3 endpoint: moto's server on loopback.

Every row once and equal to an undisturbed run after interruptions and kills, exactly the
committed objects under the prefix (read by DuckDB through fsspec), one winner of two runs,
a late task of a replaced run publishing nothing, a store that ignores conditional creates
refused, workers that do not see the output refused before any work, and a constant number
of requests per SuperBatch with no LIST."""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest

import dask_surge
from dask_surge import SurgeOutputError
from dask_surge.io.lease import Claim
from dask_surge.io.manifest import current_run
from dask_surge.io.verify import verify
from dask_surge.synthetic import lognormal_sizes, make_partitioned_frame, write_partitioned_parquet
from dask_surge.testing import CountingEncoder, InterruptAfter, loopback_s3
from dask_surge.io.store import OutputStore

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
duckdb = pytest.importorskip("duckdb")

SIZES = [int(s) for s in lognormal_sizes(600, 24, seed=11)]
N = sum(SIZES)
FULL = os.environ.get("SURGE_SWEEP") == "full"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """``(endpoint, storage_options, filesystem)`` of a moto S3 server on 127.0.0.1 with bucket ``emb``."""
    with loopback_s3("emb") as server:
        yield server


_names = iter(range(10**6))


def _url() -> str:
    return f"s3://emb/out{next(_names)}"


def _encode(url, options, model, frame=None, **kw):
    frame = make_partitioned_frame(SIZES, seed=3) if frame is None else frame
    kw = {"b_min": 60, "b_max": 120, "scheduler": "sync", "progress": False, **kw}
    return frame.surge.encode("text", url, model=model, keep=["doc_id"], storage_options=options, **kw)


def _glob(url: str, fs) -> list[tuple[int, int]]:
    """The ``(partition, row)`` keys DuckDB reads from ``<url>/part-*.parquet`` (through fsspec)."""
    if not fs.glob(f"{url.removeprefix('s3://')}/part-*.parquet"):
        return []
    con = duckdb.connect()
    con.register_filesystem(fs)
    return con.sql(f"select partition, row from read_parquet('{url}/part-*.parquet')").fetchall()


def _objects(url: str, fs) -> set[str]:
    return {p.rsplit("/", 1)[1] for p in fs.glob(f"{url.removeprefix('s3://')}/part-*.parquet")}


def _committed(url: str, options) -> set[str]:
    return {r.file for r in current_run(OutputStore.open(url, options)).committed().values()}


def _exactly_once(url, options, fs, reference=None) -> pd.DataFrame:
    keys = _glob(url, fs)
    assert len(keys) == len(set(keys)) == N
    assert _objects(url, fs) == _committed(url, options)
    back = dask_surge.read_embeddings(url, storage_options=options).compute(scheduler="sync")
    back = back.sort_values("doc_id").reset_index(drop=True)
    assert back.doc_id.tolist() == list(range(N))
    if reference is not None:
        np.testing.assert_array_equal(
            np.stack(back.embedding.to_numpy()), np.stack(reference.embedding.to_numpy())
        )
    assert verify(url, options) == []
    return back


@pytest.fixture(scope="module")
def reference(store):
    endpoint, options, fs = store
    url = _url()
    _encode(url, options, CountingEncoder())
    return _exactly_once(url, options, fs)


def test_a_cluster_writes_to_s3_and_duckdb_reads_every_row_once(store, client, tiny_model):
    _, options, fs = store
    url = _url()
    res = _encode(url, options, tiny_model, scheduler=None)
    assert res.rows == N and res.superbatches > 3 and res.ttfo_s is not None
    _exactly_once(url, options, fs)
    assert dask_surge.status(url, storage_options=options)["state"] == "complete"
    run_json = fs.cat(f"{url.removeprefix('s3://')}/_surge/runs/{res.run_id}/run.json")
    assert b"testing" not in run_json and b"secret" not in run_json  # credentials never reach disk


def test_interrupted_then_resumed_on_s3_is_exact(store, reference):
    _, options, fs = store
    url = _url()
    model = InterruptAfter(3)
    with pytest.raises(KeyboardInterrupt):
        _encode(url, options, model)
    assert 0 < len(_committed(url, options)) < 8
    keys = _glob(url, fs)
    assert len(keys) == len(set(keys)) < N and _objects(url, fs) == _committed(url, options)
    _encode(url, options, model)  # the same call again: resumes
    _exactly_once(url, options, fs)


def test_two_runs_on_one_prefix_one_wins_and_a_dead_claim_is_taken_over(store, monkeypatch):
    _, options, _ = store
    store = OutputStore.open(_url(), options)
    fs, root = store.fs, store.root
    claim = Claim.acquire(store, "0" * 16, heartbeat=False)
    with pytest.raises(SurgeOutputError, match="being written by another run"):
        Claim.acquire(store, "1" * 16, heartbeat=False)
    # a claim from another machine, written just now by a clock an hour behind: live (the store's
    # clock says so: the age of its key), then stale once the store's clock passes the TTL
    fs.pipe_file(
        f"{root}/_surge/CLAIM",
        json.dumps(
            {"run": "2" * 16, "token": "a" * 32, "host": "elsewhere", "pid": 1, "started": time.time() - 3600}
        ).encode(),
    )
    with pytest.raises(SurgeOutputError, match="being written by another run"):
        Claim.acquire(store, "1" * 16, heartbeat=False)
    monkeypatch.setattr("dask_surge.io.lease.CLAIM_TTL_S", 1.0)
    time.sleep(2.5)  # S3 times have one-second resolution
    taken = Claim.acquire(store, "1" * 16, heartbeat=False)
    assert Claim.holder(store)["token"] == taken.token != claim.token
    taken.release()
    assert Claim.holder(store) is None


def test_a_late_task_of_a_replaced_run_publishes_nothing(store, counting_encoder):
    from dask_surge.execution.sink import SuperBatchWriter
    from dask_surge.execution.superbatch import SuperBatchTask
    from dask_surge.planning.policy import Span

    _, options, fs = store
    url = _url()
    _encode(url, options, CountingEncoder(dim=4))
    old = current_run(OutputStore.open(url, options))
    late = SuperBatchWriter(
        SuperBatchTask("text", ("doc_id",), dask_surge.Encoder(CountingEncoder(dim=4))), old
    )
    _encode(url, options, counting_encoder, overwrite=True)
    part = make_partitioned_frame(SIZES, seed=3).partitions[0].compute()
    late([part], ((Span(0, 0, len(part)), len(part)),))  # its commit lands in the retired run's prefix
    _exactly_once(url, options, fs)


def test_an_overwrite_on_s3_never_shows_two_runs(store, reference):
    _, options, fs = store
    url = _url()
    _encode(url, options, CountingEncoder(dim=4))
    model = InterruptAfter(3)
    with pytest.raises(KeyboardInterrupt):
        _encode(url, options, model, overwrite=True)
    keys = _glob(url, fs)
    assert len(keys) == len(set(keys)) == N  # the old run, whole
    _encode(url, options, model, overwrite=True)
    _exactly_once(url, options, fs)


def _long_frame():
    texts = [("word " * (100 + 9 * i)).strip() for i in range(30)]
    frame = make_partitioned_frame([10, 10, 10], seed=1)
    return frame.assign(text=frame.doc_id.map(lambda i: texts[int(i)], meta=("text", "string[pyarrow]")))


def test_chunked_long_texts_work_on_the_store(store, tiny_model):
    _, options, fs = store
    url = _url()
    res = _encode(url, options, tiny_model, frame=_long_frame(), b_min=10, b_max=10, long_texts="chunk")
    assert res.output_rows > 30
    chunks = dask_surge.read_embeddings(url, storage_options=options).compute(scheduler="sync")
    assert len(chunks) == res.output_rows and set(chunks.doc_id) == set(range(30))
    assert _objects(url, fs) == _committed(url, options) and verify(url, options) == []


def test_status_verify_and_repair_on_the_store(store, monkeypatch, capsys):
    from unittest import mock

    from dask_surge.cli import main

    endpoint, options, fs = store
    url = _url()
    _encode(url, options, CountingEncoder())
    lost = sorted(_objects(url, fs))[0]
    fs.rm_file(f"{url.removeprefix('s3://')}/{lost}")
    problems = verify(url, options)
    assert len(problems) == 1 and lost in problems[0] and "missing" in problems[0]
    # the CLI in this process (a fresh interpreter per command cost 10-15 s each on 2 cores, issue 70), with
    # no storage options: the store from the environment, as in a shell; a cached s3fs filesystem made
    # before the endpoint was set must not answer for it, nor the one made here outlive the test
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        with mock.patch.dict(os.environ):  # main() sets defaults in os.environ: restored after
            assert main(["status", "--verify", url]) == 1
            capsys.readouterr()
            main(["status", "--repair", url])
        said = capsys.readouterr()
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    assert "forgot SuperBatch" in said.out + said.err, said.out + said.err
    _encode(url, options, CountingEncoder())  # the rerun encodes the forgotten rows again
    _exactly_once(url, options, fs)


def test_a_store_that_ignores_conditional_creates_is_refused(store, counting_encoder, monkeypatch):
    """moto's S3 server made to ignore ``If-None-Match`` (as some S3-compatible servers do)."""
    from moto.s3.responses import S3Response
    from werkzeug.datastructures import Headers

    _, options, fs = store
    real = S3Response.put_object

    def ignoring(self, *args, **kwargs):
        headers = Headers(self.headers)
        headers.remove("If-None-Match")
        self.headers = headers
        return real(self, *args, **kwargs)

    monkeypatch.setattr(S3Response, "put_object", ignoring)
    url = _url()
    with pytest.raises(SurgeOutputError, match="ignored a conditional create.*Nothing was written"):
        _encode(url, options, counting_encoder)
    assert fs.find(url.removeprefix("s3://")) == []


class _Requests:
    """Counts the S3 calls s3fs makes in this process, by operation."""

    def __init__(self, monkeypatch):
        self.calls: collections.Counter = collections.Counter()
        real = s3fs.S3FileSystem._call_s3

        async def counting(fs, method, *args, **kwargs):
            self.calls[method] += 1
            return await real(fs, method, *args, **kwargs)

        monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counting)


def test_a_superbatch_costs_a_constant_number_of_requests_and_no_list(store, counting_encoder, monkeypatch):
    _, options, _ = store
    requests = _Requests(monkeypatch)
    counts = {}
    for b in (120, 60):  # the same rows in about twice as many SuperBatches
        requests.calls.clear()
        res = _encode(_url(), options, counting_encoder, b_min=b, b_max=b)
        counts[res.superbatches] = dict(requests.calls)
    (few, a), (many, b) = sorted(counts.items())
    per_sb = {op: (b.get(op, 0) - a.get(op, 0)) / (many - few) for op in set(a) | set(b)}
    assert per_sb.get("list_objects_v2", 0) == 0, per_sb  # listing at start and finish only
    assert all(v == int(v) and v >= 0 for v in per_sb.values()), (
        per_sb
    )  # a whole number of each, per SuperBatch
    assert 3 <= sum(per_sb.values()) <= 8, per_sb


# --- clusters whose workers do not see the output -------------------------------------------------------


def _worker(scheduler: str, env: dict, prefix: list[str] = ()) -> subprocess.Popen:
    return subprocess.Popen(
        [
            *prefix,
            sys.executable,
            "-m",
            "distributed.cli.dask_worker",
            scheduler,
            "--nthreads",
            "1",
            "--no-dashboard",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _cluster_with(worker_env: dict, prefix: list[str] = ()):
    from distributed import Client, LocalCluster

    cluster = LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address="127.0.0.1:0")
    client = Client(cluster)
    proc = _worker(cluster.scheduler_address, worker_env, prefix)
    client.wait_for_workers(2, timeout=60)
    return cluster, client, proc


def test_a_worker_without_the_stores_credentials_is_refused_before_any_work(store, counting_encoder):
    endpoint, _, fs = store
    options = {"client_kwargs": {"endpoint_url": endpoint}}  # credentials from the client's environment
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_CONFIG_FILE="/nonexistent",
        AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
        AWS_EC2_METADATA_DISABLED="true",
    )
    cluster, client, proc = _cluster_with(env)
    try:
        url = _url()
        t0 = time.perf_counter()
        with (
            client.as_current(),
            pytest.raises(
                SurgeOutputError,
                match=r"1 worker\(s\) do not see the output.*"
                r"Credentials.*Nothing was encoded",
            ),
        ):
            _encode(url, options, counting_encoder, scheduler=None)
        assert time.perf_counter() - t0 < 20
        assert sum(counting_encoder.calls) <= 1  # at most the model's one-text probe of its dimension
        assert fs.find(url.removeprefix("s3://")) == []
    finally:
        client.close()
        cluster.close()
        proc.kill()
        proc.wait()


def _can_unshare() -> bool:
    return (
        os.geteuid() == 0
        and shutil.which("unshare") is not None
        and subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0
    )


@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare to give a worker its own mounts")
def test_a_worker_that_sees_another_disk_is_refused_within_seconds(tmp_path, counting_encoder):
    """A second 'machine': a worker in its own mount namespace, where the output's parent is an
    empty tmpfs (its own local disk at the same path)."""
    shared = tmp_path / "data"
    shared.mkdir()
    prefix = [
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        f'mount -t tmpfs tmpfs {shared} && exec "$0" "$@"',
    ]
    cluster, client, proc = _cluster_with(dict(os.environ), prefix)
    try:
        out = shared / "emb"
        t0 = time.perf_counter()
        with (
            client.as_current(),
            pytest.raises(
                SurgeOutputError,
                match=r"worker tcp://.* on host .*cannot read "
                r".*Nothing was encoded. Fix: write to a path",
            ),
        ):
            make_partitioned_frame([5, 5]).surge.encode(
                "text", str(out), model=counting_encoder, progress=False
            )
        assert time.perf_counter() - t0 < 20
        assert sum(counting_encoder.calls) <= 1  # at most the model's one-text probe of its dimension
        assert not out.exists() or not [p for p in out.rglob("*") if p.is_file()]  # nothing left behind
    finally:
        client.close()
        cluster.close()
        proc.kill()
        proc.wait()


# --- kill -9 of the CLI and its local cluster, then resume ---------------------------------------------


def _cli(src: str, url: str, model: str, fmt: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "dask_surge.cli",
        "encode",
        src,
        "--text-column",
        "text",
        "--output",
        url,
        "--model",
        model,
        "--b-min",
        "40",
        "--b-max",
        "80",
        "--device",
        "cpu",
        "--no-progress",
        "--keep",
        "doc_id",
        "--format",
        fmt,
    ]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["parquet", "csv"])  # planned (sizes from footers) and streamed
def test_kill_the_cli_and_its_cluster_then_resume_on_s3(store, tmp_path, tiny_model, fmt):
    endpoint, options, fs = store
    src = tmp_path / "in"
    write_partitioned_parquet(src, SIZES, seed=5)
    if fmt == "csv":
        for f in sorted(src.glob("*.parquet")):
            pd.read_parquet(f).to_csv(f.with_suffix(".csv"), index=False)
            f.unlink()
    src_glob = str(src / f"*.{fmt}")
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint}
    clean = _url()
    subprocess.run(_cli(src_glob, clean, tiny_model, fmt), env=env, check=True, capture_output=True)
    reference = dask_surge.read_embeddings(clean, storage_options=options).compute(scheduler="sync")
    reference = reference.sort_values("doc_id").reset_index(drop=True)
    trials = 13 if FULL else 2
    rng = random.Random(fmt)
    for _ in range(trials):
        url = _url()
        for _kill in range(rng.choice([1, 2])):
            proc = subprocess.Popen(
                _cli(src_glob, url, tiny_model, fmt),
                env=env,
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(rng.uniform(4.0, 12.0))
            os.killpg(proc.pid, signal.SIGKILL)  # the CLI and its cluster's processes at once
            proc.wait()
        done = subprocess.run(_cli(src_glob, url, tiny_model, fmt), env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        _exactly_once(url, options, fs, reference)


def test_a_prefix_with_foreign_objects_or_the_inputs_prefix_is_refused(store, counting_encoder, tmp_path):
    import dask.dataframe as dd

    _, options, fs = store
    url = _url()
    key = f"{url.removeprefix('s3://')}/notes.txt"
    fs.pipe_file(key, b"mine")
    with pytest.raises(SurgeOutputError, match="did not write.*Nothing was written"):
        _encode(url, options, counting_encoder)
    assert fs.find(url.removeprefix("s3://")) == [key] and fs.cat(key) == b"mine"
    src = _url()
    local = tmp_path / "in"
    write_partitioned_parquet(local, [5, 5], seed=1)
    fs.put(f"{local}/", f"{src.removeprefix('s3://')}/", recursive=True)
    before = sorted(fs.find(src.removeprefix("s3://")))
    frame = dd.read_parquet(src, storage_options=options)
    with pytest.raises(SurgeOutputError, match="inside the input directory"):
        frame.surge.encode(
            "text",
            f"{src}/emb",
            model=counting_encoder,
            storage_options=options,
            scheduler="sync",
            progress=False,
        )
    assert sorted(fs.find(src.removeprefix("s3://"))) == before


def test_reuse_of_an_output_on_the_store_copies_every_row(store, reference):
    """``reuse=`` of an output on the store, with the store's ``storage_options``: every text is found
    there, nothing is encoded again (the index is built under the old output's ``_surge/index``)."""
    endpoint, options, fs = store
    old = _url()
    _encode(old, options, CountingEncoder())
    model = CountingEncoder()
    new = _url()
    res = _encode(new, options, model, reuse=[old])
    assert (res.reused, res.encoded) == (N, 0)
    assert fs.glob(f"{old.removeprefix('s3://')}/_surge/index/*/meta.json")
    _exactly_once(new, options, fs, reference=reference)


def test_a_prefix_holding_only_a_folder_marker_is_empty(store, counting_encoder):
    # issue 60.7: the zero-byte "folder/" object the S3 console creates was refused as a foreign entry
    _, options, fs = store
    url = _url()
    fs.pipe_file(f"{url.removeprefix('s3://')}/", b"")
    assert OutputStore.open(url, options).listdir(url.removeprefix("s3://")) == []
    res = _encode(url, options, counting_encoder)
    assert res.rows == N and sorted(_glob(url, fs)) == sorted(
        _exactly_once(url, options, fs)[["partition", "row"]].itertuples(index=False, name=None)
    )


def test_an_object_store_location_is_normalised_and_a_glob_name_refused(store, counting_encoder):
    _, options, fs = store
    url = _url()
    res = _encode(url.replace("s3://emb/", "s3://emb//") + "/", options, counting_encoder)
    assert res.rows == N and len(_glob(url, fs)) == N  # written under the normalised prefix
    with pytest.raises(SurgeOutputError, match="take for a pattern"):
        _encode(url + "[1]", options, counting_encoder)
    assert not fs.exists(url.removeprefix("s3://") + "[1]")
