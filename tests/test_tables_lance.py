"""Lance table output (``format="lance"``): every row exactly once in the table, the table's own
history naming each SuperBatch once, whatever kills the process and whoever else writes the table."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest

import dask_surge
from dask_surge import SurgeOutputError, SurgeValueError
from dask_surge.errors import SurgeError
from dask_surge.io.tables import RUN_PROPERTY, SUPERBATCHES_PROPERTY, require
from dask_surge.testing import (
    TABLE_PARTITIONS,
    TABLE_ROWS,
    after_first_table_commit,
    checksum_model,
    numbered_frame,
    table_driver,
    table_encode,
)

lance = pytest.importorskip("lance")

N, NPART = TABLE_ROWS, TABLE_PARTITIONS


def _encode(out, ddf=None, **kw):
    return table_encode(out, "lance", ddf, **kw)


def _history(out) -> list[tuple[int, str, dict]]:
    ds = lance.dataset(str(out))
    rows = []
    for v in ds.versions():
        txn = ds.read_transaction(v["version"])
        rows.append((v["version"], type(txn.operation).__name__, txn.transaction_properties or {}))
    return rows


def _commits(out) -> list[list[str]]:
    """The SuperBatches of each version that holds any (a claim holder's fence holds none)."""
    return [sbs for _, _, p in _history(out) if (sbs := json.loads(p.get(SUPERBATCHES_PROPERTY, "[]")))]


def _superbatches(out, run: str | None = None) -> list[str]:
    """Every SuperBatch key the table's versions name (of ``run``, or of any run)."""
    return [
        sb
        for _, _, p in _history(out)
        if RUN_PROPERTY in p and (run is None or p[RUN_PROPERTY] == run)
        for sb in json.loads(p[SUPERBATCHES_PROPERTY])
    ]


def _rows(out) -> pd.DataFrame:
    return (
        lance.dataset(str(out))
        .to_table()
        .to_pandas()
        .sort_values(["partition", "row"])
        .reset_index(drop=True)
    )


def _check_once(out, n: int = N) -> pd.DataFrame:
    df = _rows(out)
    assert sorted(df.doc_id.tolist()) == list(range(n))  # every row, exactly once
    sbs = _superbatches(out)
    assert len(sbs) == len(set(sbs))  # no SuperBatch twice in the table's history
    return df


def test_lance_output_holds_every_row_once_with_the_parquet_columns(tmp_path):
    res = _encode(tmp_path / "t.lance")
    df = _check_once(tmp_path / "t.lance")
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
    assert list(df.columns) == list(pq.columns)  # partition, row, kept columns, text_hash, embedding
    assert np.array_equal(np.stack(df.embedding), np.stack(pq.embedding))
    assert df.text_hash.tolist() == pq.text_hash.tolist()
    schema = lance.dataset(str(tmp_path / "t.lance")).schema
    assert str(schema.field("embedding").type) == "fixed_size_list<item: float>[2]"
    assert sorted(_superbatches(tmp_path / "t.lance", res.run_id)) == sorted(r.sb for r in res.records)
    # a rerun of the complete run changes nothing: no new version
    before = lance.dataset(str(tmp_path / "t.lance")).version
    again = _encode(tmp_path / "t.lance")
    assert again.resumed and lance.dataset(str(tmp_path / "t.lance")).version == before


def test_commits_are_batched_by_count_and_the_first_superbatch_goes_alone(tmp_path):
    import dask

    with dask.config.set({"surge.table-commit-every": 3, "surge.table-commit-seconds": 3600}):
        res = _encode(tmp_path / "t.lance", b_min=50, b_max=100)
    versions = _commits(tmp_path / "t.lance")
    assert res.superbatches >= 9
    assert len(versions[0]) == 1  # the first SuperBatch's rows are readable at once
    assert all(1 <= len(v) <= 3 for v in versions)
    assert len(versions) < res.superbatches  # fewer versions than SuperBatches
    _check_once(tmp_path / "t.lance")


def test_a_table_this_run_did_not_create_is_refused_unless_mode_append(tmp_path):
    out = tmp_path / "t.lance"
    _encode(out, ddf=numbered_frame(300, 3, offset=N))  # another run (other input) made the table
    with pytest.raises(SurgeOutputError, match=r"already holds a different run"):
        _encode(out)
    assert len(_rows(out)) == 300  # untouched
    res = _encode(out, mode="append")
    df = _rows(out)
    assert sorted(df.doc_id.tolist()) == list(range(N + 300))  # both runs' rows, each once
    assert sorted(_superbatches(out, res.run_id)) == sorted(r.sb for r in res.records)


def test_append_to_a_foreign_table_needs_the_same_columns(tmp_path):
    out = tmp_path / "t.lance"
    lance.write_dataset(__import__("pyarrow").table({"x": [1, 2, 3]}), str(out))
    with pytest.raises(SurgeOutputError, match="did not create"):
        _encode(out)
    with pytest.raises(SurgeOutputError, match="has columns"):
        _encode(out, mode="append")
    assert lance.dataset(str(out)).to_table().column("x").to_pylist() == [1, 2, 3]


def test_a_directory_with_other_files_is_refused(tmp_path):
    out = tmp_path / "t.lance"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SurgeOutputError, match=r"notes\.txt"):
        _encode(out)
    assert (out / "notes.txt").read_text() == "mine"


