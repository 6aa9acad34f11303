"""Token counts of the user's own texts, for the cost model.

The encode cost depends on tokens, not rows: a corpus of 200-token documents
costs several times a corpus of 20-token sentences per row. The calibration
probe measures the per-text and per-token costs on synthetic texts; a plan
predicts the user's data by counting the tokens of a small sample of it
(:func:`sample_texts`, :func:`token_counter`) and re-basing the calibrated
parameters on that distribution (:meth:`dask_surge.planning.costmodel.CostParams.with_token_lengths`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ..io.arrow import to_host

__all__ = ["DEFAULT_TRUNCATION", "sample_texts", "token_counter"]

#: Truncation assumed when a model directory does not state ``max_seq_length``.
DEFAULT_TRUNCATION = 512


def token_counter(encoder) -> Callable[[Sequence[str]], np.ndarray]:
    """A function ``texts -> token counts`` (float array) for ``encoder``'s tokenizer.

    Counts include the encoder's prompt (see :meth:`dask_surge.Encoder.resolved_prompt`),
    which the model reads too. Uses, in order: the fast engine when the model is
    already loaded in this process (exact); the tokenizer of an in-memory ``SentenceTransformer`` (a
    copy, truncated at its ``max_seq_length``); the model directory's
    ``tokenizer.json`` (or one in a subfolder) truncated at its
    ``max_seq_length``. None of these loads weights or runs the model. Else
    (a callable model, a slow tokenizer) a word-count estimate: 1.3 tokens a
    word plus 2 special tokens; a user's callable is never called to count.

    Parameters
    ----------
    encoder : dask_surge.Encoder

    Returns
    -------
    callable

    Examples
    --------
    >>> from dask_surge import Encoder
    >>> count = token_counter(Encoder("default", device="cpu"))
    >>> count(["", "hello world"]).tolist()
    [2.0, 4.0]
    """
    from tokenizers import Tokenizer

    if getattr(encoder, "is_loaded", False) and encoder.engine is not None:  # it puts the prompt first itself
        engine = encoder.engine
        return lambda texts: engine.count_tokens(list(texts)).astype(float)
    prompt = (encoder.resolved_prompt() if hasattr(encoder, "resolved_prompt") else None) or ""
    obj = encoder.source_object
    if obj is not None:
        backend = getattr(getattr(obj, "tokenizer", None), "backend_tokenizer", None)
        if backend is not None:  # a copy: the user's tokenizer keeps its settings
            limit = getattr(obj, "max_seq_length", None)
            limit = limit if isinstance(limit, int) and limit > 0 else DEFAULT_TRUNCATION
            return _counter(Tokenizer.from_str(backend.to_str()), limit, prompt)
    elif encoder.spec.kind == "path":
        root = Path(encoder.spec.source)
        for path in [root / "tokenizer.json", *sorted(root.glob("*/tokenizer.json"))]:
            if path.is_file():
                return _counter(Tokenizer.from_file(str(path)), _max_seq_length(path.parent, root), prompt)
    extra = 1.3 * len(prompt.split())
    return lambda texts: np.array([1.3 * len(t.split()) + 2 + extra for t in texts], dtype=float)


def _counter(tokenizer, limit: int, prompt: str = "") -> Callable[[Sequence[str]], np.ndarray]:
    tokenizer.no_padding()
    tokenizer.enable_truncation(limit)
    if prompt:
        return lambda texts: np.array(
            [len(e.ids) for e in tokenizer.encode_batch([prompt + t for t in texts])], dtype=float
        )
    return lambda texts: np.array([len(e.ids) for e in tokenizer.encode_batch(list(texts))], dtype=float)


def _max_seq_length(*dirs: Path) -> int:
    """``max_seq_length`` of a sentence-transformers directory, else the tokenizer's limit (first dir first)."""
    for root in dirs:
        for name, key in (
            ("sentence_bert_config.json", "max_seq_length"),
            ("tokenizer_config.json", "model_max_length"),
        ):
            try:
                value = json.loads((root / name).read_text()).get(key)
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(value, int) and 0 < value < 2**31:
                return value
    return DEFAULT_TRUNCATION


def sample_texts(
    frame,
    column: str,
    sizes: Sequence[int],
    *,
    n: int = 2048,
    partitions: int = 8,
    max_partitions: int = 64,
    seed: int = 0,
) -> list[str]:
    """A sample of about ``n`` non-null texts from partitions spread over ``frame``.

    The partitions are evenly spaced among the non-empty ones (so a frame
    ordered by text length is sampled across its range): ``partitions`` of
    them, or as many as hold about ``2 n`` rows when partitions are small (at
    most ``max_partitions``). Each is sampled on its worker in proportion to
    its rows (a row-weighted sample, so each text is as likely as any other
    of the partitions read), and only the samples reach this process.

    Parameters
    ----------
    frame : dask.dataframe.DataFrame
    column : str
    sizes : sequence of int
        Rows per partition (to skip empty ones).
    n : int
        Texts wanted in all.
    partitions, max_partitions : int
        Partitions read at least (when there are as many) and at most.
    seed : int

    Returns
    -------
    list of str

    Examples
    --------
    >>> from dask_surge.testing import make_partitioned_frame
    >>> len(sample_texts(make_partitioned_frame([5, 0, 5]), "text", [5, 0, 5], n=4))
    4
    """
    import dask

    nonempty = [i for i, s in enumerate(sizes) if s > 0]
    if not nonempty or n <= 0:
        return []
    mean = float(np.mean([sizes[i] for i in nonempty]))
    k = min(len(nonempty), max(partitions, min(max_partitions, int(np.ceil(2 * n / mean)))))
    picks = sorted({nonempty[round(x)] for x in np.linspace(0, len(nonempty) - 1, k)})
    total = sum(sizes[i] for i in picks)
    series = frame[column]
    samples = [
        series.partitions[i].map_partitions(_sample, -(-n * sizes[i] // total), seed + i, meta=series._meta)
        for i in picks
    ]
    out = [t for part in dask.compute(*samples) for t in _to_list(part)]
    if len(out) > n:
        keep = np.random.default_rng(seed).choice(len(out), size=n, replace=False)
        out = [out[i] for i in sorted(keep)]
    return out


def _sample(part, k: int, seed: int):
    """Up to ``k`` of the non-null str values of one partition, in their order (runs on a worker)."""
    values = part.dropna()
    if len(values) > k:
        take = np.random.default_rng(seed).choice(len(values), size=k, replace=False)
        values = values.iloc[np.sort(take)]
    return values


def _to_list(part) -> list:

    return [v for v in to_host(part).tolist() if isinstance(v, str)]
