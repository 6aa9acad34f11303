"""Backfill an embedding column into an existing Lance or Delta table: in place, resumable after a
kill, readable throughout, and a later backfill encodes only the rows added or changed since."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from dask_surge.backfill import BACKFILL_PROPERTY, backfill
from dask_surge.errors import SurgeInputError, SurgeValueError
from dask_surge.testing import BACKFILL_KILLED, checksum_model

N = 1000
FORMATS = ["lance", "delta"]


def _module(fmt: str):
    return pytest.importorskip("lance" if fmt == "lance" else "deltalake")


def _write(fmt: str, path, data: pa.Table, mode: str = "create") -> None:
    if fmt == "lance":
        _module(fmt).write_dataset(data, str(path), mode=mode, max_rows_per_file=300)
    else:
        _module(fmt).write_deltalake(str(path), data, mode="append" if mode == "append" else "error")


def _table(fmt: str, path, n: int = N, start: int = 0, ids=None) -> None:
    ids = list(range(start, start + n)) if ids is None else ids
    texts = [f"row {i} " + "word " * (i % 9) for i in ids]
    _write(fmt, path, pa.table({"id": pa.array(ids, pa.int64()), "text": texts}))


def _read(fmt: str, path) -> pa.Table:
    if fmt == "lance":
        return _module(fmt).dataset(str(path)).to_table()
    return _module(fmt).DeltaTable(str(path)).to_pyarrow_table()


def _commit_properties(fmt: str, path) -> list[dict]:
    """The commit metadata of every table version, oldest first."""
    if fmt == "lance":
        ds = _module(fmt).dataset(str(path))
        txns = [ds.read_transaction(v["version"]) for v in ds.versions()]
        return [(t.transaction_properties or {}) if t is not None else {} for t in txns]
    return sorted(_module(fmt).DeltaTable(str(path)).history(), key=lambda h: h["version"])


def _check(fmt: str, path) -> dict[int, np.ndarray]:
    """Every row with a text holds the embedding of its text, each key once; returns key -> vector."""
    df = _read(fmt, path).to_pandas().sort_values("id")
    assert df.id.is_unique
    assert df.embedding.notna().all()
    assert _read(fmt, path).schema.field("embedding").type.value_type == pa.float32()  # as the model gives
    vectors = np.stack(df.embedding.to_numpy())
    np.testing.assert_array_equal(vectors, checksum_model(df.text.tolist()))
    return dict(zip(df.id.tolist(), vectors))


def _run(path, **kw):
    return backfill(path, "text", key="id", model=checksum_model, scheduler="threads", **kw)


@pytest.mark.parametrize("fmt", FORMATS)
def test_backfill_then_only_new_and_changed_rows(tmp_path, fmt):
    path = tmp_path / f"t.{fmt}"
    _table(fmt, path)
    first = _run(path, chunk_rows=400)
    assert (first.rows, first.encoded) == (N, N)
    before = _check(fmt, path)
    marks = [
        json.loads(p[BACKFILL_PROPERTY]) for p in _commit_properties(fmt, path) if BACKFILL_PROPERTY in p
    ]
    assert [(m["chunk"], m["rows"], m["column"]) for m in marks] == [
        (0, 400, "embedding"),
        (1, 400, "embedding"),
        (2, 200, "embedding"),
    ]
    assert len({m["id"] for m in marks}) == 1
    versions = len(_commit_properties(fmt, path))
    again = _run(path)
    assert again.encoded == 0 and again.versions == 0 and len(_commit_properties(fmt, path)) == versions
    # 100 new rows (their embedding null), and one row's text changed
    schema = _read(fmt, path).schema
    new = pa.table(
        {
            "id": pa.array(range(N, N + 100), pa.int64()),
            "text": [f"new {i}" for i in range(100)],
            "embedding": pa.nulls(100, schema.field("embedding").type),
            "embedding_text_hash": pa.nulls(100, schema.field("embedding_text_hash").type),
        }
    )
    _write(fmt, path, new, mode="append")
    if fmt == "lance":
        _module(fmt).dataset(str(path)).update({"text": "'a changed text'"}, where="id = 7")
    else:
        _module(fmt).DeltaTable(str(path)).update({"text": "'a changed text'"}, predicate="id = 7")
    later = _run(path)
    assert (later.rows, later.encoded) == (N + 100, 101)
    after = _check(fmt, path)
    assert not np.array_equal(after[7], before[7])
    for i in range(N):  # the old rows keep the embedding they had, but the changed one
        if i != 7:
            np.testing.assert_array_equal(after[i], before[i])


@pytest.mark.parametrize("fmt", FORMATS)
def test_backfill_refuses_a_missing_column(tmp_path, fmt):
    _table(fmt, tmp_path / "t", 10)
    with pytest.raises(SurgeInputError, match=r"no key column 'doc'"):
        backfill(tmp_path / "t", "text", key="doc", model=checksum_model, scheduler="threads")
    with pytest.raises(SurgeInputError, match=r"no text column 'body'"):
        backfill(tmp_path / "t", "body", key="id", model=checksum_model, scheduler="threads")


@pytest.mark.parametrize("fmt", FORMATS)
def test_backfill_refuses_repeated_keys_before_writing(tmp_path, fmt):
    path = tmp_path / "t"
    _table(fmt, path, ids=[0, 1, 2, 2, 3, 4, 4, 4])
    with pytest.raises(
        SurgeInputError, match=r"'id' .* not unique: 2 value\(s\) occur more than once \(e.g. 2, 2 times\)"
    ):
        _run(path)
    assert "embedding" not in _read(fmt, path).schema.names


@pytest.mark.parametrize("fmt", FORMATS)
def test_backfill_refuses_a_column_of_another_dimension(tmp_path, fmt):
    path = tmp_path / "t"
    _table(fmt, path, 5)
    _run(path, column="emb")  # checksum_model: 2 numbers per text
    schema = _read(fmt, path).schema
    one = {"id": pa.array([5], pa.int64()), "text": ["a new row"]}
    _write(
        fmt,
        path,
        pa.table({**one, **{n: pa.nulls(1, schema.field(n).type) for n in ("emb", "emb_text_hash")}}),
        "append",
    )
    versions = len(_commit_properties(fmt, path))

    def three(texts):
        return np.zeros((len(texts), 3), np.float32)

    with pytest.raises(
        SurgeInputError,
        match=r"column 'emb' .* dimension 2, and the model gives float vectors of dimension 3.*Fix: pass another column=",
    ):
        backfill(path, "text", key="id", column="emb", model=three, scheduler="threads", rebuild=True)
    assert len(_commit_properties(fmt, path)) == versions


def test_delta_refuses_float16_vectors(tmp_path):
    _table("delta", tmp_path / "t", 5)
    with pytest.raises(SurgeInputError, match=r"float16 vectors, and a Delta table has no float16 type"):
        _run(tmp_path / "t", precision="float16")
    assert "embedding" not in _read("delta", tmp_path / "t").schema.names


def test_backfill_refuses_what_is_not_a_lance_or_delta_table(tmp_path):
    import pandas as pd

    with pytest.raises(
        SurgeInputError, match=r"is not a table backfill writes \(lance, delta\): nothing is there"
    ):
        _run(tmp_path / "nowhere")
    pd.DataFrame({"id": [1], "text": ["a"]}).to_parquet(tmp_path / "part-0.parquet")
    with pytest.raises(
        SurgeInputError,
        match=r"a directory holding \['part-0.parquet'\]. Fix: pass the root of such a table \(holding "
        r"_versions/ \(lance\) or _delta_log/ \(delta\)\)",
    ):
        _run(tmp_path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_killed_backfill_keeps_its_chunks_and_a_rerun_encodes_the_rest(tmp_path, fmt):
    path = tmp_path / f"t.{fmt}"
    _table(fmt, path)
    killed = subprocess.run(
        [sys.executable, "-c", BACKFILL_KILLED, str(path), "", "300"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    df = _read(fmt, path).to_pandas()  # readable: the first chunk in, the rest null
    assert df.embedding.notna().sum() == 300 and len(df) == N and df.id.is_unique
    done = _run(path)
    assert done.encoded == N - 300
    _check(fmt, path)


S3_DRIVER = """
import json, sys
import pyarrow as pa
from dask_surge.backfill import backfill
from dask_surge.io.tables.locations import object_store_options
from dask_surge.testing import BACKFILL_KILLED, checksum_model
fmt, url, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
store = object_store_options(url, options)
def write(data, mode):
    if fmt == "lance":
        import lance
        lance.write_dataset(data, url, mode=mode, storage_options=store)
    else:
        import deltalake
        deltalake.write_deltalake(url, data, mode="append" if mode == "append" else "error", storage_options=store)
