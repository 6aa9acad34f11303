"""JoinedTokenizer gives every text the ids the tokenizer gives it alone, or is not used."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from dask_surge.engine.joined import JoinedTokenizer, special_ends
from dask_surge.testing import packaged_model_dir


def minilm(max_length: int | None = 16, direction: str = "right", family: str = "bert") -> Tokenizer:
    """MiniLM's tokenizer; ``family="mpnet"``: with MPNet's post-processor (``RobertaProcessing``) and its
    mask token stripping the whitespace before it (all-mpnet-base-v2's settings on BERT's vocabulary)."""
    tok = Tokenizer.from_file(str(packaged_model_dir() / "tokenizer.json"))
    if family == "mpnet":
        spec = json.loads(tok.to_str())
        spec["post_processor"] = {
            "type": "RobertaProcessing",
            "sep": ["[SEP]", 102],
            "cls": ["[CLS]", 101],
            "trim_offsets": True,
            "add_prefix_space": False,
        }
        for added in spec["added_tokens"]:
            added["lstrip"] = added["content"] == "[MASK]"
        tok = Tokenizer.from_str(json.dumps(spec))
    tok.no_padding()
    if max_length is None:
        tok.no_truncation()
    else:
        tok.enable_truncation(max_length, direction=direction)
    return tok


def per_text(tok: Tokenizer, texts: list[str]) -> tuple[list[list[int]], list[bool]]:
    encodings = tok.encode_batch(texts)
    return [e.ids for e in encodings], [bool(e.overflowing) for e in encodings]


def joined_ids(joined: JoinedTokenizer, texts: list[str]) -> tuple[list[list[int]], list[bool]]:
    lengths, overflow, ids = joined.encode(texts)
    assert lengths.dtype == np.int32 and ids.dtype == np.int32 and overflow.dtype == bool
    assert int(lengths.sum()) == len(ids)
    return [a.tolist() for a in np.split(ids, np.cumsum(lengths)[:-1])] if len(
        texts
    ) else [], overflow.tolist()


# pieces that stress what joining could change: the separator and other specials written out, whitespace
# and control characters at the edges, accents and combining marks, CJK, punctuation, words over WordPiece's
# 100 characters, text that looks like a half separator
PIECES = [
    "[SEP]",
    "[CLS]",
    "[MASK]",
    "[SEP",
    "SEP]",
    "[",
    "]",
    "[sep]",
    " ",
    "\n",
    "\t",
    "\r\n",
    "\x00",
    "\u200b",
    "\ufffd",
    "\u0301",
    "é",
    "e\u0301",
    "Ünïcödé",
    "日本語",
    "中",
    "한국어",
    "💥",
    "don't",
    "U.S.A.",
    "##ing",
    "a" * 120,
    "hello",
    "world",
    ",",
    "...",
    "0.5",
    "\u3000",
    "\x85",
    "\u2028",
    "Ⅻ",
    "ﬁ",
]
text = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=12)), max_size=12).map("".join)


@functools.cache
def _tokenizers(
    max_length: int | None, direction: str, family: str
) -> tuple[Tokenizer, JoinedTokenizer | None]:
    """One tokenizer and its joined form per setting, shared by the examples below (loading them for each
    example took most of the test's time; neither changes when it encodes)."""
    tok = minilm(max_length, direction, family)
    return tok, JoinedTokenizer.of(tok)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    texts=st.lists(text, max_size=40),
    size=st.integers(1, 9),
    max_length=st.sampled_from([3, 8, 32, None]),
    direction=st.sampled_from(["right", "left"]),
    family=st.sampled_from(["bert", "mpnet"]),
)
def test_same_ids_as_one_text_at_a_time(texts, size, max_length, direction, family):
    tok, joined = _tokenizers(max_length, direction, family)
    assert joined is not None
    expected = per_text(tok, texts)
    groups, strings = joined.groups(texts, size=size)
    assert [t for a, b in groups for t in texts[a:b]] == texts
    found = joined._tokenize(groups, strings)
    assert found is not None  # the separator check never trips on this tokenizer
    lengths, overflow, ids = joined._cut(*found)
    assert ([a.tolist() for a in np.split(ids, np.cumsum(lengths)[:-1])] if texts else []) == expected[0]
    assert (overflow.tolist(), [len(e) for e in expected[0]]) == (expected[1], lengths.tolist())
    assert joined_ids(joined, texts) == expected


def test_same_ids_on_real_text_in_default_groups():
    import importlib.util
    from pathlib import Path

    # the real-text source the benchmarks share, loaded by its path (plain pytest puts no repo root on sys.path)
    where = Path(__file__).resolve().parent.parent / "benchmarks" / "_realtext.py"
    spec = importlib.util.spec_from_file_location("surge_realtext", where)
    assert spec is not None and spec.loader is not None
    realtext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(realtext)
    texts = realtext.docstring_paragraphs(3000)
    tok = minilm(256)
    joined = JoinedTokenizer.of(tok)
    assert joined is not None
    groups, _ = joined.groups(texts)
    assert 1 < len(groups) < len(texts)  # joined for real
    assert joined_ids(joined, texts) == per_text(tok, texts)


