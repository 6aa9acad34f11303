"""Reading a SuperBatch's Parquet input: one Arrow scan for local whole files, file by file otherwise."""

from __future__ import annotations

import fsspec
import pandas as pd
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from dask_surge.errors import SurgeInputError
from dask_surge.io.parquet import ParquetPartitions, scan_files
from dask_surge.planning.sizes import parquet_footer_sizes


def _write(path, **columns) -> str:
    pq.write_table(pa.table(columns), str(path), row_group_size=3)
    return str(path)


@pytest.fixture
def files(tmp_path):
    sizes = [5, 0, 7, 1, 11]
    paths, start = [], 0
    for i, n in enumerate(sizes):
        rows = list(range(start, start + n))
        paths.append(
            _write(
                tmp_path / f"part.{i}.parquet",
                text=pa.array([f"t{r}" for r in rows], pa.string()),
                doc_id=pa.array(rows, pa.int64()),
            )
        )
        start += n
    return paths, sizes


def test_one_scan_returns_each_file_whole_and_in_order(files):
    paths, sizes = files
    tables = scan_files(pafs.LocalFileSystem(), paths, ["text", "doc_id"])
    assert [t.num_rows for t in tables] == sizes
    for path, table in zip(paths, tables):
        assert table.equals(pq.read_table(path, columns=["text", "doc_id"]))


def test_files_that_do_not_fit_one_scan_are_left_to_the_file_by_file_read(tmp_path, files):
    paths, _ = files
    local = pafs.LocalFileSystem()
    other_type = _write(tmp_path / "large.parquet", text=pa.array(["x"], pa.large_string()), doc_id=[99])
    no_text = _write(tmp_path / "notext.parquet", doc_id=[100])
    assert scan_files(local, [paths[0], other_type], ["text"]) is None  # a scan would cast
    assert scan_files(local, [paths[0], no_text], ["text"]) is None  # a scan would fill nulls
    reader = ParquetPartitions(
        fsspec.filesystem("file"), {0: (paths[0], None), 1: (no_text, None)}, ("text",), (("text", "string"),)
    )
    with pytest.raises(SurgeInputError, match="has no column 'text'"):  # not a partition of nulls
        list(reader.iterate([0, 1], []))


def test_local_scan_and_fsspec_reads_give_the_same_partitions(files, tmp_path):
    paths, sizes = files
    memory = fsspec.filesystem("memory")
    for i, path in enumerate(paths):
        memory.pipe(f"/surge-test/{i}.parquet", open(path, "rb").read())
    dtypes = (("text", "string"), ("doc_id", "int64"))
    local = ParquetPartitions(
        fsspec.filesystem("file"), {i: (p, None) for i, p in enumerate(paths)}, ("text", "doc_id"), dtypes
    )
    remote = ParquetPartitions(
        memory, {i: (f"/surge-test/{i}.parquet", None) for i in range(len(paths))}, ("text", "doc_id"), dtypes
    )
    order = [4, 0, 1, 3]
    got = list(local.iterate(order, []))
    want = list(remote.iterate(order, []))
    assert [p for p, _ in got] == order and [len(f) for _, f in got] == [sizes[p] for p in order]
    for (_, a), (_, b) in zip(got, want):
        pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True))
    # row-group pieces take the file-by-file read and slice the same rows
    pieces = ParquetPartitions(
        fsspec.filesystem("file"),
        {0: (paths[4], (1, 2)), 1: (paths[4], (0,))},
        ("doc_id",),
        (("doc_id", "int64"),),
    )
    assert [f["doc_id"].tolist() for _, f in pieces.iterate([0, 1], [])] == [
        [16, 17, 18, 19, 20, 21],
        [13, 14, 15],
    ]
    memory.rm("/surge-test", recursive=True)


def test_footer_sizes_from_local_arrow_and_from_fsspec_agree(files, tmp_path):
    import dask.dataframe as dd

    paths, sizes = files
    ddf = dd.read_parquet(str(tmp_path))
    rows, nbytes = parquet_footer_sizes(ddf, "text")
    assert list(rows) == sizes and all(b > 0 for b, n in zip(nbytes, rows) if n)


def test_a_file_without_the_text_column_stops_the_run_instead_of_skipping_its_rows(tmp_path):
    import dask.dataframe as dd
    import numpy as np

    import dask_surge

    data = tmp_path / "in"
    data.mkdir()
    _write(data / "0.parquet", text=["a", "b"], doc_id=[1, 2])
    _write(data / "1.parquet", doc_id=[3])
    with pytest.raises(SurgeInputError, match="1.parquet' has no column 'text'"):
        dd.read_parquet(str(data)).surge.encode(
            "text",
            output=str(tmp_path / "out"),
            on_null="skip",
            model=lambda t: np.ones((len(t), 3)),
            scheduler="sync",
            progress=False,
        )
    with pytest.raises(
        SurgeInputError, match="holds no dask-surge run|has no committed rows"
    ):  # nothing that looks complete
        dask_surge.read_embeddings(str(tmp_path / "out"))


def test_footer_sizes_of_a_projection_of_several_columns(tmp_path):
    """``ddf[[text, doc_id]]`` of files that hold ``doc_id`` first (what ``keep=`` reads) stays a projection
    over the read: its footers give the sizes, and the type check reads the dataset's schema beneath it (it
    raised AttributeError: 'Projection' object has no attribute '_dataset_info')."""
    import dask.dataframe as dd

    for i, n in enumerate([4, 2]):
        _write(
            tmp_path / f"p{i}.parquet", doc_id=pa.array(range(n)), text=pa.array([f"t{r}" for r in range(n)])
        )
    frame = dd.read_parquet(str(tmp_path))[["text", "doc_id"]]
    found = parquet_footer_sizes(frame, "text")
    assert found is not None and list(found[0]) == [4, 2]
