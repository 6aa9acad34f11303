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
    assert info["kind"] == "faiss" and info["rows"] == 2000 and info["rows_committed"] == 2000
    assert info["run"] == res.run_id and (tmp_path / "emb.faiss" / info["index_file"]).exists()
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


# -- staleness: an index older than its output is refused, never searched -------------------------------


def _small(n: int = 400, seed: int = 0, npartitions: int = 8):
    import dask.dataframe as dd

    rng = np.random.default_rng(seed)
    texts = [f"text {i} " + "x" * int(rng.integers(1, 40)) for i in range(n)]
    return dd.from_pandas(pd.DataFrame({"text": texts}), npartitions=npartitions)


def _encode(frame, out, model, **kw):
    kw = {"scheduler": "sync", "progress": False, "b_min": 50, "b_max": 100, **kw}
    return frame.surge.encode("text", output=out, model=model, **kw)


def test_an_index_of_a_run_resumed_since_is_refused_until_rebuilt(tmp_path):
    # before: open_index returned the index of the first 100 rows for a 400-row output, silently
    from dask_surge.testing import InterruptAfter

    out = str(tmp_path / "emb")
    model = InterruptAfter(3)
    with pytest.raises(KeyboardInterrupt):
        _encode(_small(), out, model)
    partial = build_index(out)
    assert 0 < partial["rows"] < 400 and partial["complete"] is False
    _encode(_small(), out, model)  # the same call again: resumes, commits the rest
    with pytest.raises(dask_surge.SurgeInputError, match=r"older than the output.*Fix: build_index"):
        open_index(out)
    assert build_index(out)["rows"] == 400
    index = open_index(out)
    assert len(index._keys) == 400 and index.info["complete"] is True


def test_an_index_of_an_overwritten_output_is_refused(tmp_path):
    out = str(tmp_path / "emb")
    first = _encode(_small(seed=0), out, _len_model)
    build_index(out)
    second = _encode(_small(seed=1), out, _len_model, overwrite=True)
    assert second.run_id != first.run_id
    with pytest.raises(
        dask_surge.SurgeInputError, match=f"built from run {first.run_id}.*now holds run {second.run_id}"
    ):
        open_index(out)


def _len_model(texts):
    return np.array([[len(t), t.count("x") + 1.0, 1.0] for t in texts], dtype=np.float32)


def test_a_rebuild_replaces_the_files_and_leaves_no_old_ones(tmp_path):
    out = str(tmp_path / "emb")
    _encode(_small(), out, _len_model)
    first = build_index(out, metric="l2")
    second = build_index(out)
    files = sorted(p.name for p in (tmp_path / "emb.faiss").iterdir())
    assert files == sorted(["index.json", second["index_file"], second["keys_file"]])
    assert first["index_file"] != second["index_file"] and open_index(out).metric == "cosine"


# -- other places: memory://, S3; other tables: Delta ---------------------------------------------------


def test_faiss_index_of_a_memory_output(tiny_model):
    import uuid

    out = f"memory://surge-index-{uuid.uuid4().hex}/emb"
    _encode(_frame(), out, tiny_model, b_min=500, b_max=1000)
    info = build_index(out)
    assert info["path"] == f"{out}.faiss"
    df = dask_surge.read_embeddings(out).compute(scheduler="sync").reset_index(drop=True)
    _check(open_index(out), df, 0.9)


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from dask_surge.testing import loopback_s3

    with loopback_s3("surge-index") as server:
        yield server


def test_faiss_index_beside_a_parquet_output_on_s3(s3, tiny_model):
    _, options, fs = s3
    out = "s3://surge-index/emb"
    res = _encode(_frame(), out, tiny_model, b_min=500, b_max=1000, storage_options=options)
    info = build_index(out, storage_options=options)
    assert info["rows"] == 2000 and info["run"] == res.run_id
    assert set(fs.ls("surge-index/emb.faiss", detail=False)) == {
        f"surge-index/emb.faiss/{n}" for n in ("index.json", info["index_file"], info["keys_file"])
    }
    df = dask_surge.read_embeddings(out, storage_options=options).compute(scheduler="sync")
    _check(open_index(out, storage_options=options), df.reset_index(drop=True), 0.9)
    # overwritten on S3: the index beside it is refused
    _encode(_small(), out, _len_model, overwrite=True, storage_options=options)
    with pytest.raises(dask_surge.SurgeInputError, match="older than the output"):
        open_index(out, storage_options=options)


