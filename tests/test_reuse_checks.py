"""Issue 51, items 3 and 4: ``reuse=`` checks what it copies.

A reused output's part files are checked against the sha256 their commit records hold before
a row of them is copied (flipped bytes, a truncated or deleted file stop the run with an error
naming the output and ``dask-surge status --verify``), and a reused text over the model's
window is counted as truncated, or refused with ``long_texts="error"``, as if it were encoded.
"""

from __future__ import annotations

import os
import re

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

import dask_surge
from dask_surge.errors import SurgeInputError
from dask_surge.io import hashindex, reuse
from dask_surge.io.hashing import text_hashes
from dask_surge.io.manifest import existing_run
from dask_surge.io.reuse import ReuseIndex
from dask_surge.io.verify import repair, verify
from dask_surge.testing import package_documents
from dask_surge.io.store import OutputStore

OPTS = {"device": "cpu", "keep": ["doc_id"], "b_min": 80, "b_max": 80, "progress": False}


def _texts(n: int) -> list[str]:
    """``n`` distinct real sentences (package descriptions this project did not write)."""
    seen: dict[str, None] = {}
    for doc in package_documents(200):
        for line in doc.splitlines():
            line = " ".join(line.split())
            if 30 < len(line) < 200:
                seen.setdefault(line)
        if len(seen) >= n:
            break
    assert len(seen) >= n, f"only {len(seen)} real sentences installed"
    return list(seen)[:n]


def _frame(texts: list[str], npartitions: int) -> dd.DataFrame:
    return dd.from_pandas(
        pd.DataFrame({"doc_id": range(len(texts)), "text": texts}), npartitions=npartitions, sort=False
    )


def _read(path: str) -> pd.DataFrame:
    return dask_surge.read_embeddings(path).compute().sort_values(["partition", "row"]).reset_index(drop=True)


def _part_files(path: str) -> list[str]:
    """The old output's part files, in data order."""
    manifest = existing_run(OutputStore.open(path))
    return [f"{manifest.root}/{rec.file}" for rec in manifest.committed().values()]


def _flip_embedding_bytes(path: str, n: int = 16) -> None:
    """Flip ``n`` bytes inside the stored float values of the first row group's embedding column
    (uncompressed by default): the file still reads, two rows' values are wrong."""
    rg = pq.ParquetFile(path).metadata.row_group(0)
    col = next(
        rg.column(i) for i in range(rg.num_columns) if rg.column(i).path_in_schema.startswith("embedding")
    )
    at = col.data_page_offset + col.total_compressed_size - 200  # the page's last values
    with open(path, "r+b") as f:
        f.seek(at)
        data = f.read(n)
        f.seek(at)
        f.write(bytes(b ^ 0x40 for b in data))


@pytest.fixture
def old(tmp_path, tiny_model):
    """A complete output of 240 texts in three SuperBatches (three part files), and its texts."""
    texts = _texts(240)
    path = str(tmp_path / "old")
    dask_surge.encode(_frame(texts, 6), "text", output=path, model=tiny_model, scheduler="sync", **OPTS)
    assert len(_part_files(path)) == 3
    return path, texts


def test_flipped_bytes_in_a_reused_file_stop_the_run_and_are_never_copied(tmp_path, tiny_model, old, client):
    a, texts = old
    damaged = _part_files(a)[1]
    _flip_embedding_bytes(damaged)
    assert pq.read_table(damaged).num_rows == 80  # it still reads: only its sha256 tells
    b = str(tmp_path / "new")
    new = _frame(texts[::-1], 6)  # every text moved: each SuperBatch copies from every old file
    with pytest.raises(
        SurgeInputError,
        match=re.escape(f"reuse={a!r}")
        + r".*"
        + re.escape(os.path.basename(damaged))
        + r".*sha256.*dask-surge status --verify "
        + re.escape(a),
    ):
        dask_surge.encode(new, "text", output=b, model=tiny_model, reuse=a, **OPTS)
    assert dask_surge.status(b)["state"] != "complete" and verify(b) == []

    # the fix the error names: --verify shows the damage, --repair and a rerun encode those rows again
    assert any(os.path.basename(damaged) in line for line in verify(a))
    repair(a)
    dask_surge.encode(_frame(texts, 6), "text", output=a, model=tiny_model, scheduler="sync", **OPTS)
    assert verify(a) == []
    resumed = dask_surge.encode(new, "text", output=b, model=tiny_model, reuse=a, **OPTS)
    assert resumed.resumed and resumed.reused == len(texts)  # every text copied, none encoded
    fresh = str(tmp_path / "fresh")
    dask_surge.encode(new, "text", output=fresh, model=tiny_model, scheduler="sync", **OPTS)
    got, want = _read(b), _read(fresh)
    assert got["text_hash"].tolist() == want["text_hash"].tolist()
    np.testing.assert_allclose(np.stack(got["embedding"]), np.stack(want["embedding"]), atol=1e-5)


