"""What encodes a loaded model: four backends behind one small protocol, and the function that picks one.

- :class:`FastBackend`: the tokenize-sort-forward :class:`~dask_surge.engine.transformer.TransformerEngine`,
  for a ``SentenceTransformer`` that is Transformer (an encoder or a rotary decoder) + Pooling
  (cls, mean, max or lasttoken) (+ Normalize), :func:`~dask_surge.engine.layout.plain_reason`;
- :class:`SentenceTransformersBackend`: ``SentenceTransformer.encode``, for every other
  sentence-transformers model (encoder-decoders, custom modules, CLIP...);
- :class:`FamilyBackend`: a sparse ``SparseEncoder`` or multi-vector ``MultiVectorEncoder``, run by
  its own ``encode_document`` (:mod:`dask_surge.engine.family`);
- :class:`CallableBackend`: any other callable ``texts -> (n, d) array``, called as is.

:func:`choose_backend` builds the one that applies and says why. Every backend has a
:meth:`~Backend.close` that releases what it holds (the engine's feeder thread, pinned
buffer and encoder copy; the model) once no call is running: a call that starts after
``close`` raises :class:`BackendClosed`, which :class:`~dask_surge.models.encoders.Encoder`
answers by loading the model again. Nothing here imports torch at import time.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import SurgeModelError, SurgeValueError
from ..families import DENSE, check_family_options
from ..io.texts import ArrowTexts
from .family import family_of_object
from .layout import layout_of_model
from .loading import direct_layout, load_direct
from .long_texts import TextEmbeddings, TextTooLong, WindowCutter, WindowGroup, encode_windows, no_tokenizer
from .placement import auto_dtype, checkpoint_dtype, move_to
from .prompts import resolve_prompt

logger = logging.getLogger(__name__)

__all__ = [
    "Backend",
    "BackendClosed",
    "CallableBackend",
    "FamilyBackend",
    "FastBackend",
    "SentenceTransformersBackend",
    "choose_backend",
    "direct_backend",
    "free_memory",
]


class BackendClosed(RuntimeError):
    """A call reached a backend after :meth:`Backend.close`; the caller loads the model again."""


@runtime_checkable
class Backend(Protocol):
    """What encodes texts for a loaded model.

    Attributes
    ----------
    name : str
        ``"fast"``, ``"sentence-transformers"`` or ``"callable"`` (what ``Encoder.backend``
        and ``EncodeResult.engine`` report).
    family : str
        What one text becomes: ``"dense"`` (a vector), ``"sparse"`` or ``"multivector"``
        (:class:`FamilyBackend`; see :mod:`dask_surge.engine.family`).
    dimension : int
        Embedding size (a sparse model's vocabulary, a multi-vector model's token vector size).
    """

    name: str
    family: str
    dimension: int

    def encode(self, texts: list[str], normalize: bool) -> np.ndarray:
        """``(len(texts), dimension)`` embeddings, L2-normalized when ``normalize``.

        Raises
        ------
        BackendClosed
            If the backend was closed.
        """
        ...

    def encode_long(
        self, texts: list[str], normalize: bool, long_texts: str, chunk_overlap: int
    ) -> TextEmbeddings:
        """Embed ``texts`` doing with those over the window what ``long_texts`` says (see
        :meth:`~dask_surge.models.encoders.Encoder.encode_long`; the options are checked already).
        The ``"fast"`` backend also takes an :class:`~dask_surge.io.texts.ArrowTexts`.

        Raises
        ------
        BackendClosed
            If the backend was closed.
        """
        ...

    def window_cutter(self, long_texts: str = "chunk") -> WindowCutter:
        """The model's window cutter (its fast tokenizer and window), built once.

        Raises
        ------
        SurgeValueError
            Where the model has none (no fast tokenizer), saying why ``long_texts`` cannot run.
        BackendClosed
            If the backend was closed.
        """
        ...

    def close(self) -> None:
        """Release what the backend holds, once the calls running now end; idempotent."""
        ...


class _Released:
    """Calls in flight and the release that waits for the last of them (shared by the backends)."""

    name = "?"
    #: what one text becomes (:data:`dask_surge.families.FAMILIES`): a vector, but for :class:`FamilyBackend`
    family = "dense"

    def __init__(self) -> None:
        self._calls = threading.Condition(threading.Lock())
        self._active = 0
        self._closing = False
        self._released = False

    @contextmanager
    def _call(self) -> Iterator[None]:
        with self._calls:
            if self._closing:
                raise BackendClosed(f"this {self.name} backend was closed; load the model again")
            self._active += 1
        try:
            yield
        finally:
            with self._calls:
                self._active -= 1
                release = self._closing and self._active == 0 and not self._released
                self._released = self._released or release
            if release:
                self._release()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called (the release may wait for running calls)."""
        return self._closing

    def close(self) -> None:
        """Refuse new calls, and release now, or when the running calls end (never blocks); idempotent."""
        with self._calls:
            self._closing = True
            release = self._active == 0 and not self._released
            self._released = self._released or release
        if release:
            self._release()

    def _release(self) -> None:  # pragma: no cover - each backend overrides it
        raise NotImplementedError