def test_format_options_are_checked_before_any_work(tmp_path):
    with pytest.raises(SurgeValueError, match=r"format='orc' is not an output format"):
        _encode(tmp_path / "t", format="orc")
    with pytest.raises(SurgeValueError, match="overwrite=True is for Parquet"):
        _encode(tmp_path / "t", overwrite=True)
    with pytest.raises(SurgeValueError, match="mode='append' adds rows to a table"):
        _encode(tmp_path / "t", format="parquet", mode="append")


def test_a_missing_package_names_the_extra(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_lance(name, *args, **kwargs):
        if name == "lance" or name.startswith("lance."):
            raise ImportError("No module named 'lance'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_lance)
    monkeypatch.delitem(sys.modules, "lance", raising=False)
    with pytest.raises(SurgeError, match=r'pip install "dask-surge\[lance\]"'):
        require("lance")


# -- other writers during the run: appends merged, anything else refused -----------------------


def _after_first_commit(monkeypatch, action):
    """Run ``action(table_uri)`` once, right after the run's first table commit (a test hook)."""
    return after_first_table_commit(monkeypatch, "lance", lambda table: action(table.location.uri))


def test_an_append_by_someone_else_during_the_run_is_merged(tmp_path, monkeypatch):
    def append(uri):
        ds = lance.dataset(uri)
        extra = ds.to_table().slice(0, 5)  # rows of another writer (same columns)
        lance.write_dataset(extra, uri, mode="append")

    _after_first_commit(monkeypatch, append)
    with __import__("dask").config.set({"surge.table-commit-every": 2}):
        _encode(tmp_path / "t.lance", b_min=50, b_max=100)
    df = _rows(tmp_path / "t.lance")
    assert len(df) == N + 5
    ours = list(_superbatches(tmp_path / "t.lance"))
    assert len(ours) == len(set(ours))
    counts = df.doc_id.value_counts()
    assert set(counts.index) == set(range(N)) and (counts > 1).sum() == 5  # theirs beside ours, ours once


def test_a_delete_by_someone_else_during_the_run_stops_it(tmp_path, monkeypatch):
    def delete(uri):
        lance.dataset(uri).delete("row = 0")

    _after_first_commit(monkeypatch, delete)
    with (
        __import__("dask").config.set({"surge.table-commit-every": 1}),
        pytest.raises(SurgeOutputError, match=r"was changed by another writer .*version 3: Delete"),
    ):
        _encode(tmp_path / "t.lance", b_min=50, b_max=100)
    monkeypatch.undo()
    with pytest.raises(SurgeOutputError, match="Delete"):  # and a rerun refuses the table
        _encode(tmp_path / "t.lance", b_min=50, b_max=100)


# -- kills: the client killed anywhere, also between the table commit and anything after it ------


def _driver(out, kill_after_commits: int = 0) -> list[str]:
    return table_driver(out, "lance", kill_after=kill_after_commits, sleep=0.05)


def _env() -> dict:
    return {**os.environ, "DASK_SURGE__TABLE_COMMIT_EVERY": "2"}


def _resume_and_check(out, reference: pd.DataFrame) -> None:
    done = subprocess.run(_driver(out), env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    df = _check_once(out)
    assert np.array_equal(np.stack(df.embedding), np.stack(reference.embedding))  # as an undisturbed run


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("clean") / "t.lance"
    done = subprocess.run(_driver(out), env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return _check_once(out)


@pytest.mark.parametrize("k", [1, 2])
def test_killed_right_after_a_table_commit_a_rerun_never_commits_twice(tmp_path, reference, k):
    """The process dies between the table commit and anything it would record after it."""
    out = tmp_path / "t.lance"
    killed = subprocess.run(_driver(out, k), env=_env(), capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL
    assert len(_commits(out)) == k  # the commits it made are in the table
    _resume_and_check(out, reference)


def test_client_killed_mid_run_resumes_every_row_once(tmp_path, reference):
    out = tmp_path / "t.lance"
    proc = subprocess.Popen(_driver(out), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (out / "_versions").exists():
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    _resume_and_check(out, reference)


def test_two_runs_racing_on_one_table(tmp_path, reference):
    """Two processes of the same run at once: one claims the table, the other is refused or finds it
    done; a different run at once is refused. Either way no row and no SuperBatch twice."""
    out = tmp_path / "t.lance"
    procs = [
        subprocess.Popen(_driver(out), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    codes = [p.returncode for p in procs]
    assert 0 in codes, results
    for code, (_, err) in zip(codes, results):
        assert code == 0 or "claim" in err.lower() or "being written" in err.lower(), err[-2000:]
    if codes.count(0) == 1:
        _resume_and_check(out, reference)
    df = _check_once(out)
    assert np.array_equal(np.stack(df.embedding), np.stack(reference.embedding))


def test_the_format_reaches_encode_from_the_config_and_the_cli(tmp_path, tiny_model):
    import dask

    with dask.config.set({"surge.format": "lance"}):
        res = numbered_frame(200, 2).surge.encode(
            "text",
            output=str(tmp_path / "c.lance"),
            model=checksum_model,
            scheduler="threads",
            progress=False,
        )
    assert lance.dataset(str(tmp_path / "c.lance")).count_rows() == res.rows == 200
    from dask_surge.cli import main

    src = tmp_path / "in.parquet"
    numbered_frame(50, 1).compute().to_parquet(src)
    code = main(
        [
            "encode",
            str(src),
            "--output",
            str(tmp_path / "cli.lance"),
            "--output-format",
            "lance",
            "--format",
            "parquet",
            "--text-column",
            "text",
            "--model",
            str(tiny_model),
            "--scheduler",
            "threads",
            "--no-progress",
        ]
    )
    assert code == 0
    assert lance.dataset(str(tmp_path / "cli.lance")).count_rows() == 50


def test_read_embeddings_points_a_table_output_to_its_reader(tmp_path):
    _encode(tmp_path / "t.lance", ddf=numbered_frame(100, 1))
    with pytest.raises(dask_surge.SurgeInputError, match=r"lance\.dataset"):
        dask_surge.read_embeddings(str(tmp_path / "t.lance"))
    assert dask_surge.status(str(tmp_path / "t.lance"))["state"] == "complete"
