"""Every option of dask-surge, declared once.

:data:`OPTIONS` holds one :class:`Option` per option: its name, annotation, default
(or the ``surge.<key>`` of :mod:`dask.config` it defaults to), a small validator
callable, its numpydoc text, its command-line flag, whether it changes the embeddings
(and so a run's identity) and which of :func:`dask_surge.encode`,
:func:`dask_surge.plan` and :class:`dask_surge.Encoder` take it. Everything else is
derived from that table:

* the runtime signatures of ``encode`` and ``plan`` (and of ``ddf.surge.encode`` /
  ``ddf.surge.plan``, which copy them): :func:`signature`, :func:`bind`;
* the Parameters sections of their docstrings: :func:`document`;
* the ``encode``/``demo``/``plan`` command-line flags: :func:`add_arguments`,
  :func:`from_arguments`;
* the config schema ``surge-schema.yaml``: :func:`schema_yaml` (the shipped file is
  compared with it by a test; regenerate it with
  ``python -c "from dask_surge.options import schema_yaml; print(schema_yaml(), end='')" > dask_surge/surge-schema.yaml``),
  and the config validation (:data:`dask_surge.config.OPTIONS`);
* which options take part in a run's fingerprint: :func:`identity_options`;
* :class:`dask_surge.Encoder`'s option defaults and validation: :func:`defaults`,
  :meth:`Option.check`.

Typing: ``encode`` and ``plan`` are declared as ``encode(ddf, column, output=None,
**options: Unpack[EncodeOptions])``, so a type checker sees every option with its type
from the ``TypedDict`` s below (:class:`EncodeOptions`, :class:`PlanOptions`), and the
two ``@overload`` s of ``encode`` differ on ``output`` only. A ``TypedDict`` is static (a
type checker cannot read it from a table), so it is the one thing written beside the
table; that is simpler to keep true than a generated stub file, because
``tests/test_options.py`` fails, naming the option, when a ``TypedDict``, the runtime
``__signature__`` and the table disagree. Adding an option is therefore one
:class:`Option` in :data:`OPTIONS` (plus, for the type checker, its line in the
``TypedDict`` the test names) and its implementation.

Examples
--------
>>> from dask_surge.options import Precision, choices, option
>>> choices(Precision)
('float32', 'float16', 'int8', 'binary')
>>> option("b_min").config, option("b_min").identity
('b-min', False)
>>> option("batch_size").check(0)
Traceback (most recent call last):
...
dask_surge.options.Invalid: must be a positive int; pass e.g. batch_size=32
"""

from __future__ import annotations

import difflib
import inspect
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict, get_args

__all__ = [
    "COMPRESSIONS",
    "DTYPES",
    "ENGINES",
    "ON_NULLS",
    "OPTIONS",
    "PRECISIONS",
    "Cli",
    "Compression",
    "Dtype",
    "EncodeOptions",
    "EngineName",
    "OUTPUT_FORMATS",
    "OutputFormat",
    "TableMode",
    "IndexMetric",
    "INDEX_METRICS",
    "Invalid",
    "LONG_TEXTS",
    "DEFAULT_CHUNK_OVERLAP",
    "LongTexts",
    "OnNull",
    "Option",
    "PlanOptions",
    "Precision",
    "add_arguments",
    "bind",
    "choices",
    "config_options",
    "defaults",
    "document",
    "from_arguments",
    "identity_options",
    "option",
    "options_of",
    "schema",
    "schema_yaml",
    "signature",
    "TUNING",
    "tuning_values",
]

#: Storage type of the embedding values (see :mod:`dask_surge.io.precision`).
Precision = Literal["float32", "float16", "int8", "binary"]
#: What a null text does: raise, encode as ``""``, or leave the row out and record it.
OnNull = Literal["error", "empty", "skip"]
#: Compute dtype of the forward pass; ``"auto"`` is float16 on CUDA and float32 on CPU.
Dtype = Literal["auto", "float32", "float16", "bfloat16"]
#: Which engine encodes: the fast tokenize-sort-forward engine, sentence-transformers' own
#: ``encode``, or ``"auto"`` (fast where the model's structure allows, else sentence-transformers).
EngineName = Literal["auto", "fast", "sentence-transformers"]
#: Parquet codec of the embedding column. ``"none"`` (the default) writes fastest: float vectors
#: barely compress; the codecs' cost and gain are in ``docs/ab_studies.md``.
Compression = Literal["none", "snappy", "lz4", "zstd"]
#: What a text longer than the model's window does: cut (and counted), stop the run, one output row
#: per overlapping token window, or one row of the windows' token-weighted mean.
LongTexts = Literal["truncate", "error", "chunk", "mean"]
#: What a written encode writes: Parquet part files, or a table (:mod:`dask_surge.io.tables`).
OutputFormat = Literal["parquet", "lance", "delta", "iceberg", "pgvector"]
#: Whether a table output must be new (or this run's), or may be a table the run did not create.
TableMode = Literal["create", "append"]
#: The distance a searchable index of the output ranks by (``build_index``).
IndexMetric = Literal["cosine", "l2", "dot"]
#: Where a written encode runs: a ``distributed.Client``, a local scheduler, or None (the
#: active Client, else a local cluster started for the call).
Scheduler = Any | Literal["sync", "synchronous", "threads"] | None


def choices(literal: Any) -> tuple[str, ...]:
    """The allowed values of a ``Literal`` type, in their declared order.

    Parameters
    ----------
    literal : typing.Literal
        One of the vocabularies of this module.

    Returns
    -------
    tuple of str

    Examples
    --------
    >>> choices(OnNull)
    ('error', 'empty', 'skip')
    """
    values = get_args(literal)
    if not values:
        raise TypeError(f"{literal!r} is not a Literal type. Fix: pass e.g. dask_surge.options.Precision.")
    return values


PRECISIONS: tuple[str, ...] = choices(Precision)
ON_NULLS: tuple[str, ...] = choices(OnNull)
DTYPES: tuple[str, ...] = choices(Dtype)
ENGINES: tuple[str, ...] = choices(EngineName)
COMPRESSIONS: tuple[str, ...] = choices(Compression)
LONG_TEXTS: tuple[str, ...] = choices(LongTexts)
OUTPUT_FORMATS: tuple[str, ...] = choices(OutputFormat)
INDEX_METRICS: tuple[str, ...] = choices(IndexMetric)
#: Tokens two consecutive windows share in ``long_texts="chunk"``/``"mean"`` (the option's default).
DEFAULT_CHUNK_OVERLAP = 32

# -- validators: value -> the value to use, or raise Invalid(problem, fix) ---------------------------


class Invalid(ValueError):
    """A validator's refusal: what is wrong with the value and how to fix it.

    Callers turn it into a :class:`dask_surge.errors.SurgeValueError` that names the value
    (:meth:`Option.argument_error`, :meth:`Option.config_error`).
    """

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem, self.fix = problem, fix


Validator = Callable[[Any], Any]


def _is_int(value: Any) -> bool:
    """An int or any integer type (``operator.index``: ``numpy.int64(3)`` counts as 3), not a bool."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def positive_int(
    *, none: bool = False, auto: bool = False, what: str = "", fix: str = "pass a positive int"
) -> Validator:
    """A positive int (not a bool), or also None / ``"auto"`` where allowed."""
    also = [*(["'auto'"] if auto else []), *(["None"] if none else [])]
    problem = f"must be a positive int{f' ({what})' if what else ''}{''.join(f' or {a}' for a in also)}"

    def check(value: Any) -> Any:
        if (none and value is None) or (auto and value == "auto"):
            return value
        if _is_int(value) and value > 0:
            return int(value)
        raise Invalid(problem, fix)

    return check


def positive_number(value: Any) -> Any:
    """A positive int or float (not a bool)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return value
    raise Invalid("must be a positive number", "pass e.g. 10.0")


def finite_number(*, none: bool = False, fix: str = "pass a finite number") -> Validator:
    """A finite int or float (not a bool), or also None; an int stays an int.

    Examples
    --------
    >>> finite_number(none=True)(0.05), finite_number(none=True)(None)
    (0.05, None)
    """

    def check(value: Any) -> Any:
        if none and value is None:
            return value
        if _is_int(value):
            return int(value)
        is_float = (
            isinstance(value, float) or getattr(getattr(value, "dtype", None), "kind", "") == "f"
        )  # NumPy's too
        if is_float and math.isfinite(float(value)):
            return float(value)
        raise Invalid(f"must be a finite number{' or None' if none else ''}", fix)

    return check


