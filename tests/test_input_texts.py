"""A text column of non-strings stops the run under Dask's default ``dataframe.convert-string`` too
(issue 51, item 10): checked in the pandas DataFrame given to ``dd.from_pandas``, as built."""

from __future__ import annotations

import dask
import dask.dataframe as dd
import pandas as pd
import pytest

import dask_surge
from dask_surge import SurgeInputError
from dask_surge.testing import checksum_model

KW = {"b_min": 2, "b_max": 4, "scheduler": "sync", "progress": False, "model": checksum_model}


@pytest.mark.parametrize("convert_string", [True, False])
def test_mixed_values_in_an_object_column_stop_the_run(tmp_path, convert_string):
    """[5, "a", 3.5, b"bytes"] was encoded as "5", "a", "3.5", "bytes" with convert-string on."""
    frame = pd.DataFrame({"text": pd.Series([5, "a", 3.5, b"bytes"], dtype=object), "doc_id": range(4)})
    out = tmp_path / "o"
    with dask.config.set({"dataframe.convert-string": convert_string}):
        ddf = dd.from_pandas(frame, npartitions=2)
        # converted, the DataFrame as built is checked; kept as objects, each task checks its values
        where = (
            "at index 0 of the pandas DataFrame given to dd.from_pandas"
            if convert_string
            else "in partition 0, row 0"
        )
        with pytest.raises(SurgeInputError, match=rf"holds a int \(5\) {where}: only strings can be encoded"):
            ddf.surge.encode("text", str(out), **KW)
        if convert_string:
            with pytest.raises(SurgeInputError, match="holds a int"):  # plan() checks as encode() does
                ddf.surge.plan("text", b_min=2, b_max=4)
    assert not list(out.glob("part-*.parquet"))


def test_the_first_non_string_is_named_and_nulls_pass_the_check(tmp_path):
    frame = pd.DataFrame(
        {
            "text": pd.Series(
                ["a", None, float("nan"), "b", 3.5, "c"], dtype=object, index=[10, 11, 12, 13, 14, 15]
            )
        }
    )
    with pytest.raises(SurgeInputError, match=r"holds a float \(3.5\) at index 14 .*astype\(str\)"):
        dd.from_pandas(frame, npartitions=1).surge.encode("text", str(tmp_path / "o"), on_null="skip", **KW)


def test_string_and_bytes_columns_and_a_column_converted_in_dask_still_encode(tmp_path):
    strings = pd.DataFrame({"text": pd.Series(["a", None, "b"], dtype=object)})
    dd.from_pandas(strings, npartitions=1).surge.encode("text", str(tmp_path / "s"), on_null="skip", **KW)
    assert dask_surge.status(str(tmp_path / "s"))["rows_committed"] == 2
    raw = pd.DataFrame(
        {"text": pd.Series([b"ab", b"c"], dtype=object)}
    )  # Dask decodes UTF-8 bytes, as before
    assert dd.from_pandas(raw, npartitions=1).surge.encode("text", str(tmp_path / "b"), **KW).rows == 2
    mixed = dd.from_pandas(pd.DataFrame({"text": pd.Series([5, "a"], dtype=object)}), npartitions=1)
    converted = mixed.assign(text=mixed.text.astype(str))  # the user converted it in Dask: not refused
    assert converted.surge.encode("text", str(tmp_path / "c"), **KW).rows == 2
    back = dask_surge.read_embeddings(str(tmp_path / "c")).compute()
    assert len(back) == 2
