"""Apache Iceberg table output (``format="iceberg"``) through pyiceberg's SQL catalog on SQLite: every row
exactly once in the table, its snapshots' summaries naming each SuperBatch once, whatever kills the process
and whoever else writes the table."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import dask
import numpy as np
import pandas as pd
import pytest

import dask_surge
from dask_surge import SurgeOutputError
from dask_surge.errors import SurgeValueError
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

pyiceberg = pytest.importorskip("pyiceberg")
pytest.importorskip("sqlalchemy")

N, NPART = TABLE_ROWS, TABLE_PARTITIONS


@pytest.fixture
def catalog(iceberg_catalog):
    """A real pyiceberg SQL catalog on SQLite, configured as ``surge.iceberg-catalog`` (see conftest)."""
    return iceberg_catalog


def _encode(out, ddf=None, **kw):
    return table_encode(out, "iceberg", ddf, **kw)


def _snapshots(catalog, name: str = "default.t"):
    table = catalog.load_table(name)
    return sorted(table.metadata.snapshots, key=lambda s: s.sequence_number)


def _superbatches(catalog, name: str = "default.t") -> list[str]:
    props = [dict(s.summary.additional_properties) for s in _snapshots(catalog, name)]
    return [sb for p in props if RUN_PROPERTY in p for sb in json.loads(p.get(SUPERBATCHES_PROPERTY) or "[]")]


def _rows(catalog, name: str = "default.t") -> pd.DataFrame:
    df = catalog.load_table(name).scan().to_pandas()
    return df.sort_values(["partition", "row"]).reset_index(drop=True)


def _check_once(catalog, n: int = N, name: str = "default.t") -> pd.DataFrame:
    df = _rows(catalog, name)
    assert sorted(df.doc_id.tolist()) == list(range(n))
    sbs = _superbatches(catalog, name)
    assert len(sbs) == len(set(sbs))
    return df


def test_iceberg_output_holds_every_row_once_with_the_parquet_columns(tmp_path, catalog):
    res = _encode(tmp_path / "t.iceberg")
    table = catalog.load_table("default.t")
    assert table.location().removeprefix("file://").rstrip("/") == str(tmp_path / "t.iceberg")
    assert table.properties[RUN_PROPERTY] == res.run_id  # the run that created it
    df = _check_once(catalog)
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
    assert df.text_hash.tolist() == pq.text_hash.tolist()
    assert sorted(_superbatches(catalog)) == sorted(r.sb for r in res.records)
    snaps = _snapshots(catalog)
    assert {s.summary.operation.value for s in snaps} == {"append"}
    assert {s.summary.additional_properties[RUN_PROPERTY] for s in snaps} == {res.run_id}
    assert len(snaps) < len(res.records)  # batched: fewer snapshots than SuperBatches
    before = catalog.load_table("default.t").metadata.last_sequence_number
    assert _encode(tmp_path / "t.iceberg").resumed  # a rerun of a complete run commits nothing
    assert catalog.load_table("default.t").metadata.last_sequence_number == before


def test_the_table_identifier_comes_from_the_config_or_the_path(tmp_path, catalog):
    with dask.config.set({"surge.iceberg-table": "search.docs"}):
        _encode(tmp_path / "emb.iceberg", ddf=numbered_frame(200, 2))
    assert sorted(_rows(catalog, "search.docs").doc_id.tolist()) == list(range(200))
    with (  # the name is taken, by a table elsewhere
        dask.config.set({"surge.iceberg-table": "search.docs"}),
        pytest.raises(SurgeOutputError, match=r"'search.docs' lives at .*Fix"),
    ):
        _encode(tmp_path / "other.iceberg", ddf=numbered_frame(200, 2))
    with (
        dask.config.set({"surge.iceberg-table": "docs"}),
        pytest.raises(SurgeValueError, match=r"surge.iceberg-table='docs' .*needs a namespace"),
    ):
        _encode(tmp_path / "x.iceberg", ddf=numbered_frame(200, 2))


def test_a_missing_catalog_is_an_error_naming_the_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.pyiceberg.yaml
    for key in [k for k in os.environ if k.startswith("PYICEBERG_")]:
        monkeypatch.delenv(key)
    with (
        dask.config.set({"surge.iceberg-catalog": None}),
        pytest.raises(SurgeValueError, match=r"surge.iceberg-catalog"),
    ):
        _encode(tmp_path / "t.iceberg", ddf=numbered_frame(100, 1))


def test_a_missing_pyiceberg_is_an_error_naming_the_extra(tmp_path, catalog, monkeypatch):
    from dask_surge.errors import SurgeError

    monkeypatch.setitem(sys.modules, "pyiceberg", None)  # import pyiceberg now raises ImportError
    with pytest.raises(SurgeError, match=r'pip install "dask-surge\[iceberg\]"'):
        _encode(tmp_path / "t.iceberg", ddf=numbered_frame(100, 1))
    assert not (tmp_path / "t.iceberg").exists()


def test_float16_is_refused_and_int8_reads_back_as_the_same_values(tmp_path, catalog):
    with pytest.raises(
        SurgeOutputError, match=r"Iceberg has no 16-bit float .*Fix: pass precision='float32'"
    ):
        _encode(tmp_path / "h.iceberg", ddf=numbered_frame(200, 2), precision="float16")
    assert not catalog.table_exists("default.h")
    with dask.config.set({"surge.iceberg-table": "default.i8"}):
        _encode(tmp_path / "i8.iceberg", ddf=numbered_frame(200, 2), precision="int8", normalize=True)
    ref = numbered_frame(200, 2).surge.encode(
        "text",
        output=str(tmp_path / "pq"),
        model=checksum_model,
        keep=["doc_id"],
        precision="int8",
        normalize=True,
        scheduler="threads",
        progress=False,
    )
    pq = dask_surge.read_embeddings(ref.output).compute().sort_values(["partition", "row"])
    df = _rows(catalog, "default.i8")
    assert np.array_equal(np.stack(df.embedding).astype(np.int64), np.stack(pq.embedding).astype(np.int64))


def test_a_foreign_iceberg_table_is_refused_unless_mode_append(tmp_path, catalog):
    out = tmp_path / "t.iceberg"
    first = _encode(out, ddf=numbered_frame(300, 3, offset=N))
    with pytest.raises(SurgeOutputError, match=r"already holds a different run"):
        _encode(out)
    res = _encode(out, mode="append")
    assert sorted(_rows(catalog).doc_id.tolist()) == list(range(N + 300))
    assert sorted(_superbatches(catalog)) == sorted(
        [r.sb for r in first.records] + [r.sb for r in res.records]
    )

    # a table made by another writer (no _surge/, no snapshot yet): refused, then appended to when asked
    other = tmp_path / "o.iceberg"
    catalog.create_table("default.o", catalog.load_table("default.t").schema(), location=str(other))
    with pytest.raises(SurgeOutputError, match=r"iceberg table that this run did not create .*create"):
        _encode(other, ddf=numbered_frame(200, 2))
    _encode(other, ddf=numbered_frame(200, 2), mode="append")
    assert sorted(_rows(catalog, "default.o").doc_id.tolist()) == list(range(200))


def _after_first_commit(monkeypatch, action):
    after_first_table_commit(
        monkeypatch, "iceberg", lambda table: action(table.catalog().load_table(table.identifier))
    )


def test_an_append_by_someone_else_is_merged_and_a_delete_stops_the_run(tmp_path, catalog, monkeypatch):
    def append(table):
        table.append(table.scan(limit=5).to_arrow())

    _after_first_commit(monkeypatch, append)
    with dask.config.set({"surge.table-commit-every": 2, "surge.iceberg-table": "default.a"}):
        _encode(tmp_path / "a.iceberg", b_min=50, b_max=100)
    counts = _rows(catalog, "default.a").doc_id.value_counts()
    assert set(counts.index) == set(range(N)) and (counts > 1).sum() == 5 and counts.max() == 2
    assert len(set(_superbatches(catalog, "default.a"))) == len(_superbatches(catalog, "default.a"))
    monkeypatch.undo()

    _after_first_commit(monkeypatch, lambda table: table.delete("row = 0"))
    with (
        dask.config.set({"surge.table-commit-every": 1, "surge.iceberg-table": "default.d"}),
        pytest.raises(SurgeOutputError, match=r"was changed by another writer .*(delete|overwrite)"),
    ):
        _encode(tmp_path / "d.iceberg", b_min=50, b_max=100)


def test_a_commit_that_loses_the_catalog_swap_to_another_writer_is_retried_on_top(
    tmp_path, catalog, monkeypatch, caplog
):
    """Another writer's append lands between this run's check of the table's version and the catalog's
    swap: the swap is refused (assert-ref-snapshot-id), pyiceberg does not rebase it, the committer reads
    the history again and commits the batch on top."""
    import logging

    from pyiceberg.table import Transaction

    real, raced = Transaction.add_files, []

    def add_files(self, *args, **kwargs):
        if not raced and len(self._table.metadata.snapshots) >= 2:  # the fence and a first commit: rows to copy
            raced.append(1)
            fresh = catalog.load_table("default.t")
            fresh.append(fresh.scan(limit=3).to_arrow())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Transaction, "add_files", add_files)
    with (
        dask.config.set({"surge.table-commit-every": 2}),
        caplog.at_level(logging.DEBUG, logger="dask_surge"),
    ):
        _encode(tmp_path / "t.iceberg", b_min=50, b_max=100)
    assert raced and "table commit refused" in caplog.text
    counts = _rows(catalog).doc_id.value_counts()
    assert set(counts.index) == set(range(N)) and (counts > 1).sum() == 3 and counts.max() == 2
    sbs = _superbatches(catalog)
    assert len(sbs) == len(set(sbs))


def _run(out, catalog_props, kill_after: int = 0, options=None):
    env = {**os.environ, "DASK_SURGE__TABLE_COMMIT_EVERY": "2"}
    return subprocess.run(
        table_driver(out, "iceberg", kill_after=kill_after, options=options, catalog=catalog_props),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _props(where) -> dict:
    return {"name": "surge-kill", "type": "sql", "uri": f"sqlite:///{where}/catalog.db"}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The rows of an undisturbed run of the driver."""
    from pyiceberg.catalog import load_catalog

    where = tmp_path_factory.mktemp("iceberg-clean")
    done = _run(where / "t.iceberg", _props(where))
    assert done.returncode == 0, done.stderr[-3000:]
    props = _props(where)
    return _rows(load_catalog(props.pop("name"), **props))


