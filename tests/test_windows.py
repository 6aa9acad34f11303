"""Long texts (issue 24, the models layer): truncate counted, error, chunk and mean, on both backends.

Real long text: the long descriptions of installed packages (``*.dist-info/METADATA``), which
this project did not write.
"""

from __future__ import annotations

import re
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sentence_transformers import SentenceTransformer

from dask_surge.engine import long_texts as windows_mod
from dask_surge.engine.long_texts import TextTooLong, WindowCutter
from dask_surge.options import DEFAULT_CHUNK_OVERLAP
from dask_surge.engine.tokenizing import StageClock, TextPacker
from dask_surge.engine.transformer import TransformerEngine
from dask_surge.errors import SurgeInputError, SurgeValueError
from dask_surge.models.encoders import Encoder
from dask_surge.testing import cosines, make_tiny_model, min_cosine, packaged_model_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def real_documents(min_chars: int, max_chars: int, count: int) -> list[str]:
    """``count`` package descriptions between ``min_chars`` and ``max_chars`` long (deterministic choice)."""
    purelib = Path(sysconfig.get_paths()["purelib"])
    docs = sorted(
        {p.read_text(encoding="utf-8", errors="replace") for p in purelib.glob("*.dist-info/METADATA")}
    )
    picked = [d for d in docs if min_chars <= len(d) <= max_chars]
    if len(picked) < count:
        pytest.skip(f"fewer than {count} installed package descriptions of {min_chars}-{max_chars} chars")
    return picked[:: max(1, len(picked) // count)][:count]


def big_text(chars: int) -> str:
    """A long real text: the package descriptions, one after the other, repeated up to ``chars``."""
    docs = real_documents(2_000, 10**9, 20)
    joined = "\n\n".join(docs)
    return (joined * (chars // len(joined) + 1))[:chars]


@pytest.fixture(scope="module")
def packaged() -> SentenceTransformer:
    return SentenceTransformer(str(packaged_model_dir()), device="cpu")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("windows-tiny") / "m", max_seq_length=64)


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return real_documents(3_000, 12_000, 2)


def content_tokens(model: SentenceTransformer, text: str) -> int:
    return len(model.tokenizer(text, add_special_tokens=False, truncation=False)["input_ids"])


def check_tiling(text: str, windows, text_index: int, capacity: int, overlap: int | None) -> None:
    """The windows of one text: increasing, within the window, covering every non-space char; with
    ``overlap`` 0 they share nothing, with more each join shares chars or, where the word before it is
    longer than ``overlap`` tokens (windows start at word starts), the next starts after whitespace."""
    sel = windows.text == text_index
    cs, ce, tokens, chunk = (
        windows.char_start[sel],
        windows.char_end[sel],
        windows.tokens[sel],
        windows.chunk[sel],
    )
    assert chunk.tolist() == list(range(len(chunk)))
    assert (tokens <= capacity).all() and (tokens > 0).all()
    assert (np.diff(cs) > 0).all() and (np.diff(ce) > 0).all()
    if overlap == 0:
        assert (cs[1:] >= ce[:-1]).all()
    elif overlap is not None:
        assert all(b < e or not text[e:b].strip() for b, e in zip(cs[1:].tolist(), ce[:-1].tolist()))
    covered = np.zeros(len(text) + 1, dtype=np.int64)
    np.add.at(covered, cs, 1)
    np.add.at(covered, ce, -1)
    inside = np.cumsum(covered)[: len(text)] > 0
    content = np.array([not c.isspace() for c in text])
    assert not (content & ~inside).any(), "a non-whitespace char is in no window"


# -- the cutter --------------------------------------------------------------------------------


def test_windows_tile_real_text_at_word_boundaries(packaged, docs):
    cutter = WindowCutter(packaged.tokenizer, packaged.max_seq_length)
    assert cutter.capacity == packaged.max_seq_length - 2
    w = cutter.cut(docs, overlap=DEFAULT_CHUNK_OVERLAP)
    assert w.text.tolist() == sorted(w.text.tolist()) and set(w.text.tolist()) == {0, 1}
    for i, doc in enumerate(docs):
        check_tiling(doc, w, i, cutter.capacity, DEFAULT_CHUNK_OVERLAP)
    for t, a, b, n in zip(w.text, w.char_start, w.char_end, w.tokens):
        span = docs[t][a:b]
        assert span == span.strip()
        assert content_tokens(packaged, span) == n  # the span tokenized alone is the window's tokens
        # word boundaries: a window never starts or ends inside a run of letters
        assert not (a > 0 and docs[t][a - 1].isalnum() and docs[t][a].isalnum())
        assert not (b < len(docs[t]) and docs[t][b - 1].isalnum() and docs[t][b].isalnum())


def test_overlap_is_about_chunk_overlap_tokens(packaged, docs):
    cutter = WindowCutter(packaged.tokenizer, packaged.max_seq_length)
    for overlap in (0, 8, 100):
        w = cutter.cut(docs[:1], overlap=overlap)
        ids = packaged.tokenizer(docs[0], add_special_tokens=False)["input_ids"]
        total = int(w.tokens.sum())
        # each join shares about ``overlap`` tokens (rounded up to a word start, so at most that many)
        shared = total - len(ids)
        joins = len(w) - 1
        assert 0 <= shared <= overlap * joins
        assert shared >= max(0, overlap - 10) * joins


def test_short_empty_and_space_texts_are_one_window(packaged):
    cutter = WindowCutter(packaged.tokenizer, packaged.max_seq_length)
    texts = ["", "   ", "one sentence.", "x" * 700]
    w = cutter.cut(texts)
    assert w.text.tolist() == [0, 1, 2, 3] and w.chunk.tolist() == [0, 0, 0, 0]
    assert w.char_start.tolist() == [0, 0, 0, 0] and w.char_end.tolist() == [0, 3, 13, 700]
    assert w.tokens.tolist()[:3] == [0, 0, 3]


def test_a_word_longer_than_the_window_has_left_does_not_repeat_windows(packaged):
    # capacity 14, overlap 4: after "a ... l" the word (13 pieces) fits no window that overlaps the first;
    # each window used to end at the word's start again, from one word later: (16, 23), (18, 23), (20, 23)
    cutter = WindowCutter(packaged.tokenizer, 16)
    word = "supercalifragilistic" * 2
    text = "a b c d e f g h i j k l " + word + " end"
    w = cutter.cut([text], overlap=4)
    assert w.char_start.tolist() == [0, 16, 45] and w.char_end.tolist() == [23, 54, 68]
    assert w.tokens.tolist() == [12, 14, 8]
    check_tiling(text, w, 0, cutter.capacity, 4)


#: Words of every kind a cutter meets: short ones, punctuation, and alphanumeric runs (base64, ids,
#: DNA) from a few word pieces to longer than any window, or than WordPiece's 100 chars (one [UNK]).
WORDS = st.one_of(
    st.text("abcdefghij", min_size=1, max_size=8),
    st.sampled_from([".", ",", "!", "(", "'"]),
    st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789", min_size=9, max_size=160),
    st.text("abcXYZ019+/=", min_size=9, max_size=60),
)


@settings(max_examples=150, deadline=None)
@given(
    words=st.lists(st.tuples(WORDS, st.sampled_from([" ", " ", "\n", ""])), min_size=1, max_size=60),
    max_seq_length=st.integers(6, 40),
    overlap_share=st.floats(0, 0.49),
    slice_chars=st.sampled_from([None, 40, 97]),
)
def test_windows_tile_any_text(packaged, words, max_seq_length, overlap_share, slice_chars):
    # whatever the words, the windows of a text follow each other, each ending past the last, and cover it
    # (consecutive windows overlap, by at most ``overlap`` tokens, unless the word before the join is longer)
    text = "".join(w + sep for w, sep in words)
    cutter = WindowCutter(packaged.tokenizer, max_seq_length)
    overlap = min(int(overlap_share * cutter.capacity), (cutter.capacity - 1) // 2)
    saved = windows_mod.SLICE_CHARS
    windows_mod.SLICE_CHARS = slice_chars or saved  # small slices: a long text tokenized piece by piece
    try:
        w = cutter.cut(["x", text], overlap=overlap)
    finally:
        windows_mod.SLICE_CHARS = saved
    check_tiling(text, w, 1, cutter.capacity, overlap)
    if (
        slice_chars is None
    ):  # each join shares at most ``overlap`` tokens: none when the word before it is longer
        shared = int(w.tokens[w.text == 1].sum()) - content_tokens(packaged, text)
        assert 0 <= shared <= overlap * (int((w.text == 1).sum()) - 1)


def test_one_word_longer_than_a_window_is_cut_inside(packaged):
    cutter = WindowCutter(packaged.tokenizer, 16)
    word = "supercalifragilistic" * 4  # one word of many word pieces (under WordPiece's 100 chars)
    w = cutter.cut([f"start {word} end"], overlap=2)
    assert len(w) == 4 and (w.tokens <= cutter.capacity).all()
    assert w.char_end[0] == 5  # "start": the last word start before the window is full
    assert w.char_end[1] - w.char_start[1] < len(word)  # then inside the word (longer than a window)
    check_tiling(f"start {word} end", w, 0, cutter.capacity, None)


def test_slices_do_not_change_the_windows(packaged, monkeypatch):
    text = big_text(300_000)
    cutter = WindowCutter(packaged.tokenizer, packaged.max_seq_length)
    monkeypatch.setattr(windows_mod, "SLICE_CHARS", 10**9)
    whole = cutter.cut([text])
    monkeypatch.setattr(windows_mod, "SLICE_CHARS", 20_000)
    sliced = cutter.cut([text])
    assert len(sliced) > 50
    for field in ("text", "chunk", "char_start", "char_end", "tokens"):
        np.testing.assert_array_equal(getattr(sliced, field), getattr(whole, field), err_msg=field)


def test_pack_windows_gives_the_ids_of_the_window_texts(packaged, docs):
    prompt = "query: "
    cutter = WindowCutter(packaged.tokenizer, packaged.max_seq_length, prompt=prompt)
    packer = TextPacker(packaged.tokenizer, packaged.max_seq_length, prompt=prompt, clock=StageClock())
    texts = [*docs, "", "short"]
    (group,) = list(cutter.groups(texts, overlap=16))
    w = group.windows
    packed = packer.pack_windows(
        group.content, group.starts, w.tokens, 5, head=cutter.head, tail=cutter.tail, max_tokens=2048
    )
    spans = [texts[t][a:b] for t, a, b in zip(w.text, w.char_start, w.char_end)]
    expected = [e.ids for e in packer._tokenizer.encode_batch([prompt + s for s in spans])]
    for pos, (row, start, length) in enumerate(zip(packed.where, packed.starts, packed.lengths)):
        assert packed.ids[start : start + length].tolist() == expected[row - 5], pos


def test_bad_options_are_refused(packaged):
    cutter = WindowCutter(packaged.tokenizer, packaged.max_seq_length)
    for bad in (-1, True, 1.5, "32", 127, 500):
        with pytest.raises(SurgeValueError, match="chunk_overlap"):
            cutter.check_overlap(bad)
    cutter.check_overlap(126)
    enc = Encoder(device="cpu")
    with pytest.raises(SurgeValueError, match=r"long_texts='split'.*truncate"):
        enc.encode_long(["a"], long_texts="split")  # type: ignore[arg-type]
    with pytest.raises(
        SurgeValueError,
        match=r"half the model's window of 254.*chunk_overlap < 127, e\.g\. the "
        r"default 32\.$",
    ):
        enc.encode_long(["a"], long_texts="chunk", chunk_overlap=200)
    small = WindowCutter(packaged.tokenizer, 40)  # a window of 38: the default 32 does not fit it
    with pytest.raises(
        SurgeValueError,
        match=r"window of 38 tokens.*chunk_overlap < 19, e\.g\. 18 \(the default 32 "
        r"does not fit this window either\)\.$",
    ):
        small.check_overlap(32)
    small.check_overlap(18)
    with pytest.raises(SurgeValueError, match="prompt"):
        WindowCutter(packaged.tokenizer, 4, prompt="a long prompt of many words")


def test_callable_models_truncate_only():
    enc = Encoder(lambda texts: np.ones((len(texts), 3)))
    out = enc.encode_long(["a", "b"])
    assert out.embeddings.shape == (2, 3) and out.truncated is None and out.windows is None
    for mode in ("error", "chunk", "mean"):
        with pytest.raises(SurgeValueError, match=r"callable model has no tokenizer.*long_texts='truncate'"):
            enc.encode_long(["a"], long_texts=mode)
        with pytest.raises(SurgeValueError, match="no tokenizer"):
            enc.encode_long([], long_texts=mode)


# -- the modes, against sentence-transformers, on both backends ---------------------------------


@pytest.mark.parametrize("engine", ["fast", "sentence-transformers"])
def test_chunk_windows_embed_as_their_spans(packaged, docs, engine):
    prompt = "query: "
    enc = Encoder(packaged, device="cpu", engine=engine, prompt=prompt)
    texts = [docs[0], "", "a short text", docs[1][:4000]]
    out = enc.encode_long(texts, long_texts="chunk")
    assert enc.backend == ("fast" if engine == "fast" else "sentence-transformers")
    w = out.windows
    assert out.embeddings.shape == (len(w), 384) and out.embeddings.flags.c_contiguous
    assert out.embeddings.dtype == np.float32 and out.over == 2 and not out.truncated.any()
    assert sorted(set(w.text.tolist())) == [0, 1, 2, 3]
    spans = [texts[t][a:b] for t, a, b in zip(w.text, w.char_start, w.char_end)]
    expected = packaged.encode(spans, prompt=prompt, convert_to_numpy=True)
    assert min_cosine(out.embeddings, expected) >= 0.999


def test_both_backends_cut_the_same_windows(packaged, docs):
    fast = Encoder(packaged, device="cpu").encode_long(docs, long_texts="chunk", chunk_overlap=10)
    st = Encoder(packaged, device="cpu", engine="sentence-transformers").encode_long(
        docs, long_texts="chunk", chunk_overlap=10
    )
    for field in ("text", "chunk", "char_start", "char_end", "tokens"):
        np.testing.assert_array_equal(getattr(fast.windows, field), getattr(st.windows, field))
    assert min_cosine(fast.embeddings, st.embeddings) >= 0.999


@pytest.mark.parametrize("engine", ["fast", "sentence-transformers"])
def test_mean_is_the_token_weighted_mean_of_the_chunks(tiny_dir, docs, engine):
    model = SentenceTransformer(tiny_dir, device="cpu")
    enc = Encoder(model, device="cpu", engine=engine)
    texts = [docs[0][:5000], "", "short one", docs[1][:3000]]
    chunks = enc.encode_long(texts, long_texts="chunk", chunk_overlap=8)
    w = chunks.windows
    for normalize in (False, True):
        mean = enc.encode_long(texts, long_texts="mean", normalize=normalize, chunk_overlap=8)
        assert mean.embeddings.shape == (4, model.get_embedding_dimension()) and mean.windows is None
        assert mean.over == 2 and not mean.truncated.any()
        rows = chunks.embeddings
        if normalize:
            rows = rows / np.linalg.norm(rows, axis=1, keepdims=True)
        weight = np.maximum(w.tokens, 1)[:, None]
        expected = np.stack(
            [(rows[w.text == i] * weight[w.text == i]).sum(0) / weight[w.text == i].sum() for i in range(4)]
        )
        if normalize:
            expected /= np.linalg.norm(expected, axis=1, keepdims=True)
            np.testing.assert_allclose(np.linalg.norm(mean.embeddings, axis=1), 1, rtol=1e-5)
        assert cosines(mean.embeddings, expected).min() >= 0.9999
        np.testing.assert_allclose(mean.embeddings, expected, rtol=1e-3, atol=1e-5)


def test_mean_renormalizes_where_the_model_normalizes(packaged, docs):
    out = Encoder(packaged, device="cpu").encode_long(docs, long_texts="mean")
    np.testing.assert_allclose(np.linalg.norm(out.embeddings, axis=1), 1, rtol=1e-5)


@pytest.mark.parametrize("engine", ["fast", "sentence-transformers"])
def test_truncate_counts_what_is_cut_and_embeds_as_encode(packaged, docs, engine):
    enc = Encoder(packaged, device="cpu", engine=engine)
    words = " ".join(["word"] * 254)  # exactly the window: not cut
    texts = ["short", docs[0], words, words + " more", ""]
    out = enc.encode_long(texts)
    assert out.truncated.tolist() == [False, True, False, True, False] and out.over == 2
    assert out.windows is None
    np.testing.assert_array_equal(out.embeddings, enc.encode(texts)) if engine == "fast" else None
    assert min_cosine(out.embeddings, packaged.encode(texts, convert_to_numpy=True)) >= 0.9999


@pytest.mark.parametrize("engine", ["fast", "sentence-transformers"])
def test_error_names_the_first_text_over_the_window(packaged, docs, engine):
    enc = Encoder(packaged, device="cpu", engine=engine)
    ok = ["short", " ".join(["word"] * 254)]
    assert enc.encode_long(ok, long_texts="error").embeddings.shape == (2, 384)
    with pytest.raises(TextTooLong) as info:
        enc.encode_long([*ok, docs[0], docs[1]], long_texts="error")
    err = info.value
    assert isinstance(err, SurgeInputError)
    assert (err.index, err.window) == (2, 254) and err.tokens == content_tokens(packaged, docs[0])
    assert re.search(
        r"text 2 .* \d+ tokens, over the model's window of 254 .*long_texts='chunk'.*'mean'", str(err)
    )


def test_prompt_with_include_prompt_false_pools_as_the_model(tiny_dir, docs):
    model = SentenceTransformer(tiny_dir, device="cpu")
    model[1].include_prompt = False
    enc = Encoder(model, device="cpu", prompt="query: ")
    assert enc.engine.prompt_length > 0
    out = enc.encode_long([docs[0][:3000], "a"], long_texts="chunk", chunk_overlap=8)
    w = out.windows
    spans = [[docs[0][:3000], "a"][t][a:b] for t, a, b in zip(w.text, w.char_start, w.char_end)]
    expected = model.encode(spans, prompt="query: ", convert_to_numpy=True)
    assert min_cosine(out.embeddings, expected) >= 0.999


def test_multi_megabyte_text_in_chunk_mode(tiny_dir):
    text = big_text(3_000_000)
    engine = TransformerEngine.from_sentence_transformer(SentenceTransformer(tiny_dir, device="cpu"))
    out = engine.encode_long(["before", text, "after"], long_texts="chunk", chunk_overlap=8)
    w = out.windows
    assert out.embeddings.shape == (len(w), engine.dimension) and np.isfinite(out.embeddings).all()
    assert w.text[0] == 0 and w.text[-1] == 2 and out.over == 1
    assert len(w) > 10_000  # a 64-token window: tens of thousands of windows
    check_tiling(text, w, 1, engine.cutter().capacity, 8)


def test_empty_call():
    enc = Encoder(device="cpu")
    for mode in ("truncate", "error", "chunk", "mean"):
        out = enc.encode_long([], long_texts=mode)
        assert out.embeddings.shape == (0, 384) and out.over == 0
        assert (out.windows is not None) == (mode == "chunk")


def test_encode_long_after_close_loads_again(packaged):
    enc = Encoder(str(packaged_model_dir()), device="cpu")
    enc.encode_long(["a"])
    enc.close()
    assert enc.encode_long(["a", "b c"], long_texts="chunk").embeddings.shape == (2, 384)
    engine = TransformerEngine.from_sentence_transformer(
        packaged
    )  # its own engine: the cached one stays open
    engine.close()
    with pytest.raises(SurgeValueError, match="closed"):
        engine.encode_long(["a"])
