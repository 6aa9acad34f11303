"""A SuperBatch's rows gathered from partitions read as one frame (FrameRows) match the per-partition path."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pandas as pd
import pytest

from dask_surge import Encoder, SurgeInputError
from dask_surge.execution.superbatch import SuperBatchTask
from dask_surge.io.frames import FrameRows
from dask_surge.io.layout import output_columns
from dask_surge.planning.policy import Span


def _vectors(texts):
    """A deterministic encoder: each text's length and first character code."""
    return np.array([[len(t), ord(t[0]) if t else 0, 1.0] for t in texts], dtype=np.float32)


def _frame(sizes, *, dtype="string[pyarrow]", null_at=None):
    texts = [f"text {i}" for i in range(sum(sizes))]
    frame = pd.DataFrame(
        {
            "text": pd.array(texts, dtype=dtype),
            "doc_id": np.arange(len(texts)),
            "label": pd.Categorical([("a", "b")[i % 2] for i in range(len(texts))]),
        }
    )
    if null_at is not None:
        frame.loc[null_at, "text"] = None
    frame["text"] = frame["text"].astype(dtype)  # pandas infers its str dtype from str values
    return frame


def _views(frame, sizes):
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [FrameRows(frame, int(a), int(b)) for a, b in pairwise(bounds)]


# spans over partitions 3..6 of sizes [4, 1, 5, 3]: the first and last cut, as SuperBatches cut them
SIZES = [4, 1, 5, 3]
SPANS = [(Span(3, 2, 4), 4), (Span(4, 0, 1), 1), (Span(5, 0, 5), 5), (Span(6, 0, 2), 3)]


@pytest.mark.parametrize("dtype", ["string[pyarrow]", "object"])
def test_one_frame_read_gives_the_rows_the_sliced_partitions_give(dtype, monkeypatch):
    frame = _frame(SIZES, dtype=dtype)
    assert frame["text"].dtype == dtype
    sbe = SuperBatchTask("text", ("doc_id", "label"), Encoder(_vectors))
    views = _views(frame, SIZES)
    slow = sbe.encode([v.sliced() for v in views], SPANS).frame
    sliced = []
    real = FrameRows.sliced
    monkeypatch.setattr(FrameRows, "sliced", lambda self: sliced.append(self) or real(self))
    fast = sbe.encode(views, SPANS).frame
    # Arrow strings: the run is sliced once out of the frame, no partition of it on its own;
    # Python strings: partition by partition, as before
    assert len(sliced) == (0 if dtype == "string[pyarrow]" else len(SPANS))
    pd.testing.assert_frame_equal(fast, slow)
    assert fast["partition"].tolist() == [3, 3, 4, 5, 5, 5, 5, 5, 6, 6]
    assert fast["row"].tolist() == [2, 3, 0, 0, 1, 2, 3, 4, 0, 1]
    assert fast["doc_id"].tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert fast["label"].dtype == "category"
    # Arrow strings stay in Arrow up to the encoder (whose tokenizer helpers take their bytes whole);
    # the per-partition path gives the same texts as a list
    _, texts, _ = sbe.gather(views, SPANS)
    assert type(texts).__name__ == ("ArrowTexts" if dtype == "string[pyarrow]" else "list")
    assert list(texts) == list(sbe.gather([v.sliced() for v in views], SPANS)[1])


def test_a_null_in_a_run_is_named_by_its_partition_and_row_and_skipped_rows_are_recorded():
    frame = _frame(SIZES, null_at=6)  # partition 5, row 1
    views = _views(frame, SIZES)
    with pytest.raises(SurgeInputError, match=r"partition 5, first at row 1"):
        SuperBatchTask("text", (), Encoder(_vectors)).encode(views, SPANS)
    done = SuperBatchTask("text", ("doc_id",), Encoder(_vectors), on_null="skip").encode(views, SPANS)
    assert done.skipped == [(5, 1)]
    assert done.frame["doc_id"].tolist() == [2, 3, 4, 5, 7, 8, 9, 10, 11]


def test_a_partition_that_changed_size_is_refused_before_anything_is_encoded():
    frame = _frame(SIZES)
    views = _views(frame, SIZES)
    bad = [*SPANS[:2], (Span(5, 0, 5), 6), SPANS[3]]
    with pytest.raises(SurgeInputError, match=r"partition 5 has 5 rows but 6 were planned"):
        SuperBatchTask("text", (), Encoder(_vectors)).encode(views, bad)


def test_the_frame_and_its_meta_have_the_layouts_columns_in_order():
    frame = _frame(SIZES)
    sbe = SuperBatchTask("text", ("label", "doc_id"), Encoder(_vectors))
    done = sbe.encode(_views(frame, SIZES), SPANS).frame
    meta = sbe.meta(frame.iloc[:0])
    assert tuple(done.columns) == tuple(meta.columns) == output_columns(["label", "doc_id"], chunked=False)
    assert (done.dtypes == meta.dtypes).all()