class FastBackend(_Released):
    """The fast engine of a ``SentenceTransformer`` (see :class:`~dask_surge.engine.transformer.TransformerEngine`).

    It checks the embeddings for NaN and inf itself, on the device.
    """

    name = "fast"
    #: What loaded the model: ``"sentence-transformers"``; for a plain Transformer + Pooling
    #: (+ Normalize) directory loaded without it (:func:`direct_backend`), ``"dask-surge"`` (a BERT,
    #: :mod:`dask_surge.engine.bert`) or ``"transformers"`` (another encoder, ``AutoModel``).
    loaded_by = "sentence-transformers"

    def __init__(self, model: Any, engine: Any) -> None:
        super().__init__()
        self.model = model
        #: The :class:`~dask_surge.engine.transformer.TransformerEngine` (None once released).
        self.engine = engine
        self.dimension = int(engine.dimension)

    def encode(self, texts: list[str], normalize: bool) -> np.ndarray:
        with self._call():
            return self.engine.encode(texts, normalize=normalize)

    def encode_long(
        self, texts: list[str] | ArrowTexts, normalize: bool, long_texts: str, chunk_overlap: int
    ) -> TextEmbeddings:
        with self._call():
            return self.engine.encode_long(
                texts,
                normalize=normalize,
                long_texts=long_texts,  # type: ignore[arg-type]
                chunk_overlap=chunk_overlap,
            )

    def window_cutter(self, long_texts: str = "chunk") -> WindowCutter:
        with self._call():
            return self.engine.cutter()

    def _release(self) -> None:
        engine, self.engine, self.model = self.engine, None, None
        if engine is not None:
            engine.close()  # the feeder thread, the pinned staging buffer, its encoder copy


class SentenceTransformersBackend(_Released):
    """``SentenceTransformer.encode``, one call at a time, with the prompt resolved already."""

    name = "sentence-transformers"
    engine = None

    def __init__(self, model: Any, *, prompt: str | None, batch_size: int) -> None:
        super().__init__()
        self.model = model
        self._prompt = "" if prompt is None else prompt  # resolved already: "" stops a second default lookup
        self._batch_size = batch_size
        self._lock = threading.Lock()
        self._cutter: WindowCutter | None = None  # long texts: built on first use
        get_dim = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        dim = get_dim()
        if dim is None:  # some custom stacks only know it once they ran
            dim = self._encode(["dimension probe"], False).shape[1]
        self.dimension = int(dim)

    def encode(self, texts: list[str], normalize: bool) -> np.ndarray:
        with self._call():
            return self._encode(texts, normalize)

    def _encode(self, texts: list[str], normalize: bool) -> np.ndarray:
        with self._lock:
            return self.model.encode(
                texts,
                prompt=self._prompt,
                batch_size=self._batch_size,
                normalize_embeddings=normalize,
                convert_to_numpy=True,
                show_progress_bar=False,
            )

    def encode_long(
        self, texts: list[str], normalize: bool, long_texts: str, chunk_overlap: int
    ) -> TextEmbeddings:
        """As the fast engine, with windows cut by the model's fast tokenizer and their texts run by ``model.encode``.

        ``"truncate"`` counts the texts over the window by tokenizing them (up to just past it).
        """
        with self._call():
            if long_texts in ("chunk", "mean"):
                cutter = self.window_cutter(long_texts)
                cutter.check_overlap(chunk_overlap)
                renormalize = normalize or any(type(m).__name__ == "Normalize" for m in self.model)

                def encode(groups: Iterator[WindowGroup]) -> Iterator[np.ndarray]:
                    for group in groups:
                        w = group.windows
                        spans = [
                            texts[t][a:b]
                            for t, a, b in zip(w.text.tolist(), w.char_start.tolist(), w.char_end.tolist())
                        ]
                        yield np.asarray(self._encode(spans, normalize), dtype=np.float32).reshape(
                            len(spans), -1
                        )

                return encode_windows(
                    texts, long_texts, chunk_overlap, cutter, encode, self.dimension, renormalize=renormalize
                )
            over = _over_window(self.window_cutter, texts, long_texts)
            return TextEmbeddings(
                self._encode(texts, normalize), None, over, 0 if over is None else int(over.sum())
            )

    def window_cutter(self, long_texts: str = "chunk") -> WindowCutter:
        """The model's window cutter (built once), or the error saying why there is none."""
        with self._call():
            if self._cutter is None:
                self._cutter = _window_cutter_of(self.model, long_texts, self._prompt)
            return self._cutter

    def _release(self) -> None:
        self.model = None