def one_of(literal: Any, problem: str = "is not one of the allowed values") -> Validator:
    """One of the values of a ``Literal`` vocabulary."""
    allowed = choices(literal)

    def check(value: Any) -> Any:
        if isinstance(value, str) and value in allowed:
            return value
        raise Invalid(problem, f"choose one of {allowed}")

    return check


def boolean(fix: str = "pass True or False") -> Validator:
    """True or False (not a truthy value)."""

    def check(value: Any) -> Any:
        if isinstance(value, bool):
            return value
        raise Invalid("must be True or False", fix)

    return check


def text(*, none: bool = False, fix: str = "pass a str") -> Validator:
    """A str, or also None."""

    def check(value: Any) -> Any:
        if isinstance(value, str) or (none and value is None):
            return value
        raise Invalid(f"must be a str{' or None' if none else ''}", fix)

    return check


def mapping(fix: str = "pass a dict") -> Validator:
    """A dict, or None."""

    def check(value: Any) -> Any:
        if value is None or isinstance(value, dict):
            return value
        raise Invalid("must be a dict or None", fix)

    return check


def _is_catalog(value: Any) -> bool:
    """A ``pyiceberg.catalog.Catalog`` (pyiceberg is not imported for it: without it loaded, none exists)."""
    import sys

    module = sys.modules.get("pyiceberg.catalog")
    return module is not None and isinstance(value, module.Catalog)


_CATALOG_FIX = (
    "pass a catalog's name as pyiceberg's load_catalog takes it (iceberg_catalog='prod', from "
    ".pyiceberg.yaml or PYICEBERG_CATALOG__PROD__URI), its properties "
    "({'type': 'sql', 'uri': 'sqlite:///catalog.db'}), or a pyiceberg Catalog object"
)


def iceberg_catalog(value: Any) -> Any:
    """``iceberg_catalog=``: a catalog's name, a dict of its properties, a pyiceberg ``Catalog``, or None.

    Examples
    --------
    >>> iceberg_catalog("prod"), iceberg_catalog({"type": "sql"}), iceberg_catalog(None)
    ('prod', {'type': 'sql'}, None)
    """
    if value is None or _is_catalog(value):
        return value
    if isinstance(value, str) and value.strip():
        return value.strip()
    if isinstance(value, dict) and isinstance(value.get("name", ""), str | None):
        return value
    raise Invalid(
        "is not an Iceberg catalog: it must be a catalog's name, a dict of its properties "
        "(with an optional 'name'), a pyiceberg Catalog, or None",
        _CATALOG_FIX,
    )


def iceberg_catalog_config(value: Any) -> Any:
    """``surge.iceberg-catalog``: a name or a dict of properties, or None; a ``Catalog`` object cannot be
    in dask.config, which is shipped to every worker (and a Catalog does not serialise)."""
    if _is_catalog(value):
        raise Invalid(
            "is a pyiceberg Catalog object, which dask.config cannot hold: the config is shipped to every "
            "worker, and a Catalog does not serialise",
            "pass the object to the call instead, encode(..., iceberg_catalog=catalog), or put its name or "
            "properties in the config",
        )
    return iceberg_catalog(value)


#: an Iceberg identifier: a namespace (itself dotted or not) and a name
_IDENTIFIER = r"[^.]+(\.[^.]+)+"


def iceberg_identifier(value: Any) -> Any:
    """``iceberg_table=``: ``"namespace.name"``, or None (derived from the output path)."""
    if value is None:
        return value
    if isinstance(value, str) and re.fullmatch(_IDENTIFIER, value):
        return value
    raise Invalid(
        "is not an Iceberg identifier: it needs a namespace, 'namespace.table'",
        "pass e.g. iceberg_table='default.embeddings', or None to derive 'default.<name>' from the output path",
    )


def sql_table(value: Any) -> Any:
    """``table=``: a PostgreSQL table's name (``"name"`` or ``"schema.name"``), or None.

    Examples
    --------
    >>> sql_table("search.docs"), sql_table(None)
    ('search.docs', None)
    """
    if value is None or (isinstance(value, str) and value.strip() and "\x00" not in value):
        return value
    raise Invalid(
        "is not a table name: it must be a non-empty str, 'name' or 'schema.name'",
        "pass e.g. table='doc_embeddings' with format='pgvector'",
    )


def state_directory(value: Any) -> Any:
    """``surge.pgvector-state``: a directory path (or fsspec URL), or None (the user's cache directory)."""
    if value is None or (isinstance(value, str) and value.strip()):
        return value
    raise Invalid(
        "is not a directory: it must be a path (shared by every process on a cluster) or null",
        "set e.g. '/shared/dask-surge/pgvector', or null for ~/.cache/dask-surge/pgvector",
    )


