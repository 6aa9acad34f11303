"""Synthetic English-like texts and partitioned frames with log-normal partition sizes.

Production code uses these generators (the calibration probe, ``dask-surge demo``);
:mod:`dask_surge.testing` re-exports them for tests and measurements. Everything is
deterministic for a given ``seed``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from .errors import SurgeValueError

__all__ = ["lognormal_sizes", "make_partitioned_frame", "make_texts", "write_partitioned_parquet"]

_WORDS = (  # noqa: SIM905  (a paragraph reads better than a list of 97 strings)
    "the of and to in is was for on that with as by at from his it an were are which "
    "this be or has had not but first one their its new after who they have her she two "
    "been other when there all during into school time may years more most only over city "
    "some world would where later up such used many can state about national out known "
    "university united then made data model graph partition embedding vector search query "
    "cluster worker memory batch token encoder python dask arrow parquet gpu throughput"
).split()


def make_texts(n: int, *, seed: int = 0, mean_words: float = 20.0) -> list[str]:
    """Generate ``n`` English-like texts with a log-normal length distribution.

    Parameters
    ----------
    n : int
        Number of texts.
    seed : int
        Seed (same seed, same texts).
    mean_words : float
        Median length in words (log-normal, sigma 0.6, clipped to 1-400 words).

    Returns
    -------
    list of str

    Examples
    --------
    >>> from dask_surge.synthetic import make_texts
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

    Parameters
    ----------
    total : int
        Rows over all partitions.
    partitions : int
        Number of partitions (positive).
    sigma : float
        Log-normal sigma of the sizes (the paper's default is 1.72).
    seed : int
        Seed (same seed, same sizes).

    Returns
    -------
    numpy.ndarray
        ``partitions`` int64 sizes that sum to ``total``.

    Raises
    ------
    SurgeValueError
        If ``partitions`` is not positive.

    Examples
    --------
    >>> from dask_surge.synthetic import lognormal_sizes
    >>> int(lognormal_sizes(1000, 10).sum())
    1000
    """
    if partitions <= 0:
        raise SurgeValueError(
            f"partitions={partitions!r} must be positive (sizes are drawn per partition). "
            "Fix: pass partitions >= 1."
        )
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

    Parameters
    ----------
    sizes : sequence of int
        Rows of each partition (zeros allowed).
    seed : int
        Seed of the texts.
    text_column : str
        Name of the text column.
    mean_words : float
        Median text length in words (see :func:`make_texts`).

    Returns
    -------
    dask.dataframe.DataFrame
        Columns ``text_column`` (``string[pyarrow]``) and ``doc_id`` (int64, globally
        unique), one partition per entry of ``sizes``, partition sizes known to nothing
        but the data (like a frame built by user code).

    Examples
    --------
    >>> from dask_surge.synthetic import make_partitioned_frame
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
                {
                    text_column: pd.array(texts[start : start + s], dtype="string[pyarrow]"),
                    "doc_id": np.arange(start, start + s, dtype=np.int64),
                },
                index=pd.RangeIndex(start, start + s),
            )
        )
        start += s
    return dd.from_map(_identity, frames, enforce_metadata=False)


def _identity(frame):
    return frame


def write_partitioned_parquet(path, sizes, *, seed: int = 0, text_column: str = "text") -> list[str]:
    """Write one Parquet file per partition (``part-00000.parquet``, ...) with ``sizes[i]`` rows.

    Parameters
    ----------
    path : str or os.PathLike
        Directory to write to (created if missing).
    sizes : sequence of int
        Rows of each file (zeros allowed).
    seed : int
        Seed of the texts.
    text_column : str
        Name of the text column.

    Returns
    -------
    list of str
        The files written, in partition order. Columns: ``text_column`` (string),
        ``doc_id`` (int64, globally unique).

    Examples
    --------
    >>> import tempfile
    >>> from dask_surge.synthetic import write_partitioned_parquet
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
        table = pa.table(
            {
                text_column: pa.array(texts[start : start + s], type=pa.string()),
                "doc_id": pa.array(np.arange(start, start + s, dtype=np.int64)),
            }
        )
        name = out / f"part-{i:05d}.parquet"
        pq.write_table(table, name)
        files.append(str(name))
        start += s
    return files
