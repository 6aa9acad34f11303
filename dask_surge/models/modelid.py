"""Model identity from content: what a run's fingerprint records about its model.

Two different models must never share a run, and the same model must always find
its run again, wherever it lies on disk. So a model is identified by a digest of
what it computes with, not by its name:

* a Hub snapshot by its repo id and commit hash (the Hub's own content address);
* a local model directory by a SHA-256 of its files (weights, tokenizer and
  config; model cards and hidden files left out). Hashing a large model takes
  a while, so the digest is computed once and cached, in this process and on
  disk under ``$DASK_SURGE_CACHE_DIR/model-identity/`` (default
  ``~/.cache/dask-surge``), keyed by the path and each file's size and mtime: a
  rerun only stats the files;
* an in-memory model (a loaded ``SentenceTransformer``, a ``torch.nn.Module``)
  by a digest of its ``state_dict`` plus, for a ``SentenceTransformer``, each
  module's configuration and tokenizer and its prompts; cached while no parameter
  changes (torch's per-tensor version counters) and the settings stay the same;
* any other callable by what it computes with (:func:`dask_surge.models.modelid.stable_token`):
  a function by its qualified name, a digest of its code, its defaults, its closure
  cells and the globals it uses, so two closures over different weights differ and
  the same closure recreated in a new process over the same data matches; a callable
  object by its class's ``__call__`` code plus Dask's deterministic token of the object
  (``__dask_tokenize__``, else its pickle, so ``__getstate__`` can leave per-process
  bookkeeping such as a call counter out).

Examples
--------
>>> from dask_surge.testing import packaged_model_dir
>>> len(directory_digest(packaged_model_dir()))
64
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from ..errors import SurgeModelError
from ..fingerprint import NotDeterministic
from ..fingerprint import stable_token as _generic_token

__all__ = ["directory_digest", "files_signature", "object_digest", "stable_token"]

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_DIR_CACHE: dict[str, str] = {}  # stat key -> digest
_OBJ_CACHE: dict[int, tuple[Any, tuple, str]] = {}  # id(obj) -> (obj, tensor versions, digest)
_SKIP_SUFFIXES = (".md",)


def stable_token(value: Any, where: str = "value", files: Any = None) -> Any:
    """:func:`dask_surge.fingerprint.stable_token`, with a torch module identified by its weights.

    Parameters
    ----------
    value : object
    where : str
        What ``value`` is, for the error message.
    files : callable, optional
        For the operands of a data source: ``files(value)`` returns the record of the files a
        location names (it then replaces the value), or None.

    Raises
    ------
    NotDeterministic
        Some part of ``value`` has no deterministic token (the message says which).

    Examples
    --------
    >>> stable_token({"a": 1}) == stable_token({"a": 1})
    True
    """
    return _generic_token(value, where, files, module_digest=object_digest)


def _cache_root() -> Path:
    env = os.environ.get("DASK_SURGE_CACHE_DIR")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "dask-surge") / "model-identity"


def _model_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    files = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).parts
        if any(part.startswith(".") for part in rel) or path.suffix.lower() in _SKIP_SUFFIXES:
            continue
        if path.is_file():  # follows the Hub cache's symlinks to blobs
            files.append(path)
    return files


def _hash_file(path: Path) -> str:
    """SHA-256 of one file's bytes (module-level so tests can count the calls)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def directory_digest(path: str | os.PathLike) -> str:
    """SHA-256 over the files of a model directory (names and bytes), computed once per content.

    Files whose names start with ``.`` and Markdown files (model cards) are left
    out; everything else (weights, tokenizer, configs, custom code) counts.

    Parameters
    ----------
    path : str or os.PathLike
        A model directory (or a single file).

    Returns
    -------
    str
        64 hex digits.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "config.json").write_text("{}")
    >>> directory_digest(d) == directory_digest(d)
    True
    """
    root = Path(os.fspath(path)).resolve()
    files = _model_files(root)
    stats = [(str(p.relative_to(root)) if p != root else p.name, *_stat(p)) for p in files]
    key = hashlib.sha256(json.dumps([str(root), stats]).encode()).hexdigest()
    with _LOCK:
        if key in _DIR_CACHE:
            return _DIR_CACHE[key]
    cached = _cache_root() / f"{key[:40]}.json"
    try:
        digest = json.loads(cached.read_text())["digest"]
    except (OSError, ValueError, KeyError, TypeError):
        digest = None
    if not isinstance(digest, str):
        h = hashlib.sha256()
        for (rel, size, _), p in zip(stats, files):
            h.update(f"{rel}\0{size}\0{_hash_file(p)}\n".encode())
        digest = h.hexdigest()
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"digest": digest, "path": str(root), "files": len(files)}))
            os.replace(tmp, cached)
        except OSError as err:  # a read-only home still works, it only hashes again next time
            logger.debug("dask-surge: could not cache the model digest in %s (%s)", cached, err)
    with _LOCK:
        _DIR_CACHE[key] = digest
    return digest