@pytest.mark.parametrize("index_built", [False, True], ids=["index-built-by-the-run", "index-built-before"])
def test_a_truncated_reused_file_is_a_clear_error(tmp_path, tiny_model, old, client, index_built):
    a, texts = old
    if index_built:  # the damage then shows where a worker copies rows, not where the index is built
        ReuseIndex(a).close()
    damaged = _part_files(a)[2]
    with open(damaged, "r+b") as f:
        f.truncate(os.path.getsize(damaged) // 2)
    with pytest.raises(
        SurgeInputError,
        match=re.escape(f"reuse={a!r}")
        + r".*"
        + re.escape(os.path.basename(damaged))
        + r".*dask-surge status --verify "
        + re.escape(a),
    ):
        dask_surge.encode(
            _frame(texts, 6), "text", output=str(tmp_path / "new"), model=tiny_model, reuse=a, **OPTS
        )


def test_a_deleted_reused_file_is_a_clear_error(tmp_path, tiny_model, old):
    a, texts = old
    ReuseIndex(a).close()
    gone = _part_files(a)[0]
    os.unlink(gone)
    with pytest.raises(
        SurgeInputError,
        match=re.escape(f"reuse={a!r}")
        + r".*"
        + re.escape(os.path.basename(gone))
        + r".*missing.*dask-surge status --verify "
        + re.escape(a),
    ):
        dask_surge.encode(
            _frame(texts, 6),
            "text",
            output=str(tmp_path / "new"),
            model=tiny_model,
            reuse=a,
            scheduler="sync",
            **OPTS,
        )
    with pytest.raises(SurgeInputError, match="dask-surge status --verify"):  # plan's estimate reads it too
        dask_surge.plan(_frame(texts, 6), "text", reuse=a)


def test_each_reused_file_is_hashed_once_per_index(tmp_path, old, monkeypatch):
    a, texts = old
    checked: list[str] = []
    real = hashindex.OutputIndex.check_file

    def counting(self, f):
        checked.append(self.files[f])
        return real(self, f)

    monkeypatch.setattr(hashindex.OutputIndex, "check_file", counting)
    with ReuseIndex(a, cache_bytes=0, max_open=1) as index:  # nothing cached but what was verified
        for lo in range(0, 240, 20):
            got = index.lookup(text_hashes(texts[lo : lo + 20] + texts[::-37]))
            assert got.found.all()
    assert sorted(checked) == sorted(os.path.basename(p) for p in _part_files(a))


# -- the long-text rule ------------------------------------------------------------------------


@pytest.fixture
def with_long(tmp_path, tiny_model):
    """An output of 58 short texts and 2 over the model's window (128 tokens), made with the default
    ``long_texts="truncate"``, and its texts."""
    docs = [d[:3000] for d in package_documents(2, min_chars=1500)]
    texts = _texts(58)
    texts[10:10] = [docs[0]]
    texts[40:40] = [docs[1]]
    path = str(tmp_path / "old")
    result = dask_surge.encode(
        _frame(texts, 3),
        "text",
        output=path,
        model=tiny_model,
        scheduler="sync",
        **{**OPTS, "b_min": 20, "b_max": 20},
    )
    assert result.truncated == 2
    return path, texts


def test_a_reused_text_over_the_window_is_counted_as_truncated(tmp_path, tiny_model, with_long, client):
    a, texts = with_long
    new = _frame([*texts[::-1], "a new short text", "another new one"], 4)
    b = str(tmp_path / "new")
    result = dask_surge.encode(new, "text", output=b, model=tiny_model, reuse=a, **OPTS)
    assert result.reused == len(texts) and result.encoded == 2
    assert result.truncated == 2 and dask_surge.status(b)["truncated"] == 2
    fresh = dask_surge.encode(new, "text", output=str(tmp_path / "fresh"), model=tiny_model, **OPTS)
    assert fresh.truncated == result.truncated


def test_a_reused_text_over_the_window_is_refused_with_long_texts_error(
    tmp_path, tiny_model, with_long, client
):
    a, texts = with_long
    with pytest.raises(
        SurgeInputError,
        match=r"the text at partition \d+, row \d+ is [\d,]+ tokens long, over "
        r"the model's window of 126 tokens, and long_texts='error'",
    ):
        dask_surge.encode(
            _frame(texts, 3),
            "text",
            output=str(tmp_path / "new"),
            model=tiny_model,
            reuse=a,
            long_texts="error",
            **OPTS,
        )
    short = [t for t in texts if len(t) < 1000]  # no text over the window: nothing refused
    result = dask_surge.encode(
        _frame(short, 3),
        "text",
        output=str(tmp_path / "short"),
        model=tiny_model,
        reuse=a,
        long_texts="error",
        **OPTS,
    )
    assert result.reused == len(short) and result.truncated == 0
