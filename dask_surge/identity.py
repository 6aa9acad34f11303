"""A stable identity of a Dask DataFrame's input, for run fingerprints.

A run is what it encodes (DESIGN.md section 6), so the identity of its input is
built from what defines the data, and is the same in every process:

* the whole expression upstream of the text column, node by node: each node's
  type and **every** operand (``_pd_*``-style caches of Dask left out);
* the files a source reads: any path, directory, glob, URL (``s3://``,
  ``memory://``, ``file://``...) or list of them among a source's operands
  counts as the files it expands to on its fsspec filesystem, each with its
  path, size and version (the store's ETag/version/generation, else its
  modification time), listed afresh (never from a listing cache);
* functions (``map_partitions(upper)``, ``from_map(reader, ...)``) by their
  qualified name and a digest of their code (bytecode, constants, names),
  defaults, closure cells and the globals they use (a global without a
  deterministic token, such as a lock, by its type), so ``upper`` and ``lower``
  differ and a lambda recreated in a new process matches; functions of the
  standard library and installed packages by name and code only;
* any other object by Dask's deterministic token
  (``dask.base.tokenize(obj, ensure_deterministic=True)``: ``__dask_tokenize__``,
  else its pickle).

Dask's own ``tokenize`` identifies a module-level function by reference (its
pickle is its name), so a changed body would keep its token: hence the code
digest here. A step that cannot be identified deterministically raises
:class:`~dask_surge.errors.SurgeInputError` naming it and the fix; it is never
given a random token and never skipped.

Examples
--------
>>> import pandas as pd, dask.dataframe as dd
>>> ddf = dd.from_pandas(pd.DataFrame({"t": ["a", "B"]}), npartitions=1)
>>> up = input_identity(ddf.map_partitions(lambda d: d.assign(t=d.t.str.upper())))
>>> low = input_identity(ddf.map_partitions(lambda d: d.assign(t=d.t.str.lower())))
>>> up == low
False
"""

from __future__ import annotations

import dis
import functools
import hashlib
import inspect
import json
import os
import re
import sys
import sysconfig
import types
from collections.abc import Mapping
from typing import Any

from .errors import SurgeInputError

__all__ = ["IDENTITY_OPTIONS", "NotDeterministic", "SECRET_KEY", "input_identity", "is_secret_key",
           "redact", "stable_token", "without_secrets"]

#: Every option of :func:`dask_surge.encode`: True when it changes the embeddings or the
#: output (and so makes a different run), False when it does not (a rerun with another
#: value resumes). The one list :func:`dask_surge.api.fingerprint` follows; a new
#: option must be added here (a test checks that every parameter of ``encode`` is).
IDENTITY_OPTIONS: dict[str, bool] = {
    # what is encoded: the input (its files and graph), the column and the output's schema
    "ddf": True, "column": True, "keep": True, "input_token": True,
    # the model's content and what changes its vectors
    "model": True, "revision": True, "prompt": True, "prompt_name": True, "model_kwargs": True,
    "dtype": True,  # recorded resolved ("auto" -> float16/bfloat16/float32 for the run's device)
    "normalize": True, "precision": True, "truncate_dim": True,
    # how it runs: the same vectors (up to float noise) whatever these are
    "b_min": False, "b_max": False, "max_bytes": False,  # a run keeps the thresholds it recorded
    "on_null": False,  # rows committed before a null are valid under any on_null
    "device": False, "engine": False, "batch_size": False, "max_tokens": False,
    "trust_remote_code": False,  # lets the model load; its code is part of the model's content
    "output": False, "overwrite": False, "storage_options": False, "scheduler": False, "progress": False,
}

#: Keys of ``model_kwargs`` (and ``storage_options``) that hold credentials: left out of
#: identities and shown as ``"***"``.
SECRET_KEY = re.compile(r"token|secret|password|passwd|key|auth|credential", re.IGNORECASE)

