"""What a written run tells before any worker starts (dask_surge.execution.preflight)."""

from __future__ import annotations

import logging

import dask.dataframe as dd
import pandas as pd
import pytest

import dask_surge
from dask_surge.errors import SurgeOutputError
from dask_surge.execution.preflight import IN_PROCESS_ROWS, runs_in_process
from dask_surge.testing import CountingEncoder, write_partitioned_parquet


@pytest.fixture
def no_client(monkeypatch):
    """encode() sees no active Client (as in a fresh script), whatever earlier tests left current."""
    from dask_surge import api

    monkeypatch.setattr(api, "_active_client", lambda: None)


def _cluster_started(caplog) -> bool:
    return any("started LocalCluster" in r.getMessage() for r in caplog.records)


def test_checks_that_need_no_worker_fail_before_workers_start(tmp_path, caplog, no_client):
    """'output inside input', 'other files in output' and 'a different run' failed only after
    16-18 s of starting workers. An input too large to run in this process shows it: the error
    comes and no cluster was started."""
    src = tmp_path / "in"
    write_partitioned_parquet(src, [IN_PROCESS_ROWS // 2 + 1] * 2)
    ddf = dd.read_parquet(str(src))
    assert runs_in_process(ddf, "text") is None  # would start a local cluster
    caplog.set_level(logging.WARNING, logger="dask_surge")
    with pytest.raises(SurgeOutputError):
        dask_surge.encode(ddf, "text", str(src / "emb"), model=CountingEncoder(), progress=False)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(SurgeOutputError, match="did not write"):
        dask_surge.encode(ddf, "text", str(other), model=CountingEncoder(), progress=False)
    assert not _cluster_started(caplog)


def test_a_different_run_is_refused_before_workers_start(tmp_path, caplog, no_client):
    small, large = tmp_path / "small", tmp_path / "large"
    write_partitioned_parquet(small, [3, 2])
    write_partitioned_parquet(large, [IN_PROCESS_ROWS // 2 + 1] * 2, seed=4)
    out = str(tmp_path / "emb")
    dask_surge.encode(
        dd.read_parquet(str(small)), "text", out, model=CountingEncoder(), scheduler="sync", progress=False
    )
    caplog.set_level(logging.WARNING, logger="dask_surge")
    with pytest.raises(SurgeOutputError, match="already holds a different run.*overwrite=True"):
        dask_surge.encode(dd.read_parquet(str(large)), "text", out, model=CountingEncoder(), progress=False)
    assert not _cluster_started(caplog)


def test_a_complete_output_answers_without_starting_workers(tmp_path, caplog, no_client):
    """A rerun of a complete run took 17 s and printed '0 texts/s, first output after n/a'."""
    src = tmp_path / "in"
    write_partitioned_parquet(src, [IN_PROCESS_ROWS // 2 + 1] * 2)
    out = str(tmp_path / "emb")
    ddf = dd.read_parquet(str(src))
    first = dask_surge.encode(ddf, "text", out, model=CountingEncoder(), scheduler="sync", progress=False)
    caplog.set_level(logging.WARNING, logger="dask_surge")
    encoder = CountingEncoder()
    again = dask_surge.encode(ddf, "text", out, model=encoder, progress=False)
    assert not _cluster_started(caplog) and again.records == ()
    assert again.nothing_to_do and again.rows == first.rows
    assert str(again).startswith(f"complete: {first.rows:,} rows in {first.superbatches:,} SuperBatches")


def test_a_small_input_runs_in_this_process(tmp_path, caplog, no_client):
    src = tmp_path / "in"
    write_partitioned_parquet(src, [30, 20])
    ddf = dd.read_parquet(str(src))
    assert runs_in_process(ddf, "text") == 50
    caplog.set_level(logging.WARNING, logger="dask_surge")
    result = dask_surge.encode(ddf, "text", str(tmp_path / "emb"), model=CountingEncoder(), progress=False)
    assert result.rows == 50 and not _cluster_started(caplog)
    assert any("50 rows: encoding in this process" in r.getMessage() for r in caplog.records)


def test_inputs_of_unknown_rows_are_judged_by_their_files(tmp_path):
    from dask_surge.execution.preflight import IN_PROCESS_BYTES, small_files

    small = tmp_path / "p0.csv"
    pd.DataFrame({"text": ["a b c"] * 10}).to_csv(small, index=False)
    big = tmp_path / "big.csv"
    big.write_text("text\n" + ("x" * 1000 + "\n") * (IN_PROCESS_BYTES // 1000 + 1))
    assert small_files([str(small)]) and not small_files([str(small), str(big)])
    assert not small_files([str(tmp_path / "missing.csv")]) and not small_files([])
    assert runs_in_process(dd.read_csv(str(small)), "text") is None  # rows not known ahead
    assert runs_in_process(dd.from_pandas(pd.DataFrame({"text": ["a"] * 5}), npartitions=1), "text") == 5


def test_the_cli_runs_a_few_small_csv_files_in_this_process(tmp_path, capsys, no_client):
    from dask_surge.cli import main

    src = tmp_path / "in"
    src.mkdir()
    for i in range(3):
        pd.DataFrame({"text": [f"text {i} {j}" for j in range(4)]}).to_csv(src / f"p{i}.csv", index=False)
    assert (
        main(
            [
                "encode",
                str(src),
                "--text-column",
                "text",
                "--output",
                str(tmp_path / "o"),
                "--model",
                "default",
                "--device",
                "cpu",
                "--no-progress",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert (
        "a small input: encoding in this process" in captured.err
        and "started LocalCluster" not in captured.err
    )
    assert "12 rows" in captured.out
