"""The written output is plain Parquet that other engines read directly (here DuckDB)."""

import numpy as np
import pytest

import dask_surge
from dask_surge.testing import make_partitioned_frame

duckdb = pytest.importorskip("duckdb", reason="the DuckDB check needs the [test] extra (duckdb)")


def test_duckdb_reads_a_completed_run_and_ranks_by_cosine(tmp_path, tiny_model):
    sizes = [5, 0, 9, 3, 11]
    ddf = make_partitioned_frame(sizes, seed=2)
    out = str(tmp_path / "emb")
    ddf.surge.encode(
        "text",
        out,
        model=tiny_model,
        device="cpu",
        keep=["doc_id"],
        normalize=True,
        b_min=8,
        b_max=16,
        scheduler="sync",
        progress=False,
    )
    files = f"read_parquet('{out}/part-*.parquet')"
    con = duckdb.connect()
    # a completed run leaves exactly its committed files: every row once, none twice
    assert con.sql(f"select count(*), count(distinct (partition, row)) from {files}").fetchall() == [(28, 28)]
    # vector search in SQL: the embedding column casts to a fixed-size FLOAT array
    emb = dask_surge.read_embeddings(out).compute().sort_values("doc_id")
    dim = len(emb.embedding.iloc[0])
    query = np.asarray(emb.embedding.iloc[4], dtype=np.float32).tolist()
    top = con.sql(
        f"select doc_id, array_cosine_similarity(embedding::FLOAT[{dim}], ?::FLOAT[{dim}]) as s "
        f"from {files} order by s desc limit 1",
        params=[query],
    ).fetchall()[0]
    assert top[0] == emb.doc_id.iloc[4] and top[1] == pytest.approx(1.0, abs=1e-5)