_PLAIN = (str, int, float, bool, type(None))
# operands that are Dask's caches (filled as metadata is asked for), not the input's definition
_CACHE_OPERANDS = ("_cached_optimized", "_dataset_info_cache")
_CACHE_PREFIXES = ("_pd_", "_pq_")
_GLOB = re.compile(r"[*?\[]")


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

    ``files``: for a source's operands, ``files(location)`` gives the files a string (or an
    fsspec ``OpenFile``) names, or None; they replace the string in the token.
    """
    if _is_open_file(value):
        return _open_file_record(value, where)
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if files is not None and isinstance(value, str):
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
        from .modelid import object_digest

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


def _is_open_file(value: Any) -> bool:
    core = sys.modules.get("fsspec.core")
    return core is not None and isinstance(value, core.OpenFile)


def _open_file_record(value: Any, where: str) -> Any:
    """An fsspec ``OpenFile`` (as ``read_csv``'s blocks hold): its file's path, size and version."""
    fs = value.fs
    try:
        fs.invalidate_cache()
        info = fs.info(value.path)
    except OSError as err:
        raise SurgeInputError(_unlisted(where, value.path, err)) from err
    return {"files": [_file_record(value.path, info)], "protocol": _protocol(fs)}


def stable_token(value: Any, where: str = "value") -> Any:
    """A JSON-able token of ``value`` that is the same in every process for the same content.

    Plain values are themselves; functions their qualified name, code digest,
    defaults, closure cells and the globals they use; other objects Dask's
    deterministic token (``__dask_tokenize__``, else their pickle); torch modules
    their weights (:func:`dask_surge.modelid.object_digest`).

    Parameters
    ----------
    value : object
    where : str
        What ``value`` is, for the error message.

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
    return _token(value, set(), where)


# -- files --------------------------------------------------------------------------------

_VERSION_FIELDS = ("VersionId", "version_id", "ETag", "etag", "generation", "md5Hash", "checksum")
_TIME_FIELDS = ("mtime", "LastModified", "last_modified", "updated", "modified", "created")


def _file_record(name: str, info: Mapping) -> list:
    version = next((info[k] for k in _VERSION_FIELDS if info.get(k) is not None), None)
    mtime = next((info[k] for k in _TIME_FIELDS if info.get(k) is not None), None)
    return [name, info.get("size"), None if version is None else str(version), None if mtime is None else str(mtime)]


def _looks_like_url(text: str) -> bool:
    return "://" in text or "::" in text


def _filesystem_of(text: str, leaf_fs: Any, storage_options: Mapping | None):
    """``(fs, path)`` for a string operand of a source, or None when it is not a location.

    ``leaf_fs``: the filesystem object the source was given, for its ``path`` operand only.
    """
    from fsspec.core import url_to_fs

    if leaf_fs is not None and not _looks_like_url(text):
        return leaf_fs, leaf_fs._strip_protocol(text)
    if _looks_like_url(text):
        return url_to_fs(text, **dict(storage_options or {}))
    if _GLOB.search(text) or os.path.exists(text):
        return url_to_fs(text)
    return None


def _files(text: str, *, leaf_fs: Any, storage_options: Mapping | None, where: str) -> dict | None:
    """The files a path, directory, glob or URL names, each with its size and version; None if it names none."""
    if not text or "\n" in text:
        return None
    try:
        located = _filesystem_of(text, leaf_fs, storage_options)
    except (ImportError, ValueError):  # an unknown protocol, or a string that merely contains "://"
        return None
    if located is None:
        return None
    fs, path = located
    try:
        fs.invalidate_cache()  # a listing cache (s3fs, gcsfs) may predate files written since
        if _GLOB.search(path) and not fs.exists(path):
            matches = fs.glob(path, detail=True)
            if not matches:
                return None  # matches nothing: a plain string (a source over no files fails by itself)
        elif fs.exists(path):
            matches = {path: fs.info(path)}
        else:
            return None  # not a location that exists: a plain string
        found: dict[str, Mapping] = {}
        for name, info in matches.items():
            if info.get("type") == "directory":
                found.update(fs.find(name, detail=True))
            else:
                found[name] = info
    except OSError as err:
        raise SurgeInputError(_unlisted(where, text, err)) from err
    return {"files": [_file_record(n, i) for n, i in sorted(found.items())], "protocol": _protocol(fs)}


def _protocol(fs: Any) -> str:
    return fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]


def _unlisted(where: str, location: str, err: Exception) -> str:
    return (f"{where}: the input {location!r} could not be listed to identify the run's input "
            f"({type(err).__name__}: {err}). A run's identity is the files it reads (path, size, "
            "version). Fix: check the path and its storage_options, or pass input_token='a name you "
            "choose' to encode() to identify the input yourself.")