class FamilyBackend(_Released):
    """A sentence-transformers ``SparseEncoder`` (``family="sparse"``) or ``MultiVectorEncoder``
    (``family="multivector"``), run by its own ``encode_document`` (or ``encode_query`` for
    ``prompt_name="query"``), one call at a time.

    :meth:`encode_long` returns the model's own output in ``embeddings``: a torch sparse
    ``(n, vocabulary)`` tensor on the CPU for a sparse model, a list of ``n`` ``(tokens, dim)``
    float32 arrays for a multi-vector one (see :mod:`dask_surge.io.sparse` and
    :mod:`dask_surge.io.multivector` for the columns they become). Texts over the model's
    window are cut by the model, and counted (``"truncate"``) or refused (``"error"``) here;
    ``"chunk"`` and ``"mean"`` are refused.

    Examples
    --------
    >>> import tempfile
    >>> from sentence_transformers import MultiVectorEncoder
    >>> from dask_surge.testing import make_tiny_multivector_model
    >>> model = MultiVectorEncoder(make_tiny_multivector_model(tempfile.mkdtemp()), device="cpu")
    >>> backend = FamilyBackend(model, family="multivector", prompt=None, prompt_name=None, batch_size=32)
    >>> out = backend.encode_long(["a tiny, test."], False, "truncate", 0)
    >>> backend.dimension, [m.shape for m in out.embeddings], out.over
    (16, [(6, 16)], 0)
    """

    name = "sentence-transformers"
    engine = None

    def __init__(
        self, model: Any, *, family: str, prompt: str | None, prompt_name: str | None, batch_size: int
    ) -> None:
        super().__init__()
        self.model, self.family = model, family
        self._prompt, self._prompt_name, self._batch_size = prompt, prompt_name, batch_size
        self._lock = threading.Lock()
        self._cutter: WindowCutter | None = None
        # a sparse model's rows are as wide as its vocabulary (get_embedding_dimension says its hidden size)
        probe = self._encode(["dimension probe"], False)
        self.dimension = int(probe.shape[1] if family == "sparse" else probe[0].shape[1])

    def encode(self, texts: list[str], normalize: bool) -> np.ndarray:
        raise SurgeValueError(
            f"the model writes {self.family} output, not one fixed-size vector per text, so it has no (n, d) "
            "array to return. Fix: use dask_surge.encode (or Encoder.encode_long) for its rows."
        )

    def _encode(self, texts: list[str], normalize: bool) -> Any:
        model = self.model
        kwargs: dict[str, Any] = {"batch_size": self._batch_size, "show_progress_bar": False}
        if self.family == "sparse":
            kwargs.update(convert_to_sparse_tensor=True, save_to_cpu=True)
        else:
            kwargs.update(convert_to_numpy=True, normalize_embeddings=normalize)
        with self._lock:
            if self._prompt is not None:  # an explicit prompt replaces the model's marker
                return model.encode_document(texts, prompt=self._prompt, **kwargs)
            if self._prompt_name == "query":
                return model.encode_query(texts, **kwargs)
            if self._prompt_name not in (None, "document"):
                return model.encode(texts, prompt_name=self._prompt_name, **kwargs)
            return model.encode_document(texts, **kwargs)

    def encode_long(
        self, texts: list[str], normalize: bool, long_texts: str, chunk_overlap: int
    ) -> TextEmbeddings:
        """The model's rows for ``texts`` (see the class); ``"truncate"`` counts the texts over the
        window by tokenizing them (up to just past it), ``"error"`` refuses the first.

        Raises
        ------
        SurgeValueError
            For ``"chunk"`` and ``"mean"``.
        TextTooLong
            ``"error"`` and a text is over the window.
        """
        check_family_options(self.family, long_texts=long_texts)
        with self._call():
            over = _over_window(self.window_cutter, texts, long_texts)
            return TextEmbeddings(
                self._encode(texts, normalize), None, over, 0 if over is None else int(over.sum())
            )

    def window_cutter(self, long_texts: str = "chunk") -> WindowCutter:
        with self._call():
            if self._cutter is None:
                self._cutter = _window_cutter_of(self.model, long_texts, self._marker(), self._window())
            return self._cutter

    def _window(self) -> int | None:
        """The tokens a text is cut at: a late-interaction model cuts queries and documents at lengths of
        their own (its Transformer's ``query_length`` / ``document_length``); None: its ``max_seq_length``."""
        first = self.model[0] if len(self.model) else None
        length = getattr(first, "query_length" if self._prompt_name == "query" else "document_length", None)
        return length if isinstance(length, int) and length > 0 else None

    def _marker(self) -> str:
        """The prompt each text gets: the explicit one, else the model's for the task it runs."""
        if self._prompt is not None:
            return self._prompt
        prompts = getattr(self.model, "prompts", None) or {}
        return str(prompts.get(self._prompt_name or "document", "") or "")

    def _release(self) -> None:
        self.model = None