def read():
    if fmt == "lance":
        import lance
        return lance.dataset(url, storage_options=store).to_table()
    import deltalake
    return deltalake.DeltaTable(url, storage_options=store).to_pyarrow_table()
write(pa.table({"id": pa.array(range(500), pa.int64()), "text": [f"row {i}" for i in range(500)]}), "create")
run = lambda: backfill(url, "text", key="id", model=checksum_model, scheduler="threads", chunk_rows=200,
                       storage_options=options).encoded
first = run()
schema = read().schema
write(pa.table({"id": pa.array(range(500, 600), pa.int64()), "text": [f"new {i}" for i in range(100)],
                "embedding": pa.nulls(100, schema.field("embedding").type),
                "embedding_text_hash": pa.nulls(100, schema.field("embedding_text_hash").type)}), "append")
second = run()
df = read().to_pandas().sort_values("id")
print(json.dumps([first, second, df.id.tolist(), df.text.tolist(), [list(map(float, v)) for v in df.embedding]]))
"""


@pytest.mark.parametrize("fmt", FORMATS)
def test_backfill_on_loopback_s3(tmp_path, fmt):
    """In another process: deltalake holds the GIL while it waits on this process's moto server."""
    pytest.importorskip("moto.server")
    _module(fmt)
    from dask_surge.testing import loopback_s3

    with loopback_s3(f"surge-backfill-{fmt}") as (_, options, _fs):  # moto's buckets outlive a server
        done = subprocess.run(
            [sys.executable, "-c", S3_DRIVER, fmt, f"s3://surge-backfill-{fmt}/t", json.dumps(options)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    first, second, ids, texts, vectors = json.loads(done.stdout)
    assert (first, second) == (500, 100) and ids == list(range(600))
    np.testing.assert_array_equal(np.array(vectors, np.float32), checksum_model(texts))


# -- what made the column is recorded, and other options are refused (issue 68) ---------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_backfill_with_other_options_is_refused_naming_them(tmp_path, fmt):
    path = tmp_path / f"t.{fmt}"
    _table(fmt, path, 20)
    _run(path)
    with pytest.raises(
        SurgeInputError, match=r"made with other options: .*truncate_dim.*Fix: .*rebuild=True"
    ):
        _run(path, truncate_dim=1)
    _check(fmt, path)  # untouched: every vector still the model's own
    again = _run(path)  # the same options: nothing to do, no refusal
    assert again.encoded == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_rebuild_re_encodes_every_row_and_records_the_new_options(tmp_path, fmt):
    path = tmp_path / f"t.{fmt}"
    _table(fmt, path, 20)
    _run(path)
    res = _run(path, normalize=True, rebuild=True)
    assert res.encoded == 20
    df = _read(fmt, path).to_pandas()
    assert np.allclose(np.linalg.norm(np.stack(df.embedding.to_numpy()), axis=1), 1.0, atol=1e-5)
    assert _run(path, normalize=True).encoded == 0  # recorded: a rerun with them is at ease
    with pytest.raises(SurgeInputError, match=r"normalize=True, this backfill uses normalize=False"):
        _run(path)


@pytest.mark.parametrize("option", ["build_index", "format", "keep", "output"])
def test_options_that_mean_nothing_to_a_backfill_are_refused(tmp_path, option):
    path = tmp_path / "t.lance"
    _table("lance", path, 5)
    before = len(_commit_properties("lance", path))
    value = {"build_index": True, "format": "delta", "keep": ["id"], "output": "x"}[option]
    with pytest.raises(
        SurgeValueError, match=rf"{option}=.*means nothing to a backfill.*Nothing was written"
    ):
        _run(path, **{option: value})
    assert len(_commit_properties("lance", path)) == before


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_table_object_is_accepted_where_a_path_is(tmp_path, fmt):
    path = tmp_path / f"t.{fmt}"
    _table(fmt, path, 10)
    if fmt == "lance":
        import lancedb

        obj = lancedb.connect(str(tmp_path)).open_table("t")
    else:
        import deltalake

        obj = deltalake.DeltaTable(str(path))
    assert backfill(obj, "text", key="id", model=checksum_model, scheduler="threads").encoded == 10
    _check(fmt, path)


def test_a_delta_table_is_appended_to_after_a_backfill_with_the_schema_merged(tmp_path):
    """What docs/output.md says to do: a plain append of the original columns fails after a backfill
    added its two; with schema_mode="merge" it works, and the next backfill encodes only those rows."""
    import deltalake

    path = tmp_path / "t.delta"
    _table("delta", path, 10)
    _run(path)
    new = pa.table({"id": pa.array([100, 101], pa.int64()), "text": ["new one", "new two"]})
    with pytest.raises(Exception, match=r"(?i)schema"):
        deltalake.write_deltalake(str(path), new, mode="append")
    deltalake.write_deltalake(str(path), new, mode="append", schema_mode="merge")
    assert _run(path).encoded == 2
    _check("delta", path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_backfill_shows_progress_as_encode_does(tmp_path, fmt, capsys, monkeypatch):
    monkeypatch.setenv("TQDM_MININTERVAL", "0")  # every update drawn: nothing depends on timing
    monkeypatch.setenv("TQDM_MINITERS", "1")
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    path = tmp_path / f"t.{fmt}"
    _table(fmt, path, n=50)
    capsys.readouterr()
    _run(path, chunk_rows=20, progress=True)
    states = [
        s.strip()
        for s in re.split(r"[\r\n]", capsys.readouterr().err)
        if s.strip().startswith("dask-surge [")
    ]
    assert any(s.startswith("dask-surge [encoding]") for s in states), states
    assert states[-1].startswith("dask-surge [done]") and "50/50 rows" in states[-1], states[-1]
    quiet = tmp_path / f"u.{fmt}"
    _table(fmt, quiet, n=5)
    assert _run(quiet, progress=False).encoded == 5
    assert "dask-surge" not in capsys.readouterr().err
