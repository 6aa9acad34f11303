"""ArrowTexts: an Arrow string column as a sequence of str, and its bytes as the tokenizer helpers take them."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_surge.io.texts import ArrowTexts, as_list, as_texts, join_texts, take_texts

# Arrow holds valid UTF-8 only: no lone surrogates
TEXTS = st.lists(st.text(st.characters(exclude_categories=("Cs",)), max_size=20), max_size=30)
TYPES = st.sampled_from([pa.string(), pa.large_string(), pa.string_view()])


@settings(max_examples=200, deadline=None)
@given(texts=TEXTS, arrow_type=TYPES, data=st.data())
def test_arrow_texts_behave_as_the_list(texts, arrow_type, data):
    held = ArrowTexts(pa.array(texts, arrow_type))
    assert len(held) == len(texts) and list(held) == texts and held.tolist() == texts
    start = data.draw(st.integers(-len(texts) - 2, len(texts) + 2))
    stop = data.draw(st.integers(-len(texts) - 2, len(texts) + 2))
    part = held[start:stop]
    assert isinstance(part, ArrowTexts) and list(part) == texts[start:stop]
    offsets, utf8 = part.utf8()  # what a tokenizer helper gets: the slice's own bytes, offsets from 0
    encoded = [t.encode() for t in texts[start:stop]]
    assert bytes(utf8) == b"".join(encoded)
    assert offsets.tolist() == [sum(map(len, encoded[:i])) for i in range(len(encoded) + 1)]
    if texts:
        i = data.draw(st.integers(-len(texts), len(texts) - 1))
        assert held[i] == texts[i]
        picks = np.array(data.draw(st.lists(st.integers(0, len(texts) - 1), max_size=10)), dtype=np.int64)
        if data.draw(st.booleans()):
            held.tolist()  # made already: the pick reuses it
        taken = take_texts(held, picks)
        assert isinstance(taken, ArrowTexts) and list(taken) == [texts[k] for k in picks]
        assert take_texts(texts, picks) == [texts[k] for k in picks]


@settings(max_examples=100, deadline=None)
@given(texts=TEXTS, cuts=st.lists(st.integers(0, 30), max_size=4), arrow_type=TYPES, mixed=st.booleans())
def test_join_texts_is_the_concatenation(texts, cuts, arrow_type, mixed):
    bounds = sorted({0, len(texts), *(min(c, len(texts)) for c in cuts)})
    pieces: list = [ArrowTexts(pa.array(texts[a:b], arrow_type)) for a, b in zip(bounds, bounds[1:])]
    if mixed and pieces:
        pieces[0] = list(pieces[0])
    joined = join_texts(pieces)
    assert list(joined) == texts
    assert isinstance(joined, ArrowTexts) == (bool(pieces) and not mixed)


def test_lists_stay_lists_and_other_sequences_become_lists():
    texts = ["a", "b"]
    assert as_list(texts) is texts and as_texts(texts) is texts
    assert as_list(("a",)) == ["a"] and as_texts(("a",)) == ["a"]
    held = ArrowTexts(pa.array(texts))
    assert as_texts(held) is held and as_list(held) is held.tolist()


def test_a_null_or_a_non_string_array_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="holds 1.*Fix"):
        ArrowTexts(pa.array(["a", None]))
    with pytest.raises(ValueError, match="int64.*Fix"):
        ArrowTexts(pa.array([1, 2]))
    with pytest.raises(ValueError, match="step 1 only"):
        ArrowTexts(pa.array(["a", "b"]))[::2]
    assert ArrowTexts(pa.chunked_array([["a"], ["b"]])).tolist() == ["a", "b"]


def test_a_callable_model_gets_a_list_of_its_own():
    """Only the fast engine takes Arrow-held texts; a user's callable gets a list, its own: sorting it in
    place changes neither the caller's list nor the texts an ArrowTexts holds."""
    from dask_surge import Encoder

    seen = []

    def model(texts):
        seen.append(type(texts))
        texts.sort()
        return np.zeros((len(texts), 2), np.float32)

    texts, held = ["b", "a"], ArrowTexts(pa.array(["d", "c"]))
    held.tolist()
    Encoder(model).encode_long(texts)
    Encoder(model).encode_long(held)
    assert seen and set(seen) == {list}
    assert texts == ["b", "a"] and held.tolist() == ["d", "c"] == held.arrow.to_pylist()