def _over_window(
    cutter: Callable[[str], WindowCutter], texts: list[str], long_texts: str
) -> np.ndarray | None:
    """Which ``texts`` are over the window of ``cutter(long_texts)`` (a backend's window cutter), counted
    by tokenizing them up to just past it; with ``"error"`` the first is refused. None where the model
    has no fast tokenizer to count with and ``long_texts`` is ``"truncate"`` (else that error is raised).

    Raises
    ------
    TextTooLong
        ``"error"`` and a text is over the window.
    """
    try:
        cut = cutter(long_texts)
    except SurgeValueError:
        if long_texts != "truncate":
            raise
        return None
    over = cut.over(texts)
    if long_texts == "error" and over.any():
        first = int(np.argmax(over))
        raise TextTooLong(first, cut.content_tokens(texts[first]), cut.capacity)
    return over


def _window_cutter_of(model: Any, long_texts: str, prompt: str, length: int | None = None) -> WindowCutter:
    """The window cutter of a sentence-transformers model (its fast tokenizer and ``length``, default its
    ``max_seq_length``), or the error saying why it has none."""
    tokenizer = getattr(model, "tokenizer", None)
    length = getattr(model, "max_seq_length", None) if length is None else length
    if tokenizer is None or not getattr(tokenizer, "is_fast", False):
        raise no_tokenizer(
            long_texts, f"the model's tokenizer ({type(tokenizer).__name__}) is not a fast one"
        )
    if not isinstance(length, int) or length < 1:
        raise no_tokenizer(long_texts, f"the model has no max_seq_length (it is {length!r})")
    return WindowCutter(tokenizer, length, prompt=prompt)


class CallableBackend(_Released):
    """A plain callable ``texts -> (n, d) array``, called as is (normalized here when asked).

    Raises
    ------
    SurgeModelError
        If the callable does not map one text to one row.
    """

    name = "callable"
    engine = None

    def __init__(self, fn: Callable[[list[str]], Any]) -> None:
        super().__init__()
        self.fn: Callable[[list[str]], Any] | None = fn
        probe = self._encode(["dimension probe"], False)
        if probe.ndim != 2 or probe.shape[0] != 1:
            raise SurgeModelError(
                f"model callable {fn!r} returned shape {probe.shape} for one text; it must map a "
                "list of n strings to an (n, d) array. Fix: return e.g. numpy.stack([...]) of one vector per text."
            )
        self.dimension = int(probe.shape[1])

    def encode(self, texts: list[str], normalize: bool) -> np.ndarray:
        with self._call():
            return self._encode(texts, normalize)

    def _encode(self, texts: list[str], normalize: bool) -> np.ndarray:
        assert self.fn is not None
        emb = np.asarray(self.fn(texts), dtype=np.float32)
        if normalize and emb.size:
            emb = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
        return emb

    def encode_long(
        self, texts: list[str], normalize: bool, long_texts: str, chunk_overlap: int
    ) -> TextEmbeddings:
        """``"truncate"`` only: a plain callable has no tokenizer, so what it cuts is unknown (``truncated`` None).

        Raises
        ------
        SurgeValueError
            For ``"error"``, ``"chunk"`` and ``"mean"``.
        """
        if long_texts != "truncate":
            self.window_cutter(long_texts)  # raises: no tokenizer
        with self._call():
            return TextEmbeddings(self._encode(texts, normalize), None, None, 0)

    def window_cutter(self, long_texts: str = "chunk") -> WindowCutter:
        raise no_tokenizer(long_texts, "a plain callable model has no tokenizer")

    def _release(self) -> None:
        self.fn = None


