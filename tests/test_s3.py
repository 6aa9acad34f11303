"""Input on S3, through a loopback S3 server (moto's): the accessor with ``storage_options``
and the CLI with the endpoint in the environment, killed mid-run and resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import dask_surge
from dask_surge import SurgeOutputError
from dask_surge.io.manifest import current_run
from dask_surge.io.store import OutputStore
from dask_surge.synthetic import lognormal_sizes, write_partitioned_parquet
from dask_surge.testing import loopback_s3

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
SIZES = [int(s) for s in lognormal_sizes(1500, 30, seed=3)]
N = sum(SIZES)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """``(endpoint, storage_options, s3fs filesystem)`` of a moto S3 server on 127.0.0.1 holding
    bucket ``surge`` with ``in/`` (``SIZES`` rows in Parquet files, ``doc_id`` 0..N-1)."""
    import s3fs

    with loopback_s3("surge") as (endpoint, options, _):
        # the filesystem instance dask's readers get for these options (fsspec caches instances), so
        # that objects the tests change drop out of the listings those readers cached
        fs = s3fs.S3FileSystem(**options)
        local = tmp_path_factory.mktemp("s3-input") / "in"
        write_partitioned_parquet(local, SIZES, seed=5)
        fs.put(f"{local}/", "surge/in/", recursive=True)
        yield endpoint, options, fs


def _doc_ids(path) -> list[int]:
    return sorted(dask_surge.read_embeddings(str(path)).compute().doc_id.tolist())


def _arrow_s3(endpoint: str):
    import pyarrow.fs as pafs

    return pafs.S3FileSystem(
        endpoint_override=endpoint,
        scheme="http",
        access_key="testing",
        secret_key="testing",
        region="us-east-1",
    )


@pytest.mark.parametrize("how", ["storage_options", "pyarrow filesystem"])
def test_s3_input_with_its_endpoint_given_to_read_parquet(tmp_path, s3, tiny_model, client, how):
    """The endpoint in ``storage_options``, or a ``pyarrow.fs.S3FileSystem`` as ``filesystem=``."""
    import dask.dataframe as dd

    endpoint, options, fs = s3
    out = tmp_path / "emb"
    reader = {"storage_options": options} if how == "storage_options" else {"filesystem": _arrow_s3(endpoint)}

    def run():
        ddf = dd.read_parquet("s3://surge/in/", **reader)
        return ddf.surge.encode(
            "text", output=str(out), model=tiny_model, keep=["doc_id"], b_max=200, progress=False
        )

    first = run()
    assert first.rows == N
    assert _doc_ids(out) == list(range(N))
    again = run()  # the same objects: everything is already committed
    assert again.skipped_superbatches == first.superbatches
    before = sorted(p.name for p in out.iterdir())

    fs.copy("surge/in/part-00000.parquet", "surge/kept/part-00000.parquet")
    fs.copy("surge/in/part-00001.parquet", "surge/in/part-00000.parquet")  # one object changes
    try:
        with pytest.raises(SurgeOutputError, match="already holds a different run"):
            run()
    finally:  # the module's other test reads the original objects
        fs.copy("surge/kept/part-00000.parquet", "surge/in/part-00000.parquet")
    assert sorted(p.name for p in out.iterdir()) == before
    assert _doc_ids(out) == list(range(N))  # the refused run touched nothing


def _cli(out, model) -> list[str]:
    return [
        sys.executable,
        "-m",
        "dask_surge.cli",
        "encode",
        "s3://surge/in/",
        "--text-column",
        "text",
        "--output",
        str(out),
        "--model",
        model,
        "--b-min",
        "40",
        "--b-max",
        "120",
        "--device",
        "cpu",
        "--scheduler",
        "threads",
        "--no-progress",
        "--keep",
        "doc_id",
        "--json",
    ]


def _committed(out) -> int:
    try:
        return len(current_run(OutputStore.open(str(out))).committed())
    except Exception:  # noqa: BLE001 - no manifest yet, or one being written
        return 0


@pytest.mark.slow  # a CLI kill-and-resume trial (14 s): those run in the slow leg (.ci/run)
def test_cli_s3_input_killed_mid_run_resumes_exactly(tmp_path, s3, tiny_model):
    endpoint, _, _ = s3
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint}  # how the CLI (s3fs, boto) is pointed at a store
    clean = tmp_path / "clean"
    subprocess.run(_cli(clean, tiny_model), env=env, check=True, capture_output=True)
    reference = dask_surge.read_embeddings(str(clean)).compute().sort_values("doc_id")

    out = tmp_path / "killed"
    proc = subprocess.Popen(
        _cli(out, tiny_model), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    while proc.poll() is None and _committed(out) == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)  # after its first commit, before its last (it has 20+)
    proc.wait()
    killed_at = _committed(out)
    assert 0 < killed_at < len(current_run(OutputStore.open(str(clean))).committed())

    done = subprocess.run(_cli(out, tiny_model), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert summary["rows"] == N and summary["skipped_superbatches"] == killed_at
    resumed = dask_surge.read_embeddings(str(out)).compute().sort_values("doc_id")
    assert resumed.doc_id.tolist() == list(range(N))
    np.testing.assert_array_equal(
        np.stack(resumed.embedding.to_numpy()), np.stack(reference.embedding.to_numpy())
    )
