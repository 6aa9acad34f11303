"""The searchable index at the end: FAISS beside a Parquet output, Lance's own on a Lance table,
each opened with one call and measured against exact search (recall@10)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import dask_surge
from dask_surge.io.index import build_index, exact_neighbours, open_index, recall_at_k

faiss = pytest.importorskip("faiss")


def _frame(n: int = 2000):
    import dask.dataframe as dd

    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(300)]
    texts = [" ".join(rng.choice(words, size=int(rng.integers(3, 12)))) for _ in range(n)]
    return dd.from_pandas(pd.DataFrame({"text": texts}), npartitions=4)


def _vectors(df: pd.DataFrame) -> np.ndarray:
    return np.stack(df.embedding.to_numpy()).astype(np.float32)


def _check(index, df: pd.DataFrame, min_recall: float) -> float:
    """Stored vectors as queries: each finds itself first, and recall@10 against exact search."""
    x = _vectors(df)
    queries = np.arange(0, len(df), 20)
    dist, keys = index.search(x[queries], k=10)
    assert dist.shape == (len(queries), 10)
    pos = {(p, r): i for i, (p, r) in enumerate(zip(df.partition, df.row))}
    found = np.array([[pos[(p, r)] for p, r in zip(g.partition, g.row)] for _, g in keys.groupby("query")])
    exact = exact_neighbours(x, x[queries], 10)
    recall = recall_at_k(found, exact)
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    best = np.einsum(
        "ij,ij->i", unit[found[:, 0]], unit[queries]
    )  # the first hit: the query itself, or a tie
    assert np.mean(best >= 1 - 1e-4) >= 0.95
    assert recall >= min_recall, recall
    return recall


def test_faiss_index_beside_a_parquet_output(tmp_path, tiny_model):
    res = _frame().surge.encode(
        "text",
        output=str(tmp_path / "emb"),
        model=tiny_model,
        scheduler="threads",
        progress=False,
        b_min=500,
        b_max=1000,
    )
    info = build_index(res.output)
    assert (
        info["kind"] == "faiss" and info["rows"] == 2000 and (tmp_path / "emb.faiss" / "index.faiss").exists()
    )
    df = dask_surge.read_embeddings(res.output).compute().reset_index(drop=True)
    _check(open_index(res.output), df, 0.9)
    # the output itself stays a valid output: a rerun resumes (nothing foreign inside it)
    again = _frame().surge.encode(
        "text",
        output=str(tmp_path / "emb"),
        model=tiny_model,
        scheduler="threads",
        progress=False,
        b_min=500,
        b_max=1000,
    )
    assert again.resumed


def test_lance_index_on_a_lance_output(tmp_path, tiny_model):
    lance = pytest.importorskip("lance")
    out = tmp_path / "emb.lance"
    _frame().surge.encode(
        "text",
        output=str(out),
        format="lance",
        model=tiny_model,
        scheduler="threads",
        progress=False,
        b_min=500,
        b_max=1000,
    )
    with pytest.raises(dask_surge.SurgeInputError, match="no vector index"):
        open_index(out)
    info = build_index(out)
    assert info["kind"] == "lance" and info["index_type"] == "IVF_FLAT"
    df = lance.dataset(str(out)).to_table().to_pandas()
    _check(open_index(out), df, 0.8)


def test_a_lance_index_is_searched_with_the_metric_it_was_built_with(tmp_path):
    # open_index reported (and searched with) cosine whatever metric the index was built with
    lance = pytest.importorskip("lance")
    import pyarrow as pa

    x = np.random.default_rng(1).random((300, 8), dtype=np.float32)
    table = pa.table(
        {
            "partition": np.zeros(300, np.int64),
            "row": np.arange(300),
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 8),
        }
    )
    path = str(tmp_path / "t.lance")
    lance.write_dataset(table, path)
    assert build_index(path, metric="l2")["metric"] == "l2"
    index = open_index(path)
    assert index.metric == "l2"
    _, keys = index.search(x[:3], k=1)
    assert keys.row.tolist() == [0, 1, 2]  # each vector's nearest by l2 is itself