def test_lance_index_on_a_lance_output_on_s3(s3, tiny_model):
    lance = pytest.importorskip("lance")
    from dask_surge.io.tables.locations import object_store_options

    _, options, fs = s3
    out = "s3://surge-index/emb.lance"
    _encode(_frame(), out, tiny_model, b_min=500, b_max=1000, format="lance", storage_options=options)
    assert fs.isdir("surge-index/emb.lance/_versions")
    info = build_index(out, storage_options=options)
    assert info["kind"] == "lance" and info["rows"] == 2000
    assert fs.ls("surge-index/emb.lance/_indices")  # the index is in the table, on S3
    ds = lance.dataset(out, storage_options=object_store_options(out, options))
    _check(open_index(out, storage_options=options), ds.to_table().to_pandas(), 0.8)


def test_faiss_index_beside_a_delta_output(tmp_path):
    pytest.importorskip("deltalake")
    out = str(tmp_path / "emb.delta")
    res = _encode(_small(), out, _len_model, format="delta")
    info = build_index(out)
    assert info["output_kind"] == "delta" and info["rows"] == 400 and info["run"] == res.run_id
    import deltalake

    df = deltalake.DeltaTable(out).to_pandas()
    x = np.stack(df.embedding.to_numpy()).astype(np.float32)
    _, keys = open_index(out).search(x[:5], k=1)
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    pos = {(p, r): i for i, (p, r) in enumerate(zip(df.partition, df.row))}
    hits = [pos[(p, r)] for p, r in zip(keys.partition, keys.row)]
    assert np.allclose(np.einsum("ij,ij->i", unit[hits], unit[:5]), 1, atol=1e-5)
    deltalake.write_deltalake(out, df.head(3), mode="append")  # another writer: the table's version moves on
    with pytest.raises(
        dask_surge.SurgeInputError, match=r"older than the output.*now holds .* at table version"
    ):
        open_index(out)
    assert build_index(out)["rows"] == 403  # the table's rows, its other writers' too


