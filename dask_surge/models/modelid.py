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

import dis
import functools
import hashlib
import inspect
import json
import logging
import os
import re
import sys
import sysconfig
import threading
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import SurgeModelError

__all__ = ["directory_digest", "object_digest"]

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_DIR_CACHE: dict[str, str] = {}  # stat key -> digest
_OBJ_CACHE: dict[int, tuple[Any, tuple, str]] = {}  # id(obj) -> (obj, tensor versions, digest)
_SKIP_SUFFIXES = (".md",)


#: Keys of ``model_kwargs`` (and ``storage_options``) that hold credentials: left out of
#: identities and shown as ``"***"``.
SECRET_KEY = re.compile(r"token|secret|password|passwd|key|auth|credential", re.IGNORECASE)

_PLAIN = (str, int, float, bool, type(None))

class NotDeterministic(Exception):
    """An object has no deterministic token; ``args[0]`` says which and why."""


def is_secret_key(key: Any) -> bool:
    """True when a mapping key names a credential (``token``, ``api_key``, ``password``...).

    Examples
    --------
    >>> [is_secret_key(k) for k in ("token", "use_auth_token", "HF_API_KEY", "torch_dtype")]
    [True, True, True, False]
    """
    return isinstance(key, str) and SECRET_KEY.search(key) is not None


def redact(value: Any) -> Any:
    """A copy of ``value`` with the values of credential keys replaced by ``"***"`` (nested dicts too).

    Examples
    --------
    >>> redact({"token": "hf_abc", "opts": {"password": "p", "n": 1}, "torch_dtype": "float16"})
    {'token': '***', 'opts': {'password': '***', 'n': 1}, 'torch_dtype': 'float16'}
    """
    if isinstance(value, Mapping):
        return {k: "***" if is_secret_key(k) else redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value) if isinstance(value, list) else tuple(redact(v) for v in value)
    return value


def without_secrets(value: Any) -> Any:
    """A copy of ``value`` with credential keys left out (nested dicts too): what an identity may hold.

    Examples
    --------
    >>> without_secrets({"token": "hf_abc", "attn_implementation": "sdpa"})
    {'attn_implementation': 'sdpa'}
    """
    if isinstance(value, Mapping):
        return {k: without_secrets(v) for k, v in value.items() if not is_secret_key(k)}
    if isinstance(value, (list, tuple)):
        return [without_secrets(v) for v in value]
    return value


# -- deterministic tokens of any value ------------------------------------------------------


def _render_const(value: Any) -> str:
    if inspect.iscode(value):
        return _render_code(value)
    if isinstance(value, (frozenset, set)):  # their repr's order follows the per-process string hash
        return "{" + ", ".join(sorted(_render_const(v) for v in value)) + "}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_render_const(v) for v in value) + ")"
    return repr(value)


def _render_code(code: types.CodeType) -> str:
    """Bytecode, names and constants of a code object, nested code included (no addresses, no line numbers)."""
    consts = ", ".join(_render_const(c) for c in code.co_consts)
    return f"{code.co_code.hex()}|{code.co_names}|[{consts}]"


def _global_names(code: types.CodeType) -> set[str]:
    """The globals a code object (or code nested in it) loads, from its bytecode."""
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _global_names(const)
    return {n for n in names if isinstance(n, str)}


@functools.lru_cache(maxsize=1)
def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return tuple(sorted(r + os.sep for r in roots))


def _is_library(func: types.FunctionType) -> bool:
    """True for a function of the standard library or an installed package (not the user's own code)."""
    module = sys.modules.get(func.__module__ or "")
    file = getattr(module, "__file__", None)
    return isinstance(file, str) and os.path.realpath(file).startswith(_library_roots())


def code_digest(code: types.CodeType) -> str:
    """SHA-256 of what a code object computes: its bytecode, constants (recursively) and names.

    Stable across processes (frozenset constants are sorted; line numbers and file names
    are left out, so moving a function in its file keeps its digest).

    Examples
    --------
    >>> code_digest((lambda s: s.upper()).__code__) == code_digest((lambda s: s.upper()).__code__)
    True
    >>> code_digest((lambda s: s.upper()).__code__) == code_digest((lambda s: s.lower()).__code__)
    False
    """
    return hashlib.sha256(_render_code(code).encode()).hexdigest()


def _function_token(func: types.FunctionType, active: set[int]) -> Any:
    name = f"{func.__module__}.{func.__qualname__}"
    if id(func) in active:  # recursion (a function calling itself, two calling each other)
        return {"function": name, "recursive": True}
    if _is_library(func):  # its module's state (caches...) is not what it computes: its code is
        return {"function": name, "code": code_digest(func.__code__)}
    active.add(id(func))
    try:
        closure = []
        for cell in func.__closure__ or ():
            try:
                closure.append(_token(cell.cell_contents, active, f"{name}: a closure cell"))
            except ValueError:  # an empty cell (a name assigned after the function was made)
                closure.append("<empty cell>")
        globs = func.__globals__
        used = {n: _global_token(globs[n], active, f"{name}: its global {n!r}")
                for n in sorted(_global_names(func.__code__)) if n in globs and n != "__builtins__"}
        return {"function": name, "code": code_digest(func.__code__),
                "defaults": _token(func.__defaults__, active, f"{name}: its defaults"),
                "kwdefaults": _token(func.__kwdefaults__, active, f"{name}: its keyword defaults"),
                "closure": closure, "globals": used}
    finally:
        active.discard(id(func))


