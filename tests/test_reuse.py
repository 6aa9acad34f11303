"""dask_surge.io.reuse: text hashes, the on-disk reuse index of earlier outputs, identity checks."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
import uuid
import zlib

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dask_surge.errors import SurgeInputError, SurgeValueError
from dask_surge.io import hashindex, reuse
from dask_surge.io.directory import index_dir, sb_key
from dask_surge.io.hashing import hash_column, hashes_of, text_hash_field, text_hashes
from dask_surge.io.layout import TEXT_HASH
from dask_surge.io.manifest import CommitRecord, RunPlan, existing_run, finish_run, open_run
from dask_surge.io.reuse import ReuseIndex, compatible, embedding_identity, open_index
from dask_surge.io.store import OutputStore

DIM = 4


def vector(text: str, chunk: int = 0) -> list[float]:
    """A deterministic embedding of a text (and chunk), different for different texts."""
    c = zlib.crc32(text.encode("utf-8", "surrogatepass"))
    return [float(len(text)), float(c % 1009), float((c >> 10) % 997), float(chunk)]


def n_chunks(text: str) -> int:
    return 1 + len(text) % 3


def fingerprint(**changes) -> dict:
    fp = {
        "input": uuid.uuid4().hex[:16],
        "column": "text",
        "keep": [],
        "partitions": 0,
        "library": "0.1.0",
        "model": {
            "kind": "object",
            "object": "tests.Model",
            "digest": "ab" * 32,
            "prompt": None,
            "prompt_name": None,
        },
        "normalize": False,
        "precision": "float32",
        "truncate_dim": None,
        "dimension": DIM,
    }
    fp.update(changes)
    return fp


def part_table(
    partitions: list[tuple[int, list[str]]],
    *,
    chunked: bool,
    with_hash: bool,
    hashes: np.ndarray | None = None,
) -> pa.Table:
    """The rows a SuperBatch of ``partitions`` (``(partition, texts)``) writes."""
    cols: dict[str, list] = {"partition": [], "row": [], "embedding": [], "hash": []}
    if chunked:
        cols.update(chunk=[], char_start=[], char_end=[], tokens=[])
    k = 0
    for p, texts in partitions:
        for r, t in enumerate(texts):
            h = text_hashes([t])[0] if hashes is None else hashes[k]
            k += 1
            for c in range(n_chunks(t) if chunked else 1):
                cols["partition"].append(p)
                cols["row"].append(r)
                cols["embedding"].append(vector(t, c))
                cols["hash"].append(h)
                if chunked:
                    cols["chunk"].append(c)
                    cols["char_start"].append(c)
                    cols["char_end"].append(c + 1)
                    cols["tokens"].append(c + 2)
    arrays = {"partition": pa.array(cols["partition"], pa.int64()), "row": pa.array(cols["row"], pa.int64())}
    if chunked:
        arrays.update(
            chunk=pa.array(cols["chunk"], pa.int32()),
            char_start=pa.array(cols["char_start"], pa.int64()),
            char_end=pa.array(cols["char_end"], pa.int64()),
            tokens=pa.array(cols["tokens"], pa.int32()),
        )
    fields = [pa.field(n, a.type) for n, a in arrays.items()]
    if with_hash:
        h = np.array(cols["hash"], dtype=np.uint64).reshape(-1, 2)
        arrays[TEXT_HASH] = hash_column(h)
        fields.append(text_hash_field())
    flat = pa.array(np.array(cols["embedding"], dtype=np.float32).reshape(-1), pa.float32())
    arrays["embedding"] = pa.FixedSizeListArray.from_arrays(flat, DIM)
    fields.append(pa.field("embedding", arrays["embedding"].type))
    return pa.Table.from_arrays(list(arrays.values()), schema=pa.schema(fields))


def write_output(
    path: str,
    sbs: list[list[tuple[int, list[str]]]],
    *,
    chunked: bool = False,
    with_hash: bool = True,
    row_group_rows: int | None = None,
    fp: dict | None = None,
    hashes: list[np.ndarray] | None = None,
    complete: bool = True,
    truncated: list[int] | None = None,
) -> str:
    """An output as a run writes it: part files (a row group per partition, or of
    ``row_group_rows``), commit records (``truncated``: each one's count of texts cut at the
    window), ``run.json``, ``CURRENT``, ``COMPLETE``."""
    partitions = sum(len(sb) for sb in sbs)
    manifest, _ = open_run(
        OutputStore.open(path),
        fp or fingerprint(partitions=partitions),
        plan=RunPlan(b_min=1, b_max=10**6, mode="planned", partitions=partitions),
    )
    rows = 0
    for i, sb in enumerate(sbs):
        table = part_table(
            sb, chunked=chunked, with_hash=with_hash, hashes=None if hashes is None else hashes[i]
        )
        buf = io.BytesIO()
        with pq.ParquetWriter(buf, table.schema) as w:
            if row_group_rows:
                w.write_table(table, row_group_size=row_group_rows)
            else:
                at = 0
                for _, texts in sb:
                    n = sum(n_chunks(t) for t in texts) if chunked else len(texts)
                    w.write_table(table.slice(at, n))
                    at += n
        data = buf.getvalue()
        key = sb_key(sb[0][0], 0)
        attempt = f"{i:08x}"
        target = manifest.data_path(key, attempt)
        manifest.store.write(target, data)
        n_texts = sum(len(t) for _, t in sb)
        rows += n_texts
        rec = CommitRecord(
            sb=key,
            run=manifest.run_id,
            file=target.rsplit("/", 1)[-1],
            rows=n_texts,
            bytes=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
            spans=tuple((p, 0, len(t), len(t)) for p, t in sb),
            attempt=attempt,
            truncated=0 if truncated is None else truncated[i],
        )
        assert manifest.commit(rec)
    if complete:
        finish_run(
            manifest,
            manifest.committed(),
            {"rows": rows, "superbatches": len(sbs), "nulls_skipped": 0, "partitions": partitions},
        )
    return path


def corpus(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "épsilon", "ζήτα", "日本", "x", ""]
    return [" ".join(rng.choice(words, size=int(rng.integers(0, 6)))) + f" #{i}" for i in range(n)]


def layout(texts: list[str], per_partition: int, partitions_per_sb: int, first_partition: int = 0):
    parts = [
        (first_partition + i, texts[a : a + per_partition])
        for i, a in enumerate(range(0, len(texts), per_partition))
    ]
    return [parts[a : a + partitions_per_sb] for a in range(0, len(parts), partitions_per_sb)]


def stored(path: str) -> dict[bytes, list]:
    """hash bytes -> the stored rows of its first occurrence (by file, row): what reuse must return."""
    manifest = existing_run(OutputStore.open(path))
    out: dict[bytes, list] = {}
    for rec in manifest.committed().values():
        cols = pq.read_table(f"{manifest.root}/{rec.file}").to_pydict()
        collecting: list | None = None
        for i, h in enumerate(cols[TEXT_HASH]):
            if cols.get("chunk", [0] * (i + 1))[i] == 0:  # a text's first row
                collecting = None if h in out else out.setdefault(h, [])
            if collecting is not None:
                collecting.append(
                    {k: v[i] for k, v in cols.items() if k not in ("partition", "row", TEXT_HASH)}
                )
    return out


# -- hashes -------------------------------------------------------------------------------


def test_text_hashes_are_xxh3_128_of_utf8_whatever_the_container():
    texts = ["", "a", "héllo wörld", "日本語のテキスト", "emoji 😀", "x" * 10_000, "a"]
    expected = np.frombuffer(b"".join(xxhash.xxh3_128_digest(t.encode()) for t in texts), ">u8").reshape(
        -1, 2
    )
    containers = [
        texts,
        np.array(texts, dtype=object),
        pd.Series(texts, dtype=object),
        pd.Series(texts, dtype="str"),
        pd.Series(texts, dtype="string[pyarrow]"),
        pa.array(texts),
        pa.array(texts, pa.large_string()),
        pa.array(texts, pa.string_view()),
        pa.chunked_array([texts[:3], texts[3:]]),
        pa.array(texts).slice(0),
    ]
    for c in containers:
        h = text_hashes(c)
        assert h.dtype == np.uint64 and h.shape == (len(texts), 2)
        assert (h == expected).all(), type(c)
    assert (text_hashes(pa.array(texts).slice(2, 3)) == expected[2:5]).all()  # a sliced Arrow array
    assert (text_hashes(pa.array(texts)[2:]) == expected[2:]).all()
    assert text_hashes([]).shape == (0, 2)


def test_text_hashes_lone_surrogate_and_refusals():
    bad = "a\udc80b"
    assert (
        text_hashes([bad, "a"])[0]
        == np.frombuffer(xxhash.xxh3_128_digest(bad.encode("utf-8", "surrogatepass")), ">u8")
    ).all()
    for values in (
        ["a", None],
        ["a", float("nan")],
        pd.Series(["a", None], dtype="string[pyarrow]"),
        pa.array(["a", None]),
        ["a", pd.NA],
    ):
        with pytest.raises(SurgeValueError, match=r"null value\(s\) \(first at position 1\).*Fix:"):
            text_hashes(values)
    with pytest.raises(SurgeValueError, match="int value 3 at position 1; only str texts"):
        text_hashes(["a", 3])
    with pytest.raises(SurgeValueError, match="Arrow int64 array"):
        text_hashes(pa.array([1]))


def test_hash_column_round_trips_and_sorts_like_the_pairs():
    h = text_hashes(corpus(500))
    col = hash_column(h)
    assert col.type == pa.binary(16) and (hashes_of(col) == h).all()
    assert (hashes_of(pa.chunked_array([col[:100], col[100:]])) == h).all()
    assert (hashes_of(col.slice(7, 30)) == h[7:37]).all()
    by_bytes = sorted(range(len(h)), key=lambda i: col[i].as_py())
    assert by_bytes == np.lexsort((h[:, 1], h[:, 0])).tolist()
    with pytest.raises(SurgeValueError, match=r"\(n, 2\)"):
        hash_column(h[:, 0])


# -- the index ----------------------------------------------------------------------------


def check(index: ReuseIndex, queries: list[str], truth: dict[bytes, list], columns=("embedding",)):
    """lookup of ``queries`` equals ``truth`` (hash -> rows), row for row, byte for byte."""
    h = text_hashes(queries)
    got = index.lookup(h, columns=[c for c in columns if c != "embedding"])
    keys = [bytes(k) for k in hash_column(h).to_pylist()]
    assert got.found.tolist() == [k in truth for k in keys]
    want_counts = [len(truth[k]) for k in keys if k in truth]
    assert got.counts.tolist() == want_counts
    want = [r for k in keys if k in truth for r in truth[k]]
    assert got.embedding.to_pylist() == [r["embedding"] for r in want]
    for c in columns:
        if c != "embedding":
            assert got.columns[c].tolist() == [r[c] for r in want]
    return got


def test_hits_misses_moved_rows_and_duplicates(tmp_path):
    texts = corpus(300)
    texts[50] = texts[10]  # a repeat inside the old output: found once (its first row)
    old = write_output(str(tmp_path / "old"), layout(texts, 20, 3))
    index = ReuseIndex(old)
    truth = stored(old)
    assert index.entries == len(set(texts))
    # the new corpus: rows moved between partitions, new and edited texts, repeats
    rng = np.random.default_rng(1)
    queries = [*list(rng.permutation(texts[:200])), "new text", texts[5] + " edited", texts[7], texts[7]]
    got = check(index, queries, truth)
    assert got.matches.hits == 200 + 2
    m = index.find(text_hashes([texts[10]]))
    first_file = existing_run(OutputStore.open(old)).committed()
    assert m.found[0] and m.row[0] == 10 and m.count[0] == 1 and m.source[0] == 0
    assert sorted(first_file) and index.indexes[0].files[m.file[0]] == next(iter(first_file.values())).file
    # byte for byte: the buffer of the stored values
    emb = index.lookup(text_hashes([texts[3]])).embedding
    raw = pq.read_table(f"{old}/{index.indexes[0].files[0]}").column("embedding").combine_chunks()[3:4]
    assert emb.equals(raw) and emb.type == raw.type


@pytest.mark.parametrize("row_group_rows", [None, 4, 1])
def test_chunk_runs_in_chunk_order_across_row_groups(tmp_path, row_group_rows):
    texts = corpus(120, seed=3)
    old = write_output(
        str(tmp_path / "old"), layout(texts, 10, 4), chunked=True, row_group_rows=row_group_rows
    )
    index = ReuseIndex(old)
    assert index.chunked
    truth = stored(old)
    assert {len(v) for v in truth.values()} == {1, 2, 3}
    queries = [*texts[::-1], "absent"]
    got = check(index, queries, truth, columns=("chunk", "char_start", "char_end", "tokens", "embedding"))
    assert got.counts.tolist() == [n_chunks(t) for t in texts[::-1]]
    assert got.columns["chunk"].tolist() == [c for t in texts[::-1] for c in range(n_chunks(t))]
    offsets = got.matches.offsets
    assert offsets[-1] == offsets[-2] == got.counts.sum()  # the missing last query has no rows


def test_bucket_boundaries_and_shared_64_bit_prefixes(tmp_path):
    rng = np.random.default_rng(7)
    n = 400
    h = rng.integers(0, 2**63, size=(n, 2), dtype=np.int64).astype(np.uint64) * np.uint64(2)
    bits = 4
    edges = np.arange(1, 16, dtype=np.uint64) << np.uint64(60)
    h[:15, 0] = edges  # first hash of each bucket
    h[15:30, 0] = edges - np.uint64(1)  # last hash of the bucket before
    h[30, 0], h[31, 0] = 0, np.uint64(2**64 - 1)  # the extremes
    h[40:44, 0] = h[39, 0]  # five entries sharing their high 64 bits
    h[40:44, 1] = h[39, 1] + np.arange(1, 5, dtype=np.uint64) * np.uint64(2)
    texts = [f"t{i}" for i in range(n)]  # the hashes are given, not computed
    sbs = layout(texts, 50, 2)
    hashes = [h[i * 100 : (i + 1) * 100] for i in range(4)]
    old = write_output(str(tmp_path / "old"), sbs, hashes=hashes)
    index = ReuseIndex(old, bits=bits)
    assert index.indexes[0].bits == 4 and index.entries == n
    m = index.find(h)
    assert m.found.all()
    assert (m.row == np.tile(np.arange(100), 4)).all() and (m.file == np.repeat(np.arange(4), 100)).all()
    miss = h.copy()
    miss[:, 1] += np.uint64(1)  # odd low halves: never written
    assert not index.find(miss).found.any()
    near = np.stack([edges + np.uint64(1), np.zeros(15, np.uint64)], axis=1)
    assert not index.find(near).found.any()
    got = index.lookup(h[[43, 39, 15]])
    assert got.embedding.to_pylist() == [vector(texts[43]), vector(texts[39]), vector(texts[15])]


def test_several_old_outputs_first_one_wins(tmp_path):
    texts = corpus(200, seed=5)
    a = write_output(str(tmp_path / "a"), layout(texts[:120], 30, 2))
    b = write_output(str(tmp_path / "b"), layout(texts[80:], 25, 1, first_partition=7))
    index = ReuseIndex([a, b])
    m = index.find(text_hashes([*texts, "none"]))
    assert m.found.tolist() == [True] * 200 + [False]
    assert m.source.tolist() == [0] * 120 + [1] * 80 + [-1]
    truth = {**stored(b), **stored(a)}
    check(index, texts[::-1], truth)


def test_damaged_or_stale_index_is_rebuilt(tmp_path):
    texts = corpus(300, seed=9)
    old = write_output(str(tmp_path / "old"), layout(texts, 30, 2))
    truth = stored(old)
    ReuseIndex(old, bits=3)
    where = index_dir(str(tmp_path / "old"), existing_run(OutputStore.open(old)).run_id)
    buckets = sorted(n for n in os.listdir(where) if n.startswith("bucket-"))
    assert len(buckets) == 8
    # a torn bucket, found when the index is used
    with open(f"{where}/{buckets[2]}", "r+b") as f:
        f.truncate(100)
    index = ReuseIndex(old)
    check(index, texts, truth)
    assert os.path.getsize(f"{where}/{buckets[2]}") > 100
    # a damaged meta.json, found when opened
    with open(f"{where}/meta.json", "wb") as f:
        f.write(b"{not json")
    check(ReuseIndex(old, bits=3), texts, truth)
    # a bucket file gone
    os.unlink(f"{where}/{buckets[5]}")
    check(ReuseIndex(old), texts, truth)
    with open(f"{where}/meta.json") as f:
        assert json.load(f)["bits"] == 3


def _files(path: str) -> list[str]:
    manifest = existing_run(OutputStore.open(path))
    return [f"{manifest.root}/{rec.file}" for rec in manifest.committed().values()]


def test_a_file_changed_after_its_run_is_never_copied(tmp_path):
    texts = corpus(90, seed=21)
    old = write_output(str(tmp_path / "old"), layout(texts, 15, 2))  # three files of 30 texts
    truth = stored(old)
    files = _files(old)
    table = pq.read_table(files[1])
    changed = table.set_column(
        table.schema.get_field_index("embedding"),
        table.schema.field("embedding"),
        pa.array([[9.0] * DIM] * table.num_rows, table.schema.field("embedding").type),
    )
    pq.write_table(changed, files[1])  # a valid Parquet file, every value wrong
    with open(files[2], "r+b") as f:  # the same size: only the sha256 differs
        f.seek(os.path.getsize(files[2]) // 2)
        f.write(b"\xff" * 8)
    index = ReuseIndex(old)
    check(index, texts[:30], truth)  # the file left as written is copied from
    with pytest.raises(
        SurgeInputError,
        match=re.escape(os.path.basename(files[1])) + r" is [\d,]+ bytes, its "
        r"commit record says [\d,]+.*dask-surge status --verify " + re.escape(old),
    ):
        index.lookup(text_hashes(texts[25:35]))
    with pytest.raises(
        SurgeInputError,
        match=re.escape(os.path.basename(files[2])) + r" has sha256 [0-9a-f]{16}"
        r"\.\.\., its commit record says [0-9a-f]{16}\.\.\..*dask-surge status --verify",
    ):
        index.lookup(text_hashes(texts[60:]))
    opened = ReuseIndex(old)
    os.unlink(files[0])  # gone after the index was opened: rebuilding it finds the file missing
    with pytest.raises(
        SurgeInputError,
        match=re.escape(f"reuse={old!r}: its data file {os.path.basename(files[0])} is missing"),
    ):
        opened.lookup(text_hashes(texts[:1]))


def test_a_file_of_another_layout_is_a_clear_input_error(tmp_path):
    texts = corpus(40, seed=23)
    old = write_output(str(tmp_path / "old"), layout(texts, 10, 2), chunked=True)
    path = _files(old)[1]
    table = pq.read_table(path)
    pq.write_table(table.slice(1), path)  # its first text's first chunk row gone
    with pytest.raises(
        SurgeInputError,
        match=r"is not of the layout dask-surge writes \(rows at 0 continue no "
        r"text's chunks\).*dask-surge status --verify",
    ):
        ReuseIndex(old)


def test_may_be_cut_follows_the_records_count_of_texts_cut_at_the_window(tmp_path):
    texts = corpus(60, seed=25)
    old = write_output(str(tmp_path / "old"), layout(texts, 10, 2), truncated=[0, 3, -1])
    got = ReuseIndex(old).lookup(text_hashes([texts[45], texts[5], "new", texts[25], texts[15]]))
    assert got.found.tolist() == [True, True, False, True, True]
    assert got.may_be_cut.tolist() == [True, False, True, False]  # files 2 (unknown), 0, 1 (3 cut), 0
    meta_path = f"{index_dir(old, existing_run(OutputStore.open(old)).run_id)}/meta.json"
    with open(meta_path) as f:
        meta = json.load(f)
    assert meta["truncated"] == [0, 3, -1] and len(meta["sha256"]) == 3
    with open(meta_path, "w") as f:  # an index of the format before: rebuilt with what is checked
        json.dump({**meta, "format": 1, "sha256": None}, f)
    assert ReuseIndex(old).indexes[0].meta["sha256"] == meta["sha256"]


def test_old_output_without_text_hash_is_refused(tmp_path):
    old = write_output(str(tmp_path / "old"), layout(corpus(20), 10, 1), with_hash=False)
    with pytest.raises(SurgeInputError, match=r"has no 'text_hash' column .*Fix: re-run once without reuse="):
        ReuseIndex(old)


def test_incomplete_or_missing_output_is_refused(tmp_path):
    old = write_output(str(tmp_path / "old"), layout(corpus(20), 10, 1), complete=False)
    with pytest.raises(SurgeInputError, match=r"is not complete.*Fix: finish it first"):
        ReuseIndex(old)
    with pytest.raises(SurgeInputError, match="holds no dask-surge run"):
        ReuseIndex(str(tmp_path / "nothing"))


def test_compatible_names_what_differs(tmp_path):
    fp = fingerprint(partitions=2)
    old = write_output(str(tmp_path / "old"), layout(corpus(20), 10, 1), fp=fp)
    ident = embedding_identity(fp)
    assert set(ident) == {"model", "normalize", "precision", "truncate_dim", "dimension"}
    assert compatible(OutputStore.open(old), ident) is None
    # the input, column, kept columns, partitions and library version are not the embedding's identity
    other_input = embedding_identity({**fp, "input": "zz", "keep": ["id"], "partitions": 9, "library": "9"})
    assert compatible(OutputStore.open(old), other_input) is None
    hub = {"kind": "path", "repo_id": "org/other", "commit": "0123456789abcdef0123"}
    why = compatible(OutputStore.open(old), {**ident, "model": hub})
    assert why == (
        "it was made with in-memory tests.Model (digest abababababab), this run uses org/other@0123456789ab"
    )
    why = compatible(
        OutputStore.open(old), {**ident, "model": {**fp["model"], "prompt": "query: "}, "normalize": True}
    )
    assert "this run uses in-memory tests.Model (digest abababababab) (prompt='query: ')" in why
    assert "it was made with normalize=False, this run uses normalize=True" in why
    assert (
        compatible(OutputStore.open(old), {**ident, "long_texts": "chunk"})
        == "it was made with long_texts=None, this run uses long_texts='chunk'"
    )
    with pytest.raises(
        SurgeInputError,
        match=r"cannot be reused: it was made with precision='float32', this "
        r"run uses precision='int8'.*Fix:",
    ):
        ReuseIndex(old, identity={**ident, "precision": "int8"})


def test_a_real_run(tmp_path):
    """An output written by dask_surge.encode (text_hash added here where the run did not write it)."""
    import dask.dataframe as dd

    import dask_surge
    from dask_surge.testing import checksum_model

    texts = corpus(90, seed=11)
    ddf = dd.from_pandas(pd.DataFrame({"text": texts}), npartitions=6)
    out = str(tmp_path / "real")
    dask_surge.encode(
        ddf, "text", output=out, model=checksum_model, keep=["text"], scheduler="sync", progress=False
    )
    manifest = existing_run(OutputStore.open(out))
    for rec in manifest.committed().values():
        path = f"{manifest.root}/{rec.file}"
        pf = pq.ParquetFile(path)
        if TEXT_HASH in pf.schema_arrow.names:
            continue
        groups = [pf.read_row_group(g) for g in range(pf.num_row_groups)]
        schema = pf.schema_arrow.append(text_hash_field())
        with pq.ParquetWriter(path, schema) as w:
            for g in groups:
                w.write_table(g.append_column(text_hash_field(), hash_column(text_hashes(g.column("text")))))
    ident = embedding_identity(manifest.fingerprint)
    index = open_index(out, identity=ident)
    assert open_index(out) is index
    new = [*texts[30:], "brand new"]
    got = index.lookup(text_hashes(new))
    assert got.found.tolist() == [True] * 60 + [False]
    read = dask_surge.read_embeddings(out).compute()
    by_text = dict(zip(read["text"], read["embedding"]))
    assert np.array(got.embedding.to_pylist()).tolist() == [list(by_text[t]) for t in texts[30:]]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    old=st.lists(st.text(alphabet="abc", max_size=3), min_size=1, max_size=60),
    new=st.lists(st.text(alphabet="abcd", max_size=3), max_size=60),
    per=st.integers(1, 7),
    bits=st.integers(0, 3),
    chunked=st.booleans(),
)
def test_lookup_agrees_with_a_dict(tmp_path_factory, old, new, per, bits, chunked):
    path = str(tmp_path_factory.mktemp("prop") / "old")
    write_output(path, layout(old, per, 2), chunked=chunked)
    index = ReuseIndex(path, bits=bits)
    first: dict[str, list] = {}
    for t in old:  # the first occurrence of each text, in data order
        first.setdefault(t, [vector(t, c) for c in range(n_chunks(t) if chunked else 1)])
    got = index.lookup(text_hashes(new))
    assert got.found.tolist() == [t in first for t in new]
    assert got.embedding.to_pylist() == [v for t in new if t in first for v in first[t]]


def test_memory_does_not_grow_with_the_old_output(tmp_path):
    """Build and lookup peaks (NumPy/Python allocations) for an output and one 10x its size."""
    peaks = []
    for n in (20_000, 200_000):
        texts = [f"text number {i}" for i in range(n)]
        old = write_output(str(tmp_path / f"o{n}"), layout(texts, 2_000, 1))
        tracemalloc.start()
        index = ReuseIndex(old, bucket_entries=4_096, spill_bytes=256 << 10, cache_bytes=1 << 20)
        build = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        got = index.lookup(text_hashes(texts[-5_000:]))
        lookup = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert got.found.all()
        peaks.append((build, lookup))
    (b1, l1), (b10, l10) = peaks
    assert b10 < 1.5 * b1 + (1 << 20), peaks
    assert l10 < 1.5 * l1 + (1 << 20), peaks


def test_one_process_builds_while_others_wait(tmp_path, monkeypatch):
    texts = corpus(200, seed=13)
    old = write_output(str(tmp_path / "old"), layout(texts, 20, 2))
    where = index_dir(str(tmp_path / "old"), existing_run(OutputStore.open(old)).run_id)
    os.makedirs(where)
    builds = []
    real_build = hashindex.OutputIndex.build

    def counting_build(self, **kw):
        builds.append(threading.current_thread().name)
        return real_build(self, **kw)

    monkeypatch.setattr(hashindex.OutputIndex, "build", counting_build)

    def note(**info):
        with open(f"{where}/BUILDING", "w") as f:
            json.dump({"time": time.time(), "host": "another-host", "pid": 1, **info}, f)

    # a live builder elsewhere: wait for its index, build nothing
    note()
    builder = threading.Thread(
        target=lambda: (time.sleep(0.5), ReuseIndex(old, rebuild=True)), name="builder"
    )
    builder.start()
    t0 = time.monotonic()
    index = ReuseIndex(old)
    builder.join()
    assert builds == ["builder"] and time.monotonic() - t0 >= 0.5
    check(index, texts, stored(old))
    assert not os.path.exists(f"{where}/BUILDING")
    # a builder that stopped beating (its lock last written two TTLs ago on the store's clock: the
    # file's modification time), or died on this host: not waited for
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    for info in (
        {"time": time.time() - 2 * hashindex.BUILD_STALE_S},
        {"host": socket.gethostname(), "pid": int(dead.stdout)},
    ):
        os.unlink(f"{where}/meta.json")
        note(**info)
        if "time" in info:
            os.utime(f"{where}/BUILDING", (info["time"], info["time"]))
        builds.clear()
        t0 = time.monotonic()
        check(ReuseIndex(old), texts, stored(old))
        assert builds == ["MainThread"] and time.monotonic() - t0 < hashindex.BUILD_STALE_S / 2


def test_open_index_reopens_an_output_replaced_in_place(tmp_path):
    texts = corpus(60, seed=17)
    path = str(tmp_path / "out")
    write_output(path, layout(texts[:30], 10, 1))
    first = open_index(path)
    assert open_index(path) is first and first.find(text_hashes(texts[:1])).found.all()
    # a new run completes in the same directory (overwrite=True), replacing the old one
    manifest, _ = open_run(
        OutputStore.open(path),
        fingerprint(partitions=3),
        overwrite=True,
        plan=RunPlan(b_min=1, b_max=10**6, mode="planned", partitions=3),
    )
    finish_run(
        manifest, manifest.committed(), {"rows": 0, "superbatches": 0, "nulls_skipped": 0, "partitions": 0}
    )
    second = open_index(path)
    assert second is not first and second.entries == 0 and not second.find(text_hashes(texts[:1])).found.any()


@pytest.mark.parametrize("how", ["flip", "rewrite"])
def test_a_file_damaged_after_it_was_checked_is_checked_again(tmp_path, how):
    # issue 60.1: a long-lived process (a notebook, a LocalCluster kept across runs) reuses an output,
    # which remembers each file as checked; the output is damaged afterwards: the next reuse in the
    # same process must refuse it, not copy the damaged rows (nor rows cached from before)
    texts = corpus(60, seed=5)
    old = write_output(str(tmp_path / "old"), layout(texts, 15, 2))  # two files of 30 texts
    truth = stored(old)
    index = ReuseIndex(old)
    check(index, texts, truth)  # both files hashed, their row groups cached
    target = _files(old)[0]
    if how == "flip":  # 16 bytes flipped in place: same size, same inode
        with open(target, "r+b") as f:
            f.seek(os.path.getsize(target) // 3)
            raw = f.read(16)
            f.seek(os.path.getsize(target) // 3)
            f.write(bytes(b ^ 0xFF for b in raw))
    else:  # a valid Parquet file written over it, every embedding wrong
        table = pq.read_table(target)
        pq.write_table(
            table.set_column(
                table.schema.get_field_index("embedding"),
                table.schema.field("embedding"),
                pa.array([[9.0] * DIM] * table.num_rows, table.schema.field("embedding").type),
            ),
            target,
        )
    with pytest.raises(SurgeInputError, match=re.escape(os.path.basename(target))):
        index.lookup(text_hashes(texts[:5]))
    check(index, texts[30:], truth)  # the untouched file is still copied from