def test_faiss_index_beside_an_iceberg_output(tmp_path):
    pytest.importorskip("pyiceberg")
    import dask

    props = {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db", "warehouse": f"file://{tmp_path}/wh"}
    out = str(tmp_path / "emb.iceberg")
    with dask.config.set({"surge.iceberg-catalog": {"name": "surge-index", **props}}):
        res = _encode(_small(), out, _len_model, format="iceberg", build_index="l2")
        assert res.index["output_kind"] == "iceberg" and res.index["rows"] == 400
        index = open_index(out)
        x = _len_model(_small().compute().text.tolist())
        _, keys = index.search(x[:3], k=1)
        frame = _small()
        hits = [
            _len_model([frame.partitions[p].compute().text.iloc[r]])[0]
            for p, r in zip(keys.partition, keys.row)
        ]
        assert np.allclose(hits, x[:3])  # each query's nearest by l2: itself (or a row with its vector)
        # the hits' own columns, read from the table by their keys
        dist, found = index.search(x[:3], k=2, columns=True)
        assert (dist[:, 0] == 0).all() and len(found) == 6 and "embedding" not in found.columns
        from pyiceberg.catalog import load_catalog

        rows = load_catalog("surge-index", **props).load_table("default.emb").scan().to_pandas()
        by_key = dict(zip(zip(rows.partition, rows.row), rows.text_hash))
        assert [by_key[(p, r)] for p, r in zip(found.partition, found.row)] == found.text_hash.tolist()
        # a second run appended to the table: the index is older than it
        _encode(_small(seed=1), out, _len_model, format="iceberg", mode="append")
        with pytest.raises(dask_surge.SurgeInputError, match="older than the output"):
            open_index(out)


def test_an_iceberg_index_is_stale_once_another_writer_appends(tmp_path):
    """Issue 67: the index recorded no table version for Iceberg, so after another writer's append (no
    dask-surge run, the same committed rows) it was opened and its keys missed the new rows."""
    pytest.importorskip("pyiceberg")
    import dask
    from pyiceberg.catalog import load_catalog

    props = {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db", "warehouse": f"file://{tmp_path}/wh"}
    out = str(tmp_path / "emb.iceberg")
    with dask.config.set({"surge.iceberg-catalog": {"name": "surge-index", **props}}):
        _encode(_small(), out, _len_model, format="iceberg", build_index="l2")
        open_index(out)  # fresh
        table = load_catalog("surge-index", **props).load_table("default.emb")
        table.append(table.scan(limit=5).to_arrow())  # another tool's append
        with pytest.raises(dask_surge.SurgeInputError, match="older than the output"):
            open_index(out)


def test_an_output_that_is_not_dense_vectors_is_refused(tmp_path):
    with pytest.raises(dask_surge.SurgeInputError, match="holds no dask-surge run"):
        build_index(str(tmp_path))
    with pytest.raises(dask_surge.SurgeInputError, match="metric='hamming'"):
        build_index(str(tmp_path), metric="hamming")  # type: ignore[arg-type]


# -- encode(build_index=...) ------------------------------------------------------------------------------


def test_encode_builds_the_index_once_the_run_completes(tmp_path, tiny_model):
    out = str(tmp_path / "emb")
    res = _encode(_frame(), out, tiny_model, b_min=500, b_max=1000, build_index=True)
    assert res.index["kind"] == "faiss" and res.index["metric"] == "cosine" and res.index["built"]
    assert res.index["rows"] == 2000 and res.as_dict()["index"]["run"] == res.run_id
    assert "searchable index (built): a FAISS HNSW32 index" in str(res)
    df = dask_surge.read_embeddings(out).compute().reset_index(drop=True)
    _check(open_index(out), df, 0.9)
    again = _encode(_frame(), out, tiny_model, b_min=500, b_max=1000, build_index="cosine")
    assert again.nothing_to_do and again.index["built"] is False
    assert "already up to date, kept" in str(again)
    other = _encode(_frame(), out, tiny_model, b_min=500, b_max=1000, build_index="l2")
    assert other.index["built"] and open_index(out).metric == "l2"


def test_encode_builds_a_lance_index_on_a_lance_output(tmp_path):
    pytest.importorskip("lance")
    out = str(tmp_path / "emb.lance")
    res = _encode(_small(), out, _len_model, format="lance", build_index="l2")
    assert res.index["kind"] == "lance" and res.index["metric"] == "l2" and res.index["built"]
    assert "the Lance table's own IVF_FLAT index" in str(res)
    assert open_index(out).metric == "l2"
    again = _encode(_small(), out, _len_model, format="lance", build_index="l2")
    assert again.index["built"] is False and "own IVF_FLAT index" in str(again)


def test_an_interrupted_run_builds_no_index(tmp_path):
    from dask_surge.testing import InterruptAfter

    out = str(tmp_path / "emb")
    with pytest.raises(KeyboardInterrupt):
        _encode(_small(), out, InterruptAfter(2), build_index=True)
    assert not (tmp_path / "emb.faiss").exists()


def test_build_index_is_refused_without_an_output_or_with_a_bad_value():
    with pytest.raises(dask_surge.SurgeValueError, match=r"build_index='cosine'.*output=None.*Fix"):
        _small().surge.encode("text", model=_len_model, build_index=True)
    with pytest.raises(dask_surge.SurgeValueError, match=r"build_index='hamming'.*Fix"):
        _small().surge.encode("text", "out", model=_len_model, build_index="hamming")


def test_build_index_from_the_config_and_the_command_line(tmp_path):
    import dask

    from dask_surge import cli, config
    from dask_surge.options import from_arguments

    with dask.config.set({"surge.build-index": "dot"}):
        assert config.bind("encode", {})["build_index"] == "dot"
    assert config.bind("encode", {})["build_index"] is False
    parser = cli.build_parser()
    for flags, want in (([], None), (["--build-index"], "cosine"), (["--build-index", "l2"], "l2")):
        args = parser.parse_args(["encode", "in.parquet", "--text-column", "t", "--output", "o", *flags])
        assert from_arguments(args, "encode")["build_index"] == want
    with pytest.raises(SystemExit):
        parser.parse_args(["encode", "x", "--text-column", "t", "--output", "o", "--build-index", "cos"])


# -- LanceDB reads what build_index built ----------------------------------------------------------------


def test_lancedb_searches_a_lance_output_with_its_index(tmp_path, tiny_model):
    lancedb = pytest.importorskip("lancedb")
    lance = pytest.importorskip("lance")
    out = tmp_path / "emb.lance"
    _encode(_frame(), str(out), tiny_model, b_min=500, b_max=1000, format="lance", build_index=True)
    table = lancedb.connect(str(tmp_path)).open_table("emb")
    assert [i.index_type for i in table.list_indices()] == ["IvfFlat"]
    df = lance.dataset(str(out)).to_table().to_pandas()
    x = _vectors(df)
    queries = np.arange(0, len(df), 20)
    pos = {(p, r): i for i, (p, r) in enumerate(zip(df.partition, df.row))}
    found = []
    for q in queries:
        hits = table.search(x[q]).distance_type("cosine").nprobes(20).refine_factor(10).limit(10).to_pandas()
        found.append([pos[(p, r)] for p, r in zip(hits.partition, hits.row)])
    assert recall_at_k(np.array(found), exact_neighbours(x, x[queries], 10)) >= 0.8


# -- one distance on every index: smaller is nearer, the same value for the same rows ------------------


def _kept(n: int = 300):
    import dask.dataframe as dd

    rng = np.random.default_rng(3)
    texts = [
        f"doc {i} " + " ".join(rng.choice(["a", "bb", "ccc", "dd"], size=int(rng.integers(2, 9))))
        for i in range(n)
    ]
    frame = pd.DataFrame({"text": texts, "doc_id": [f"d{i:04d}" for i in range(n)]})
    return dd.from_pandas(frame, npartitions=3)


@pytest.fixture(scope="module")
def lance_and_delta(tmp_path_factory, tiny_model):
    """The same run (same model, same input, keep=["doc_id"]) written as a Lance and a Delta table."""
    pytest.importorskip("lance")
    pytest.importorskip("deltalake")
    base = tmp_path_factory.mktemp("one-distance")
    outs = {}
    for fmt in ("lance", "delta"):
        outs[fmt] = str(base / f"emb.{fmt}")
        _encode(_kept(), outs[fmt], tiny_model, format=fmt, keep=["doc_id"])
    import deltalake

    df = deltalake.DeltaTable(outs["delta"]).to_pandas().sort_values(["partition", "row"], ignore_index=True)
    return outs, df


@pytest.mark.parametrize("metric", ["cosine", "l2", "dot"])
def test_lance_and_faiss_return_the_same_neighbours_and_distances(lance_and_delta, metric):
    # before: Lance returned distances (rising), FAISS cosine similarities (falling), both "distances"
    from dask_surge.io.index import exact_distances

    outs, df = lance_and_delta
    x = _vectors(df)
    rng = np.random.default_rng(5)
    queries = np.concatenate(
        [x[::37] + rng.normal(0, 0.05, x[::37].shape), rng.normal(0, 1, (4, x.shape[1]))]
    )
    found = {}
    for fmt, out in outs.items():
        info = build_index(out, metric=metric)
        assert info["kind"] == ("lance" if fmt == "lance" else "faiss") and info["metric"] == metric
        index = open_index(out)
        assert index.metric == metric
        found[fmt] = index.search(queries.astype(np.float32), k=5, columns=["doc_id"])
    (d_lance, h_lance), (d_faiss, h_faiss) = found["lance"], found["delta"]
    assert h_lance[["query", "rank", "partition", "row", "doc_id"]].equals(
        h_faiss[["query", "rank", "partition", "row", "doc_id"]]
    )
    scale = max(1.0, float(np.abs(d_lance).max()))
    assert np.abs(d_lance - d_faiss).max() <= 1e-5 * scale, np.abs(d_lance - d_faiss).max()
    # the distance is the metric's own, as exact_distances defines it (1 - cos, squared L2, 1 - dot)
    pos = {(p, r): i for i, (p, r) in enumerate(zip(df.partition, df.row))}
    rows = np.array([pos[(p, r)] for p, r in zip(h_lance.partition, h_lance.row)]).reshape(d_lance.shape)
    exact = exact_distances(x, queries, metric)
    assert np.allclose(np.take_along_axis(exact, rows, 1), d_lance, atol=1e-5 * scale)
    assert np.allclose(np.sort(exact, axis=1)[:, :5], d_lance, atol=1e-5 * scale)  # the nearest 5, exactly
    # the kept column is the row's own
    assert (h_faiss.doc_id == df.doc_id.to_numpy()[rows.ravel()]).all()


@pytest.mark.parametrize("metric", ["cosine", "l2", "dot"])
def test_distances_rise_with_rank_on_every_index(lance_and_delta, metric):
    outs, df = lance_and_delta
    x = _vectors(df)
    for out in outs.values():
        build_index(out, metric=metric)
        dist, hits = open_index(out).search(x[:10] + 0.01, k=8)
        assert dist.shape == (10, 8) and np.isfinite(dist).all()
        assert (np.diff(dist, axis=1) >= -1e-6).all(), dist
        assert np.allclose(hits.distance.to_numpy(), dist.ravel())
        assert list(hits.columns) == ["query", "rank", "partition", "row", "distance"]
        if metric == "cosine":
            assert ((dist >= -1e-6) & (dist <= 2 + 1e-6)).all()
        if metric == "l2":
            assert (dist >= 0).all()


def test_search_returns_the_kept_columns_of_a_parquet_output(tmp_path):
    out = str(tmp_path / "emb")
    _encode(_kept(120), out, _len_model, keep=["doc_id"])
    build_index(out, metric="l2")
    df = dask_surge.read_embeddings(out).compute().reset_index(drop=True)
    x = _vectors(df)
    index = open_index(out)
    _, hits = index.search(x[:4], k=3, columns=True)
    assert list(hits.columns)[:5] == ["query", "rank", "partition", "row", "distance"]
    assert {"doc_id", "text_hash"} <= set(hits.columns)
    assert "embedding" not in hits.columns and len(hits) == 12
    by_key = df.set_index(["partition", "row"]).doc_id
    assert [by_key[(p, r)] for p, r in zip(hits.partition, hits.row)] == hits.doc_id.tolist()
    assert (hits.groupby("query").distance.first() == 0).all()  # each query finds its own vector first
    dist, more = index.search(x[:1], k=130)  # more than the output holds: the missing places are inf
    found = int(np.isfinite(dist[0]).sum())
    assert dist.shape == (1, 130) and found <= 120 and np.isinf(dist[0, found:]).all() and len(more) == found
    with pytest.raises(dask_surge.SurgeInputError, match=r"columns=\['nope'\].*Fix"):
        index.search(x[:1], columns=["nope"])


def test_a_chunk_mode_index_names_each_window(tmp_path, tiny_model):
    # the keys were (partition, row): a text's windows were one key, and its columns came back once per window
    import dask.dataframe as dd

    texts = [" ".join(f"w{j}" for j in range(i % 7 * 60 + 5)) for i in range(40)]
    frame = pd.DataFrame({"text": texts, "doc_id": [f"d{i}" for i in range(40)]})
    out = str(tmp_path / "emb")
    _encode(dd.from_pandas(frame, npartitions=2), out, tiny_model, long_texts="chunk", keep=["doc_id"])
    df = dask_surge.read_embeddings(out).compute().reset_index(drop=True)
    assert df.chunk.max() > 0
    build_index(out, metric="l2")
    index = open_index(out)
    assert list(index._keys.columns) == ["partition", "row", "chunk"]
    windows = np.flatnonzero(df.chunk.to_numpy() > 0)[:5]
    dist, hits = index.search(_vectors(df)[windows], k=3, columns=["char_start", "doc_id"])
    assert len(hits) == 15 and "chunk" in hits.columns
    assert (dist[:, 0] == 0).all()  # each window finds itself (or the same window of a same text)
    by_key = df.set_index(["partition", "row", "chunk"])
    for _, hit in hits.iterrows():
        own = by_key.loc[(hit.partition, hit.row, hit.chunk)]
        assert (own.char_start, own.doc_id) == (hit.char_start, hit.doc_id)
