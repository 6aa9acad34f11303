"""Backfill keys compared as the table compares them (issue 67, b): ``0.0`` and ``-0.0`` are one key
to a MERGE, and a NaN key matches no row, so both are refused before anything is written (they used to
pass the uniqueness check: Delta then failed with a raw "MERGE matched a target row with multiple
source rows", and a NaN key's chunk was never written back)."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest

from dask_surge.backfill import backfill
from dask_surge.errors import SurgeInputError
from dask_surge.testing import checksum_model

FORMATS = ["lance", "delta"]


def _table(fmt: str, path, keys: list[float]) -> None:
    data = pa.table({"id": pa.array(keys, pa.float64()), "text": [f"row {i}" for i in range(len(keys))]})
    if fmt == "lance":
        pytest.importorskip("lance").write_dataset(data, str(path))
    else:
        pytest.importorskip("deltalake").write_deltalake(str(path), data)


def _names(fmt: str, path) -> list[str]:
    if fmt == "lance":
        return pytest.importorskip("lance").dataset(str(path)).schema.names
    return pytest.importorskip("deltalake").DeltaTable(str(path)).schema().to_arrow().names


def _run(path):
    return backfill(path, "text", key="id", model=checksum_model, scheduler="sync", progress=False)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_and_negative_zero_are_one_key(tmp_path, fmt):
    path = tmp_path / "t"
    _table(fmt, path, [0.0, 1.0, -0.0, 2.0])
    with pytest.raises(
        SurgeInputError,
        match=r"'id' .* not unique as the table compares keys: 1 value\(s\) occur more than once "
        r"\(e\.g\. 0\.0, 2 times; 0\.0 and -0\.0 are one key\).*Nothing was written.*Fix:",
    ):
        _run(path)
    assert "embedding" not in _names(fmt, path)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("keys", [[math.nan], [1.0, math.nan, 2.0, math.nan]])
def test_a_nan_key_is_refused(tmp_path, fmt, keys):
    path = tmp_path / "t"
    _table(fmt, path, keys)
    with pytest.raises(
        SurgeInputError,
        match=rf"'id' .* has {sum(map(math.isnan, keys))} NaN value\(s\); "
        r"NaN equals no key.*Nothing was written.*Fix:",
    ):
        _run(path)
    assert "embedding" not in _names(fmt, path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_distinct_float_keys_are_backfilled(tmp_path, fmt):
    path = tmp_path / "t"
    _table(fmt, path, [0.0, 1.5, -2.0])
    assert _run(path).encoded == 3