@pytest.mark.parametrize("k", [1, 2])
def test_killed_right_after_an_iceberg_commit_a_rerun_never_commits_twice(tmp_path, k, clean):
    from pyiceberg.catalog import load_catalog

    killed = _run(tmp_path / "t.iceberg", _props(tmp_path), k)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    props = _props(tmp_path)
    catalog = load_catalog(props.pop("name"), **props)
    held = [
        s
        for s in _snapshots(catalog)
        if json.loads(s.summary.additional_properties.get(SUPERBATCHES_PROPERTY) or "[]")
    ]
    assert (
        len(held) == k
    )  # the killed process committed k snapshots of SuperBatches (after its fence), recorded none
    done = _run(tmp_path / "t.iceberg", _props(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    df = _check_once(catalog)
    assert np.array_equal(np.stack(df.embedding), np.stack(clean.embedding))


def test_iceberg_on_loopback_s3_killed_right_after_a_commit(tmp_path, clean):
    pytest.importorskip("moto.server")
    from pyiceberg.catalog import load_catalog

    from dask_surge.testing import loopback_s3

    with loopback_s3("surge-iceberg") as (endpoint, options, _fs):
        out = "s3://surge-iceberg/t.iceberg"
        killed = _run(out, _props(tmp_path), 1, options)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        done = _run(out, _props(tmp_path), 0, options)
        assert done.returncode == 0, done.stderr[-3000:]
        props = _props(tmp_path)
        catalog = load_catalog(
            props.pop("name"),
            **props,
            **{"s3.endpoint": endpoint, "s3.access-key-id": "testing", "s3.secret-access-key": "testing"},
        )
        assert catalog.load_table("default.t").location() == out
        df = _check_once(catalog)
        assert np.array_equal(np.stack(df.embedding), np.stack(clean.embedding))
