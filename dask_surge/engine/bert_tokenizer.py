"""A BERT tokenizer read from a checkpoint's tokenizer files, without importing transformers.

The fast engine reads little of a Hugging Face tokenizer: its Rust ``tokenizers.Tokenizer``
(``backend_tokenizer``), the pad id, the special token ids, whether the model takes token type
ids, the truncation side and ``model_max_length``. Getting them from ``AutoTokenizer`` costs an
``import transformers`` (most of it transformers scanning its own model folders; see
``docs/ab_studies.md``, "Cold first output"), for a tokenizer the ``tokenizers`` library reads
from ``tokenizer.json`` at once.

:func:`load_bert_tokenizer` reads them from ``tokenizer.json``, ``tokenizer_config.json`` and
``special_tokens_map.json``, only where the result is the tokenizer ``AutoTokenizer`` builds: a
``BertTokenizer`` whose ``tokenizer.json`` already has the normalizer, pre-tokenizer and
``[CLS] ... [SEP]`` post-processor that transformers sets from ``tokenizer_config.json`` (else
transformers would change them), and whose added tokens are all in ``tokenizer.json``. Anything
else raises :class:`NotNativeTokenizer` saying why, and the caller uses ``AutoTokenizer``.

Examples
--------
>>> from dask_surge.testing import packaged_model_dir
>>> tok = load_bert_tokenizer(str(packaged_model_dir()), model_max_length=256)
>>> tok.pad_token_id, sorted(tok.all_special_ids), tok.model_max_length, tok.is_fast
(0, [0, 100, 101, 102, 103], 256, True)
>>> enc = tok.backend_tokenizer.encode("Hello world")  # padded to 128, as its tokenizer.json says (so is transformers')
>>> enc.ids[:5], sum(enc.attention_mask)
([101, 7592, 2088, 102, 0], 4)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BertTokenizerFiles", "NotNativeTokenizer", "load_bert_tokenizer"]

#: transformers' ``model_max_length`` when neither the caller nor ``tokenizer_config.json`` sets one.
UNBOUNDED_LENGTH = int(1e30)
#: ``BertTokenizer``'s named special tokens and their defaults.
_SPECIAL = {
    "unk_token": "[UNK]",
    "sep_token": "[SEP]",
    "pad_token": "[PAD]",
    "cls_token": "[CLS]",
    "mask_token": "[MASK]",
}
_BERT_CLASSES = ("BertTokenizer", "BertTokenizerFast")


class NotNativeTokenizer(ValueError):
    """Tokenizer files :func:`load_bert_tokenizer` does not read as transformers would (the message says why)."""


@dataclass
class BertTokenizerFiles:
    """The parts of a Hugging Face fast BERT tokenizer the engine reads, by the same attribute names.

    Attributes
    ----------
    backend_tokenizer : tokenizers.Tokenizer
        The Rust tokenizer, as ``tokenizer.json`` says.
    model_max_length : int
    pad_token_id : int
    all_special_ids : list of int
    model_input_names : list of str
    truncation_side, padding_side : str
    """

    backend_tokenizer: Any
    model_max_length: int
    pad_token_id: int
    all_special_ids: list[int]
    model_input_names: list[str] = field(
        default_factory=lambda: ["input_ids", "token_type_ids", "attention_mask"]
    )
    truncation_side: str = "right"
    padding_side: str = "right"
    is_fast: bool = True


def _read(path: Path, *, required: bool) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        if required:
            raise NotNativeTokenizer(f"there is no {path.name}") from None
        return {}
    except (OSError, ValueError) as err:
        raise NotNativeTokenizer(f"{path.name} could not be read ({type(err).__name__})") from None
    if not isinstance(data, dict):
        raise NotNativeTokenizer(f"{path.name} is not a JSON object")
    return data


def _content(token: Any) -> str | None:
    """A special token's text, from a string or a serialized ``AddedToken``."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def load_bert_tokenizer(directory: str, *, model_max_length: int | None = None) -> BertTokenizerFiles:
    """The BERT tokenizer of ``directory``, as ``AutoTokenizer.from_pretrained(directory, model_max_length=...)`` makes it.

    Parameters
    ----------
    directory : str
        A Hugging Face checkpoint directory holding ``tokenizer.json`` and ``tokenizer_config.json``.
    model_max_length : int, optional
        Overrides ``tokenizer_config.json``'s, as the keyword does for ``AutoTokenizer``.

    Raises
    ------
    NotNativeTokenizer
        When the files are not a ``BertTokenizer`` this reads exactly as transformers does.

    Examples
    --------
    >>> import tempfile
    >>> load_bert_tokenizer(tempfile.mkdtemp())
    Traceback (most recent call last):
    ...
    dask_surge.engine.bert_tokenizer.NotNativeTokenizer: there is no tokenizer_config.json
    """
    from tokenizers import Tokenizer, processors

    root = Path(directory)
    config = _read(root / "tokenizer_config.json", required=True)
    if config.get("tokenizer_class") not in _BERT_CLASSES:
        raise NotNativeTokenizer(
            f"tokenizer_class={config.get('tokenizer_class')!r} is not one of {_BERT_CLASSES}"
        )
    mapped = _read(root / "special_tokens_map.json", required=False)
    try:
        backend = Tokenizer.from_file(str(root / "tokenizer.json"))
    except Exception as err:  # noqa: BLE001 - the Rust loader's errors are plain Exceptions
        raise NotNativeTokenizer(f"tokenizer.json could not be read ({type(err).__name__}: {err})") from None
    layout = json.loads(backend.to_str())
    normalizer = {
        "type": "BertNormalizer",
        "clean_text": True,
        "handle_chinese_chars": config.get("tokenize_chinese_chars", True),
        "strip_accents": config.get("strip_accents"),
        "lowercase": config.get("do_lower_case", True),
    }
    if layout.get("normalizer") != normalizer:
        raise NotNativeTokenizer(
            f"tokenizer.json's normalizer {layout.get('normalizer')} is not the {normalizer} "
            "tokenizer_config.json asks for"
        )
    if layout.get("pre_tokenizer") != {"type": "BertPreTokenizer"}:
        raise NotNativeTokenizer(
            f"tokenizer.json's pre-tokenizer {layout.get('pre_tokenizer')} is not BertPreTokenizer"
        )
    tokens = {
        name: _content(config.get(name, mapped.get(name, default))) for name, default in _SPECIAL.items()
    }
    ids = {name: backend.token_to_id(text) if text is not None else None for name, text in tokens.items()}
    if None in ids.values():
        raise NotNativeTokenizer(f"special tokens {tokens} are not all in the vocabulary")
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
    extra_ids = (
        [backend.token_to_id(_content(token) or "") for token in extra] if isinstance(extra, list) else [None]
    )
    if None in extra_ids:
        raise NotNativeTokenizer(
            f"the additional special tokens {extra!r} are not a list of tokens in the vocabulary"
        )
    added = {token.get("content"): token.get("id") for token in layout.get("added_tokens") or []}
    declared = config.get("added_tokens_decoder") or {}
    if any(added.get(_content(token)) != int(index) for index, token in declared.items()):
        raise NotNativeTokenizer("tokenizer_config.json adds tokens that tokenizer.json does not hold")
    cls, sep = tokens["cls_token"], tokens["sep_token"]
    template = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0",
        pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, ids["cls_token"]), (sep, ids["sep_token"])],
    )
    if json.loads(template.__getstate__()) != layout.get(
        "post_processor"
    ):  # its JSON, as tokenizer.json holds it
        raise NotNativeTokenizer("tokenizer.json's post-processor is not BERT's [CLS] ... [SEP] template")
    length = (
        model_max_length if model_max_length is not None else config.get("model_max_length", UNBOUNDED_LENGTH)
    )
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise NotNativeTokenizer(f"model_max_length={length!r} is not a positive int")
    names = config.get("model_input_names") or ["input_ids", "token_type_ids", "attention_mask"]
    sides = {key: config.get(key, "right") for key in ("truncation_side", "padding_side")}
    if not all(side in ("left", "right") for side in sides.values()):
        raise NotNativeTokenizer(f"{sides} are not 'left' or 'right'")
    special = [i for i in (*ids.values(), *extra_ids) if i is not None]  # none is None: checked above
    return BertTokenizerFiles(
        backend, length, ids["pad_token"] or 0, list(dict.fromkeys(special)), list(names), **sides
    )
