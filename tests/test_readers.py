"""Reading a run back (:mod:`dask_surge.io.readers`): status, skipped rows, committed embeddings."""

from __future__ import annotations

import pandas as pd
import pytest

import dask_surge
from dask_surge import SurgeInputError, SurgeValueError
from dask_surge.testing import (
    InterruptAfter,
    checksum_model,
    make_partitioned_frame,
    write_partitioned_parquet,
)

SIZES = [4, 9, 2, 6]
KW = {"b_min": 5, "b_max": 8, "scheduler": "sync", "progress": False}


def test_status_of_a_directory_without_a_run_is_empty(tmp_path):
    assert dask_surge.status(str(tmp_path / "none")) == {"output": str(tmp_path / "none"), "state": "empty"}


def test_status_counts_what_an_interrupted_run_committed(tmp_path):
    import dask.dataframe as dd

    write_partitioned_parquet(tmp_path / "in", SIZES)  # sizes from the footers: a planned run
    out, model = str(tmp_path / "o"), InterruptAfter(3)
    with pytest.raises(KeyboardInterrupt):
        dd.read_parquet(tmp_path / "in").surge.encode("text", out, model=model, **KW)
    info = dask_surge.status(out)
    assert info["state"] == "incomplete" and info["mode"] == "planned"
    assert (info["b_min"], info["b_max"]) == (5, 8) and info["partitions_planned"] == len(SIZES)
    # SuperBatches of 4, 8, 1 and 8 rows: the third call of more than one text is the last one
    assert info["superbatches_committed"] == 3 and info["rows_planned"] == sum(SIZES)
    assert info["superbatches_planned"] is None  # known once the run completes
    assert 0 < info["rows_committed"] < sum(SIZES) and info["partitions_committed"] >= 1
    assert info["last_commit"] is not None and info["nulls_skipped"] == 0
    dd.read_parquet(tmp_path / "in").surge.encode("text", out, model=model, **KW)  # its 3rd call is past
    done = dask_surge.status(out)
    assert done["state"] == "complete" and done["rows_committed"] == done["rows_planned"] == sum(SIZES)
    assert (
        done["partitions_committed"] == len(SIZES)
        and done["superbatches_planned"] == done["superbatches_committed"]
    )


def test_status_of_a_streamed_run(tmp_path):
    out = str(tmp_path / "o")
    ddf = make_partitioned_frame(SIZES)  # sizes not known ahead: streamed
    ddf.surge.encode("text", out, model=checksum_model, **KW)
    info = dask_surge.status(out)
    assert info["mode"] == "streaming" and info["state"] == "complete" and info["rows_planned"] == sum(SIZES)


def test_skipped_rows_are_read_from_the_commit_records_sorted(tmp_path):
    out = str(tmp_path / "o")
    frame = pd.DataFrame({"text": ["a", None, "b", None, "c", "d", None]})
    import dask.dataframe as dd

    dd.from_pandas(frame, npartitions=3).surge.encode(
        "text", out, model=checksum_model, on_null="skip", b_min=2, b_max=3, scheduler="sync", progress=False
    )
    skipped = dask_surge.skipped_rows(out)
    assert list(skipped.dtypes) == ["int64", "int64"]
    positions = frame.index[frame.text.isna()].tolist()
    bounds = [0, 3, 5, 7]  # from_pandas: 3 partitions of 7 rows
    want = [[p, i - bounds[p]] for i in positions for p in range(3) if bounds[p] <= i < bounds[p + 1]]
    assert skipped.values.tolist() == want
    clean = str(tmp_path / "clean")
    make_partitioned_frame([3]).surge.encode("text", clean, model=checksum_model, **KW)
    none = dask_surge.skipped_rows(clean)
    assert (
        none.empty and list(none.columns) == ["partition", "row"] and list(none.dtypes) == ["int64", "int64"]
    )


def test_read_embeddings_reads_committed_rows_a_partition_or_columns(tmp_path):
    out = str(tmp_path / "o")
    make_partitioned_frame(SIZES, seed=2).surge.encode(
        "text", out, model=checksum_model, keep=["doc_id"], **KW
    )
    back = dask_surge.read_embeddings(out).compute()
    assert sorted(back.doc_id) == list(range(sum(SIZES)))
    assert str(back.embedding.dtype).startswith("fixed_size_list")
    one = dask_surge.read_embeddings(out, partition=1, columns=["partition", "row"]).compute()
    assert list(one.columns) == ["partition", "row"] and sorted(one.row) == list(range(SIZES[1]))
    assert set(one.partition) == {1}
    with pytest.raises(SurgeInputError, match="no committed rows for partition 9"):
        dask_surge.read_embeddings(out, partition=9)
    with pytest.raises(SurgeValueError, match="backend='nope' is not supported"):
        dask_surge.read_embeddings(out, backend="nope")  # type: ignore[arg-type]
    with pytest.raises(SurgeInputError, match="holds no dask-surge run"):
        dask_surge.read_embeddings(str(tmp_path / "elsewhere"))