def catalog_argument(value: str) -> Any:
    """Command-line form of ``iceberg_catalog``: a catalog's name, or its properties as a JSON object.

    Examples
    --------
    >>> catalog_argument("prod"), catalog_argument('{"type": "sql"}')
    ('prod', {'type': 'sql'})
    """
    import json

    if value.lstrip().startswith("{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError as err:
            import argparse

            raise argparse.ArgumentTypeError(f"not a JSON object of catalog properties ({err})") from None
    return value


def non_negative_int(fix: str, *, none: bool = False) -> Validator:
    """An int >= 0 (not a bool), or also None."""

    def check(value: Any) -> Any:
        if none and value is None:
            return value
        if _is_int(value) and value >= 0:
            return int(value)
        raise Invalid(f"must be an int >= 0{' or None' if none else ''}", fix)

    return check


def paths(value: Any) -> tuple[str, ...]:
    """One path or URL, or a sequence of them, as a tuple (empty for None)."""
    import os

    if value is None:
        return ()
    items = [value] if isinstance(value, (str, os.PathLike)) else value
    try:
        out = tuple(os.fspath(v) for v in items)
    except TypeError:
        out = None
    if out is None or not all(isinstance(v, str) and v for v in out):
        raise Invalid("must be a path or URL, a list of them, or None", "pass e.g. reuse='emb-2024-06/'")
    return out


def byte_size(value: Any) -> int | None:
    """A positive byte count from an int or a size string such as ``"512 MiB"``, or None."""
    from dask.utils import parse_bytes

    if value is None:
        return None
    size = value
    if isinstance(value, str):
        try:
            size = parse_bytes(value)
        except ValueError:
            size = None
    if _is_int(size) and size > 0:
        return size
    raise Invalid("must be a positive int of bytes, a size such as '512 MiB', or None", "pass e.g. '512 MiB'")


def duration(value: Any) -> float | None:
    """Seconds (> 0) from a number or a duration string such as ``"5 minutes"``, or None."""
    from dask.utils import parse_timedelta

    if value is None:
        return None
    seconds = value
    if isinstance(value, str):
        try:
            seconds = parse_timedelta(value, default="s")
        except (ValueError, KeyError):
            seconds = None
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds > 0:
        return float(seconds)
    raise Invalid(
        "must be a positive number of seconds, a duration such as '5 minutes', or None",
        "pass e.g. '5 minutes', or None to wait for workers as long as it takes",
    )


def torch_device(value: Any) -> Any:
    """None, ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"mps"``."""
    if value is None or (
        isinstance(value, str)
        and (value in ("cpu", "cuda", "mps") or (value.startswith("cuda:") and value[5:].isdigit()))
    ):
        return value
    raise Invalid(
        "is not a torch device: it must be 'cpu', 'cuda', 'cuda:N' (N a device index) or 'mps'",
        "use 'cpu', 'cuda' or 'cuda:N'",
    )


def index_metric(value: Any) -> Any:
    """``build_index``: False (no index; None too), or the metric of the index (True: ``"cosine"``).

    Examples
    --------
    >>> index_metric(True), index_metric(None), index_metric("l2")
    ('cosine', False, 'l2')
    """
    if value is None or value is False:
        return False
    if value is True:
        return "cosine"
    if isinstance(value, str) and value in INDEX_METRICS:
        return value
    raise Invalid(
        f"must be True, False, None or a metric among {INDEX_METRICS}",
        "pass build_index=True (cosine), build_index='l2' or build_index='dot', or leave it out",
    )


def threshold(value: str) -> int | str:
    """Command-line form of ``b_min``/``b_max``: ``auto`` or a number of rows."""
    return value if value == "auto" else int(value)


# -- the declaration ----------------------------------------------------------------------------------

TAKERS = ("encode", "plan", "Encoder")
_INT_MIN_1 = {"type": "integer", "minimum": 1}
_NULL = {"type": "null"}


@dataclass(frozen=True)
class Cli:
    """How an option appears on the command line (``dask-surge encode``/``demo``/``plan``).

    ``flag`` defaults to ``--`` plus the name with hyphens; ``type``, ``action`` and ``help``
    are argparse's (``help`` defaults to the option's ``summary``; ``choices`` come from the
    option's vocabulary).
    """

    flag: str | None = None
    type: Callable[[str], Any] | None = None
    action: str | None = None
    help: str | None = None
    #: argparse's ``nargs`` and ``const`` (``"?"``: the flag alone means ``const``) and ``metavar``
    nargs: str | None = None
    const: Any = None
    metavar: str | None = None


@dataclass(frozen=True)
class Option:
    """One option: everything the API, the CLI, the config, the docs and the fingerprint need.

    Attributes
    ----------
    name : str
        The Python keyword (``batch_size``).
    annotation : type
        The type ``encode``/``plan`` show (including ``None`` where None means "the
        configured default").
    doc_type, doc : str
        The numpydoc type line and description.
    summary : str
        One line: the CLI help and the config schema's description.
    default : object
        The value when nothing is given: for a config option, the shipped ``surge.<key>``
        value (``surge.yaml``, checked by a test); :class:`dask_surge.Encoder` uses it as its
        own default.
    config : str, optional
        The key under ``surge.`` in :mod:`dask.config`; then ``encode``/``plan`` show
        ``None`` as the default and resolve it from the config when the function runs.
    validator : callable, optional
        Validator: value -> the value to use, or raise :class:`Invalid`. None: checked
        where it is used.
    vocabulary : typing.Literal, optional
        The allowed values (validator, CLI ``choices``, schema ``enum`` come from it).
    schema : dict, optional
        JSON schema of the config value (a vocabulary gives ``{"enum": [...]}``).
    identity : bool
        True when it changes the embeddings or the output, so a different value makes a
        different run (see :func:`identity_options`).
    takers : frozenset of {"encode", "plan", "Encoder"}
        The functions that take it as a keyword (none: config only).
    cli : Cli, optional
        Its command-line flag (none: not on the command line).
    config_validator : callable, optional
        The rule of the ``surge.<key>`` value where it is narrower than the argument's (a value
        dask.config cannot ship to workers); None: :attr:`validator`.
    """

    name: str
    annotation: Any
    doc_type: str
    doc: str
    summary: str
    default: Any = None
    config: str | None = None
    validator: Validator | None = None
    vocabulary: Any = None
    schema: Mapping[str, Any] | None = None
    identity: bool = False
    takers: frozenset[str] = frozenset()
    cli: Cli | None = None
    config_validator: Validator | None = None

    def __post_init__(self) -> None:
        if not self.takers <= set(TAKERS):
            raise ValueError(f"option {self.name!r}: takers {sorted(self.takers)} must be among {TAKERS}")

    @property
    def choices(self) -> tuple[str, ...] | None:
        """The vocabulary's values, if the option has one."""
        return choices(self.vocabulary) if self.vocabulary is not None else None

    @property
    def api_default(self) -> Any:
        """The default ``encode``/``plan`` show: None for a config option (resolved when they run)."""
        return None if self.config else self.default

    def check(self, value: Any) -> Any:
        """``value`` validated (by :attr:`validator`, else by :attr:`vocabulary`); raises :class:`Invalid`."""
        if self.validator is not None:
            return self.validator(value)
        if self.vocabulary is not None:
            return one_of(self.vocabulary)(value)
        return value

    def check_config(self, value: Any) -> Any:
        """The ``surge.<key>`` value validated (:attr:`config_validator`, else :meth:`check`)."""
        return self.config_validator(value) if self.config_validator is not None else self.check(value)

    def argument_error(self, value: Any, err: Invalid, shown: Any = None) -> str:
        """The message for a bad keyword argument ``name=value`` (``shown`` replaces the value, e.g. redacted)."""
        return f"{self.name}={value if shown is None else shown!r} {err.problem}. Fix: {err.fix}."

    def config_error(self, value: Any, err: Invalid) -> str:
        """The message for a bad ``surge.<key>`` value."""
        key = self.config
        env = f"DASK_SURGE__{str(key).upper().replace('-', '_')}"
        return (
            f"surge.{key}={value!r} is not allowed: {err.problem}. Fix: dask.config.set({{'surge.{key}': ...}}) "
            f"or the {env} environment variable ({err.fix})."
        )


def _opt(
    name: str, annotation: Any, doc_type: str, doc: str, summary: str, *, takers: str = "", **kw: Any
) -> Option:
    return Option(
        name, annotation, doc_type, " ".join(doc.split()), summary, takers=frozenset(takers.split()), **kw
    )


#: The names under ``surge.tuning.``; each is declared (what it does, where it was measured, its value
#: per device) in :mod:`dask_surge.engine.tuning` (tests/test_tuning.py keeps the two equal).
TUNING: tuple[str, ...] = (
    "allocator",
    "gc-pause",
    "rayon-threads",
    "pause-profiler",
    "cpu-kernels",
    "tokenize-processes",
    "joined-tokenizing",
)


def tuning_values(value: Any) -> Any:
    """A mapping of ``surge.tuning`` names to ``"auto"``, a bool (or an int >= 0 for a count).

    Examples
    --------
    >>> tuning_values({"allocator": False})
    {'allocator': False}
    >>> tuning_values({"allocater": False})
    Traceback (most recent call last):
    ...
    dask_surge.options.Invalid: has an unknown name 'allocater'; use names among ...
    """
    if not isinstance(value, Mapping):
        raise Invalid("must be a mapping of setting names to values", "set e.g. {'allocator': 'auto'}")
    for name, v in value.items():
        if name not in TUNING:
            raise Invalid(f"has an unknown name {name!r}", f"use names among {list(TUNING)}")
        count = name == "tokenize-processes"
        if not (
            (v == "auto" and isinstance(v, str))
            or (v is None or (_is_int(v) and v >= 0) if count else isinstance(v, bool))
        ):
            raise Invalid(
                f"has {name}={v!r}", "use 'auto', or " + ("an int >= 0" if count else "True or False")
            )
    return value


#: The options, in the order ``encode`` and ``plan`` show them.
OPTIONS: tuple[Option, ...] = (
    _opt(
        "model",
        Any,
        "str, path, SentenceTransformer, callable or Encoder, optional",
        """
         Can be a Hugging Face Hub name such as ``"BAAI/bge-small-en-v1.5"`` (resolved through the HF
         cache, ``HF_HOME``/``HF_HUB_CACHE``, honouring ``HF_HUB_OFFLINE``), a local
         sentence-transformers model directory, ``"default"`` (the packaged all-MiniLM-L6-v2), a
         loaded model or callable ``texts -> (n, d) array``, or a ready :class:`dask_surge.Encoder`
         (then give no encoder options beside it).""",
        "a Hugging Face Hub name (org/name, from the HF cache), a local model dir, or 'default' "
        "(packaged all-MiniLM-L6-v2)",
        default="default",
        config="model",
        validator=text(),
        schema={"type": "string"},
        identity=True,
        takers="encode plan",
        cli=Cli(),
    ),
    _opt(
        "b_min",
        int | Literal["auto"] | None,
        'int or "auto", optional',
        """
         SuperBatch flush threshold in rows: a SuperBatch is flushed once it holds at least this
         many. Can be a number of rows, or ``"auto"`` to pick it (100,000 on a GPU, 8,192 on a CPU,
         or from a cached calibration). A run keeps the thresholds it recorded when it started.""",
        "SuperBatch flush threshold, rows, or auto",
        default="auto",
        config="b-min",
        validator=positive_int(auto=True),
        identity=False,
        schema={"oneOf": [_INT_MIN_1, {"enum": ["auto"]}]},
        takers="encode plan",
        cli=Cli(type=threshold),
    ),
    _opt(
        "b_max",
        int | Literal["auto"] | None,
        'int or "auto", optional',
        """
         SuperBatch hard cap in rows; larger partitions are sliced. Can be a number of rows, or
         ``"auto"`` (400,000 on a GPU, 32,768 on a CPU).""",
        "SuperBatch hard cap, rows, or auto",
        default="auto",
        config="b-max",
        validator=positive_int(auto=True),
        identity=False,
        schema={"oneOf": [_INT_MIN_1, {"enum": ["auto"]}]},
        takers="encode plan",
        cli=Cli(type=threshold),
    ),
    _opt(
        "max_bytes",
        int | str | None,
        "int or str, optional",
        """
         Cap on the text bytes of one SuperBatch, so partitions of a few huge texts are not fused
         past what a worker holds and a partition over it is sliced. Can be a number of bytes or a
         size such as ``"1 GiB"``; set the config option to None to plan by rows only. Bytes come
         from Parquet footers or the size pass; a frame whose lengths Dask knows in memory is
         planned by rows.""",
        "cap on a SuperBatch's text bytes, e.g. '512 MiB'",
        default="512 MiB",
        config="max-bytes",
        validator=byte_size,
        identity=False,
        schema={"oneOf": [_INT_MIN_1, {"type": "string"}, _NULL]},
        takers="encode plan",
        cli=Cli(),
    ),
    _opt(
        "keep",
        Sequence[str],
        "sequence of str",
        """
         Input columns (str names) to carry into the output beside ``partition``/``row``: not the
         index (``ddf.reset_index()`` makes it a column), nor a name the output writes itself.""",
        "input columns to carry into the output",
        default=(),
        identity=True,
        takers="encode",
    ),
    _opt(
        "normalize",
        bool | None,
        "bool, optional",
        """
         L2-normalize embeddings (models with a Normalize module always are).""",
        "L2-normalize embeddings",
        default=False,
        config="normalize",
        validator=boolean(),
        schema={"type": "boolean"},
        identity=True,
        takers="encode",
        cli=Cli(action="store_true"),
    ),
    _opt(
        "precision",
        Precision | None,
        '{"float32", "float16", "int8", "binary"}, optional',
        """
         Storage type of the embedding values: ``int8`` is ``round(127 x)`` of unit vectors (needs
         ``normalize=True``), ``binary`` packs the sign bits into ``ceil(d / 8)`` bytes; see
         :mod:`dask_surge.io.precision`.""",
        "stored type: float32, float16, int8 (round(127 x), needs normalize) or binary (sign bits)",
        default="float32",
        config="precision",
        vocabulary=Precision,
        identity=True,
        takers="encode",
        cli=Cli(),
    ),
    _opt(
        "truncate_dim",
        int | None,
        "int, optional",
        """
         Keep the first ``k`` dimensions (Matryoshka models), re-normalized when ``normalize``. Can be
         an int from 1 to the model's dimension, or None to keep all.""",
        "keep the first k dimensions (Matryoshka)",
        config="truncate-dim",
        validator=positive_int(none=True),
        schema={"oneOf": [_INT_MIN_1, _NULL]},
        identity=True,
        takers="encode",
        cli=Cli(type=int),
    ),
    _opt(
        "sparse_top_k",
        int | None,
        "int, optional",
        """
         For a sparse (SPLADE) model: the most non-zero weights a row keeps, its largest (ties: the
         smaller vocabulary id), after ``sparse_threshold``. Can be an int >= 1, or None to keep
         every non-zero. Other models refuse it.""",
        "sparse models: the most non-zero weights a row keeps",
        config="sparse-top-k",
        validator=positive_int(
            none=True,
            what="non-zero weights a row keeps",
            fix="pass e.g. sparse_top_k=128, or None to keep all",
        ),
        schema={"oneOf": [_INT_MIN_1, _NULL]},
        identity=True,
        takers="encode",
        cli=Cli(type=int),
    ),
    _opt(
        "sparse_threshold",
        float | None,
        "float, optional",
        """
         For a sparse (SPLADE) model: weights below it are dropped. Can be a finite number, or None
         to keep every non-zero. Other models refuse it.""",
        "sparse models: weights below it are dropped",
        config="sparse-threshold",
        validator=finite_number(none=True, fix="pass e.g. sparse_threshold=0.01, or None"),
        schema={"oneOf": [{"type": "number"}, _NULL]},
        identity=True,
        takers="encode",
        cli=Cli(type=float),
    ),
    _opt(
        "on_null",
        OnNull | None,
        '{"error", "empty", "skip"}, optional',
        """
         What a null text does: ``"error"`` raises, naming its partition and row; ``"empty"``
         encodes it as ``""``; ``"skip"`` leaves it out of the output and records its
         ``(partition, row)`` with the run's commit records (needs ``output``; see
         :func:`skipped_rows`).""",
        "what a null text does: error, encode as empty, or skip and record it",
        default="error",
        config="on-null",
        vocabulary=OnNull,
        identity=False,
        takers="encode",
        cli=Cli(),
    ),
    _opt(
        "long_texts",
        LongTexts | None,
        '{"truncate", "error", "chunk", "mean"}, optional',
        """
         What a text longer than the model's window (its ``max_seq_length`` tokens) does. Can be
         ``"truncate"`` (cut at the window, as sentence-transformers does, and counted:
         :attr:`EncodeResult.truncated`, ``dask-surge status``); ``"error"`` (the first such text
         stops the run with an error naming its partition, row and token count; what was committed
         is kept); ``"chunk"`` (one output row per token window, windows overlapping by up to
         ``chunk_overlap`` tokens and cut at word boundaries, with columns ``chunk``,
         ``char_start``, ``char_end`` and ``tokens``; the key becomes ``(partition, row, chunk)``);
         or ``"mean"`` (one row per text: its windows' embeddings averaged, weighted by their
         tokens). ``"truncate"`` and ``"error"`` write the same rows, so switching between them
         resumes a run.""",
        "what a text over the model's window does: truncate (counted), error, chunk (a row per "
        "window) or mean (of the windows)",
        default="truncate",
        config="long-texts",
        vocabulary=LongTexts,
        validator=one_of(LongTexts, "is not a long-text mode"),
        identity=True,
        takers="encode plan",
        cli=Cli(),
    ),
    _opt(
        "chunk_overlap",
        int | None,
        "int, optional",
        f"""
         Tokens two consecutive windows share at most with ``long_texts="chunk"`` or ``"mean"``
         (fewer where the word before the join is longer: windows start at word starts). Can be an
         int from 0 to less than half the window, or None for the default ({DEFAULT_CHUNK_OVERLAP}).""",
        "tokens consecutive windows share (long-texts chunk or mean)",
        default=DEFAULT_CHUNK_OVERLAP,
        config="chunk-overlap",
        validator=non_negative_int(f"pass e.g. chunk_overlap={DEFAULT_CHUNK_OVERLAP}"),
        schema={"type": "integer", "minimum": 0},
        identity=True,
        takers="encode plan",
        cli=Cli(type=int),
    ),
    _opt(
        "reuse",
        str | Sequence[str] | None,
        "str or sequence of str, optional",
        """
         Earlier outputs whose embeddings are copied, not encoded, for rows whose text (by its
         ``text_hash``) they already hold; everything else is encoded as usual. Only outputs made
         with the same embedding options (model, prompt, normalization, precision, dtype,
         ``truncate_dim``, long-text mode) are used; another is refused with an error that says
         what differs. Can be one path, a list of paths, or None. ``output`` itself may be among
         them (with ``overwrite=True``): the old output stays readable until the new run completes.""",
        "earlier outputs whose embeddings are copied for texts they already hold",
        validator=paths,
        identity=False,
        takers="encode plan",
        cli=Cli(action="append"),
    ),
    _opt(
        "device",
        str | None,
        "str, optional",
        """
         Where the model runs. Can be ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"mps"``, or None to use
         CUDA when available. In a dask-cuda worker each worker sees its own GPU as ``cuda:0``.""",
        "cpu, cuda, cuda:N (default: CUDA when available)",
        config="device",
        validator=torch_device,
        schema={"type": ["string", "null"], "pattern": "^(cpu|cuda|cuda:[0-9]+|mps)$"},
        identity=False,
        takers="encode Encoder",
        cli=Cli(),
    ),
    _opt(
        "dtype",
        Dtype | None,
        '{"auto", "float32", "float16", "bfloat16"}, optional',
        """
         Compute dtype of the forward pass; ``"auto"`` is float32 on a CPU and, on CUDA, bfloat16 for
         a bfloat16 checkpoint, else float16. Recorded resolved for the run's device.""",
        "forward-pass dtype",
        default="auto",
        config="dtype",
        vocabulary=Dtype,
        validator=one_of(Dtype, "is not a known compute dtype"),
        identity=True,
        takers="encode Encoder",
        cli=Cli(),
    ),
    _opt(
        "engine",
        EngineName | None,
        '{"auto", "fast", "sentence-transformers"}, optional',
        """
         ``"fast"`` tokenizes with Rust ``tokenizers``, sorts by length and cuts micro-batches by a
         token budget; ``"sentence-transformers"`` uses ``SentenceTransformer.encode``; ``"auto"``
         uses the fast engine where the model's structure allows, else sentence-transformers.""",
        "fast engine, sentence-transformers' encode, or auto (fast where the model allows)",
        default="auto",
        config="engine",
        vocabulary=EngineName,
        validator=one_of(EngineName, "is not known"),
        identity=False,
        takers="encode Encoder",
        cli=Cli(),
    ),
    _opt(
        "batch_size",
        int | None,
        "int, optional",
        """
         Batch size of the ``SentenceTransformer.encode`` fallback.""",
        "batch size of the sentence-transformers fallback",
        default=32,
        config="batch-size",
        validator=positive_int(fix="pass e.g. batch_size=32"),
        schema=_INT_MIN_1,
        identity=False,
        takers="encode Encoder",
        cli=Cli(type=int),
    ),
    _opt(
        "max_tokens",
        int | None,
        "int, optional",
        """
         Token budget per micro-batch of the fast engine. Can be a positive int, or None to size it
         from the model's activation bytes per token: on a CPU, what 2,048 MiniLM tokens take
         (2,048 tokens for MiniLM and wider models, up to 8,192 for narrower ones), on CUDA a
         quarter of the free GPU memory (4,096 to 65,536 tokens).""",
        "tokens per micro-batch of the fast engine; default automatic",
        config="max-tokens",
        validator=positive_int(
            none=True, what="tokens per micro-batch", fix="pass e.g. max_tokens=8192, or None for automatic"
        ),
        schema={"oneOf": [_INT_MIN_1, _NULL]},
        identity=False,
        takers="encode Encoder",
        cli=Cli(type=int),
    ),
    _opt(
        "prompt",
        str | None,
        "str, optional",
        """
         Text put before every input, as ``SentenceTransformer.encode(prompt=...)``; wins over
         ``prompt_name``. Can be a str, ``""`` to turn the model's default prompt off, or None.""",
        "text put before every input (as SentenceTransformer.encode)",
        validator=text(none=True, fix="pass e.g. prompt='query: '"),
        identity=True,
        takers="encode plan Encoder",
        cli=Cli(),
    ),
    _opt(
        "prompt_name",
        str | None,
        "str, optional",
        """
         Key of the model's prompts (``config_sentence_transformers.json``), e.g. ``"query"``. With
         neither ``prompt`` nor ``prompt_name`` the model's default prompt applies, if any.""",
        "one of the model's prompts, e.g. query",
        validator=text(none=True, fix="pass e.g. prompt_name='query'"),
        identity=True,
        takers="encode plan Encoder",
        cli=Cli(),
    ),
    _opt(
        "revision",
        str | None,
        "str, optional",
        """
         Branch, tag or commit of a Hub model (default ``main``); the commit it resolves to is what
         every worker loads and what the run's fingerprint records.""",
        "branch, tag or commit of a Hub model (default main)",
        validator=text(none=True, fix="pass a branch, tag or commit such as 'main'"),
        identity=True,
        takers="encode plan Encoder",
        cli=Cli(),
    ),
    _opt(
        "trust_remote_code",
        bool,
        "bool",
        """
         Let a Hub model run its own modelling code (``SentenceTransformer(...,
         trust_remote_code=True)``); only for models you trust. Its code is part of the model's
         content, so this flag itself does not change a run.""",
        "let a Hub model run its own code (only for models you trust)",
        default=False,
        validator=boolean("pass trust_remote_code=True only for models whose code you trust"),
        identity=False,
        takers="encode plan Encoder",
        cli=Cli(action="store_true"),
    ),
    _opt(
        "model_kwargs",
        dict | None,
        "dict, optional",
        """
         Passed to ``SentenceTransformer(model_kwargs=...)`` (e.g. ``{"attn_implementation":
         "sdpa"}``); credentials such as ``token`` are left out of the run's identity.""",
        "keyword arguments of SentenceTransformer(model_kwargs=...)",
        validator=mapping("pass e.g. model_kwargs={'attn_implementation': 'sdpa'}"),
        identity=True,
        takers="encode plan Encoder",
    ),
    _opt(
        "overwrite",
        bool,
        "bool",
        """
         Replace a different run found at ``output`` (only once this run completes).""",
        "replace a different run at --output once done",
        default=False,
        validator=boolean("pass overwrite=True to replace a different run"),
        identity=False,
        takers="encode",
        cli=Cli(action="store_true"),
    ),
    _opt(
        "storage_options",
        dict | None,
        "dict, optional",
        """
         Can be the fsspec options (credentials, endpoint) of ``output``, which also apply to the
         ``reuse`` outputs given as URLs (``s3://...``), or None to use the filesystem's defaults.""",
        "fsspec options for the output",
        validator=mapping("pass e.g. storage_options={'auto_mkdir': True}"),
        identity=False,
        takers="encode",
    ),
    _opt(
        "format",
        OutputFormat | None,
        '{"parquet", "lance", "delta", "iceberg", "pgvector"}, optional',
        """
         What ``output`` is: ``"parquet"`` (a directory of part files and the manifest) or
         ``"lance"`` (a Lance table: workers write its data files, the calling process commits
         them in batches, each table version naming the run and its SuperBatches, so a resume
         never commits one twice; see the output formats in ``docs/output.md``), ``"delta"``
         (a Delta Lake table, committed the same way), ``"iceberg"`` (an Iceberg table at
         ``output``, in the catalog ``iceberg_catalog`` names, as ``iceberg_table``) or
         ``"pgvector"`` (the PostgreSQL table ``table`` in the database ``output``, a
         ``postgresql://user@host:5432/db`` URI, each batch of SuperBatches committed in one
         transaction). Needs ``pip install "dask-surge[lance]"``, ``"dask-surge[delta]"``,
         ``"dask-surge[iceberg]"`` or ``"dask-surge[pgvector]"``.""",
        "output format: parquet (part files), lance (a Lance table), delta (a Delta Lake table), iceberg "
        "(an Iceberg table) or pgvector (a PostgreSQL table)",
        default="parquet",
        config="format",
        vocabulary=OutputFormat,
        validator=one_of(OutputFormat, "is not an output format"),
        identity=False,
        takers="encode",
        cli=Cli(flag="--output-format"),
    ),
    _opt(
        "mode",
        TableMode,
        '{"create", "append"}',
        """
         For a table output: ``"create"`` writes only a new table (or resumes this run's own);
         ``"append"`` also adds this run's rows to an existing table with the same columns that it
         did not create (its other rows are left as they are; each of this run's SuperBatches is
         still committed exactly once).""",
        "table outputs: create (a new table) or append (to an existing one with the same columns)",
        default="create",
        vocabulary=TableMode,
        validator=one_of(TableMode, "is not a table mode"),
        identity=False,
        takers="encode",
        cli=Cli(),
    ),
    _opt(
        "iceberg_catalog",
        str | dict | Any | None,
        "str, dict or pyiceberg.catalog.Catalog, optional",
        """
         ``format="iceberg"``: the catalog the table is committed through, named as pyiceberg names
         one: a catalog's name (``"prod"``: ``pyiceberg.catalog.load_catalog("prod")``, from
         ``.pyiceberg.yaml`` or ``PYICEBERG_CATALOG__PROD__*`` variables), a dict of its properties
         (``name``, ``"default"`` unless given, and e.g. ``{"type": "sql", "uri":
         "sqlite:///catalog.db"}``, merged by pyiceberg with its own configuration of that name), or
         a ``pyiceberg.catalog.Catalog`` object (used in the calling process only: workers write
         data files and never see it; dask.config cannot hold one). None is pyiceberg's configured
         default catalog.""",
        "iceberg outputs: the catalog, by name (from .pyiceberg.yaml or PYICEBERG_CATALOG__<NAME>__*) or "
        "its properties; null: pyiceberg's default catalog",
        default=None,
        config="iceberg-catalog",
        validator=iceberg_catalog,
        config_validator=iceberg_catalog_config,
        schema={"oneOf": [{"type": "string", "pattern": r"\S"}, {"type": "object"}, _NULL]},
        identity=False,
        takers="encode",
        cli=Cli(
            type=catalog_argument,
            metavar="NAME",
            help="iceberg outputs: the catalog's name, from .pyiceberg.yaml or PYICEBERG_CATALOG__<NAME>__* "
            "variables (or its properties as a JSON object); default: surge.iceberg-catalog, else pyiceberg's "
            "default catalog",
        ),
    ),
    _opt(
        "iceberg_table",
        str | None,
        "str, optional",
        """
         ``format="iceberg"``: the table's identifier in the catalog (``"namespace.name"``); None
         is ``default.<name>``, ``<name>`` the output path's last component without its
         extension. The output path is the table's location.""",
        "iceberg outputs: the table identifier (namespace.name); null: default.<last component of the output path>",
        default=None,
        config="iceberg-table",
        validator=iceberg_identifier,
        schema={"oneOf": [{"type": "string", "pattern": f"^{_IDENTIFIER}$"}, _NULL]},
        identity=False,
        takers="encode",
        cli=Cli(metavar="NAMESPACE.NAME"),
    ),
    _opt(
        "table",
        str | None,
        "str, optional",
        """
         ``format="pgvector"``: the table in the database ``output`` names, as pandas'
         ``to_sql`` takes ``name``: ``"doc_embeddings"`` (schema ``public``) or
         ``"schema.name"``; any characters (names are always quoted identifiers). The run's
         manifest is kept in a state directory of its own (``surge.pgvector-state``).""",
        "pgvector outputs: the table (name or schema.name) in the database --output names",
        default=None,
        config="table",
        validator=sql_table,
        schema={"oneOf": [{"type": "string", "pattern": r"\S"}, _NULL]},
        identity=False,
        takers="encode",
        cli=Cli(metavar="NAME"),
    ),
    _opt(
        "build_index",
        bool | IndexMetric | None,
        'bool or {"cosine", "l2", "dot"}, optional',
        """
         Once the written run completes, build a searchable index of ``output`` ranked by this
         metric (``True``: ``"cosine"``; ``False``: none): a Lance table's own vector index, FAISS
         beside a Parquet, Delta or Iceberg output (``<output>.faiss/``). An index already there and
         up to date is kept. What was built is the result's ``index``; open it with
         :func:`dask_surge.io.index.open_index` (see the searchable index in ``docs/output.md``). A
         run that fails or is interrupted builds nothing. Needs ``pip install "dask-surge[faiss]"``
         (or ``[lance]`` for a Lance table).""",
        "once the run completes, build a searchable index of the output: cosine (the flag alone), l2 or dot",
        default=False,
        config="build-index",
        validator=index_metric,
        vocabulary=IndexMetric,
        schema={"oneOf": [{"type": "boolean"}, {"enum": list(INDEX_METRICS)}, _NULL]},
        identity=False,
        takers="encode",
        cli=Cli(nargs="?", const="cosine", metavar="METRIC"),
    ),
    _opt(
        "scheduler",
        Scheduler,
        'None, distributed.Client, "threads" or "sync"',
        """
         Where a written encode runs: None uses the active distributed Client, else starts a local
         cluster for the call; ``"threads"``/``"sync"`` run in this process. :func:`plan` plans for
         the worker threads of the same choice.""",
        "address of a running Dask scheduler, or 'threads'/'sync' (default: a local cluster)",
        identity=False,
        takers="encode plan",
        cli=Cli(),
    ),
    _opt(
        "progress",
        bool | None,
        "bool, optional",
        """
         Print progress while writing.""",
        "print progress while writing output",
        default=True,
        config="progress",
        validator=boolean(),
        schema={"type": "boolean"},
        identity=False,
        takers="encode",
        cli=Cli(flag="--no-progress", action="store_false", help="do not print progress"),
    ),
    _opt(
        "input_token",
        str | None,
        "str, optional",
        """
         A name you choose for the input, used as its identity instead of the input's files and
         graph. Needed only when a step of the graph cannot be identified deterministically (the
         error says which); you then vouch for the input: a rerun with the same name resumes,
         whatever the data now is.""",
        "a name for the input, used as its identity instead of its files and graph",
        validator=text(none=True, fix="pass a name such as 'corpus-2024-06'"),
        identity=True,
        takers="encode",
        cli=Cli(),
    ),
    _opt(
        "params",
        Any,
        "dask_surge.planning.costmodel.CostParams, optional",
        """
         Cost-model parameters; with them the plan predicts every policy.""",
        "cost-model parameters",
        takers="plan",
    ),
    _opt(
        "calibrate",
        bool,
        "bool",
        """
         Measure the parameters on the live cluster first (a probe of 10-20 s, cached per model,
         device and cluster shape; see :mod:`dask_surge.execution.calibrate`).""",
        "measure the cost model on a local cluster (~10-20 s, cached) and predict every policy",
        default=False,
        takers="plan",
        cli=Cli(action="store_true"),
    ),
    _opt(
        "client",
        Any,
        "distributed.Client, optional",
        """
         Cluster to calibrate on and plan for (default: the active one, else the local cluster
         :func:`encode` would start, started for the probe; this process with ``scheduler="threads"``).""",
        "cluster to calibrate on and plan for",
        takers="plan",
    ),
    _opt(
        "token_sample",
        int | None,
        "int, optional",
        """
         With parameters, texts sampled (row-weighted, from partitions spread over the frame) and
         tokenized with ``model``'s tokenizer (pass the model the parameters were calibrated for),
         so automatic thresholds and predictions use the token lengths of this data rather than of
         the calibration texts. Can be a positive int, or None (as the config value) to skip.""",
        "texts plan() samples and tokenizes so predictions use the data's token lengths; "
        "null uses the calibration texts'",
        default=2048,
        config="token-sample",
        validator=positive_int(none=True),
        schema={"oneOf": [_INT_MIN_1, _NULL]},
        takers="plan",
        cli=Cli(type=int),
    ),
    # configuration only (no keyword): resolved where they are used
    _opt(
        "compression",
        Compression,
        '{"none", "snappy", "lz4", "zstd"}',
        """
         Parquet codec of the embedding column (other columns are always zstd); ``"none"`` writes
         fastest, float vectors barely compress.""",
        "Parquet codec of the embedding column (other columns are always zstd); none writes fastest, "
        "float vectors barely compress",
        default="none",
        config="compression",
        vocabulary=Compression,
    ),
    _opt(
        "ttfo_target",
        float,
        "float",
        """
         Seconds to the first SuperBatch that ``b_min="auto"`` aims for (with a calibration).""",
        "seconds to the first SuperBatch that b-min auto aims for",
        default=10.0,
        config="ttfo-target",
        validator=positive_number,
        schema={"type": "number", "exclusiveMinimum": 0},
    ),
    _opt(
        "memory_budget",
        int | None,
        "int, optional",
        """
         Bytes per worker that ``b_min``/``b_max`` ``"auto"`` may use; None is 2 GiB.""",
        "bytes per worker that b-min/b-max auto may use; null is 2 GiB",
        config="memory-budget",
        validator=positive_int(none=True),
        schema={"oneOf": [_INT_MIN_1, _NULL]},
    ),
    _opt(
        "max_loaded_models",
        int,
        "int",
        """
         Models a process (a worker, or the client) keeps loaded at most: loading one more closes
         the least recently used (its engine thread, pinned buffer and weights are released; it
         loads again on its next use).""",
        "models a process keeps loaded at most; one more closes the least recently used",
        default=4,
        config="max-loaded-models",
        validator=positive_int(fix="pass e.g. 4"),
        schema=_INT_MIN_1,
    ),
    _opt(
        "first_superbatch",
        int | None,
        "int, optional",
        """
         Rows of a new run's first SuperBatch when partition sizes are known (Parquet, in-memory
         frames): the thresholds of the next ones double from there up to ``b_min``, so the first
         output comes after one small SuperBatch, not ``b_min`` rows (a cold worker's first forward
         passes are the slowest part of its start). Recorded with the run, so a resumed run plans
         the same SuperBatches. Can be a positive int, or None to start at ``b_min``.""",
        "rows of a new run's first SuperBatch (thresholds double up to b-min); null starts at b-min",
        default=32,
        config="first-superbatch",
        validator=positive_int(none=True),
        schema={"oneOf": [_INT_MIN_1, _NULL]},
    ),
    _opt(
        "table_commit_every",
        int,
        "int",
        """
         SuperBatches a table commit holds at most (a table output makes one version per commit).""",
        "table outputs: SuperBatches per table commit at most",
        default=16,
        config="table-commit-every",
        validator=positive_int(fix="pass e.g. 16"),
        schema=_INT_MIN_1,
    ),
    _opt(
        "table_commit_seconds",
        float,
        "float",
        """
         Seconds a committed SuperBatch waits for others before its table commit (the run's first
         is committed at once).""",
        "table outputs: seconds a SuperBatch waits for others before its table commit",
        default=5.0,
        config="table-commit-seconds",
        validator=positive_number,
        schema={"type": "number", "exclusiveMinimum": 0},
    ),
    _opt(
        "pgvector_state",
        str | None,
        "str, optional",
        """
         Where a pgvector output's run keeps its manifest, claim and heartbeat (a database table has
         no directory beside it): one subdirectory per table, named by a hash of the server,
         database, user and table. Can be a path (on a cluster: one every process sees, a shared
         filesystem) or None for the user's cache directory (``~/.cache/dask-surge/pgvector``).""",
        "pgvector outputs: the directory of their runs' manifests (shared by every process on a cluster); "
        "null: ~/.cache/dask-surge/pgvector",
        default=None,
        config="pgvector-state",
        validator=state_directory,
        schema={"oneOf": [{"type": "string", "pattern": r"\S"}, _NULL]},
    ),
    _opt(
        "superbatches_per_gpu",
        int,
        "int",
        """
         SuperBatch tasks a GPU worker runs at once: one encodes on the GPU (the engine serializes
         forward passes through one feeder thread) while the others read, tokenize, pack, write and
         commit, so the GPU does not wait for the host between SuperBatches. Each task claims
         ``1/n`` of the ``GPU`` resource a GPU worker advertises, and each holds its SuperBatch in
         memory; dask-surge's own GPU clusters start this many threads per GPU worker.""",
        "SuperBatch tasks a GPU worker runs at once (one on the GPU, the others reading, tokenizing or writing)",
        default=4,
        config="superbatches-per-gpu",
        validator=positive_int(fix="pass e.g. 4"),
        schema=_INT_MIN_1,
    ),
    _opt(
        "tuning",
        dict,
        "dict",
        """
         The process-wide settings of a worker (the allocator, the garbage collector pause, the
         tokenizer's threads, the profiler pause, the CPU kernels, the tokenizing helper processes,
         joined tokenizing), under ``surge.tuning.<name>``: each ``"auto"`` (on where it was
         measured: a setting measured only on a CPU stays off on a GPU), ``True``/``False`` to force
         it, or for ``tokenize-processes`` a number of helper processes. Declared, with what each does
         and where it was measured, in :mod:`dask_surge.engine.tuning` (``docs/tuning.md``); the worker
         plugin applies them, never a user's own process unless forced.""",
        "process-wide settings of a worker (docs/tuning.md): each auto (on where measured), true/false, "
        "or a count for tokenize-processes",
        default=dict.fromkeys(TUNING, "auto"),
        config="tuning",
        validator=tuning_values,
        schema={
            "type": "object",
            "additionalProperties": False,
            "properties": {
                name: {"oneOf": [{"enum": ["auto"]}, {"type": "integer", "minimum": 0}, _NULL]}
                if name == "tokenize-processes"
                else {"enum": ["auto", True, False]}
                for name in TUNING
            },
        },
    ),
    _opt(
        "dedicated_workers",
        bool,
        "bool",
        """
         Whether this worker process runs dask-surge only, so that ``surge.tuning.*`` settings that
         cannot be undone (the allocator's thresholds) apply on ``"auto"``: read in each worker's own
         config. dask-surge's clusters (:func:`dask_surge.local_cluster`, its jobqueue clusters) set it in
         the workers they start; on a cluster of your own it stays False and a run leaves the workers as
         it found them (``docs/tuning.md``).""",
        "the worker runs dask-surge only: settings that cannot be undone (allocator) apply on auto; "
        "dask-surge's own clusters set it in their workers",
        default=False,
        config="dedicated-workers",
        validator=boolean(),
        schema={"type": "boolean"},
    ),
    _opt(
        "keep_model",
        bool,
        "bool",
        """
         Whether the model stays loaded on the workers once a written run ends (the next run of
         the same model starts without loading it). False unregisters dask-surge's worker plugin
         at the end of the run: every worker closes the model and frees its memory (on a GPU, for
         the next RAPIDS step), and a worker that joins later loads nothing (``docs/tuning.md``).""",
        "keep the model loaded on the workers after a written run (false: unloaded, GPU memory freed)",
        default=False,
        config="keep-model",
        validator=boolean(),
        schema={"type": "boolean"},
    ),
    _opt(
        "in_flight",
        int | None,
        "int, optional",
        """
         SuperBatches submitted at once when writing; None is 2 x worker threads.""",
        "SuperBatches submitted at once when writing; null is 2 x worker threads",
        config="in-flight",
        validator=positive_int(none=True),
        schema={"oneOf": [_INT_MIN_1, _NULL]},
    ),
    _opt(
        "no_workers_timeout",
        float | str | None,
        "float or str, optional",
        """
         How long a written run waits once every worker has left the cluster (jobs preempted or
         cancelled, workers that crashed, or that closed because they could not unpickle a task)
         before it stops with an error that says so; its commits are kept, and a rerun resumes.
         A cluster that has had no worker yet (jobs still queued) is waited for as long as it
         takes. Can be seconds, a duration such as ``"5 minutes"``, or None to wait for workers
         in every case (e.g. an adaptive cluster whose replacement jobs queue for long).
         ``distributed.scheduler.no-workers-timeout``, when set, stops the run too.""",
        "seconds (or e.g. '5 minutes') a run waits once every worker has left before it stops; "
        "null waits as long as it takes",
        default=300,
        config="no-workers-timeout",
        validator=duration,
        schema={
            "oneOf": [
                {"type": "number", "exclusiveMinimum": 0},
                {"type": "string", "pattern": r"^\s*[0-9]*\.?[0-9]+\s*[a-zA-Z]*\s*$"},
                _NULL,
            ]
        },
    ),
)


# -- what a type checker sees (tests/test_options.py keeps these equal to the table) -----------------


class _ModelOptions(TypedDict, total=False):
    prompt: str | None
    prompt_name: str | None
    revision: str | None
    trust_remote_code: bool
    model_kwargs: dict | None


class EncodeOptions(_ModelOptions, total=False):
    """The keyword options of :func:`dask_surge.encode`, typed."""

    model: Any
    b_min: int | Literal["auto"] | None
    b_max: int | Literal["auto"] | None
    max_bytes: int | str | None
    keep: Sequence[str]
    normalize: bool | None
    precision: Precision | None
    truncate_dim: int | None
    sparse_top_k: int | None
    sparse_threshold: float | None
    on_null: OnNull | None
    long_texts: LongTexts | None
    chunk_overlap: int | None
    reuse: str | Sequence[str] | None
    device: str | None
    dtype: Dtype | None
    engine: EngineName | None
    batch_size: int | None
    max_tokens: int | None
    overwrite: bool
    storage_options: dict | None
    format: OutputFormat | None
    mode: TableMode
    iceberg_catalog: str | dict | Any | None
    iceberg_table: str | None
    table: str | None
    build_index: bool | IndexMetric | None
    scheduler: Scheduler
    progress: bool | None
    input_token: str | None


class PlanOptions(_ModelOptions, total=False):
    """The keyword options of :func:`dask_surge.plan`, typed."""

    model: Any
    b_min: int | Literal["auto"] | None
    b_max: int | Literal["auto"] | None
    max_bytes: int | str | None
    long_texts: LongTexts | None
    chunk_overlap: int | None
    reuse: str | Sequence[str] | None
    scheduler: Scheduler
    params: Any
    calibrate: bool
    client: Any
    token_sample: int | None


# -- derived views --------------------------------------------------------------------------------------


def option(name: str) -> Option:
    """The option called ``name`` (its Python name, or its config key such as ``"b-min"``)."""
    for opt in OPTIONS:
        if name in (opt.name, opt.config):
            return opt
    raise KeyError(name)


def options_of(taker: str) -> tuple[Option, ...]:
    """The options ``"encode"``, ``"plan"`` or ``"Encoder"`` takes, in table order."""
    if taker not in TAKERS:
        raise ValueError(f"{taker!r} is not one of {TAKERS}")
    return tuple(opt for opt in OPTIONS if taker in opt.takers)


def config_options() -> dict[str, Option]:
    """Config key (under ``surge.``) -> option, for every option with one."""
    return {opt.config: opt for opt in OPTIONS if opt.config}


def defaults(taker: str = "Encoder") -> dict[str, Any]:
    """Name -> default of the options ``taker`` takes, as :class:`dask_surge.Encoder` uses them.

    Examples
    --------
    >>> defaults()["batch_size"], defaults()["dtype"]
    (32, 'auto')
    """
    return {opt.name: opt.default for opt in options_of(taker)}


#: the parameters of ``encode`` before its options, and whether each changes the run
ENCODE_POSITIONAL: dict[str, bool] = {"ddf": True, "column": True, "output": False}


def identity_options() -> dict[str, bool]:
    """Every parameter of :func:`dask_surge.encode` -> whether it changes the embeddings or the output.

    True makes a different run (the fingerprint records it); False lets a rerun with another
    value resume. Read from :data:`OPTIONS` on each call.

    Examples
    --------
    >>> identity_options()["normalize"], identity_options()["batch_size"]
    (True, False)
    """
    return {**ENCODE_POSITIONAL, **{opt.name: opt.identity for opt in options_of("encode")}}


def signature(func: Callable[..., Any], taker: str) -> inspect.Signature:
    """``func``'s positional parameters followed by the keyword options ``taker`` takes.

    Its ``**options`` (or the options of a signature derived before) give way to the table's.

    Examples
    --------
    >>> def f(ddf, column, **options): ...
    >>> list(signature(f, "plan").parameters)[:4]
    ['ddf', 'column', 'model', 'b_min']
    """
    sig = inspect.signature(func)
    head = [
        p
        for p in sig.parameters.values()
        if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    tail = [
        inspect.Parameter(
            opt.name, inspect.Parameter.KEYWORD_ONLY, default=opt.api_default, annotation=opt.annotation
        )
        for opt in options_of(taker)
    ]
    return sig.replace(parameters=[*head, *tail])


def bind(taker: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """Every option ``taker`` takes -> its given value, else the default its signature shows.

    Raises
    ------
    TypeError
        For a keyword ``taker`` does not take (as Python would), with the nearest names.

    Examples
    --------
    >>> bind("plan", {"b_min": 5})["b_min"], bind("plan", {})["calibrate"]
    (5, False)
    >>> bind("plan", {"calibrat": True})
    Traceback (most recent call last):
    ...
    TypeError: plan() got an unexpected keyword argument 'calibrat'. Did you mean 'calibrate'?
    """
    taken = {opt.name: opt for opt in options_of(taker)}
    for name in given:
        if name not in taken:
            near = difflib.get_close_matches(name, list(taken), n=2)
            hint = f". Did you mean {' or '.join(map(repr, near))}?" if near else ""
            raise TypeError(f"{taker}() got an unexpected keyword argument {name!r}{hint}")
    return {name: given.get(name, opt.api_default) for name, opt in taken.items()}


def _doc_entry(opt: Option, indent: str, taker: str, note: str) -> list[str]:
    import textwrap

    if taker == "Encoder":  # the Encoder reads no ``surge.*`` config: its default is the option's own
        default = f"Default: ``{opt.default!r}``."
    else:
        default = f"Default: ``surge.{opt.config}`` (shipped as ``{opt.default!r}``)." if opt.config else ""
    doc = " ".join(filter(None, [opt.doc, note, default]))
    body = textwrap.wrap(
        doc,
        width=88,
        initial_indent=indent + "    ",
        subsequent_indent=indent + "    ",
        break_long_words=False,
        break_on_hyphens=False,
    )
    return [f"{indent}{opt.name} : {opt.doc_type}", *body]


def document(
    doc: str | None, taker: str, marker: str = "{options}", notes: Mapping[str, str] | None = None
) -> str:
    r"""``doc`` with the line holding ``marker`` replaced by the numpydoc entries of ``taker``'s options.

    ``notes`` (option name -> text) adds what ``taker`` says of an option after its declared text.

    Examples
    --------
    >>> print(document("Parameters\n----------\n{options}", "Encoder").splitlines()[2])
    device : str, optional
    """
    if not doc or marker not in doc:
        raise ValueError(f"the docstring has no {marker!r} line to put the options of {taker}() in")
    lines = doc.split("\n")
    out: list[str] = []
    for line in lines:
        if marker in line:
            indent = line[: len(line) - len(line.lstrip())]
            for opt in options_of(taker):
                out += _doc_entry(opt, indent, taker, (notes or {}).get(opt.name, ""))
        else:
            out.append(line)
    return "\n".join(out)


def add_arguments(parser: Any, taker: str) -> None:
    """Add the command-line flag of every option ``taker`` takes that has one (argparse)."""
    for opt in options_of(taker):
        if opt.cli is None:
            continue
        # None: the function resolves a config option when it runs
        kwargs: dict[str, Any] = {
            "dest": opt.name,
            "help": opt.cli.help or opt.summary,
            "default": opt.api_default,
        }
        if opt.cli.action:
            kwargs["action"] = opt.cli.action
        else:
            if opt.cli.type is not None:
                kwargs["type"] = opt.cli.type
            if opt.choices is not None:
                kwargs["choices"] = opt.choices
            if opt.cli.nargs is not None:
                kwargs.update(nargs=opt.cli.nargs, const=opt.cli.const)
            if opt.cli.metavar is not None:
                kwargs["metavar"] = opt.cli.metavar
        parser.add_argument(opt.cli.flag or "--" + opt.name.replace("_", "-"), **kwargs)


def from_arguments(args: Any, taker: str) -> dict[str, Any]:
    """The keyword options ``taker`` takes from parsed command-line ``args`` (those with a flag)."""
    return {
        opt.name: getattr(args, opt.name)
        for opt in options_of(taker)
        if opt.cli is not None and hasattr(args, opt.name)
    }


def schema() -> dict[str, Any]:
    """The JSON schema of the ``surge.*`` configuration, from :data:`OPTIONS` (``surge-schema.yaml``)."""
    properties: dict[str, Any] = {}
    for key, opt in config_options().items():
        rule = dict(opt.schema) if opt.schema is not None else {"enum": list(opt.choices or ())}
        properties[key] = {**rule, "description": opt.summary}
    return {
        "properties": {"surge": {"type": "object", "additionalProperties": False, "properties": properties}}
    }


def schema_yaml() -> str:
    """The text of the shipped ``surge-schema.yaml``: :func:`schema` with a header."""
    import yaml

    header = (
        "# JSON Schema of the surge.* configuration (dask.config), like dask's own dask-schema.yaml.\n"
        "# Generated from dask_surge/options.py (schema_yaml()); tests/test_options.py fails when they drift.\n"
    )

    class _Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:  # the shared rules written out in full
            return True

    return header + yaml.dump(schema(), Dumper=_Dumper, sort_keys=False, width=200, default_flow_style=None)
