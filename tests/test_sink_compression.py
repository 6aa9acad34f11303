"""The embedding column's Parquet codec: none by default, surge.compression to choose (issue 17 item 6)."""

from __future__ import annotations

import dask.config
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dask_surge.errors import SurgeValueError
from dask_surge.io.arrow import embedding_array
from dask_surge.io.partfiles import parquet_bytes
from dask_surge.options import COMPRESSIONS


def _table(n: int = 50, d: int = 8) -> pa.Table:
    emb = np.random.default_rng(0).standard_normal((n, d)).astype(np.float32)
    return pa.table(
        {
            "partition": np.repeat([0, 1], [20, n - 20]),
            "row": np.r_[np.arange(20), np.arange(n - 20)],
            "text": ["t"] * n,
            "embedding": embedding_array(emb),
        }
    )


def _codecs(data) -> dict[str, str]:
    md = pq.ParquetFile(pa.BufferReader(data)).metadata.row_group(0)
    return {md.column(i).path_in_schema: md.column(i).compression for i in range(md.num_columns)}


def test_embedding_is_uncompressed_by_default_other_columns_zstd():
    table = _table()
    codecs = _codecs(parquet_bytes(table, [20, 30]))
    assert codecs == {
        "partition": "ZSTD",
        "row": "ZSTD",
        "text": "ZSTD",
        "embedding.list.element": "UNCOMPRESSED",
    }


@pytest.mark.parametrize("codec", COMPRESSIONS)
def test_each_codec_round_trips(codec):
    table = _table()
    data = parquet_bytes(table, [20, 30], compression=codec)
    assert _codecs(data)["embedding.list.element"] == ("UNCOMPRESSED" if codec == "none" else codec.upper())
    back = pq.read_table(pa.BufferReader(data))
    assert back.equals(table) and pq.ParquetFile(pa.BufferReader(data)).num_row_groups == 2


def test_config_chooses_the_codec_and_bad_values_are_refused():
    with dask.config.set({"surge.compression": "zstd"}):
        assert _codecs(parquet_bytes(_table(), [20, 30]))["embedding.list.element"] == "ZSTD"
    with pytest.raises(SurgeValueError, match=r"surge.compression='brotli' is not allowed.*Fix"):
        parquet_bytes(_table(), [20, 30], compression="brotli")


def test_bytes_are_a_view_not_a_copy():
    data = parquet_bytes(_table(), [20, 30])
    assert isinstance(data, memoryview) and bytes(data[:4]) == b"PAR1" and len(data) == data.nbytes


def test_the_clients_codec_reaches_the_workers(tmp_path, client):
    """surge.compression set on the client (not in the workers' config) decides the codec."""
    import dask
    import pyarrow.parquet as pq

    from dask_surge.testing import checksum_model, make_partitioned_frame

    out = tmp_path / "o"
    with dask.config.set({"surge.compression": "zstd"}):
        make_partitioned_frame([5, 7], seed=2).surge.encode(
            "text", str(out), model=checksum_model, progress=False
        )
    files = sorted(out.glob("part-*.parquet"))
    assert files
    for path in files:
        group = pq.read_metadata(path).row_group(0)
        codecs = {
            group.column(i).path_in_schema.split(".")[0]: group.column(i).compression
            for i in range(group.num_columns)
        }
        assert codecs["embedding"] == "ZSTD"