def test_texts_holding_the_separator_go_alone_and_keep_their_ids():
    tok = minilm(12)
    joined = JoinedTokenizer.of(tok)
    texts = ["question? [SEP] answer.", "plain", "[SEP]", "also plain", "x[SEP]y[SEP]"]
    groups, strings = joined.groups(texts, size=5)
    assert groups == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    groups, strings = joined.groups(["a", "b", *texts[:1], "c", "d"], size=5)
    assert groups == [(0, 2), (2, 3), (3, 5)] and strings[0] == "a [SEP] b"
    assert joined_ids(joined, texts) == per_text(tok, texts)


def test_a_misplaced_separator_id_falls_back_to_one_text_per_group(monkeypatch):
    tok = minilm(16)
    joined = JoinedTokenizer.of(tok)
    texts = ["one text", "two texts", "three texts here"]
    # a vocabulary where a content token has the separator's id: the joined groups' check must trip
    monkeypatch.setattr(joined, "sep_id", tok.token_to_id("text"))
    assert joined._tokenize(*joined.groups(texts, size=3)) is None
    lengths, _, ids = joined.encode(texts)
    assert [a.tolist() for a in np.split(ids, np.cumsum(lengths)[:-1])] == per_text(tok, texts)[0]


def test_empty_and_non_str_input():
    joined = JoinedTokenizer.of(minilm(8))
    lengths, overflow, ids = joined.encode([])
    assert (len(lengths), len(overflow), len(ids)) == (0, 0, 0)
    with pytest.raises(TypeError):
        joined.encode(["a", 3])
    with pytest.raises(TypeError):  # what the tokenizer raises for a text with no UTF-8 form
        per_text(minilm(8), ["broken \ud83d"])
    with pytest.raises(TypeError):
        joined.encode(["ok", "broken \ud83d"])


def bpe_byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE({"a": 0, "b": 1, "Ġ": 2, "<s>": 3, "</s>": 4}, [], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 3), ("</s>", 4)]
    )
    return tok


def wordpiece(**changes) -> Tokenizer:
    spec = json.loads(minilm(16).to_str())
    spec.update(changes)
    return Tokenizer.from_str(json.dumps(spec))


@pytest.mark.parametrize(
    "make, why",
    [
        (bpe_byte_level, "a byte-level BPE marks where a word starts"),
        (
            lambda: wordpiece(
                pre_tokenizer={
                    "type": "Metaspace",
                    "replacement": "▁",
                    "prepend_scheme": "always",
                    "split": True,
                }
            ),
            "a SentencePiece-style pre-tokenizer",
        ),
        (
            lambda: wordpiece(normalizer={"type": "Replace", "pattern": {"String": " "}, "content": ""}),
            "a normalizer that joins words",
        ),
        (
            lambda: wordpiece(
                truncation={"max_length": 16, "strategy": "LongestFirst", "stride": 4, "direction": "Right"}
            ),
            "a stride",
        ),
        (
            lambda: wordpiece(
                padding={
                    "strategy": "BatchLongest",
                    "direction": "Right",
                    "pad_to_multiple_of": None,
                    "pad_id": 0,
                    "pad_type_id": 0,
                    "pad_token": "[PAD]",
                }
            ),
            "padding",
        ),
        (
            lambda: wordpiece(
                added_tokens=[
                    {**t, "normalized": True} for t in json.loads(minilm(16).to_str())["added_tokens"]
                ]
            ),
            "special tokens matched after normalizing",
        ),
        (
            lambda: wordpiece(
                added_tokens=[
                    *json.loads(minilm(16).to_str())["added_tokens"],
                    {
                        "id": 7,
                        "special": False,
                        "content": " x",
                        "single_word": False,
                        "lstrip": False,
                        "rstrip": False,
                        "normalized": True,
                    },
                ]
            ),
            "an added token with whitespace could match at a joined text's edge",
        ),
        (
            lambda: wordpiece(
                truncation={"max_length": 2, "strategy": "LongestFirst", "stride": 0, "direction": "Right"}
            ),
            "no room for a text's tokens",
        ),
    ],
)
def test_not_used_where_joining_could_change_an_id(make, why):
    assert JoinedTokenizer.of(make()) is None, why


def test_the_separator_is_one_no_other_token_overlaps():
    spec = json.loads(minilm(16).to_str())
    spec["added_tokens"].append(
        {
            "id": 5,
            "special": True,
            "content": "[SEP]x",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
        }
    )
    joined = JoinedTokenizer.of(Tokenizer.from_str(json.dumps(spec)))
    assert joined is not None and joined.separator == "[CLS]"


def test_special_ends_ignores_padding_and_truncation():
    tok = Tokenizer.from_file(str(packaged_model_dir() / "tokenizer.json"))  # padded to 128, truncated at 128
    assert special_ends(tok) == ([101], [102])
    bare = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    bare.normalizer = normalizers.BertNormalizer()
    bare.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    assert special_ends(bare) == ([], [])


def test_why_an_added_token_with_whitespace_refuses_joining():
    spec = json.loads(minilm(16).to_str())
    spec["added_tokens"].append(
        {
            "id": 30522,
            "special": False,
            "content": " x",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": True,
        }
    )
    tok = Tokenizer.from_str(json.dumps(spec))
    assert JoinedTokenizer.of(tok) is None
    forced = JoinedTokenizer(tok, "[SEP]")  # joined anyway: the space before a text lets " x" match
    texts = ["a x b", "x"]
    lengths, _, ids = forced._cut(*forced._tokenize(*forced.groups(texts, size=2)))
    assert [a.tolist() for a in np.split(ids, np.cumsum(lengths)[:-1])] != per_text(tok, texts)[0]