def _is_filesystem(value: Any) -> bool:
    fsspec = sys.modules.get("fsspec")
    return fsspec is not None and isinstance(value, fsspec.AbstractFileSystem)


def _is_cache(name: str) -> bool:
    return name in _CACHE_OPERANDS or name.startswith(_CACHE_PREFIXES)


def _not_deterministic(expr: Any, name: str, err: NotDeterministic) -> SurgeInputError:
    return SurgeInputError(
        f"the input's step {type(expr).__name__} (operand {name!r}) cannot be identified the same way in "
        f"every process: {err.args[0]}. A run's identity includes the whole graph upstream of the text "
        "column, so that a rerun resumes only the same computation. Fix: make that object tokenize "
        "deterministically (define __dask_tokenize__ returning a stable value, use a module-level "
        "function rather than a bound or built object), or pass input_token='a name you choose' to "
        "encode(): you then vouch for the input, and a rerun with the same name resumes."
    )


def _node(expr: Any, memo: dict[str, Any]) -> Any:
    key = expr._name
    if key in memo:
        return {"same_as": memo[key][0]}
    from dask._expr import Expr

    leaf = not expr.dependencies()
    params = dict(zip(expr._parameters, expr.operands))
    leaf_fs = next((v for v in params.values() if _is_filesystem(v)), None)
    storage_options = params.get("storage_options") if isinstance(params.get("storage_options"), Mapping) else None
    operands: dict[str, Any] = {}
    for name, op in params.items():
        if _is_cache(name):
            continue
        if isinstance(op, Expr):
            operands[name] = _node(op, memo)
            continue
        if _is_filesystem(op):  # its options may hold credentials; the files it lists are what count
            operands[name] = {"filesystem": _protocol(op)}
            continue
        if name == "storage_options" and isinstance(op, Mapping):
            op = without_secrets(op)
        where = f"{type(expr).__name__}.{name}"
        files = None
        if leaf:
            fs = leaf_fs if name == "path" else None
            files = functools.partial(_files, leaf_fs=fs, storage_options=storage_options, where=where)
        try:
            operands[name] = _token(op, set(), where, files)
        except NotDeterministic as err:
            raise _not_deterministic(expr, name, err) from None
    node = {"type": f"{type(expr).__module__}.{type(expr).__qualname__}", "operands": operands}
    memo[key] = (len(memo), node)
    return node


def input_identity(frame: Any, token: str | None = None) -> str:
    """Digest of the input's graph and sources, the same in every process for the same input.

    Parameters
    ----------
    frame : dask.dataframe.DataFrame
        The input (as projected on the columns the run reads).
    token : str, optional
        A name the caller chose for the input (``encode(input_token=...)``): it is the
        identity, and nothing of the graph is looked at. The caller vouches for it.

    Returns
    -------
    str
        16 hex digits, or ``"input_token:<token>"``.

    Raises
    ------
    SurgeInputError
        A step of the graph cannot be identified deterministically (named in the message,
        with the fix), or an input location cannot be listed.

    Examples
    --------
    >>> import pandas as pd, dask.dataframe as dd
    >>> a = dd.from_pandas(pd.DataFrame({"t": ["x", "y"]}), npartitions=1)
    >>> input_identity(a) == input_identity(dd.from_pandas(pd.DataFrame({"t": ["x", "y"]}), npartitions=1))
    True
    >>> input_identity(a, token="corpus-2024-06")
    'input_token:corpus-2024-06'
    """
    if token is not None:
        if not isinstance(token, str) or not token.strip():
            raise SurgeInputError(
                f"input_token={token!r} must be a non-empty str: the name that identifies this input "
                "across reruns. Fix: pass e.g. input_token='corpus-2024-06', or leave it out."
            )
        return f"input_token:{token}"
    expr = frame.expr.simplify()
    blob = json.dumps(_node(expr, {}), sort_keys=True, default=_json_fallback)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _json_fallback(value: Any) -> str:  # pragma: no cover - _token returns JSON-able values only
    raise TypeError(f"not JSON-able in an identity: {type(value).__name__}")
