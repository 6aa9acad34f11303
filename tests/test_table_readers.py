"""Every common reader reads every table output, with the vectors as a list or array of float32
(issue 68): the type in the table's own schema is the type of its data files.

Delta and Iceberg have no fixed-size list: their schemas declare ``embedding`` a list of floats, and
the data files hold exactly that (they held ``fixed_size_list``, which polars refused:
``pl.read_delta`` "data type mismatch ... Array(Float32, d) != List(Float32)", ``pl.scan_iceberg``
"failed to resolve Iceberg column mapping"). Lance declares and stores a fixed-size list.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from dask_surge.testing import TABLE_ROWS, table_encode

pl = pytest.importorskip("polars")
duckdb = pytest.importorskip("duckdb")

DIM = 2  # the table tests' checksum model


def _check(frame: pa.Table) -> None:
    assert frame.num_rows == TABLE_ROWS
    emb = frame.column("embedding")
    assert (
        pa.types.is_list(emb.type)
        or pa.types.is_large_list(emb.type)
        or pa.types.is_fixed_size_list(emb.type)
    )
    assert emb.type.value_type == pa.float32()
    assert {len(v) for v in emb.to_pylist()} == {DIM}


def _arrow_of(fmt: str, out: str, catalog):
    if fmt == "lance":
        import lance

        return lance.dataset(out)
    if fmt == "delta":
        import deltalake

        return deltalake.DeltaTable(out).to_pyarrow_dataset()
    return catalog.load_table("default.t").scan().to_arrow()


@pytest.mark.parametrize("fmt", ["lance", "delta", "iceberg"])
def test_polars_duckdb_and_pyarrow_read_every_table_output(tmp_path, fmt, request, monkeypatch):
    catalog = request.getfixturevalue("iceberg_catalog") if fmt == "iceberg" else None
    out = str(tmp_path / f"t.{fmt}")
    table_encode(out, fmt)
    # polars, through each format's own entry point
    if fmt == "delta":
        frame = pl.read_delta(out)
    elif fmt == "iceberg":  # planned by pyiceberg (polars' own planner is a separate package)
        monkeypatch.setenv("POLARS_ICEBERG_PLANNER", "pyiceberg")
        frame = pl.scan_iceberg(catalog.load_table("default.t")).collect()
    else:
        frame = pl.from_arrow(_arrow_of(fmt, out, catalog).to_table())
    assert frame.schema["embedding"] in (pl.List(pl.Float32), pl.Array(pl.Float32, DIM))
    _check(frame.to_arrow())
    # pyarrow (the format's own dataset or scan)
    source = _arrow_of(fmt, out, catalog)
    _check(source if isinstance(source, pa.Table) else source.to_table())
    # DuckDB, over the same Arrow source
    con = duckdb.connect()
    con.register("t", source)
    rows = con.execute("select count(*), min(len(embedding)), max(len(embedding)) from t").fetchone()
    assert rows == (TABLE_ROWS, DIM, DIM)
    first = con.execute("select embedding from t order by partition, row limit 1").fetchone()[0]
    assert np.asarray(first, dtype=np.float32).shape == (DIM,)


@pytest.mark.parametrize("fmt", ["delta", "iceberg"])
def test_the_data_files_hold_the_type_the_table_declares(tmp_path, fmt, request):
    import pyarrow.parquet as pq

    catalog = request.getfixturevalue("iceberg_catalog") if fmt == "iceberg" else None
    out = tmp_path / f"t.{fmt}"
    table_encode(str(out), fmt)
    files = sorted(out.rglob("*.parquet"))
    assert files
    if fmt == "delta":
        import deltalake

        declared = deltalake.DeltaTable(str(out)).schema().to_arrow().field("embedding").type
    else:
        declared = catalog.load_table("default.t").schema().as_arrow().field("embedding").type
    for f in files:
        stored = pq.read_schema(f).field("embedding").type
        assert pa.types.is_list(stored) and stored.value_type == pa.float32(), (f, stored)
        assert "list" in str(declared).lower() and "fixed" not in str(declared).lower(), declared
