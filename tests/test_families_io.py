"""Issue 55's foundations: the sparse and multi-vector output columns, and the tiny offline
checkpoints of each model family, checked against the sentence-transformers reference on real texts.

Writing these columns from ``encode()`` is not wired yet; here the columns are built from the
reference's own output and taken through the part-file writer and back.
"""

from __future__ import annotations

import hashlib
import io
import tempfile

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dask_surge.errors import SurgeValueError
from dask_surge.families import DENSE, MULTIVECTOR, SPARSE
from dask_surge.io.layout import (
    INDICES,
    PARTITION,
    ROW,
    TEXT_HASH,
    TOKENS,
    VALUES,
    VECTORS,
    output_columns,
    reserved_columns,
)
from dask_surge.io.multivector import multivector_arrays, to_matrices, vectors_type
from dask_surge.io.partfiles import parquet_bytes, row_groups, table_of
from dask_surge.io.sparse import INDICES_TYPE, VALUES_TYPE, sparse_arrays, to_csr
from dask_surge.synthetic import make_texts
from dask_surge.testing import (
    add_to_hub_cache,
    cosines,
    make_tiny_decoder_model,
    make_tiny_multivector_model,
    make_tiny_sparse_model,
    package_documents,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 30522  # the packaged MiniLM tokenizer's


def commit_of(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Real texts of mixed lengths: package READMEs (cut) and the synthetic generator's, with punctuation."""
    docs = [d[:400] for d in package_documents(4, min_chars=400)]
    return docs + list(make_texts(6, seed=3)) + ["Hello, world!", "a"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """An offline Hub cache holding one tiny checkpoint of each family."""
    root = tmp_path_factory.mktemp("families")
    cache = root / "hub"
    builders = {
        "sparse": make_tiny_sparse_model,
        "decoder": make_tiny_decoder_model,
        "colbert": make_tiny_multivector_model,
    }
    for name, build in builders.items():
        add_to_hub_cache(cache, f"tiny/{name}", build(root / name), commit=commit_of(name))
    return cache


@pytest.fixture(scope="module")
def offline(hub):
    """Hub loads from ``hub`` only (huggingface_hub reads ``HF_HUB_CACHE`` once, at import: the reference
    classes are given the cache as ``cache_folder``)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_CACHE", str(hub))
    mp.setenv("HF_HUB_OFFLINE", "1")
    yield str(hub)
    mp.undo()


@pytest.fixture(scope="module")
def sparse_model(offline):
    from sentence_transformers import SparseEncoder

    return SparseEncoder("tiny/sparse", device="cpu", cache_folder=offline, local_files_only=True)


@pytest.fixture(scope="module")
def colbert(offline):
    from sentence_transformers import MultiVectorEncoder

    return MultiVectorEncoder("tiny/colbert", device="cpu", cache_folder=offline, local_files_only=True)


def write_and_read(columns: dict, n: int) -> pa.Table:
    """A part file's bytes of ``columns`` (as the SuperBatch frame holds them), read back with pyarrow."""
    frame = pd.DataFrame(
        {
            PARTITION: np.zeros(n, np.int64),
            ROW: np.arange(n, dtype=np.int64),
            TEXT_HASH: pd.arrays.ArrowExtensionArray(pa.array([bytes(16)] * n, pa.binary(16))),
            **{k: pd.arrays.ArrowExtensionArray(v) for k, v in columns.items()},
        }
    )
    table = table_of(frame)
    return pq.read_table(pa.BufferReader(parquet_bytes(table, row_groups([n], floor=4), compression="zstd")))


# -- layout ----------------------------------------------------------------------------------------


def test_layout_states_each_family_once():
    assert output_columns(["id"], chunked=False, family=DENSE)[-1] == "embedding"
    assert output_columns(["id"], chunked=False, family=SPARSE)[-2:] == (INDICES, VALUES)
    assert output_columns(["id"], chunked=False, family=MULTIVECTOR)[-2:] == (VECTORS, TOKENS)
    assert output_columns(["id"], chunked=True) == output_columns(["id"], chunked=True, family=DENSE)
    assert {INDICES, VALUES} <= set(reserved_columns(False, SPARSE))
    with pytest.raises(SurgeValueError, match="family='dense', 'sparse' or 'multivector'"):
        output_columns([], chunked=False, family="colbert")
    with pytest.raises(SurgeValueError, match="long_texts='truncate'"):
        output_columns([], chunked=True, family=MULTIVECTOR)


# -- the tiny checkpoints load offline with their reference class ------------------------------------


def test_each_family_loads_offline_from_the_hub_cache(offline, sparse_model, colbert, texts):
    from sentence_transformers import SentenceTransformer

    decoder = SentenceTransformer("tiny/decoder", device="cpu", cache_folder=offline, local_files_only=True)
    dense = decoder.encode(texts)
    assert dense.shape == (len(texts), 32)
    np.testing.assert_allclose(np.linalg.norm(dense, axis=1), 1.0, atol=1e-5)
    assert decoder[1].get_config_dict()["pooling_mode"] == "lasttoken"
    assert decoder.tokenizer.padding_side == "left"
    # the query prompt changes the vector; distinct texts give distinct vectors
    assert np.abs(decoder.encode(texts[:1], prompt_name="query") - dense[:1]).max() > 1e-3
    assert np.unique(dense.round(5), axis=0).shape[0] == len(set(texts))

    emb = sparse_model.encode(texts, convert_to_sparse_tensor=True)
    assert emb.is_sparse and tuple(emb.shape) == (len(texts), VOCAB)
    assert (emb.coalesce().values() > 0).all()

    docs = colbert.encode_document(texts, convert_to_numpy=True)
    queries = colbert.encode_query(texts[:3], convert_to_numpy=True)
    assert all(d.shape[1] == 16 for d in docs) and all(q.shape == (32, 16) for q in queries)


def test_the_same_seed_builds_the_same_checkpoint(tmp_path, sparse_model, texts):
    from sentence_transformers import SparseEncoder

    again = SparseEncoder(make_tiny_sparse_model(tmp_path / "again"), device="cpu")
    a = sparse_model.encode(texts[:3], convert_to_sparse_tensor=True).to_dense().numpy()
    b = again.encode(texts[:3], convert_to_sparse_tensor=True).to_dense().numpy()
    assert (a > 0).sum() > 0
    np.testing.assert_array_equal(a, b)


def test_colbert_markers_and_skiplist_are_the_models(colbert):
    """The reference applies [D] and drops punctuation from documents only; queries get [Q] and [MASK] padding."""
    tok = colbert.tokenizer
    q_id, d_id = tok.convert_tokens_to_ids("[Q]"), tok.convert_tokens_to_ids("[D]")
    assert q_id != tok.unk_token_id and d_id != tok.unk_token_id
    doc = colbert.encode_document(["Hello, world!"], convert_to_numpy=True)[0]
    plain = colbert.encode_document(["Hello world"], convert_to_numpy=True)[0]
    assert doc.shape[0] == 5  # [CLS] [D] hello world [SEP]: "," and "!" skipped
    assert plain.shape[0] == 5
    query = colbert.encode_query(["Hello, world!"], convert_to_numpy=True)[0]
    assert query.shape[0] == 32  # queries keep punctuation and are padded to query_length


# -- sparse ----------------------------------------------------------------------------------------


def test_sparse_columns_equal_the_reference_non_zeros(sparse_model, texts):
    ref = sparse_model.encode(texts, convert_to_sparse_tensor=True).coalesce()
    dense_ref = ref.to_dense().numpy()
    indices, values = sparse_arrays(ref)
    assert indices.type == INDICES_TYPE and values.type == VALUES_TYPE and len(indices) == len(texts)
    for i, (ids, vals) in enumerate(zip(indices.to_pylist(), values.to_pylist())):
        expect = np.flatnonzero(dense_ref[i])
        assert ids == sorted(ids) and np.array_equal(ids, expect), i
        np.testing.assert_allclose(vals, dense_ref[i, expect], rtol=0, atol=1e-5)
    # the same columns from the dense array and from per-row pairs
    for other in (
        sparse_arrays(dense_ref),
        sparse_arrays([(np.flatnonzero(r), r[r != 0]) for r in dense_ref]),
    ):
        assert other[0].equals(indices) and other[1].equals(values)


def test_sparse_pruning_keeps_the_right_entries(sparse_model, texts):
    dense_ref = sparse_model.encode(texts, convert_to_sparse_tensor=True).to_dense().numpy()
    k, threshold = 5, float(np.median(dense_ref[dense_ref > 0]))
    indices, values = sparse_arrays(dense_ref, top_k=k, threshold=threshold)
    for i, (ids, vals) in enumerate(zip(indices.to_pylist(), values.to_pylist())):
        row = dense_ref[i]
        candidates = np.flatnonzero(row >= threshold)
        # the k largest among those at or above the threshold, ties to the smaller id, stored by id
        best = candidates[np.lexsort((candidates, -row[candidates].astype(np.float64)))][:k]
        assert ids == sorted(best.tolist()), i
        assert len(ids) == min(k, len(candidates))
        np.testing.assert_allclose(vals, row[ids], atol=1e-6)
    only_k = sparse_arrays(dense_ref, top_k=k)
    assert [len(r) for r in only_k[0].to_pylist()] == [min(k, int((r > 0).sum())) for r in dense_ref]
    ties = sparse_arrays([([9, 4, 6, 1], [1.0, 1.0, 2.0, 0.5])], top_k=2)
    assert ties[0].to_pylist() == [[4, 6]]
    with pytest.raises(SurgeValueError, match="sparse_top_k=-1"):
        sparse_arrays(dense_ref, top_k=-1)
    with pytest.raises(SurgeValueError, match="sparse_threshold=nan"):
        sparse_arrays(dense_ref, threshold=float("nan"))


def test_sparse_columns_round_trip_the_part_file_and_to_csr(sparse_model, texts):
    ref = sparse_model.encode(texts, convert_to_sparse_tensor=True)
    indices, values = sparse_arrays(ref)
    back = write_and_read({INDICES: indices, VALUES: values}, len(texts))
    assert back.schema.field(INDICES).type == INDICES_TYPE and back.schema.field(VALUES).type == VALUES_TYPE
    assert back.column(INDICES).to_pylist() == indices.to_pylist()
    csr = to_csr(back, VOCAB)
    assert csr.shape == (len(texts), VOCAB) and csr.dtype == np.float32
    np.testing.assert_allclose(csr.toarray(), ref.to_dense().numpy(), rtol=0, atol=1e-5)
    # a pandas partition (as read_embeddings returns it) and a slice of rows
    frame = back.to_pandas()
    np.testing.assert_array_equal(to_csr(frame, VOCAB).toarray(), csr.toarray())
    np.testing.assert_array_equal(to_csr(back.slice(3, 4), VOCAB).toarray(), csr.toarray()[3:7])
    with pytest.raises(SurgeValueError, match="vocab_size=100"):
        to_csr(back, 100)
    with pytest.raises(SurgeValueError, match="no 'values' column"):
        to_csr(back.select([INDICES]), VOCAB)


def test_sparse_part_file_writes_no_dictionary_for_the_weights():
    indices, values = sparse_arrays(np.eye(6, 50, dtype=np.float32))
    n = 6
    frame = pd.DataFrame(
        {
            PARTITION: np.zeros(n, np.int64),
            ROW: np.arange(n, dtype=np.int64),
            INDICES: pd.arrays.ArrowExtensionArray(indices),
            VALUES: pd.arrays.ArrowExtensionArray(values),
        }
    )
    meta = pq.ParquetFile(pa.BufferReader(parquet_bytes(table_of(frame), [n], compression="none"))).metadata
    chunks = {
        meta.row_group(0).column(i).path_in_schema: meta.row_group(0).column(i)
        for i in range(meta.num_columns)
    }
    for leaf in ("indices.list.element", "values.list.element"):
        assert chunks[leaf].compression == "UNCOMPRESSED" and not chunks[leaf].is_stats_set, leaf
    assert chunks["partition"].compression == "ZSTD" and chunks["partition"].is_stats_set


# -- multi-vector ----------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_multivector_columns_round_trip_within_cosine(colbert, texts, precision):
    ref = colbert.encode_document(texts, convert_to_numpy=True)
    vectors, tokens = multivector_arrays(ref, precision=precision)
    assert vectors.type == vectors_type(16, precision)
    back = write_and_read({VECTORS: vectors, TOKENS: tokens}, len(texts))
    assert back.schema.field(VECTORS).type == vectors_type(16, precision)
    assert back.schema.field(TOKENS).type == pa.int32()
    assert back.column(TOKENS).to_pylist() == [len(r) for r in ref]
    got = to_matrices(back)
    assert [g.shape for g in got] == [r.shape for r in ref]
    worst = min(float(cosines(g, r).min()) for g, r in zip(got, ref))
    assert worst >= 0.9999, worst
    if precision == "float32":
        np.testing.assert_array_equal(np.concatenate(got), np.concatenate(ref))
    # a pandas partition reads back the same, and queries (padded to query_length) too
    assert all(np.array_equal(a, b) for a, b in zip(to_matrices(back.to_pandas()), got))
    queries = colbert.encode_query(texts[:4])  # torch tensors
    qv, qt = multivector_arrays(queries, precision=precision)
    assert qt.to_pylist() == [32] * 4
    assert min(float(cosines(a, b.numpy()).min()) for a, b in zip(to_matrices(qv), queries)) >= 0.9999


def test_multivector_rejects_what_it_cannot_store():
    with pytest.raises(SurgeValueError, match="precision='int8'"):
        multivector_arrays([np.ones((2, 3))], precision="int8")
    with pytest.raises(SurgeValueError, match=r"shape \(2, 4\)"):
        multivector_arrays([np.ones((2, 3)), np.ones((2, 4))])
    with pytest.raises(SurgeValueError, match="dimension="):
        multivector_arrays([])
    vectors, tokens = multivector_arrays([np.zeros((0, 3)), np.ones((1, 3))])
    assert tokens.to_pylist() == [0, 1] and [m.shape for m in to_matrices(vectors)] == [(0, 3), (1, 3)]


# -- other readers ---------------------------------------------------------------------------------


def test_duckdb_reads_the_new_columns(sparse_model, colbert, texts):
    duckdb = pytest.importorskip("duckdb")
    indices, values = sparse_arrays(sparse_model.encode(texts, convert_to_sparse_tensor=True))
    vectors, tokens = multivector_arrays(colbert.encode_document(texts, convert_to_numpy=True))
    back = write_and_read({INDICES: indices, VALUES: values, VECTORS: vectors, TOKENS: tokens}, len(texts))
    buf = io.BytesIO()
    pq.write_table(back, buf)
    con = duckdb.connect()
    path = f"{tempfile.mkdtemp()}/part.parquet"
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    rows = con.execute(
        f"SELECT indices, \"values\", len(vectors), tokens, vectors[1] FROM '{path}' ORDER BY row"
    ).fetchall()
    assert [r[0] for r in rows] == indices.to_pylist()
    np.testing.assert_allclose(
        np.concatenate([r[1] for r in rows]), np.concatenate(values.to_pylist()), atol=1e-7
    )
    assert [r[2] for r in rows] == [r[3] for r in rows] == tokens.to_pylist()
    np.testing.assert_allclose([r[4] for r in rows], [m[0] for m in to_matrices(vectors)], atol=1e-7)
    half, _ = multivector_arrays(colbert.encode_document(texts, convert_to_numpy=True), precision="float16")
    pq.write_table(pa.table({VECTORS: half}), path)
    firsts = [r[0] for r in con.execute(f"SELECT vectors[1] FROM '{path}'").fetchall()]
    np.testing.assert_array_equal(np.array(firsts, np.float32), [m[0] for m in to_matrices(half)])


def test_read_embeddings_partitions_feed_the_helpers(sparse_model, colbert, texts, tmp_path):
    """Part files read as read_embeddings reads them (its Arrow-to-pandas mapping) give partitions
    that to_csr and to_matrices take as they are."""
    from dask_surge.io.readers import frame_of

    ref = sparse_model.encode(texts, convert_to_sparse_tensor=True).to_dense().numpy()
    mats = colbert.encode_document(texts, convert_to_numpy=True)
    indices, values = sparse_arrays(ref)
    vectors, tokens = multivector_arrays(mats, precision="float16")
    table = write_and_read({INDICES: indices, VALUES: values, VECTORS: vectors, TOKENS: tokens}, len(texts))
    pq.write_table(table, tmp_path / "part-0.parquet")
    part = frame_of(pq.read_table(tmp_path / "part-0.parquet"))
    assert part[TOKENS].tolist() == [len(m) for m in mats]
    np.testing.assert_allclose(to_csr(part, VOCAB).toarray(), ref, rtol=0, atol=1e-5)
    got = to_matrices(part)
    assert min(float(cosines(g, m).min()) for g, m in zip(got, mats)) >= 0.9999