def files_signature(path: str | os.PathLike) -> tuple:
    """What changes when a model directory's files change: each file's name, size and mtime (the
    key :func:`directory_digest` is cached by), without reading any file.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "config.json").write_text("{}")
    >>> before = files_signature(d); _ = (d / "config.json").write_text('{"a": 1}')
    >>> files_signature(d) != before
    True
    """
    root = Path(os.fspath(path)).resolve()
    return tuple((str(p.relative_to(root)) if p != root else p.name, *_stat(p)) for p in _model_files(root))


def _stat(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def object_digest(obj: Any) -> str:
    """SHA-256 of an in-memory model's content (cached while its tensors are unchanged).

    Parameters
    ----------
    obj : SentenceTransformer, torch.nn.Module or callable
        Torch modules are identified by their weights (``state_dict``) and settings;
        other callables by their code and the data they close over (see the module's text).

    Returns
    -------
    str
        64 hex digits; two models of the same shape with different weights differ.

    Raises
    ------
    SurgeModelError
        A callable holds something that has no deterministic token (named in the message).

    Examples
    --------
    >>> import torch
    >>> a, b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    >>> object_digest(a) == object_digest(a), object_digest(a) == object_digest(b)
    (True, False)

    Two closures over different weights are two models:

    >>> import numpy as np
    >>> def linear(w):
    ...     return lambda texts: np.ones((len(texts), 3)) @ w
    >>> object_digest(linear(np.eye(3))) == object_digest(linear(np.eye(3)))
    True
    >>> object_digest(linear(np.eye(3))) == object_digest(linear(2 * np.eye(3)))
    False
    """
    try:
        import torch
    except ImportError:  # pragma: no cover - a runtime dependency
        torch = None  # type: ignore[assignment]
    if torch is not None and isinstance(obj, torch.nn.Module):
        state = obj.state_dict(keep_vars=True)
        settings = _module_settings(obj)  # prompts, configs, tokenizer: may change without the weights
        versions = (*(t._version for t in state.values() if isinstance(t, torch.Tensor)), hash(settings))
        with _LOCK:
            hit = _OBJ_CACHE.get(id(obj))
            if hit is not None and hit[0] is obj and hit[1] == versions:
                return hit[2]
        h = hashlib.sha256(f"{type(obj).__module__}.{type(obj).__qualname__}\n".encode())
        for name, tensor in state.items():
            if isinstance(tensor, torch.Tensor):
                t = tensor.detach()
                h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\n".encode())
                if t.device.type != "meta" and t.numel():
                    h.update(t.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        h.update(settings.encode())
        digest = h.hexdigest()
        with _LOCK:
            _OBJ_CACHE[id(obj)] = (obj, versions, digest)
        return digest
    return _callable_digest(obj)


def _callable_digest(obj: Any) -> str:
    """SHA-256 of a plain callable's :func:`~dask_surge.models.modelid.stable_token`."""

    try:
        token = stable_token(obj, where=f"the model {type(obj).__qualname__}")
    except NotDeterministic as err:
        raise SurgeModelError(
            f"model={_short_repr(obj)} cannot be identified the same way in every process: {err.args[0]}. "
            "A run's identity includes its model, so that a rerun resumes only with the same one. Fix: give "
            "the model's class a __dask_tokenize__ returning a stable value (e.g. its name and weights' "
            "version), or a __getstate__ without per-process state (locks, open files, clients)."
        ) from None
    return hashlib.sha256(json.dumps(token, sort_keys=True).encode()).hexdigest()


def _short_repr(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."


def _module_settings(model: Any) -> str:
    """The non-tensor settings of a ``SentenceTransformer``: module configs, tokenizers, prompts."""
    parts: list[str] = []
    for module in model.children() if hasattr(model, "children") else ():
        parts.append(f"{type(module).__module__}.{type(module).__qualname__}")
        get_config = getattr(module, "get_config_dict", None)
        if callable(get_config):
            try:
                parts.append(json.dumps(get_config(), sort_keys=True, default=str))
            except Exception as err:  # noqa: BLE001 - a custom module's config is best effort
                logger.debug(
                    "dask-surge: no config of %s in the model digest (%s)", type(module).__name__, err
                )
        config = getattr(getattr(module, "auto_model", None), "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            parts.append(config.to_json_string(use_diff=False))
        backend = getattr(getattr(module, "tokenizer", None), "backend_tokenizer", None)
        if backend is not None:
            parts.append(backend.to_str())
    for attr in ("prompts", "default_prompt_name", "truncate_dim"):
        if hasattr(model, attr):
            parts.append(f"{attr}={json.dumps(getattr(model, attr), sort_keys=True, default=str)}")
    return "\n".join(parts)
