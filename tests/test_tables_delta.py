"""Delta Lake table output (``format="delta"``): every row exactly once in the table, its own history
(``commitInfo``) naming each SuperBatch once, whatever kills the process and whoever else writes the table."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

import dask_surge
from dask_surge import SurgeOutputError
from dask_surge.io.tables import RUN_PROPERTY, SUPERBATCHES_PROPERTY
from dask_surge.testing import (
    TABLE_PARTITIONS,
    TABLE_ROWS,
    after_first_table_commit,
    checksum_model,
    numbered_frame,
    table_driver,
    table_encode,
)

deltalake = pytest.importorskip("deltalake")

N, NPART = TABLE_ROWS, TABLE_PARTITIONS


def _encode(out, ddf=None, **kw):
    return table_encode(out, "delta", ddf, **kw)


def _superbatches(out, options=None) -> list[str]:
    history = deltalake.DeltaTable(str(out), storage_options=options).history()
    return [
        sb for h in history if RUN_PROPERTY in h for sb in json.loads(h.get(SUPERBATCHES_PROPERTY) or "[]")
    ]


def _rows(out, options=None) -> pd.DataFrame:
    df = deltalake.DeltaTable(str(out), storage_options=options).to_pandas()
    return df.sort_values(["partition", "row"]).reset_index(drop=True)


def _check_once(out, n: int = N, options=None) -> pd.DataFrame:
    df = _rows(out, options)
    assert sorted(df.doc_id.tolist()) == list(range(n))
    sbs = _superbatches(out, options)
    assert len(sbs) == len(set(sbs))
    return df


def test_delta_output_holds_every_row_once_with_the_parquet_columns(tmp_path):
    res = _encode(tmp_path / "t.delta")
    df = _check_once(tmp_path / "t.delta")
    ref = numbered_frame(N, NPART).surge.encode(
        "text",
        output=str(tmp_path / "pq"),
        model=checksum_model,
        keep=["doc_id"],
        b_min=100,
        b_max=200,
        scheduler="threads",
        progress=False,
    )
    pq = (
        dask_surge.read_embeddings(ref.output)
        .compute()
        .sort_values(["partition", "row"])
        .reset_index(drop=True)
    )
    assert list(df.columns) == list(pq.columns)
    assert np.array_equal(np.stack(df.embedding), np.stack(pq.embedding))
    assert sorted(_superbatches(tmp_path / "t.delta")) == sorted(r.sb for r in res.records)
    dt = deltalake.DeltaTable(str(tmp_path / "t.delta"))
    assert dt.transaction_version(f"dask-surge-{res.run_id}") is not None  # the idempotent-transaction action
    before = dt.version()
    assert _encode(tmp_path / "t.delta").resumed
    assert deltalake.DeltaTable(str(tmp_path / "t.delta")).version() == before


def test_a_foreign_delta_table_is_refused_unless_mode_append(tmp_path):
    out = tmp_path / "t.delta"
    first = _encode(out, ddf=numbered_frame(300, 3, offset=N))
    deltalake.write_deltalake(str(out), _rows(out).head(0), mode="append")  # another writer, no rows
    with pytest.raises(SurgeOutputError, match=r"already holds a different run"):
        _encode(out)
    res = _encode(out, mode="append")
    assert sorted(_rows(out).doc_id.tolist()) == list(range(N + 300))
    assert sorted(_superbatches(out)) == sorted([r.sb for r in first.records] + [r.sb for r in res.records])


def _after_first_commit(monkeypatch, action):
    after_first_table_commit(monkeypatch, "delta", lambda table: action(table.location.uri))


def test_an_append_by_someone_else_is_merged_and_a_delete_stops_the_run(tmp_path, monkeypatch):
    import dask

    def append(uri):
        deltalake.write_deltalake(
            uri, deltalake.DeltaTable(uri).to_pyarrow_table().slice(0, 5), mode="append"
        )

    _after_first_commit(monkeypatch, append)
    with dask.config.set({"surge.table-commit-every": 2}):
        _encode(tmp_path / "a.delta", b_min=50, b_max=100)
    counts = _rows(tmp_path / "a.delta").doc_id.value_counts()
    assert set(counts.index) == set(range(N)) and (counts > 1).sum() == 5 and counts.max() == 2
    monkeypatch.undo()

    _after_first_commit(monkeypatch, lambda uri: deltalake.DeltaTable(uri).delete("row = 0"))
    with (
        dask.config.set({"surge.table-commit-every": 1}),
        pytest.raises(SurgeOutputError, match=r"was changed by another writer .*DELETE"),
    ):
        _encode(tmp_path / "d.delta", b_min=50, b_max=100)


def _run(out, kill_after: int = 0, options=None):
    env = {**os.environ, "DASK_SURGE__TABLE_COMMIT_EVERY": "2"}
    return subprocess.run(
        table_driver(out, "delta", kill_after=kill_after, options=options),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The rows of an undisturbed run of the driver."""
    out = tmp_path_factory.mktemp("delta-clean") / "clean.delta"
    done = _run(out)
    assert done.returncode == 0, done.stderr[-3000:]
    return _rows(out)


@pytest.mark.parametrize("k", [1, 2])
def test_killed_right_after_a_delta_commit_a_rerun_never_commits_twice(tmp_path, k, clean):
    out = tmp_path / "t.delta"
    killed = _run(out, k)
    assert killed.returncode == -signal.SIGKILL
    done = _run(out)
    assert done.returncode == 0, done.stderr[-3000:]
    df = _check_once(out)
    assert np.array_equal(np.stack(df.embedding), np.stack(clean.embedding))


def test_delta_on_loopback_s3_killed_right_after_a_commit(tmp_path):
    pytest.importorskip("moto.server")
    from dask_surge.io.tables.locations import object_store_options
    from dask_surge.testing import loopback_s3

    with loopback_s3("surge-delta") as (_, options, _fs):
        out = "s3://surge-delta/t.delta"
        killed = _run(out, 1, options)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        done = _run(out, 0, options)
        assert done.returncode == 0, done.stderr[-3000:]
        # read in another process: deltalake holds the GIL while it waits on the server in this one
        check = subprocess.run(
            [sys.executable, "-c", CHECK, out, json.dumps(object_store_options(out, options))],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert check.returncode == 0, check.stderr[-3000:]
        ids, sbs = json.loads(check.stdout)
        assert sorted(ids) == list(range(N)) and len(sbs) == len(set(sbs))


CHECK = """
import json, sys
import deltalake
dt = deltalake.DeltaTable(sys.argv[1], storage_options=json.loads(sys.argv[2]))
sbs = [sb for h in dt.history() if "dask-surge.run" in h for sb in json.loads(h.get("dask-surge.superbatches") or "[]")]
print(json.dumps([dt.to_pandas().doc_id.tolist(), sbs]))
"""
