"""A run's identity: what it encodes (:func:`fingerprint`), and the stable identity of its input.

A run is what it encodes (docs/design.md, "Output contract"), so the identity of its input is
built from what defines the data, and is the same in every process:

* the whole expression upstream of the text column, node by node: each node's
  type and **every** operand (``_pd_*``-style caches of Dask left out);
* the files a source reads: any path, directory, glob, URL (``s3://``,
  ``memory://``, ``file://``...) or list of them among a source's operands
  counts as the files it expands to on its fsspec filesystem, each with its
  path, size and version (the store's ETag/version/generation, else its
  modification time; on a local or shared POSIX filesystem also its inode and
  inode change time, which no ``touch -r`` or ``cp -p`` restores), listed afresh
  (never from a listing cache). A string that names no existing file, and a glob
  that matches none or is no valid pattern, is a value like any other (the
  texts, ids or queries ``dd.from_map`` is often given);
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

import functools
import hashlib
import json
import os
import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from .._compat import BaseExpr as Expr
from .._compat import expr_operands, simplified
from .._version import __version__
from ..config import get as config_get
from ..errors import SurgeInputError
from ..fingerprint import NotDeterministic, without_secrets
from ..io.store import is_posix, protocol_of
from ..models.modelid import stable_token  # the fingerprint's token, with a torch module's weights digest
from ..options import identity_options, option

__all__ = ["IDENTITY_OPTIONS", "input_identity", "fingerprint"]


class _IdentityOptions(Mapping[str, bool]):
    """Every parameter of :func:`dask_surge.encode` -> whether it changes the embeddings or the output.

    A live view of the ``identity`` flags of :data:`dask_surge.options.OPTIONS` (see
    :func:`dask_surge.options.identity_options`): True makes a different run, False lets a
    rerun with another value resume. The one list :func:`dask_surge.api.fingerprint` follows.
    """

    def __getitem__(self, name: str) -> bool:
        return identity_options()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(identity_options())

    def __len__(self) -> int:
        return len(identity_options())

    def __repr__(self) -> str:
        return f"IDENTITY_OPTIONS({identity_options()!r})"


#: Every option of :func:`dask_surge.encode`: True when it changes the embeddings or the
#: output (and so makes a different run), False when it does not (a rerun with another
#: value resumes). Derived from the declarations in :data:`dask_surge.options.OPTIONS`:
#: the input, column, kept columns, the model's content and revision, prompts, ``model_kwargs``,
#: the compute dtype (recorded resolved for the run's device), ``normalize``, ``precision``
#: and ``truncate_dim`` do; thresholds (a run keeps the ones it recorded), ``on_null`` (rows
#: committed before a null are valid under any), device, engine, batch size, token budget,
#: ``trust_remote_code`` (the model's code is part of its content) and where/how it runs do not.
IDENTITY_OPTIONS: Mapping[str, bool] = _IdentityOptions()

# operands that are Dask's caches (filled as metadata is asked for), not the input's definition
_CACHE_OPERANDS = ("_cached_optimized", "_dataset_info_cache")
_CACHE_PREFIXES = ("_pd_", "_pq_")
_GLOB = re.compile(r"[*?\[]")


def _is_open_file(value: Any) -> bool:
    core = sys.modules.get("fsspec.core")
    return core is not None and isinstance(value, core.OpenFile)


def _open_file_record(value: Any, where: str) -> Any:
    """An fsspec ``OpenFile`` (as ``read_csv``'s blocks hold): its file's path, size and version."""
    fs = value.fs
    try:
        fs.invalidate_cache()
        record = _file_record(value.path, fs.info(value.path), fs)
    except OSError as err:
        raise SurgeInputError(_unlisted(where, value.path, err)) from err
    return {"files": [record], "protocol": protocol_of(fs)}


# -- files --------------------------------------------------------------------------------

_VERSION_FIELDS = ("VersionId", "version_id", "ETag", "etag", "generation", "md5Hash", "checksum")
_TIME_FIELDS = ("mtime", "LastModified", "last_modified", "updated", "modified", "created")


def _file_record(name: str, info: Mapping, fs: Any) -> list:
    """``[path, size, version, mtime]`` of a file, and on a local (POSIX) filesystem its inode and
    inode change time too: ``cp -p``, ``touch -r`` or ``tar -x`` restore a rewritten file's size and
    mtime, but no call sets the change time, and a file replaced by another gets a new inode."""
    version = next((info[k] for k in _VERSION_FIELDS if info.get(k) is not None), None)
    mtime = next((info[k] for k in _TIME_FIELDS if info.get(k) is not None), None)
    record = [
        name,
        info.get("size"),
        None if version is None else str(version),
        None if mtime is None else str(mtime),
    ]
    if is_posix(fs):
        st = os.stat(name)
        record += [st.st_ino, st.st_ctime_ns]
    return record


def _looks_like_url(text: str) -> bool:
    return "://" in text or "::" in text


def _filesystem_of(text: str, leaf_fs: Any, storage_options: Mapping | None):
    """``(fs, path)`` for a string operand of a source, or None when it is not a location.

    ``leaf_fs``: the filesystem object the source was given, for its ``path`` operand only.
    """
    from fsspec.core import url_to_fs

    if leaf_fs is not None:  # the source reads its path with this filesystem, URL or not
        return leaf_fs, leaf_fs._strip_protocol(text).rstrip("/") or text
    if _looks_like_url(text):
        return url_to_fs(text, **dict(storage_options or {}))
    if _GLOB.search(text) or os.path.exists(text):
        return url_to_fs(text)
    return None


def _location(
    value: Any, *, leaf_fs: Any, storage_options: Mapping | None, where: str, strict: bool = True
) -> dict | None:
    """The record of the files a source's operand names (a path, glob or URL string, an fsspec
    ``OpenFile``), or None when it names none (it is then tokenized as a value).

    ``strict``: a string that looks like a location but cannot be listed is an error (a reader's
    ``path``), else a value (``from_map`` over strings such as ``"s3://bucket/key"`` as text)."""
    if _is_open_file(value):
        return _open_file_record(value, where)
    if isinstance(value, str):
        return _files(value, leaf_fs=leaf_fs, storage_options=storage_options, where=where, strict=strict)
    return None


def _files(
    text: str, *, leaf_fs: Any, storage_options: Mapping | None, where: str, strict: bool = True
) -> dict | None:
    """The files a path, directory, glob or URL names, each with its size and version; None if it names
    none (or, unless ``strict``, cannot be listed)."""
    if not text or "\n" in text:
        return None
    try:
        located = _filesystem_of(text, leaf_fs, storage_options)
    except (ImportError, ValueError):  # an unknown protocol, or a string that merely contains "://"
        return None
    except Exception as err:  # a store client that cannot even start (no credentials, no region)
        if not strict:
            return None
        raise SurgeInputError(_unlisted(where, text, err)) from err
    if located is None:
        return None
    fs, path = located
    try:
        fs.invalidate_cache()  # a listing cache (s3fs, gcsfs) may predate files written since
        if _GLOB.search(path) and not fs.exists(path):
            try:
                matches = fs.glob(path, detail=True)
            except (ValueError, re.error):  # no valid pattern ("f(*args, **kw)"): text, not a location
                return None
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
        records = [_file_record(n, i, fs) for n, i in sorted(found.items())]
    except Exception as err:  # OSError, or a store client's own (botocore's EndpointConnectionError)
        if not strict:
            return None  # a string the source's function is given: a value unless it lists as files
        raise SurgeInputError(_unlisted(where, text, err)) from err
    return {"files": records, "protocol": protocol_of(fs)}


def _unlisted(where: str, location: str, err: Exception) -> str:
    return (
        f"{where}: the input {location!r} could not be listed to identify the run's input "
        f"({type(err).__name__}: {err}). A run's identity is the files it reads (path, size, "
        "version). Fix: check the path and its storage_options, or pass input_token='a name you "
        "choose' to encode() to identify the input yourself."
    )


def _is_arrow_filesystem(value: Any) -> bool:
    pafs = sys.modules.get("pyarrow.fs")
    return pafs is not None and isinstance(value, pafs.FileSystem)


def _is_filesystem(value: Any) -> bool:
    """An fsspec filesystem, or a ``pyarrow.fs`` one (``dd.read_parquet(..., filesystem=...)``)."""
    fsspec = sys.modules.get("fsspec")
    return (fsspec is not None and isinstance(value, fsspec.AbstractFileSystem)) or _is_arrow_filesystem(
        value
    )


def _lister(fs: Any) -> Any:
    """``fs`` as an fsspec filesystem, to list the files it reads."""
    if _is_arrow_filesystem(fs):
        from fsspec.implementations.arrow import ArrowFSWrapper

        return ArrowFSWrapper(fs)
    return fs


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

    leaf = not expr.dependencies()
    params = expr_operands(expr)
    leaf_fs = next((v for v in params.values() if _is_filesystem(v)), None)
    storage_options = (
        params.get("storage_options") if isinstance(params.get("storage_options"), Mapping) else None
    )
    operands: dict[str, Any] = {}
    for name, op in params.items():
        if _is_cache(name):
            continue
        if isinstance(op, Expr):
            operands[name] = _node(op, memo)
            continue
        if _is_filesystem(op):  # its options may hold credentials; the files it lists are what count
            operands[name] = {"filesystem": protocol_of(op)}
            continue
        options = name == "storage_options" and isinstance(op, Mapping)
        if options:  # how to reach the files (an endpoint URL among them), not files the input reads
            op = without_secrets(op)
        where = f"{type(expr).__name__}.{name}"
        files = None
        if leaf and not options:
            fs = _lister(leaf_fs) if name == "path" and leaf_fs is not None else None
            files = functools.partial(
                _location, leaf_fs=fs, storage_options=storage_options, where=where, strict=name == "path"
            )
        try:
            operands[name] = stable_token(op, where, files)
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
    expr = simplified(frame.expr)
    blob = json.dumps(_node(expr, {}), sort_keys=True, default=_json_fallback)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _json_fallback(value: Any) -> str:  # pragma: no cover - _token returns JSON-able values only
    raise TypeError(f"not JSON-able in an identity: {type(value).__name__}")


#: the options the fingerprint records inside another entry: the model's identity (its content,
#: revision, prompts, ``model_kwargs`` and the resolved compute dtype) and the input's
_RECORDED_WITH = {
    "model": "model",
    "revision": "model",
    "prompt": "model",
    "prompt_name": "model",
    "model_kwargs": "model",
    "dtype": "model",
    "input_token": "ddf",
    "long_texts": "long_texts",
    "chunk_overlap": "long_texts",
}


def fingerprint(
    frame: Any,
    task: Any,
    *,
    device: str | None = None,
    input_token: str | None = None,
    options: dict | None = None,
) -> dict:
    """What makes two runs the same run (and lets a rerun resume): what it encodes.

    The options in it are those :data:`dask_surge.planning.identity.IDENTITY_OPTIONS` marks as
    changing the embeddings or the output: the input (its files and graph, or
    ``input_token``), the column and kept columns, the model's identity (content,
    revision, prompts, ``model_kwargs`` without credentials, the compute dtype resolved
    for ``device``), normalization, precision and truncation. ``on_null``, the
    thresholds (a run records the ones it resolved and keeps them), the device,
    engine, batch size and token budget are not in it. It is written to the run's
    ``run.json`` and shown when a rerun differs, so it holds no credentials.

    Parameters
    ----------
    frame : dask.dataframe.DataFrame
        The input as the run reads it (the text column and kept columns).
    task : dask_surge.execution.superbatch.SuperBatchTask
        What each SuperBatch runs: its column, kept columns, encoder and output options.
    device : str, optional
        Where the run encodes (``"cuda"`` or ``"cpu"``): ``dtype="auto"`` resolves for it.
    input_token : str, optional
        The input's identity as the caller named it (see :func:`encode`).
    options : dict, optional
        The options of :func:`encode` as given: an option that changes the embeddings and is
        recorded nowhere else (one declared after these, see :mod:`dask_surge.options`) is
        recorded under its name, resolved from the config, when it differs from its default
        (so adding one leaves the identity of existing runs alone).

    Examples
    --------
    >>> import pandas as pd, dask.dataframe as dd
    >>> from dask_surge.execution.superbatch import SuperBatchTask
    >>> from dask_surge import Encoder
    >>> ddf = dd.from_pandas(pd.DataFrame({"text": ["a", "b"]}), npartitions=1)
    >>> enc = Encoder("default")
    >>> a = fingerprint(ddf, SuperBatchTask("text", (), enc, on_null="error"), device="cpu")
    >>> b = fingerprint(ddf, SuperBatchTask("text", (), enc.with_options(batch_size=8), on_null="skip"), device="cpu")
    >>> a == b, a["model"]["dtype"]
    (True, 'float32')
    """

    values = {
        "ddf": input_identity(frame, token=input_token),
        "column": task.column,
        "keep": list(task.keep),
        "model": task.encoder.identity(device),
        "normalize": task.normalize,
        "precision": task.precision,
        "truncate_dim": task.truncate_dim,
        "on_null": task.on_null,
    }
    if task.long_texts in ("chunk", "mean"):  # "truncate" and "error" write the same rows: one run
        values["long_texts"] = {"mode": task.long_texts, "chunk_overlap": task.chunk_overlap}
    for name, changes in IDENTITY_OPTIONS.items():  # options declared later record their value by name
        if changes and name not in values and name not in _RECORDED_WITH and options and name in options:
            opt = option(name)
            value = config_get(opt.config, options[name]) if opt.config else options[name]
            if value != opt.default:
                values[name] = value
    names = {"ddf": "input"}  # the fingerprint's own key names (kept from earlier runs)
    found = {names.get(k, k): v for k, v in values.items() if IDENTITY_OPTIONS[k]}
    # what the input and the model imply: the partitions read and the vectors' size
    found.update(partitions=frame.npartitions, dimension=task.dimension, library=__version__)
    return found
