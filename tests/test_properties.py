"""Property: whatever the layout, texts and thresholds, the committed output holds every
input (partition, row) exactly once, and nothing else."""

import tempfile

import dask.dataframe as dd
import numpy as np
import pandas as pd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dask_surge
from dask_surge.testing import checksum_model as _model  # installed: workers can unpickle it

texts_st = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)


@st.composite
def layouts(draw):
    sizes = draw(st.lists(st.integers(0, 12), min_size=1, max_size=10))
    texts = draw(st.lists(texts_st, min_size=sum(sizes), max_size=sum(sizes)))
    b_min = draw(st.integers(1, 20))
    b_max = draw(st.integers(b_min, 30))
    return sizes, texts, b_min, b_max


def _frame(sizes, texts):
    parts, start = [], 0
    for n in sizes:
        parts.append(
            pd.DataFrame(
                {
                    "text": pd.array(texts[start : start + n], dtype="string[pyarrow]"),
                    "i": np.arange(start, start + n),
                }
            )
        )
        start += n
    return dd.from_map(lambda p: p, parts, enforce_metadata=False)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_committed_rows_equal_input_rows(layout):
    sizes, texts, b_min, b_max = layout
    ddf = _frame(sizes, texts)
    with tempfile.TemporaryDirectory() as out:
        res = ddf.surge.encode(
            "text", out, model=_model, b_min=b_min, b_max=b_max, keep=["i"], scheduler="sync", progress=False
        )
        assert res.rows == sum(sizes)
        if not sum(sizes):
            return
        back = dask_surge.read_embeddings(out).compute().sort_values(["partition", "row"])
    assert list(zip(back.partition, back.row)) == [(p, r) for p, n in enumerate(sizes) for r in range(n)]
    assert back.i.tolist() == list(range(sum(sizes)))
    np.testing.assert_array_equal(np.stack(back.embedding.to_numpy()), _model(texts))