def choose_backend(
    obj: Any,
    *,
    name: str,
    in_memory: bool,
    device: str | None = None,
    engine: str = "auto",
    dtype: str = "auto",
    max_tokens: int | None = None,
    batch_size: int = 32,
    prompt: str | None = None,
    prompt_name: str | None = None,
) -> tuple[Backend, str]:
    """The backend that encodes with ``obj``, and why it was chosen.

    A ``SentenceTransformer`` runs on the fast engine when ``engine`` is ``"auto"`` or
    ``"fast"`` and its modules are Transformer (an encoder or a rotary decoder) + Pooling
    (cls, mean, max or lasttoken) (+ Normalize), else through ``SentenceTransformer.encode``; an in-memory one is
    first moved to ``device``. Any other callable is called as is.

    Parameters
    ----------
    obj : SentenceTransformer or callable
    name : str
        How error messages name the model.
    in_memory : bool
        ``obj`` is the caller's object (moved to ``device``), not one loaded for ``device``.
    device, engine, dtype, max_tokens, batch_size, prompt, prompt_name
        The encoder's options (see :class:`~dask_surge.models.encoders.Encoder`).

    Returns
    -------
    tuple of (Backend, str)

    Raises
    ------
    SurgeModelError
        ``engine="fast"`` for a model the fast engine cannot run; a callable that does
        not return one row per text.
    SurgeValueError
        A prompt for a plain callable.

    Examples
    --------
    >>> backend, why = choose_backend(lambda texts: [[1.0, 0.0]] * len(texts), name="f", in_memory=True)
    >>> backend.name, backend.dimension, why
    ('callable', 2, 'a plain callable, not a SentenceTransformer: called as is')
    >>> backend.close(); backend.closed
    True
    """
    # an instance of SentenceTransformer means its module is imported: a plain callable never pays for the
    # import, seconds before the first SuperBatch (docs/ab_studies.md, "Cold first output")
    st_module = sys.modules.get("sentence_transformers")
    SentenceTransformer = getattr(st_module, "SentenceTransformer", ()) if st_module is not None else ()
    family = family_of_object(obj)
    if family != DENSE:
        if engine == "fast":
            raise SurgeModelError(
                f"engine='fast' runs dense models, but {name!r} is a {type(obj).__name__} ({family} output). "
                "Fix: pass engine='auto' (its own encode runs inside the SuperBatches)."
            )
        if in_memory:
            move_to(obj, device)
        # checks that prompt_name names one of the model's prompts; the model's own call applies it
        resolve_prompt(dict(obj.prompts), obj.default_prompt_name, prompt, prompt_name, source=repr(name))
        backend = FamilyBackend(
            obj, family=family, prompt=prompt, prompt_name=prompt_name, batch_size=batch_size
        )
        return backend, f"the model is a {type(obj).__name__} ({family} output): its own encode runs"
    if not isinstance(obj, SentenceTransformer):
        if prompt is not None or prompt_name is not None:
            raise SurgeValueError(
                f"prompt=/prompt_name= apply to sentence-transformers models, but the model is a "
                f"{type(obj).__name__} callable. Fix: put the prompt into the texts (or into the callable)."
            )
        return CallableBackend(obj), "a plain callable, not a SentenceTransformer: called as is"
    if in_memory:
        move_to(obj, device)
    resolved = resolve_prompt(
        dict(obj.prompts), obj.default_prompt_name, prompt, prompt_name, source=repr(name)
    )
    modules = layout_of_model(obj).modules  # the structure the plain rule judges (engine/layout.py)
    if engine == "sentence-transformers":
        reason = "engine='sentence-transformers' was asked for: SentenceTransformer.encode runs"
    else:
        from .transformer import TransformerEngine

        if dtype == "auto":
            dtype = auto_dtype(str(obj.device), checkpoint_dtype(obj))
        fast = TransformerEngine.from_sentence_transformer(
            obj, max_tokens=max_tokens, dtype=dtype, prompt="" if resolved is None else resolved
        )
        if fast is not None:
            return FastBackend(obj, fast), _fast_reason(engine, modules)
        if engine == "fast":
            raise SurgeModelError(
                f"engine='fast' needs a Transformer (an encoder or a rotary decoder) + Pooling (cls, mean, max or "
                f"lasttoken) (+ Normalize) model, but {name!r} has modules {modules} "
                f"({layout_of_model(obj).reason or 'its tokenizer is not a fast one'}). "
                "Fix: pass engine='auto' to fall back to SentenceTransformer.encode."
            )
        reason = (
            f"engine='auto' and the model ({' + '.join(modules)}) is not an encoder Transformer + Pooling "
            "(cls, mean, max or lasttoken) (+ Normalize), nor a rotary decoder one, that the fast engine runs "
            f"({layout_of_model(obj).reason or 'its tokenizer is not a fast one'}): "
            "SentenceTransformer.encode runs"
        )
    return SentenceTransformersBackend(obj, prompt=resolved, batch_size=batch_size), reason


