"""Deterministic tokens of Python values, the same in every process, and credential scrubbing.

:func:`stable_token` identifies a value by what it computes with, not by where it lives: a
function by its qualified name, a digest of its code, its defaults, closure cells and the
globals it uses; a callable object by its class's ``__call__`` code plus Dask's deterministic
token; a Dask task by its function and arguments. A run's identity is built from these tokens
(:mod:`dask_surge.planning.identity`), so a rerun in a new process finds its run again.
:func:`without_secrets`, :func:`redact` and :func:`scrub` keep credentials out of identities and messages.

Generic: nothing here knows about models. A torch module's token is its weights' digest,
which :mod:`dask_surge.models.modelid` supplies.
"""

from __future__ import annotations

import contextvars
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
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "SECRET_KEY",
    "NotDeterministic",
    "code_digest",
    "is_secret_key",
    "redact",
    "scrub",
    "stable_token",
    "without_secrets",
]

#: the digest of a torch module for the :func:`stable_token` call in progress (its ``module_digest``)
_MODULE_DIGEST: contextvars.ContextVar[Callable[[Any], str] | None] = contextvars.ContextVar(
    "surge_module_digest", default=None
)

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
        return (
            type(value)(redact(v) for v in value)
            if isinstance(value, list)
            else tuple(redact(v) for v in value)
        )
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


def secret_values(value: Any, key: Any = None) -> list[str]:
    """The string values held under credential keys of ``value`` (nested dicts and lists too).

    Strings shorter than 4 characters are left out: replacing them would garble a message.

    Examples
    --------
    >>> secret_values({"token": "hf_abcdef", "opts": [{"api_key": "k-1234"}], "torch_dtype": "float16"})
    ['hf_abcdef', 'k-1234']
    """
    if isinstance(value, Mapping):
        return [s for k, v in value.items() for s in secret_values(v, k)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in secret_values(v, key)]
    return [value] if is_secret_key(key) and isinstance(value, str) and len(value) >= 4 else []


def scrub(text: str, value: Any) -> str:
    """``text`` with every credential held in ``value`` (see :func:`secret_values`) replaced by ``***``.

    For error messages that quote what a library said about a call that carried credentials
    (a Hub token in ``model_kwargs``).

    Examples
    --------
    >>> scrub("401 for token hf_abcdef", {"token": "hf_abcdef"})
    '401 for token ***'
    """
    for secret in sorted(secret_values(value), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


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
        used = {
            n: _global_token(globs[n], active, f"{name}: its global {n!r}")
            for n in sorted(_global_names(func.__code__))
            if n in globs and n != "__builtins__"
        }
        return {
            "function": name,
            "code": code_digest(func.__code__),
            "defaults": _token(func.__defaults__, active, f"{name}: its defaults"),
            "kwdefaults": _token(func.__kwdefaults__, active, f"{name}: its keyword defaults"),
            "closure": closure,
            "globals": used,
        }
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
        return {
            "set": sorted(
                (_token(v, active, where, files) for v in value), key=lambda v: json.dumps(v, sort_keys=True)
            )
        }
    if isinstance(value, functools.partial):
        return {
            "partial": [
                _token(value.func, active, where),
                _token(value.args, active, where, files),
                _token(value.keywords, active, where, files),
            ]
        }
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
        module_digest = _MODULE_DIGEST.get()
        if module_digest is None:
            raise NotDeterministic(
                f"{where}: {_short(value)} (a torch module; tokenize it with "
                "dask_surge.models.modelid.stable_token, which digests its weights)"
            )
        return {"torch_module": module_digest(value)}
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
        return {
            "task": [
                _token(value.func, active, where),
                _token(value.args, active, where, files),
                _token(value.kwargs, active, where, files),
            ]
        }
    if isinstance(value, spec.Alias):
        return {"alias": str(value.target)}
    return {"ref": str(value.key)}


def stable_token(
    value: Any, where: str = "value", files: Any = None, *, module_digest: Callable[[Any], str] | None = None
) -> Any:
    """A JSON-able token of ``value`` that is the same in every process for the same content.

    Plain values are themselves; functions their qualified name, code digest,
    defaults, closure cells and the globals they use; other objects Dask's
    deterministic token (``__dask_tokenize__``, else their pickle); torch modules
    their weights, through ``module_digest``.

    Parameters
    ----------
    value : object
    where : str
        What ``value`` is, for the error message.
    files : callable, optional
        For the operands of a data source: ``files(value)`` returns the record of the
        files a location names (it then replaces the value), or None.
    module_digest : callable, optional
        The digest of a ``torch.nn.Module`` met in ``value`` (its weights): model identity,
        which :func:`dask_surge.models.modelid.stable_token` supplies. Without it a torch
        module has no token.

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
    reset = _MODULE_DIGEST.set(module_digest)
    try:
        return _token(value, set(), where, files)
    finally:
        _MODULE_DIGEST.reset(reset)
