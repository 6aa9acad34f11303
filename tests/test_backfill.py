"""Backfill an embedding column into an existing Lance table: in place, resumable after a kill,
readable throughout, and a later backfill encodes only the rows added or changed since."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from dask_surge.backfill import backfill
from dask_surge.errors import SurgeInputError
from dask_surge.testing import checksum_model

lance = pytest.importorskip("lance")

N = 1000


def _table(path, n: int = N, start: int = 0):
    texts = [f"row {i} " + "word " * (i % 9) for i in range(start, start + n)]
    lance.write_dataset(
        pa.table({"id": pa.array(range(start, start + n), pa.int64()), "text": texts}),
        str(path),
        max_rows_per_file=300,
    )


def _check(path) -> None:
    """Every row with a text holds the embedding of its text."""
    df = lance.dataset(str(path)).to_table().to_pandas()
    assert df.embedding.notna().all()
    np.testing.assert_array_equal(np.stack(df.embedding.to_numpy()), checksum_model(df.text.tolist()))


def test_backfill_then_only_new_and_changed_rows(tmp_path):
    path = tmp_path / "t.lance"
    _table(path)
    first = backfill(path, "text", key="id", model=checksum_model, scheduler="threads", chunk_rows=400)
    assert (first.rows, first.encoded) == (N, N)
    _check(path)
    version = lance.dataset(str(path)).version
    again = backfill(path, "text", key="id", model=checksum_model, scheduler="threads")
    assert again.encoded == 0 and again.versions == 0 and lance.dataset(str(path)).version == version
    # 100 new rows (their embedding null), and one row's text changed
    ds = lance.dataset(str(path))
    new = pa.table(
        {
            "id": pa.array(range(N, N + 100), pa.int64()),
            "text": [f"new {i}" for i in range(100)],
            "embedding": pa.nulls(100, ds.schema.field("embedding").type),
            "embedding_text_hash": pa.nulls(100, pa.binary(16)),
        }
    )
    lance.write_dataset(new, str(path), mode="append")
    lance.dataset(str(path)).update({"text": "'a changed text'"}, where="id = 7")
    later = backfill(path, "text", key="id", model=checksum_model, scheduler="threads")
    assert (later.rows, later.encoded) == (N + 100, 101)
    _check(path)


def test_backfill_refuses_a_missing_column(tmp_path):
    _table(tmp_path / "t.lance", 10)
    with pytest.raises(SurgeInputError, match=r"no key column 'doc'"):
        backfill(tmp_path / "t.lance", "text", key="doc", model=checksum_model, scheduler="threads")


DRIVER = """
import os, signal, sys
import dask_surge.backfill as bf
from dask_surge.testing import checksum_model
real, calls = bf.encode, []
def encode(*a, **k):  # test hook: SIGKILL this process while it encodes its second chunk
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a, **k)
bf.encode = encode
bf.backfill(sys.argv[1], "text", key="id", model=checksum_model, scheduler="threads", chunk_rows=300)
"""


def test_a_killed_backfill_keeps_its_chunks_and_a_rerun_encodes_the_rest(tmp_path):
    path = tmp_path / "t.lance"
    _table(path)
    killed = subprocess.run(
        [sys.executable, "-c", DRIVER, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    df = lance.dataset(str(path)).to_table().to_pandas()  # readable: the first chunk in, the rest null
    assert df.embedding.notna().sum() == 300 and len(df) == N
    done = backfill(path, "text", key="id", model=checksum_model, scheduler="threads")
    assert done.encoded == N - 300
    _check(path)