def direct_backend(
    path: str,
    *,
    name: str,
    device: str,
    engine: str = "auto",
    dtype: str = "auto",
    max_tokens: int | None = None,
    prompt: str | None = None,
    prompt_name: str | None = None,
) -> tuple[Backend, str] | None:
    """The fast backend of the model directory ``path``, loaded without sentence-transformers when its
    files say it is a plain Transformer + Pooling (+ Normalize) encoder (see :mod:`dask_surge.engine.loading`);
    None when it is not (the caller loads it with sentence-transformers, which also raises the errors).

    The reason is the one :func:`choose_backend` gives for the same model.

    Examples
    --------
    >>> from dask_surge.testing import packaged_model_dir
    >>> backend, why = direct_backend(str(packaged_model_dir()), name="minilm", device="cpu")
    >>> backend.name, backend.dimension, backend.loaded_by
    ('fast', 384, 'dask-surge')
    >>> backend.close()
    >>> direct_backend(str(packaged_model_dir()), name="minilm", device="cpu", engine="sentence-transformers") is None
    True
    """
    if engine == "sentence-transformers":
        return None
    layout, why = direct_layout(path)
    if layout is None:
        logger.debug("dask-surge: %s is loaded with sentence-transformers: %s", name, why)
        return None
    resolved = resolve_prompt(
        layout.prompts, layout.default_prompt_name, prompt, prompt_name, source=repr(name)
    )
    module = load_direct(layout, device)
    if dtype == "auto":
        dtype = auto_dtype(str(device), checkpoint_dtype(module.auto_model))
    if dtype not in (None, "float32") and not str(device).startswith("cuda"):
        return None  # half precision on a CPU: sentence-transformers' load raises the error that says so
    from .transformer import TransformerEngine

    fast = TransformerEngine(
        module,
        layout.pooling,
        normalize=layout.normalize,
        max_tokens=max_tokens,
        dtype=dtype,
        prompt="" if resolved is None else resolved,
        include_prompt=layout.include_prompt,
    )
    backend = FastBackend(module.auto_model, fast)
    backend.loaded_by = module.loaded_by
    return backend, _fast_reason(engine, layout.modules)


def _fast_reason(engine: str, modules: list[str]) -> str:
    """Why the fast engine runs a model of these modules (the same whichever loader built it)."""
    return f"engine={engine!r} and the model is {' + '.join(modules)}, which the fast engine runs"


def free_memory() -> None:
    """Give freed model memory back: collect garbage, empty torch's CUDA cache, trim the C heap (glibc)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if sys.platform.startswith("linux"):
        with suppress(OSError, AttributeError):  # a libc without malloc_trim (musl): nothing to trim
            ctypes.CDLL(None).malloc_trim(0)