def _global_token(value: Any, active: set[int], where: str) -> Any:
    """A global a function uses: its data counts (a weight matrix, a helper function); state
    that has no deterministic token (a lock, a client, an open file) is not data: its type."""
    try:
        return _token(value, active, where)
    except NotDeterministic:
        return {"state": f"{type(value).__module__}.{type(value).__qualname__}"}


def _dask_token(value: Any, where: str) -> str:
    from dask.base import tokenize

    try:
        return tokenize(value, ensure_deterministic=True)
    except Exception as err:  # any failure means: no deterministic token
        raise NotDeterministic(f"{where}: {_short(value)} ({type(err).__name__}: {err})") from err


def _short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


def _token(value: Any, active: set[int], where: str, files: Any = None) -> Any:
    """A JSON-able, process-independent token of ``value`` (raises :class:`NotDeterministic`).

    ``files``: for a source's operands, ``files(value)`` gives the record of the files a
    location (a path string, an fsspec ``OpenFile``) names, or None; it replaces the value.
    """
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if files is not None:  # a source's operand: a location stands for the files it names
        found = files(value)
        if found is not None:
            return found
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, bytes):
        return {"bytes": hashlib.sha256(value).hexdigest()}
    if isinstance(value, (list, tuple)):
        return [_token(v, active, where, files) for v in value]
    if isinstance(value, dict):
        items = [[_token(k, active, where), _token(v, active, where, files)] for k, v in value.items()]
        return {"dict": sorted(items, key=lambda kv: json.dumps(kv, sort_keys=True))}
    if isinstance(value, (set, frozenset)):
        return {"set": sorted((_token(v, active, where, files) for v in value),
                              key=lambda v: json.dumps(v, sort_keys=True))}
    if isinstance(value, functools.partial):
        return {"partial": [_token(value.func, active, where), _token(value.args, active, where, files),
                            _token(value.keywords, active, where, files)]}
    if isinstance(value, types.MethodType):
        return {"method": [_token(value.__func__, active, where), _token(value.__self__, active, where)]}
    if isinstance(value, types.FunctionType):
        return _function_token(value, active)
    if isinstance(value, types.ModuleType):
        return {"module": value.__name__}
    if isinstance(value, type):
        return {"class": f"{value.__module__}.{value.__qualname__}"}
    task = _task_token(value, active, where, files)
    if task is not None:
        return task
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.nn.Module):
        return {"torch_module": object_digest(value)}
    token: dict[str, Any] = {"object": f"{type(value).__module__}.{type(value).__qualname__}"}
    call = getattr(type(value), "__call__", None)
    if isinstance(call, types.FunctionType):  # a callable object: its code counts, as a function's
        token["call"] = _function_token(call, active)
    token["token"] = _dask_token(value, where)
    return token


def _task_token(value: Any, active: set[int], where: str, files: Any) -> Any:
    """A Dask task spec node (a ``read_csv`` block, a ``map_partitions`` keyword dict) by what it
    computes (function and arguments), not by its key, whose token is not always deterministic."""
    spec = sys.modules.get("dask._task_spec")
    if spec is None or not isinstance(value, (spec.GraphNode, spec.TaskRef)):
        return None
    if isinstance(value, spec.DataNode):
        return _token(value.value, active, where, files)
    if isinstance(value, spec.Task):
        return {"task": [_token(value.func, active, where), _token(value.args, active, where, files),
                         _token(value.kwargs, active, where, files)]}
    if isinstance(value, spec.Alias):
        return {"alias": str(value.target)}
    return {"ref": str(value.key)}


def stable_token(value: Any, where: str = "value", files: Any = None) -> Any:
    """A JSON-able token of ``value`` that is the same in every process for the same content.

    Plain values are themselves; functions their qualified name, code digest,
    defaults, closure cells and the globals they use; other objects Dask's
    deterministic token (``__dask_tokenize__``, else their pickle); torch modules
    their weights (:func:`dask_surge.models.modelid.object_digest`).

    Parameters
    ----------
    value : object
    where : str
        What ``value`` is, for the error message.
    files : callable, optional
        For the operands of a data source: ``files(value)`` returns the record of the
        files a location names (it then replaces the value), or None.

    Raises
    ------
    NotDeterministic
        Some part of ``value`` has no deterministic token (the message says which).

    Examples
    --------
    >>> import numpy as np
    >>> def scale(w):
    ...     return lambda x: x * w
    >>> stable_token(scale(np.ones(3))) == stable_token(scale(np.ones(3)))
    True
    >>> stable_token(scale(np.ones(3))) == stable_token(scale(np.zeros(3)))
    False
    """
    return _token(value, set(), where, files)



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
                logger.debug("dask-surge: no config of %s in the model digest (%s)", type(module).__name__, err)
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
