"""A part file's row groups: whole source partitions, consecutive, at least ROW_GROUP_ROWS rows each but the last."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
from hypothesis import given
from hypothesis import strategies as st

from dask_surge.io.partfiles import ROW_GROUP_ROWS, row_groups
from dask_surge.testing import checksum_model, make_partitioned_frame


@given(st.lists(st.integers(0, 3000), max_size=60), st.integers(1, 2048))
def test_row_groups_hold_whole_partitions_and_reach_the_floor(sizes, floor):
    groups = row_groups(sizes, floor=floor)
    assert sum(groups) == sum(sizes)
    assert all(g >= floor for g in groups[:-1]) and all(g > 0 for g in groups)
    # every group boundary is a partition boundary, and a group closes as soon as it reaches the floor
    bounds = set(np.cumsum(sizes).tolist())
    at = 0
    for g in groups:
        at += g
        assert at in bounds
    for g, start in zip(groups, np.cumsum([0, *groups[:-1]])):
        inner = [b - start for b in sorted(bounds) if start < b < start + g]
        assert all(b < floor for b in inner), (g, inner)


def test_a_run_of_tiny_partitions_writes_few_row_groups_and_a_partition_is_found_from_the_footer(
    tmp_path, client
):
    sizes = [7] * 300 + [1500, 3]
    out = tmp_path / "o"
    ddf = make_partitioned_frame(sizes, seed=4)
    ddf.surge.encode("text", str(out), model=checksum_model, progress=False)
    files = sorted(out.glob("part-*.parquet"))
    groups = [pq.ParquetFile(f).metadata.num_row_groups for f in files]
    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    assert rows == sum(sizes)
    assert sum(groups) < len(sizes) // 10, groups  # not one per partition
    for f in files:
        md = pq.ParquetFile(f).metadata
        for g in range(md.num_row_groups - 1):
            assert md.row_group(g).num_rows >= ROW_GROUP_ROWS
    # a reader filtering on `partition` reads exactly that partition's rows
    back = pq.read_table(out, filters=[("partition", "==", 150)]).to_pandas()
    assert back["row"].tolist() == list(range(7))
    big = pq.read_table(out, filters=[("partition", "==", 300)]).to_pandas()
    assert sorted(big["row"].tolist()) == list(range(1500))
