"""Text encoders: a model handle that is cheap to ship and loaded once per process.

An :class:`Encoder` describes a model (the packaged default, a local path, a
loaded ``SentenceTransformer`` or any callable ``texts -> (n, d) array``) plus
its options. Pickling it never pickles model weights: a path-based encoder
ships as its path and options and is loaded lazily, once per process, into a
process-wide cache; an in-memory model ships as a registry token and reaches
Dask workers once each through :class:`dask_surge.execution.plugins.EncoderPlugin`.

The handle is built from one module per concept; import a name from its own module:
:mod:`~dask_surge.models.resolve` (model names to directories), :mod:`~dask_surge.models.spec`
(the picklable spec), :mod:`~dask_surge.models.registry` (in-memory models by token),
:mod:`~dask_surge.models.loader` (a spec to a backend; what the files say),
:mod:`~dask_surge.models.cache` (loaded models, bounded) and :mod:`~dask_surge.models.output`
(checks on what a backend returns).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

import numpy as np

from ..config import check_argument
from ..engine.backends import BackendClosed
from ..engine.family import family_of_files, family_of_object
from ..engine.long_texts import (
    TextEmbeddings,
    Windows,
    check_long_texts,
)
from ..engine.placement import auto_dtype, checkpoint_dtype, gpu_count
from ..engine.prompts import resolve_prompt
from ..errors import SurgeInputError, SurgeModelError, SurgeValueError
from ..families import DENSE, MULTIVECTOR
from ..fingerprint import redact, without_secrets
from ..io.arrow import embedding_array
from ..io.texts import as_texts
from ..options import DEFAULT_CHUNK_OVERLAP, Dtype, EngineName, LongTexts, defaults, document, options_of
from . import cache
from .cache import Loaded
from .loader import configured_prompts, dimension_from_files, stored_dtype
from .modelid import directory_digest, object_digest
from .output import checked
from .registry import installed, token_for
from .resolve import resolve_model
from .spec import EncoderSpec, freeze, thaw

__all__ = ["Encoder", "from_spec"]


#: the Encoder's options and their defaults, as declared in :data:`dask_surge.options.OPTIONS`
_OPTION_DEFAULTS: dict[str, Any] = defaults("Encoder")


class Encoder:
    """A sentence encoder that Dask tasks can carry without carrying weights.

    Parameters
    ----------
    model : str, os.PathLike, SentenceTransformer or callable, default "default"
        A Hugging Face Hub name (``"BAAI/bge-small-en-v1.5"``), resolved through the
        Hugging Face cache as sentence-transformers does (see :func:`resolve_model`);
        a local sentence-transformers model directory; ``"default"`` for the packaged
        all-MiniLM-L6-v2; a loaded ``SentenceTransformer``, used as is; or any other
        callable mapping a list of ``n`` strings to an ``(n, d)`` float array.
    {options}

    Examples
    --------
    >>> from dask_surge import Encoder
    >>> enc = Encoder("default", device="cpu")
    >>> enc.encode(["a short text", "another one"]).shape
    (2, 384)
    >>> import pickle
    >>> len(pickle.dumps(enc)) < 2_000   # weights never travel with the encoder
    True

    Prompts work as in sentence-transformers (here an explicit one):

    >>> Encoder("default", device="cpu", prompt="query: ").encode(["what is dask?"]).shape
    (1, 384)
    """

    spec: EncoderSpec

    def __init__(
        self,
        model: Any = "default",
        *,
        device: str | None = None,
        dtype: Dtype = "auto",
        engine: EngineName = "auto",
        batch_size: int = 32,
        max_tokens: int | None = None,
        prompt: str | None = None,
        prompt_name: str | None = None,
        revision: str | None = None,
        trust_remote_code: bool = False,
        model_kwargs: dict[str, Any] | None = None,
    ) -> None:
        values = locals()  # every option declared for the Encoder is a keyword above (KeyError if not)
        given = {k: values[k] for k in _OPTION_DEFAULTS}
        if isinstance(model, Encoder):
            changed = {k: v for k, v in given.items() if v != _OPTION_DEFAULTS[k]}
            if changed:
                raise SurgeValueError(
                    f"Encoder({model!r}, {', '.join(f'{k}={redact(v)!r}' for k, v in changed.items())}): options were "
                    "given alongside a ready Encoder, which already holds its own. Fix: "
                    f"encoder.with_options({', '.join(f'{k}=...' for k in changed)}) for a changed copy, or pass "
                    "the model name instead of the Encoder."
                )
            self.spec = model.spec
            return
        _check_options(given)
        resolved = None
        if isinstance(model, (str, os.PathLike)):
            resolved = resolve_model(model, revision)
            kind, source = "path", resolved.path
        elif callable(model):
            if revision is not None or trust_remote_code or model_kwargs:
                raise SurgeValueError(
                    f"revision=, trust_remote_code= and model_kwargs= apply when a model is loaded by name, but "
                    f"model={type(model).__name__} is already in memory. Fix: drop them, or pass the model's name."
                )
            kind, source = "object", token_for(model)
        else:
            raise SurgeModelError(
                f"model={model!r} is not a path, a SentenceTransformer or a callable. Fix: pass "
                "'default', a Hub name such as 'BAAI/bge-small-en-v1.5', a local model directory, a loaded "
                "SentenceTransformer, or a function texts -> (n, d) array."
            )
        spec_options = {k: v for k, v in given.items() if k != "revision"}  # the commit is recorded instead
        spec_options.update(
            trust_remote_code=bool(trust_remote_code), model_kwargs=freeze(model_kwargs or {})
        )
        self.spec = EncoderSpec(
            kind,
            source,
            **spec_options,
            repo_id=resolved.repo_id if resolved else None,
            commit=resolved.commit if resolved else None,
        )
        if prompt_name is not None and prompt is None:
            prompts = configured_prompts(self.spec)
            if prompts is not None and prompt_name not in prompts[0]:
                raise SurgeValueError(
                    f"prompt_name={prompt_name!r} is not one of this model's prompts {sorted(prompts[0])} "
                    f"({self._name()}). Fix: pass one of those, or the text itself with prompt='...'."
                )

    # -- identity ---------------------------------------------------------------------
    def __reduce__(self):
        return (from_spec, (self.spec,))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Encoder) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    def __dask_tokenize__(self) -> Any:
        return ("dask-surge-encoder", self.spec)

    def _name(self) -> str:
        if self.spec.repo_id:
            return f"{self.spec.repo_id}@{self.spec.commit[:12] if self.spec.commit else 'main'}"
        return self.spec.source if self.spec.kind == "path" else f"<in-memory {self.spec.source}>"

    def __repr__(self) -> str:
        extra = "".join(
            f", {k}={getattr(self.spec, k)!r}"
            for k in ("prompt", "prompt_name")
            if getattr(self.spec, k) is not None
        )
        if self.spec.model_kwargs:  # credentials (token=...) shown as "***"
            extra += f", model_kwargs={redact(thaw(self.spec.model_kwargs))!r}"
        return f"Encoder({self._name()!r}, device={self.spec.device!r}, dtype={self.spec.dtype!r}{extra})"

    @property
    def in_memory(self) -> bool:
        """True when the model is an in-memory object (shipped by plugin, not by path)."""
        return self.spec.kind == "object"

    @property
    def source_object(self) -> Any:
        """The in-memory model object (``None`` for path-based encoders)."""
        return installed(self.spec.source) if self.in_memory else None

    def identity(self, device: str | None = None) -> dict:
        """What identifies the model for a run's fingerprint: its content, and the options that change vectors.

        A Hub model is its repo id and commit; a local directory a SHA-256 of its files
        (computed once, then cached by path, sizes and mtimes); an in-memory model a
        digest of its ``state_dict``, a plain callable of its code and the data it
        closes over (see :mod:`dask_surge.models.modelid`). The prompt options, ``model_kwargs``
        (credentials such as ``token`` left out: another token for the same model is
        the same model) and the compute dtype, resolved for ``device`` (see
        :meth:`compute_dtype`), are part of it. Options that do not change the vectors
        (device, engine, batch size, token budget) are not.

        Parameters
        ----------
        device : str, optional
            The device the run encodes on (``"cpu"``, ``"cuda"``); default: the
            encoder's own, else CUDA when this process sees a GPU.

        Examples
        --------
        >>> from dask_surge import Encoder
        >>> a = Encoder("default", prompt="query: ").identity()
        >>> b = Encoder("default").identity()
        >>> a["digest"] == b["digest"], a == b
        (True, False)
        >>> Encoder("default", dtype="auto").identity("cpu")["dtype"]
        'float32'
        >>> Encoder("default", batch_size=8).identity() == b
        True
        """

        ident: dict[str, Any] = {"kind": self.spec.kind}
        dtype = self.compute_dtype(device)
        if dtype is not None:
            ident["dtype"] = dtype
        if self.spec.repo_id is not None:
            ident.update(repo_id=self.spec.repo_id, commit=self.spec.commit)
        elif self.spec.kind == "path":
            ident.update(digest=directory_digest(self.spec.source))
        else:
            obj = self.source_object
            ident.update(
                object=type(obj).__module__ + "." + type(obj).__qualname__, digest=object_digest(obj)
            )
        ident.update(prompt=self.spec.prompt, prompt_name=self.spec.prompt_name)
        if (
            family := self.family
        ) != DENSE:  # recorded only where it is not a vector per text: older runs keep theirs
            ident["family"] = family
        kwargs = without_secrets(thaw(self.spec.model_kwargs)) if self.spec.model_kwargs else None
        if kwargs:
            ident["model_kwargs"] = json.dumps(kwargs, sort_keys=True, default=str)
        return ident

    def compute_dtype(self, device: str | None = None) -> str | None:
        """The dtype the forward pass runs in on ``device``: ``dtype``, with ``"auto"`` resolved.

        ``"auto"`` resolves as where the model loads (:func:`auto_dtype`): float32 on a
        CPU; on CUDA bfloat16 for a bfloat16 checkpoint (read from the model's
        ``config.json``, or its ``model_kwargs`` ``torch_dtype``), else float16. A plain
        callable computes as it does, whatever ``dtype`` says: None.

        Parameters
        ----------
        device : str, optional
            Default: the encoder's ``device``, else CUDA when this process sees a GPU.

        Examples
        --------
        >>> from dask_surge import Encoder
        >>> enc = Encoder("default")
        >>> enc.compute_dtype("cpu"), enc.compute_dtype("cuda"), enc.with_options(dtype="bfloat16").compute_dtype("cpu")
        ('float32', 'float16', 'bfloat16')
        """
        obj = self.source_object
        torch = sys.modules.get("torch")
        if self.in_memory and not (torch is not None and isinstance(obj, torch.nn.Module)):
            return None
        if self.spec.dtype != "auto":
            return self.spec.dtype
        device = device or self.spec.device or ("cuda" if gpu_count() else "cpu")
        stored = checkpoint_dtype(obj) if self.in_memory else stored_dtype(self.spec)
        return auto_dtype(device, stored)

    def resolved_prompt(self) -> str | None:
        """The prompt text put before each input, resolved as sentence-transformers does; None if none.

        ``prompt`` if given (even ``""``), else ``prompts[prompt_name]``, else the
        model's default prompt. Does not load the model.

        Examples
        --------
        >>> from dask_surge import Encoder
        >>> Encoder("default", prompt="query: ").resolved_prompt()
        'query: '
        >>> Encoder("default").resolved_prompt() is None
        True
        """
        configured = configured_prompts(self.spec)
        prompts, default = configured if configured is not None else ({}, None)
        return resolve_prompt(prompts, default, self.spec.prompt, self.spec.prompt_name, source=self._name())

    # -- loading and encoding -----------------------------------------------------------
    def _loaded(self) -> Loaded:
        return cache.get(self.spec)

    def load(self) -> Encoder:
        """Load the model into this process now (otherwise done on first use)."""
        self._loaded()
        return self

    def close(self) -> bool:
        """Release the model loaded for this encoder in this process; idempotent.

        Closes what encodes (the fast engine's feeder thread, its pinned staging buffer
        and its encoder copy), drops the loaded model's weights, and gives the memory
        back (garbage collection, torch's CUDA cache, the C heap). A call encoding right
        now finishes first. The encoder stays usable: its next use loads the model
        again. Every equal encoder (same model and options) in this process shares the
        loaded model, so this releases it for all of them. An in-memory model stays
        installed: its weights are the caller's object.

        Returns
        -------
        bool
            True when a model was loaded (and is now released).

        Examples
        --------
        >>> from dask_surge import Encoder
        >>> with Encoder("default", device="cpu") as enc:
        ...     enc.encode(["a text"]).shape
        (1, 384)
        >>> enc.is_loaded, enc.close()
        (False, False)
        """
        return cache.release(self.spec)

    #: Same as :meth:`close`.
    unload = close

    def __enter__(self) -> Encoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def is_loaded(self) -> bool:
        """True when the model is loaded in this process (nothing is loaded to answer)."""
        return cache.cached(self.spec) is not None

    @property
    def dimension(self) -> int:
        """Embedding size ``d``.

        Read from the model's files (``modules.json``, the ``Pooling`` and ``Dense``
        configs, ``config.json``'s ``hidden_size``) without loading weights, for
        path and Hub models of known layout; otherwise (in-memory models,
        callables, other module stacks) the model is loaded in this process.

        Examples
        --------
        >>> from dask_surge import Encoder
        >>> enc = Encoder("default", device="cpu", max_tokens=1000)
        >>> enc.dimension, enc.is_loaded   # read from the files: nothing loaded
        (384, False)
        """
        loaded = cache.cached(self.spec)
        if loaded is not None:
            return loaded.dimension
        if self.spec.kind == "path":
            dim = dimension_from_files(self.spec.source)
            if dim is not None:
                return dim
        return self._loaded().dimension

    @property
    def family(self) -> str:
        """What one text becomes: ``"dense"`` (a vector, the ``embedding`` column), ``"sparse"``
        (a ``SparseEncoder``: ``indices`` and ``values``) or ``"multivector"`` (a ``MultiVectorEncoder``:
        ``vectors`` and ``tokens``); see :mod:`dask_surge.io.layout`. Read from the model's files
        (``config_sentence_transformers.json``) or object without loading it.

        Examples
        --------
        >>> from dask_surge import Encoder
        >>> enc = Encoder("default")
        >>> enc.family, enc.is_loaded
        ('dense', False)
        """
        loaded = cache.cached(self.spec)
        if loaded is not None:
            return loaded.impl.family
        if self.spec.kind == "path":
            return family_of_files(self.spec.source)
        return family_of_object(self.source_object) if self.in_memory else DENSE

    @property
    def engine(self):
        """The fast :class:`~dask_surge.engine.transformer.TransformerEngine` encoding here, or None."""
        return self._loaded().engine

    @property
    def backend(self) -> str:
        """What encodes: ``"fast"``, ``"sentence-transformers"`` (the fallback) or ``"callable"``.

        Examples
        --------
        >>> from dask_surge import Encoder
        >>> Encoder("default", device="cpu").backend
        'fast'
        """
        return self._loaded().backend

    @property
    def backend_reason(self) -> str:
        """Why :attr:`backend` encodes (see :func:`dask_surge.engine.backends.choose_backend`).

        Examples
        --------
        >>> from dask_surge import Encoder
        >>> Encoder("default", device="cpu").backend_reason
        "engine='auto' and the model is Transformer + Pooling + Normalize, which the fast engine runs"
        """
        return self._loaded().reason

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
        loaded, raw = self._call(loaded, lambda impl: impl.encode(texts, normalize))
        return checked(raw, len(texts), loaded.backend)

    def _call(self, loaded: Loaded, run: Any) -> tuple[Loaded, Any]:
        """``run(backend)``, with the model loaded again if another thread closed it meanwhile."""
        for _ in range(3):  # closed (evicted, unloaded) by another thread meanwhile: load it again
            try:
                return loaded, run(loaded.impl)
            except BackendClosed:
                cache.forget(self.spec, loaded)  # closed while still cached (closed directly)
                loaded = self._loaded()
        return loaded, run(loaded.impl)

    def windows(self, texts: Sequence[str], *, chunk_overlap: int | None = DEFAULT_CHUNK_OVERLAP) -> Windows:
        """The token windows ``long_texts="chunk"`` would make of ``texts``, without encoding them.

        What :func:`dask_surge.plan` counts on a sample (texts over the window, windows to encode).

        Raises
        ------
        SurgeValueError
            For a model without a fast tokenizer (a plain callable), or a bad ``chunk_overlap``.

        Examples
        --------
        >>> from dask_surge import Encoder
        >>> w = Encoder(device="cpu").windows(["short", "word " * 600])
        >>> w.text.tolist()
        [0, 1, 1, 1]
        """
        cutter = self._cutter()
        overlap = DEFAULT_CHUNK_OVERLAP if chunk_overlap is None else chunk_overlap
        cutter.check_overlap(overlap)
        return cutter.cut(list(texts), overlap)

    @property
    def window_capacity(self) -> int | None:
        """Content tokens one window holds (the model's window less its special tokens and the
        prompt), or None for a model without a fast tokenizer.

        Examples
        --------
        >>> from dask_surge import Encoder
        >>> Encoder(device="cpu").window_capacity   # all-MiniLM-L6-v2: 256 less [CLS] and [SEP]
        254
        """
        try:
            return self._cutter().capacity
        except SurgeValueError:
            return None

    @property
    def window_overhead(self) -> int:
        """Tokens each window adds to its content: the special tokens and the prompt's (0 without a tokenizer).

        Examples
        --------
        >>> from dask_surge import Encoder
        >>> Encoder(device="cpu").window_overhead   # [CLS] and [SEP]
        2
        """
        try:
            cutter = self._cutter()
        except SurgeValueError:
            return 0
        return len(cutter.head) + len(cutter.tail)

    def _cutter(self) -> Any:
        """The model's window cutter (:meth:`~dask_surge.engine.backends.Backend.window_cutter`)."""
        return self._call(self._loaded(), lambda impl: impl.window_cutter("chunk"))[1]

    def encode_long(
        self,
        texts: Sequence[str],
        *,
        normalize: bool = False,
        long_texts: LongTexts = "truncate",
        chunk_overlap: int | None = DEFAULT_CHUNK_OVERLAP,
    ) -> TextEmbeddings:
        """Encode texts, doing with those longer than the model's window what ``long_texts`` says.

        The window is the model's ``max_seq_length`` less its special tokens and the prompt's
        tokens (each window gets both).

        Parameters
        ----------
        texts : sequence of str
        normalize : bool
            L2-normalize each embedding (models ending in a ``Normalize`` module are normalized anyway).
        long_texts : {"truncate", "error", "chunk", "mean"}
            ``"truncate"`` (:meth:`encode`'s behaviour): cut, as sentence-transformers does, and
            counted in ``truncated``. ``"error"``: raise :class:`~dask_surge.engine.long_texts.TextTooLong`
            for the first text over the window. ``"chunk"``: one row per window; a text's windows
            overlap by up to ``chunk_overlap`` tokens and start and end at word boundaries (unless one
            word is longer than a window), and a window's embedding is the model's on
            ``text[char_start:char_end]``. ``"mean"``: one row per text, the mean of its windows'
            embeddings weighted by their tokens, renormalized when the model normalizes or
            ``normalize`` is set.
        chunk_overlap : int, default :data:`~dask_surge.options.DEFAULT_CHUNK_OVERLAP` (32)
            Tokens two consecutive windows of a text share, ``0 <= chunk_overlap < window / 2``;
            None means the default.

        Returns
        -------
        TextEmbeddings
            ``embeddings`` (float32, C-contiguous), ``windows`` (``"chunk"``), ``truncated``, ``over``.
            For a sparse or multi-vector model (:attr:`family`) ``embeddings`` is the model's own
            output (see :class:`~dask_surge.engine.backends.FamilyBackend`).

        Raises
        ------
        SurgeValueError
            An unknown ``long_texts``, a bad ``chunk_overlap``, or a mode other than
            ``"truncate"`` for a plain callable model (it has no tokenizer).
        TextTooLong
            ``long_texts="error"`` and a text is over the window (a :class:`~dask_surge.errors.SurgeInputError`).

        Examples
        --------
        >>> from dask_surge import Encoder
        >>> enc = Encoder(device="cpu")
        >>> out = enc.encode_long(["short", "word " * 300], long_texts="truncate")
        >>> out.embeddings.shape, out.truncated.tolist(), out.over
        ((2, 384), [False, True], 1)
        >>> out = enc.encode_long(["short", "word " * 300], long_texts="chunk")
        >>> out.embeddings.shape, out.windows.text.tolist(), out.windows.chunk.tolist()
        ((3, 384), [0, 1, 1], [0, 0, 1])
        >>> enc.encode_long(["short", "word " * 300], long_texts="mean").embeddings.shape
        (2, 384)
        """
        chunk_overlap = DEFAULT_CHUNK_OVERLAP if chunk_overlap is None else chunk_overlap
        check_long_texts(long_texts, chunk_overlap)
        loaded = self._loaded()
        texts = as_texts(texts)
        family = loaded.impl.family
        if not texts:
            empty: Any = np.zeros((0, loaded.dimension), dtype=np.float32) if family != MULTIVECTOR else []
            if long_texts != "truncate" and loaded.backend == "callable":
                loaded.impl.encode_long([], normalize, long_texts, int(chunk_overlap))  # raises: no tokenizer
            return TextEmbeddings(
                empty, Windows.empty() if long_texts == "chunk" else None, np.zeros(0, dtype=bool), 0
            )
        # the fast engine takes Arrow-held texts as they are (its tokenizer helpers copy their bytes);
        # every other backend, a user's callable among them, gets a list of str of its own
        loaded, out = self._call(
            loaded,
            lambda impl: impl.encode_long(
                texts if impl.name == "fast" else list(texts), normalize, long_texts, int(chunk_overlap)
            ),
        )
        if family != DENSE:  # the model's own rows (see dask_surge.engine.backends.FamilyBackend)
            return out
        emb = checked(
            out.embeddings, len(out.windows) if out.windows is not None else len(texts), loaded.backend
        )
        return out if emb is out.embeddings else replace(out, embeddings=emb)

    def __call__(self, texts: Any, *, normalize: bool = False) -> Any:
        """Encode: a pandas (or cuDF) Series gives a Series (see :meth:`embed`), a list an array.

        So an encoder is a function Dask's ``map_partitions`` understands without
        ``meta=``: ``ddf["text"].map_partitions(encoder)``.

        Examples
        --------
        >>> import pandas as pd
        >>> from dask_surge import Encoder
        >>> enc = Encoder(device="cpu")
        >>> enc(["a", "b"]).shape, enc(pd.Series(["a", "b"])).name
        ((2, 384), 'embedding')
        """
        if hasattr(texts, "index") and hasattr(texts, "dtype") and getattr(texts, "ndim", 1) == 1:
            return self.embed(texts, normalize=normalize)
        return self.encode(texts, normalize=normalize)

    def embed(self, texts: Any, *, normalize: bool = False):
        """Encode a pandas Series into a Series of fixed-size float32 lists (same index and length).

        A null text gives a null embedding, as pandas string methods map NA to NA
        (``encode(..., on_null=...)`` is where nulls raise or are recorded). Meant
        for plain ``map_partitions`` use, where ``meta=`` is optional::

            ddf["text"].map_partitions(enc.embed)

        Examples
        --------
        >>> import pandas as pd
        >>> from dask_surge import Encoder
        >>> s = Encoder(device="cpu").embed(pd.Series(["a", None]))
        >>> len(s), str(s.dtype).startswith("fixed_size_list"), s.isna().tolist()
        (2, True, [False, True])
        """
        import pandas as pd
        import pyarrow as pa

        if hasattr(texts, "to_pandas") and not isinstance(texts, pd.Series):  # cuDF
            texts = texts.to_pandas()
        values = texts.tolist() if hasattr(texts, "tolist") else list(texts)
        valid = np.fromiter((isinstance(v, str) for v in values), dtype=bool, count=len(values))
        nulls = ~valid & np.fromiter(
            (v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)) for v in values),
            dtype=bool,
            count=len(values),
        )
        if (bad := np.flatnonzero(~valid & ~nulls)).size:
            raise SurgeInputError(
                f"texts[{bad[0]}]={values[bad[0]]!r} is a {type(values[bad[0]]).__name__}, but every text must "
                "be a str (or null). Fix: convert the column first, e.g. series.astype('string')."
            )
        if valid.all():
            array = embedding_array(self.encode(values, normalize=normalize))
        else:
            emb = np.zeros((len(values), self.dimension), dtype=np.float32)
            if valid.any():
                emb[valid] = self.encode([v for v, ok in zip(values, valid) if ok], normalize=normalize)
            flat = pa.array(emb.reshape(-1))
            array = pa.FixedSizeListArray.from_arrays(flat, emb.shape[1], mask=pa.array(~valid))
        index = getattr(texts, "index", None)
        return pd.Series(pd.arrays.ArrowExtensionArray(array), index=index, name="embedding")

    @property
    def meta(self):
        """Empty Series with the dtype :meth:`embed` returns (for Dask ``meta=``)."""
        import pandas as pd

        empty = embedding_array(np.zeros((0, self.dimension), dtype=np.float32))
        return pd.Series(pd.arrays.ArrowExtensionArray(empty), name="embedding")

    def with_options(self, **changes: Any) -> Encoder:
        """A copy with some options changed (``device=``, ``dtype=``, ``prompt_name=``...), checked as in the constructor.

        Examples
        --------
        >>> from dask_surge import Encoder
        >>> Encoder("default").with_options(device="cpu").spec.device
        'cpu'
        """
        allowed = set(_OPTION_DEFAULTS) - {"revision"}
        unknown = set(changes) - allowed
        if unknown:
            raise SurgeValueError(
                f"with_options({', '.join(sorted(unknown))}=...): not an option that can change on a ready "
                f"Encoder; those are {sorted(allowed)}. Fix: build a new Encoder for another model or revision."
            )
        current = {f.name: getattr(self.spec, f.name) for f in fields(self.spec)}
        current["model_kwargs"] = thaw(self.spec.model_kwargs) or None
        merged = {k: current[k] for k in allowed} | changes
        _check_options(merged)
        if "model_kwargs" in changes:
            changes["model_kwargs"] = freeze(changes["model_kwargs"] or {})
        if "trust_remote_code" in changes:
            changes["trust_remote_code"] = bool(changes["trust_remote_code"])
        new = object.__new__(Encoder)
        new.spec = replace(self.spec, **changes)
        return new


#: what the Encoder adds to an option's description in :data:`dask_surge.options.OPTIONS`
_ENCODER_NOTES: dict[str, str] = {
    "device": '``"cuda:N"`` must name a device the loading process sees (checked where the model '
    "loads). An in-memory ``SentenceTransformer`` is moved to this device (to CUDA when "
    "available, with ``device=None``) where it encodes.",
    "engine": "The fast engine runs a model that is Transformer (an encoder, or a rotary decoder) + Pooling "
    "(cls, mean, max or lasttoken), optionally + Normalize; :attr:`backend` says which ran.",
}


Encoder.__doc__ = document(Encoder.__doc__, "Encoder", notes=_ENCODER_NOTES)


def _check_options(opts: dict[str, Any]) -> None:
    """Each option in ``opts`` by its validator in :data:`dask_surge.options.OPTIONS` (credentials redacted)."""
    for opt in options_of("Encoder"):
        if opt.name in opts:
            check_argument(opt.name, opts[opt.name], shown=redact(opts[opt.name]))


def from_spec(spec: EncoderSpec) -> Encoder:
    """The :class:`Encoder` of ``spec``, unchecked: how a pickled Encoder comes back in another process."""
    enc = object.__new__(Encoder)
    enc.spec = spec
    return enc
