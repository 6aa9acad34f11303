"""PostgreSQL + pgvector table output: workers stage rows, the claim holder moves them in one transaction.

``encode(ddf, "text", output="postgresql://user@host:5432/db", format="pgvector",
table="doc_embeddings")`` (issue 69). The table is the output; the run's manifest, claim and
heartbeat, which every other format keeps in ``_surge/`` beside its data, live in a *state
directory* (:func:`state_store`): ``surge.pgvector-state`` (default: the user's cache directory,
``~/.cache/dask-surge/pgvector``), one subdirectory per table, named by a hash of the password-free
server address (host, port, database, user) and the qualified table name, holding
:data:`MARKER_FILE` (the table's redacted URI and name) and ``_surge/``. On a cluster that directory
must be one every process sees (a shared filesystem), as any output's; the run checks it before any
work.

A SuperBatch task COPYs its rows (binary COPY, vectors through pgvector's own adapter) into a
staging table ``<table>__surge_staging`` beside the output table (logged: a server crash keeps what
was staged, so a resume commits it), under a random staging key, in a transaction of its own (:meth:`PgVectorTable.write`): no reader of the output table sees
them. Its payload (the SuperBatch's commit record) holds that key, the row count and the Arrow
schema: never the URI, never a password.

The process holding the run's claim commits batches of them (:meth:`PgVectorTable.commit`), each
in ONE transaction: lock the output table's row in ``<schema>.surge_tables`` (``SELECT ... FOR
UPDATE``: commits to one table are serialized, so its versions are numbered in commit order);
refuse (:class:`~.base.CommitConflict`) when a version of the run was committed after the version
the committer read; record every SuperBatch in ``<schema>.surge_commits`` (primary key ``(tbl, run,
sb)``: a second commit of a SuperBatch fails on the constraint); ``INSERT INTO <table> SELECT ...
FROM <staging>``; delete the staged rows; record the version in ``<schema>.surge_versions``; bump
the table's version. The rows and their commit record land together or not at all, and a reader
(any isolation level) never sees part of a SuperBatch.

**Fencing.** A claim holder's first version is a *fence* (:meth:`PgVectorTable.fence`): the
output table's creation (with the staging and bookkeeping tables and ``CREATE EXTENSION vector``)
when ``read_version`` is 0, else a version that holds no SuperBatch. Every commit checks, under the
row lock, that no version of the run came after the one it read, so a paused process whose claim
was taken over lands nothing. Each session sets ``idle_in_transaction_session_timeout``, so a
process paused inside a commit transaction (holding the lock) is rolled back by the server instead
of blocking the new claim holder.

**Versions.** ``surge_tables.version`` counts the versions dask-surge made of the table (any run);
0 means "no table". A table dask-surge did not create (``mode="append"``) reads as version 1, made
by another writer (op ``CREATE TABLE``). Changes other clients make with plain SQL (INSERT,
DELETE) are not versions: this module cannot see them.

**Credentials.** They stay in libpq's channels (``PGPASSWORD``, ``~/.pgpass``, ``PGSSLMODE``
and the rest, read by libpq in each process): every message formats the URI through
:func:`redact_uri`, which drops the password, and a table pickles (into a task graph, to a worker)
and tokenizes with the redacted URI only. A password given in the URI stays in the process that was
given it (:data:`_SECRETS`, keyed by the redacted URI); worker processes get it in memory, through a
Dask worker plugin for the run's duration (:func:`secrets_plugin`), never on disk. Table and column
names are always ``psycopg.sql.Identifier`` s.

**Index and search.** :meth:`PgVectorTable.build_index` builds an HNSW index
(``CREATE INDEX CONCURRENTLY``); :meth:`PgVectorTable.search` returns the ``k`` nearest rows'
distances as every output's index does (:func:`dask_surge.io.index.exact_distances`): cosine
``<=>`` (1 - cosine similarity), l2 the square of ``<->`` (pgvector's is the Euclidean distance) and
dot ``1 + <#>`` (pgvector's is the negative inner product), smaller nearer; the SQL orders by
pgvector's own operator, so the HNSW index serves it.
"""

from __future__ import annotations

import getpass
import hashlib
import importlib
import json
import os
import re
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...config import get
from ...errors import SurgeError, SurgeOutputError, SurgeValueError
from ..store import OutputStore
from .base import EMBEDDING_PROPERTY, CommitConflict, History, TableOutput, schema_of, schema_text

__all__ = [
    "PgVectorTable",
    "PgLocation",
    "redact_uri",
    "is_address",
    "split_output",
    "state_root",
    "state_store",
    "secrets_plugin",
    "MARKER_FILE",
    "KEEPS_ROWS",
    "STAGING_SUFFIX",
    "METRICS",
]

#: the staging table of ``<table>`` is ``<table>__surge_staging`` (same schema)
STAGING_SUFFIX = "__surge_staging"
#: the bookkeeping tables, one set per schema (keyed by the output table's name)
TABLES, VERSIONS, COMMITS = "surge_tables", "surge_versions", "surge_commits"
#: operations of a version that leave every committed row in place
KEEPS_ROWS = frozenset({"CREATE", "CREATE TABLE", "FENCE", "APPEND", "REPAIR"})
#: metric -> (pgvector operator, operator class suffix)
METRICS = {"cosine": ("<=>", "cosine_ops"), "l2": ("<->", "l2_ops"), "dot": ("<#>", "ip_ops")}
#: PostgreSQL's identifier length limit (NAMEDATALEN - 1 bytes); longer names are truncated silently
_MAX_NAME = 63
_INDEX_SUFFIX = {"cosine": "__surge_hnsw_cos", "l2": "__surge_hnsw_l2", "dot": "__surge_hnsw_ip"}
_SECRET_KEYS = ("password", "sslpassword")
_KV_SECRET = re.compile(r"(?i)(?<![\w.])(?:ssl)?password\s*=\s*(?:'(?:[^'\\]|\\.)*'|\S*)\s*")
_FIX_INSTALL = 'pip install "dask-surge[pgvector]"'
#: the file of a pgvector output's state directory that names its table (redacted URI, schema, name)
MARKER_FILE = "pgvector.json"
#: redacted URI -> the password its URI held: this process's only (see the module's docstring)
_SECRETS: dict[str, str] = {}
_SCHEMES = ("postgresql://", "postgres://")


def _modules() -> tuple[Any, Any]:
    """``(psycopg, pgvector.psycopg)``, or an error naming the extra to install."""
    try:
        return importlib.import_module("psycopg"), importlib.import_module("pgvector.psycopg")
    except ImportError as err:
        raise SurgeError(
            f"a pgvector output needs the 'psycopg' and 'pgvector' packages, which are not installed "
            f"({err}). Fix: {_FIX_INSTALL}."
        ) from err


def redact_uri(uri: str) -> str:
    """``uri`` (a libpq URI or ``key=value`` string) without its password: what every message shows.

    Everything between ``://`` and the last ``@`` before the query keeps only the user name;
    ``password`` and ``sslpassword`` parameters are dropped.

    Examples
    --------
    >>> redact_uri("postgresql://alice:s3cret@db.example:5432/app")
    'postgresql://alice@db.example:5432/app'
    >>> redact_uri("postgres://bob:p@ss/w@h1:5432,h2/db?password=x&sslmode=require")
    'postgres://bob@h1:5432,h2/db?sslmode=require'
    >>> redact_uri("postgresql://postgres:@/postgres?host=/tmp/pg")
    'postgresql://postgres@/postgres?host=/tmp/pg'
    >>> redact_uri("host=db user=carol password='a b' dbname=app")
    'host=db user=carol dbname=app'
    """
    m = re.match(r"(?is)^(postgres(?:ql)?://)(.*)$", uri)
    if m is None:
        return _KV_SECRET.sub("", uri).strip()
    scheme, rest = m.groups()
    head, q, query = rest.partition("?")
    if "@" in head:  # user info: up to the last '@' (a password may hold '@' or '/')
        userinfo, _, hosts = head.rpartition("@")
        user = userinfo.split(":", 1)[0]
        head = f"{user}@{hosts}" if user else hosts
    if q:
        query, h, frag = query.partition("#")
        kept = [p for p in query.split("&") if p.split("=", 1)[0].lower() not in _SECRET_KEYS]
        query = ("?" + "&".join(kept) if kept else "") + h + frag
    return scheme + head + query


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


@dataclass(frozen=True)
class PgLocation:
    """Where a pgvector output is: the libpq ``uri`` (never shown: see :attr:`url`), ``schema``, ``table``."""

    uri: str = field(repr=False)
    schema: str
    table: str

    @property
    def url(self) -> str:
        """The location as messages show it: the URI without its password, ``#schema.table``."""
        return f"{redact_uri(self.uri)}#{self.schema}.{self.table}"

    def store(self) -> None:
        """A database table has no store of data files (:meth:`PgVectorTable.data_files` is empty)."""
        return None


# -- columns ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Column:
    name: str
    ddl: str  # the PostgreSQL type as format_type() spells it (vector types: without their schema)
    copy: str  # the type name for binary COPY's set_types
    kind: str  # "scalar", "vector" or "halfvec"


def _scalar(name: str, t: pa.DataType) -> tuple[str, str]:
    for test, ddl, copy in (
        (pa.types.is_int64, "bigint", "int8"),
        (pa.types.is_int32, "integer", "int4"),
        (pa.types.is_int16, "smallint", "int2"),
        (pa.types.is_float64, "double precision", "float8"),
        (pa.types.is_float32, "real", "float4"),
        (pa.types.is_string, "text", "text"),
        (pa.types.is_large_string, "text", "text"),
        (pa.types.is_boolean, "boolean", "bool"),
        (pa.types.is_binary, "bytea", "bytea"),
        (pa.types.is_large_binary, "bytea", "bytea"),
        (pa.types.is_fixed_size_binary, "bytea", "bytea"),
    ):
        if test(t):
            return ddl, copy
    raise SurgeOutputError(
        f"column {name!r} has Arrow type {t}, which the pgvector output cannot store. Nothing was written. "
        "Fix: keep only columns of type int64, int32, float64, float32, string, bool or binary (keep=), "
        "or cast the column before encoding."
    )


def _columns(schema: pa.Schema, dim: int | None = None) -> list[_Column]:
    """The table's columns for rows of Arrow ``schema`` (``dim``: the embedding's length when it is a
    variable-size list); refuses what pgvector cannot hold, naming the fix."""
    names = set(schema.names)
    if "embedding" not in names:
        family = (
            "a multi-vector (ColBERT) output"
            if "vectors" in names
            else "a sparse output"
            if {"indices", "values"} <= names
            else "no 'embedding' column"
        )
        raise SurgeOutputError(
            f"the pgvector output stores a dense model's 'embedding' column, and this run writes {family} "
            f"(columns {schema.names}). Nothing was written. Fix: use a dense model, or format='parquet' "
            "(or 'lance') for sparse and multi-vector outputs."
        )
    out = []
    for f in schema:
        if f.name != "embedding":
            ddl, copy = _scalar(f.name, f.type)
            out.append(_Column(f.name, ddl, copy, "scalar"))
            continue
        t = f.type
        if not (pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t)):
            raise SurgeOutputError(
                f"the 'embedding' column has Arrow type {t}, not a list of floats. Nothing was written. "
                "Fix: encode with a dense model (float32 or float16 precision)."
            )
        value = t.value_type
        if pa.types.is_float32(value):
            kind = "vector"
        elif pa.types.is_float16(value):
            kind = "halfvec"
        else:
            raise SurgeOutputError(
                f"the 'embedding' column holds {value} values; pgvector stores float32 (vector) and float16 "
                "(halfvec) vectors. Nothing was written. Fix: pass precision='float32' (or 'float16') for a "
                "pgvector output."
            )
        d = t.list_size if pa.types.is_fixed_size_list(t) else dim
        if not d or d > 16000:
            raise SurgeOutputError(
                f"the 'embedding' column has {d} dimensions; a pgvector {kind} column holds 1 to 16000. "
                "Nothing was written. Fix: use a model with fewer dimensions (or truncate with dimensions=)."
            )
        out.append(_Column(f.name, f"{kind}({d})", kind, kind))
    return out


def _payload_columns(payload: dict) -> list[_Column]:
    return _columns(schema_of(payload["schema"]), payload.get("dim"))


def _embedding_rows(column: pa.ChunkedArray | pa.Array, kind: str) -> list[Any]:
    """The ``embedding`` column as one numpy array per row (None for a null), for pgvector's dumpers."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if isinstance(arr, pa.ExtensionArray):  # pragma: no cover - no extension type is written
        arr = arr.storage
    dtype = np.float16 if kind == "halfvec" else np.float32
    if pa.types.is_fixed_size_list(arr.type):
        d = arr.type.list_size
        flat = arr.values.slice(arr.offset * d, len(arr) * d).to_numpy(zero_copy_only=False)
        matrix = np.asarray(flat, dtype=dtype).reshape(len(arr), d)
        rows: list[Any] = list(matrix)
    else:
        rows = [None if v is None else np.asarray(v, dtype=dtype) for v in arr.to_pylist()]
    if arr.null_count:
        valid = arr.is_valid().to_pylist()
        rows = [r if ok else None for r, ok in zip(rows, valid, strict=True)]
    return rows


# -- the table ---------------------------------------------------------------------------------------


class PgVectorTable(TableOutput):
    """One PostgreSQL table (pgvector ``vector`` / ``halfvec`` embeddings) as a dask-surge output.

    Picklable (workers write through it): it holds the URI and the names, never a connection, and
    pickles with the URI's password left out (:meth:`__reduce__`; see the module's docstring).

    Parameters
    ----------
    uri : str
        A libpq connection URI (``postgresql://user@host:port/db``) or ``key=value`` string. Keep the
        password out of it: libpq reads ``PGPASSWORD`` and ``~/.pgpass``.
    table : str or (str, str)
        The output table: ``"name"`` (schema ``public``), ``"schema.name"`` (split at the first dot),
        or a ``(schema, name)`` pair for names that hold a dot. Any characters are allowed: names are
        always quoted identifiers.
    schema : str, optional
        The schema, when ``table`` is a bare name.
    unlogged : bool
        Stage rows in an UNLOGGED table (no WAL for rows that are copied again at commit: faster). A
        server crash empties an UNLOGGED table: SuperBatches staged but not yet committed then cannot
        be committed (the commit says so). False (the default): a logged staging table, which
        survives a crash, so a rerun after one commits every staged SuperBatch.
    """

    name = "pgvector"
    #: the format as messages name it (:func:`~dask_surge.io.tables.display_name`)
    DISPLAY = "pgvector"
    LIBRARY = "psycopg"
    native_index = True
    #: :func:`dask_surge.backfill.backfill` adds a vector column to an existing table in place
    merges_columns = True
    #: addressed by a PostgreSQL URI (and ``table=``), not by a directory holding a marker
    database = True
    #: vector(d) and halfvec(d); pgvector's bit type is not written (int8 and binary are refused)
    precisions = frozenset({"float32", "float16"})
    #: the file of the state directory that names the table (:func:`state_store`)
    MARKER = MARKER_FILE
    #: what the state directory holds besides ``_surge/``
    ENTRIES = frozenset({MARKER_FILE})

    @classmethod
    def owns_payload(cls, payload: str) -> bool:
        """True when ``payload`` (a commit record's table data) is this format's: a staging key, no file."""
        facts = json.loads(payload)
        return isinstance(facts, dict) and "key" in facts and "path" not in facts and "fragments" not in facts

    @classmethod
    def at(cls, store: Any) -> PgVectorTable:
        """The table the state directory ``store`` (:func:`state_store`) names in its :data:`MARKER_FILE`."""
        try:
            facts = json.loads(store.read(f"{store.root}/{MARKER_FILE}"))
        except (FileNotFoundError, NotADirectoryError):
            named = getattr(store, "location", None)
            if is_address(named):  # no run of dask-surge wrote it: the table the location names
                uri, table = split_output(str(named))  # the password, if any, is in _SECRETS
                return cls(uri, table)
            raise SurgeOutputError(
                f"{store.location!r} names no pgvector table: its state directory {store.root!r} holds no "
                f"{MARKER_FILE}. Fix: pass output='postgresql://...' and table= as the encode was given them "
                "(with the same surge.pgvector-state)."
            ) from None
        return cls(facts["uri"], (facts["schema"], facts["table"]))

    @classmethod
    def check_options(cls, *, output: Any, mode: str, overwrite: bool, precision: str) -> None:
        """Refuse, before any work, an ``output`` that is not a PostgreSQL URI, and what
        :meth:`.base.Output.check_options` refuses."""
        if output is not None and not is_address(str(output)):
            raise SurgeValueError(
                f"format='pgvector' writes a PostgreSQL table, and output={str(output)!r} is not a PostgreSQL "
                "URI. Fix: pass output='postgresql://user@host:5432/db' and table='name' (the password through "
                "PGPASSWORD or ~/.pgpass)."
            )
        if output is None:
            raise SurgeValueError(
                "format='pgvector' writes a PostgreSQL table at output=...; output=None returns a lazy frame. "
                "Fix: pass output='postgresql://user@host:5432/db' and table='name'."
            )
        if overwrite:
            raise SurgeValueError(
                "format='pgvector' writes a PostgreSQL table, which it never replaces: overwrite=True is for "
                "Parquet. Fix: pass a new table=, or mode='append' to add this run's rows to the table."
            )
        super().check_options(output=output, mode=mode, overwrite=overwrite, precision=precision)

    def __init__(
        self, uri: str, table: str | tuple[str, str], *, schema: str | None = None, unlogged: bool = False
    ) -> None:
        self.unlogged = bool(unlogged)
        if isinstance(table, tuple):
            schema, table = table
        elif schema is None and "." in table:
            schema, table = table.split(".", 1)
        schema = schema or "public"
        for what, value, room in (
            ("table", table, _MAX_NAME - max(len(STAGING_SUFFIX), *map(len, _INDEX_SUFFIX.values()))),
            ("schema", schema, _MAX_NAME),
        ):
            if not value or "\x00" in value or len(value.encode()) > room:
                raise SurgeValueError(
                    f"the pgvector output's {what} name {value!r} must be 1 to {room} bytes without NUL "
                    f"(PostgreSQL names are at most {_MAX_NAME} bytes, and the staging table adds "
                    f"{STAGING_SUFFIX!r}). Fix: choose a shorter name."
                )
        self.location = PgLocation(uri, schema, table)
        #: what :meth:`record` keeps for a column not added yet (name -> value)
        self._pending: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"PgVectorTable({self.location.url!r})"

    def __dask_tokenize__(self) -> tuple:
        return ("PgVectorTable", self.location.url)

    def __reduce__(self) -> tuple:
        """Pickle with the redacted URI: a password the URI holds stays in this process (:data:`_SECRETS`,
        where a copy unpickled here finds it; workers get it from :func:`secrets_plugin`)."""
        key, secret = redact_uri(self.location.uri), self._secret()
        if secret:
            _SECRETS[key] = secret
        return (_rebuild, (key, self.location.schema, self.location.table, self.unlogged))

    def keeps_rows(self, op: str) -> bool:
        """True when another writer's operation ``op`` leaves every committed row in place."""
        return op in KEEPS_ROWS

    def check_target(self, store: Any, run_id: str, mode: str, detect: Any) -> None:
        """Before any work: the server is reachable and has the pgvector extension (created where it is
        missing and the role may; else one line says who must), then what every table output refuses
        (:meth:`.base.TableOutput.check_target`)."""
        with self._session() as conn:
            self._ensure_extension(conn)
        super().check_target(store, run_id, mode, detect)

    # -- connections -----------------------------------------------------------------------------

    def _secret(self) -> str | None:
        """The password of the URI, else the one this process was given for it (:data:`_SECRETS`)."""
        psycopg, _ = _modules()
        try:
            params = psycopg.conninfo.conninfo_to_dict(self.location.uri)
        except psycopg.Error:
            return None
        return params.get("password") or _SECRETS.get(redact_uri(self.location.uri)) or None

    def _scrub(self, text: Any) -> str:
        """``text`` on one line, without the URI's password anywhere in it."""
        out = _one_line(str(text)).replace(self.location.uri, redact_uri(self.location.uri))
        secret = self._secret()  # libpq prints no password; this is for what a server might echo
        return out.replace(secret, "***") if secret and len(secret) >= 4 else out

    def _where(self) -> str:
        psycopg, _ = _modules()
        try:
            params = psycopg.conninfo.conninfo_to_dict(self.location.uri)
        except psycopg.Error:
            params = {}
        host = params.get("host") or params.get("hostaddr") or os.environ.get("PGHOST") or "localhost"
        port = params.get("port") or os.environ.get("PGPORT") or "5432"
        return f"{host}:{port}" if not str(host).startswith("/") else f"{host} (socket, port {port})"

    @contextmanager
    def _session(self, *, vectors: bool = False) -> Iterator[Any]:
        """A connection (autocommit: transactions are explicit) closed on exit; ``vectors``: with
        pgvector's types registered (the extension exists)."""
        psycopg, pgv = _modules()
        try:
            params = psycopg.conninfo.conninfo_to_dict(self.location.uri)
        except psycopg.Error:
            params = {}
        extra = {
            k: v
            for k, v in (("connect_timeout", "10"), ("application_name", "dask-surge"))
            if k not in params
        }
        if "password" not in params and redact_uri(self.location.uri) in _SECRETS:  # kept out of the URI
            extra["password"] = _SECRETS[redact_uri(self.location.uri)]
        try:
            conn = psycopg.connect(self.location.uri, autocommit=True, **extra)
        except psycopg.Error as err:
            why = self._scrub(err)
            fix = (
                "give the role's password through PGPASSWORD or ~/.pgpass (not the URI), or check the user name"
                if "password" in why or "authentication" in why
                else "start the server or correct the host and port in the URI; give a password through "
                "PGPASSWORD or ~/.pgpass, not the URI"
            )
            raise SurgeOutputError(
                f"cannot connect to PostgreSQL at {self._where()} for the pgvector output "
                f"{self.location.url!r}: {why}. Fix: {fix}."
            ) from None
        try:
            # a process paused inside a transaction (holding the table's lock) is rolled back by the
            # server; a lock held elsewhere for long is a refused commit, not a hang
            conn.execute("SET idle_in_transaction_session_timeout = '120s'")
            conn.execute("SET lock_timeout = '60s'")
            if vectors:
                pgv.register_vector(conn)
            yield conn
        finally:
            conn.close()

    def _names(self, sql: Any) -> dict[str, Any]:
        s, t = self.location.schema, self.location.table
        return {
            "target": sql.Identifier(s, t),
            "staging": sql.Identifier(s, t + STAGING_SUFFIX),
            "tables": sql.Identifier(s, TABLES),
            "versions": sql.Identifier(s, VERSIONS),
            "commits": sql.Identifier(s, COMMITS),
        }

    def _regclass(self, conn: Any, *parts: str) -> bool:
        from psycopg import sql

        name = sql.Identifier(*parts).as_string(conn)
        return conn.execute("SELECT to_regclass(%s) IS NOT NULL", (name,)).fetchone()[0]

    def _ensure_extension(self, conn: Any) -> str:
        """The schema pgvector's types are in; creates the extension when missing (or says how)."""
        psycopg, _ = _modules()
        sel = (
            "SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace "
            "WHERE e.extname = 'vector'"
        )
        row = conn.execute(sel).fetchone()
        if row is not None:
            return str(row[0])
        db = conn.info.dbname
        if conn.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'").fetchone() is None:
            raise SurgeOutputError(
                f"the PostgreSQL server at {self._where()} has no pgvector extension (no 'vector' among its "
                "available extensions). Nothing was written. Fix: install pgvector on the server (the "
                "postgresql-<version>-pgvector package, or the pgvector/pgvector image), then rerun."
            )
        try:
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        except psycopg.errors.InsufficientPrivilege:
            raise SurgeOutputError(
                f"the pgvector extension is not created in database {db!r} at {self._where()}, and role "
                f"{conn.info.user!r} may not create it. Nothing was written. Fix: have a superuser run "
                f"`CREATE EXTENSION vector;` in database {db!r}, then rerun."
            ) from None
        except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateObject):
            pass  # created by another process meanwhile
        return str(conn.execute(sel).fetchone()[0])

    def _ddl(self, conn: Any, statements: Sequence[Any], present: Any = None) -> None:
        """Run ``CREATE`` statements in one transaction, unless ``present()`` says their work is done;
        retried when a concurrent creator wins the race (PostgreSQL raises a unique violation then)."""
        psycopg, _ = _modules()
        for tries in range(5):
            if present is not None and present():
                return
            try:
                with conn.transaction():
                    for statement in statements:
                        conn.execute(statement)
                return
            except (
                psycopg.errors.UniqueViolation,
                psycopg.errors.DuplicateTable,
                psycopg.errors.DuplicateObject,
            ):
                if tries == 4:
                    raise
                time.sleep(0.05 * 2**tries)
            except psycopg.errors.InsufficientPrivilege as err:
                raise SurgeOutputError(
                    f"role {conn.info.user!r} may not create tables in schema {self.location.schema!r} of "
                    f"{self.location.url!r} ({self._scrub(err)}). Nothing was written. Fix: have the schema's owner run "
                    f"`GRANT CREATE ON SCHEMA {self.location.schema} TO {conn.info.user};`, or choose a schema "
                    "the role owns."
                ) from None

    def _ensure(self, conn: Any) -> str:
        """The extension, the schema and the bookkeeping tables exist; returns pgvector's schema."""
        from psycopg import sql

        ext = self._ensure_extension(conn)
        n = self._names(sql)
        statements = []
        if (
            conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (self.location.schema,)).fetchone()
            is None
        ):
            statements.append(
                sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self.location.schema))
            )
        if not all(self._regclass(conn, self.location.schema, t) for t in (TABLES, VERSIONS, COMMITS)):
            statements += [
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (tbl text PRIMARY KEY, version bigint NOT NULL, "
                    "arrow_schema text, dim integer)"
                ).format(n["tables"]),
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (tbl text NOT NULL, version bigint NOT NULL, run text NOT NULL, "
                    "token text NOT NULL, superbatches jsonb NOT NULL, repaired jsonb NOT NULL DEFAULT '[]', "
                    "op text NOT NULL, rows bigint NOT NULL DEFAULT 0, at timestamptz NOT NULL DEFAULT now(), "
                    "PRIMARY KEY (tbl, version))"
                ).format(n["versions"]),
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (tbl text NOT NULL, run text NOT NULL, sb text NOT NULL, "
                    "version bigint NOT NULL, token text NOT NULL, PRIMARY KEY (tbl, run, sb))"
                ).format(n["commits"]),
            ]
        if statements:
            self._ddl(conn, statements)
        return ext

    def _column_defs(self, ext: str, columns: Sequence[_Column]) -> Any:
        from psycopg import sql

        defs = []
        for c in columns:
            kind: Any
            if c.kind == "scalar":
                kind = sql.SQL(c.ddl)  # one of _scalar's own fixed names
            else:
                dim = int(c.ddl[c.ddl.index("(") + 1 : -1])
                kind = sql.SQL("{}({})").format(sql.Identifier(ext, c.kind), sql.Literal(dim))
            defs.append(sql.SQL("{} {}").format(sql.Identifier(c.name), kind))
        return sql.SQL(", ").join(defs)

    def _columns_now(self, conn: Any, name: str) -> list[tuple[str, str]]:
        """``(column, type)`` of table ``name`` of the schema, as :class:`_Column` spells types."""
        from psycopg import sql

        rows = conn.execute(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = "
            "to_regclass(%s) AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            (sql.Identifier(self.location.schema, name).as_string(conn),),
        ).fetchall()
        out = []
        for col, kind in rows:
            last = kind.rsplit(".", 1)[-1]
            out.append((col, last if last.startswith(("vector(", "halfvec(")) else kind))
        return out

    def _ensure_staging(self, conn: Any, ext: str, columns: Sequence[_Column]) -> None:
        from psycopg import sql

        name = self.location.table + STAGING_SUFFIX
        want = [("surge_key", "text"), *[(c.name, c.ddl) for c in columns]]
        staging = self._names(sql)["staging"]
        self._ddl(
            conn,
            [
                sql.SQL("CREATE {} TABLE {} (surge_key text NOT NULL, {})").format(
                    sql.SQL("UNLOGGED" if self.unlogged else ""), staging, self._column_defs(ext, columns)
                ),
                # unnamed: PostgreSQL picks a name no other index of the schema has
                sql.SQL("CREATE INDEX ON {} (surge_key)").format(staging),
            ],
            present=lambda: self._regclass(conn, self.location.schema, name),
        )
        have = self._columns_now(conn, name)
        if have != want:
            raise SurgeOutputError(
                f"the staging table {self.location.schema}.{name} of {self.location.url!r} has columns "
                f"{have[1:]}, but this run writes {want[1:]}. Nothing was written. Fix: write to a new table, "
                "or drop the staging table when no run is writing (it holds uncommitted rows only)."
            )

    # -- the worker's side -----------------------------------------------------------------------

    def exists(self) -> bool:
        """True when the output table exists."""
        with self._session() as conn:
            return self._regclass(conn, self.location.schema, self.location.table)

    def write(self, data: pa.Table) -> str:
        """COPY ``data``'s rows into the staging table under a new random key, in a transaction of its
        own (no reader of the output table sees them); returns the payload (JSON: the key, the rows,
        the embedding's dimensions and the Arrow schema; no URI)."""
        from psycopg import sql

        emb = data.schema.field("embedding").type if "embedding" in data.schema.names else None
        dim = None
        if emb is not None and not pa.types.is_fixed_size_list(emb):  # a list: its length, from the data
            lengths = pc.list_value_length(data.column("embedding")).drop_null().unique().to_pylist()
            if len(lengths) > 1:
                raise SurgeOutputError(
                    f"the 'embedding' column holds vectors of {sorted(lengths)[:5]} dimensions; a pgvector "
                    "column holds one. Nothing was written. Fix: encode with one model and dimensions=."
                )
            dim = int(lengths[0]) if lengths else None
        columns = _columns(data.schema, dim)
        key = uuid.uuid4().hex
        values = [
            _embedding_rows(data.column(c.name), c.kind)
            if c.kind != "scalar"
            else data.column(c.name).to_pylist()
            for c in columns
        ]
        staging = self._names(sql)["staging"]
        copy_sql = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(
            staging, sql.SQL(", ").join(sql.Identifier(n) for n in ["surge_key", *(c.name for c in columns)])
        )
        halves = [i for i, c in enumerate(columns) if c.kind == "halfvec"]
        psycopg, _ = _modules()
        with self._session() as conn:
            ext = self._ensure(conn)
            self._ensure_staging(conn, ext, columns)
            from pgvector import HalfVector
            from pgvector.psycopg import register_vector

            register_vector(conn)
            for i in halves:
                values[i] = [None if v is None else HalfVector(v) for v in values[i]]
            try:
                with conn.transaction(), conn.cursor() as cur, cur.copy(copy_sql) as copy:
                    copy.set_types(["text", *(c.copy for c in columns)])
                    for row in zip(*values, strict=True):
                        copy.write_row((key, *row))
            except psycopg.errors.DataException as err:
                raise SurgeOutputError(
                    f"PostgreSQL refused a value of this SuperBatch for {self.location.url!r} "
                    f"({self._scrub(err)}). Nothing was written. Fix: pgvector stores no NaN or infinity: "
                    "check the model's output (float16 overflows past 65504: pass precision='float32')."
                ) from None
        payload = {"key": key, "rows": data.num_rows, "schema": schema_text(data.schema)}
        if dim is not None:
            payload["dim"] = dim
        return json.dumps(payload, sort_keys=True)

    # -- the claim holder's side -------------------------------------------------------------------

    def _adopted(self, conn: Any) -> int | None:
        """The table's version in ``surge_tables`` (None: dask-surge has no row for it)."""
        from psycopg import sql

        if not self._regclass(conn, self.location.schema, TABLES):
            return None
        row = conn.execute(
            sql.SQL("SELECT version FROM {} WHERE tbl = %s").format(self._names(sql)["tables"]),
            (self.location.table,),
        ).fetchone()
        return None if row is None else int(row[0])

    def history(self, run_id: str, since: int = 0) -> History:
        """What the table's versions after ``since`` say: the SuperBatches each version of run ``run_id``
        holds, and the versions other runs made (one consistent snapshot)."""
        from psycopg import sql

        n = self._names(sql)
        with self._session() as conn, conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            if not self._regclass(conn, self.location.schema, self.location.table):
                return History(exists=False)
            version = self._adopted(conn)
            if version is None:  # a table dask-surge did not create: one version, another writer's
                out = History(exists=True, version=1)
                if since < 1:
                    out.note_foreign()
                    out.foreign.append((1, "CREATE TABLE", ""))
                return out
            rows = conn.execute(
                sql.SQL(
                    "SELECT version, run, token, superbatches, repaired, op FROM {} WHERE tbl = %s AND "
                    "version > %s ORDER BY version"
                ).format(n["versions"]),
                (self.location.table, since),
            ).fetchall()
        out = History(exists=True, version=version)
        for v, run, token, sbs, repaired, op in rows:
            if run == run_id:
                out.add_ours(int(v), list(sbs), op, token, repaired=list(repaired))
            else:
                out.note_foreign()
                out.foreign.append((int(v), op, run))
        return out

    def table_version(self) -> int | None:
        """The table's version now (None: no table): every commit of any run moves it."""
        with self._session() as conn:
            if not self._regclass(conn, self.location.schema, self.location.table):
                return None
            version = self._adopted(conn)
            return 1 if version is None else version

    def version_rows(self) -> list[tuple[int, float, int]]:
        """``(version, commit time in epoch seconds, rows)`` of each version dask-surge made, oldest
        first (rows: what the versions up to it added)."""
        from psycopg import sql

        with self._session() as conn:
            if self._adopted(conn) is None:
                return []
            rows = conn.execute(
                sql.SQL(
                    "SELECT version, extract(epoch FROM at)::float8, sum(rows) OVER (ORDER BY version) FROM {} "
                    "WHERE tbl = %s ORDER BY version"
                ).format(self._names(sql)["versions"]),
                (self.location.table,),
            ).fetchall()
        return [(int(v), float(at), int(r)) for v, at, r in rows]

    def data_files(self) -> list[tuple[str, int | None]]:
        """A database table has no data files of its own to list: empty."""
        return []

    def check_schema(self, payload: str) -> None:
        """Refuse ``payload``'s rows when their columns differ from the table's."""
        mine = [(c.name, c.ddl) for c in _payload_columns(json.loads(payload))]
        with self._session() as conn:
            if not self._regclass(conn, self.location.schema, self.location.table):
                return
            table = self._columns_now(conn, self.location.table)
        if mine != table:
            raise SurgeOutputError(
                f"the PostgreSQL table {self.location.url!r} has columns {table}, but this run writes {mine}. "
                "Nothing was committed to it. Fix: append only runs with the same columns (keep=, model, "
                "precision), or write to a new table."
            )

    def _bump(
        self,
        conn: Any,
        run_id: str,
        token: str,
        read_version: int,
        op: str,
        sbs: Sequence[str] = (),
        rows: int = 0,
        repaired: Sequence[str] = (),
    ) -> int:
        """Inside the caller's transaction: lock the table's version row, refuse when a version of the
        run came after ``read_version``, record the new version; returns it."""
        from psycopg import sql
        from psycopg.types.json import Jsonb

        n, t = self._names(sql), self.location.table
        lock = sql.SQL("SELECT version FROM {} WHERE tbl = %s FOR UPDATE").format(n["tables"])
        row = conn.execute(lock, (t,)).fetchone()
        if row is None:  # the first version dask-surge makes of a table it did not create
            if not self._regclass(conn, self.location.schema, t):
                raise CommitConflict(f"the table {self.location.url!r} is gone")
            cur = conn.execute(
                sql.SQL("INSERT INTO {} (tbl, version) VALUES (%s, 1) ON CONFLICT DO NOTHING").format(
                    n["tables"]
                ),
                (t,),
            )
            if cur.rowcount == 1:
                conn.execute(
                    sql.SQL(
                        "INSERT INTO {} (tbl, version, run, token, superbatches, op) VALUES "
                        "(%s, 1, '', '', '[]', 'CREATE TABLE')"
                    ).format(n["versions"]),
                    (t,),
                )
            row = conn.execute(lock, (t,)).fetchone()
        current = int(row[0])
        last = conn.execute(
            sql.SQL("SELECT coalesce(max(version), 0) FROM {} WHERE tbl = %s AND run = %s").format(
                n["versions"]
            ),
            (t, run_id),
        ).fetchone()[0]
        if int(last) > read_version:
            raise CommitConflict(
                f"version {last} of run {run_id} came after version {read_version}, which this commit read "
                f"(the table {self.location.url!r} is at {current})"
            )
        version = current + 1
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (tbl, version, run, token, superbatches, repaired, op, rows) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s)"
            ).format(n["versions"]),
            (t, version, run_id, token, Jsonb(sorted(sbs)), Jsonb(sorted(repaired)), op, rows),
        )
        conn.execute(sql.SQL("UPDATE {} SET version = %s WHERE tbl = %s").format(n["tables"]), (version, t))
        return version

    def fence(self, run_id: str, token: str, read_version: int, payload: str) -> int:
        """Make the version that begins the commits of the claim holder ``token``: create the table
        (``read_version`` 0; refused when one exists) or a version holding no SuperBatch, after
        ``read_version`` (refused when a version of the run came after it). Returns the new version;
        raises :class:`~.base.CommitConflict` when refused."""
        psycopg, _ = _modules()
        from psycopg import sql

        n, t = self._names(sql), self.location.table
        with self._session() as conn:
            ext = self._ensure(conn)
            try:
                with conn.transaction():
                    if read_version > 0:
                        return self._bump(conn, run_id, token, read_version, "FENCE")
                    if self._regclass(conn, self.location.schema, t):
                        raise CommitConflict(f"a table was created at {self.location.url!r} meanwhile")
                    facts = json.loads(payload)
                    schema = schema_of(facts["schema"])
                    columns = _columns(schema, facts.get("dim"))
                    for table in (n["versions"], n["commits"], n["tables"]):  # a dropped table's records
                        conn.execute(sql.SQL("DELETE FROM {} WHERE tbl = %s").format(table), (t,))
                    conn.execute(
                        sql.SQL("CREATE TABLE {} ({})").format(n["target"], self._column_defs(ext, columns))
                    )
                    conn.execute(
                        sql.SQL(
                            "INSERT INTO {} (tbl, version, arrow_schema, dim) VALUES (%s, 0, %s, %s)"
                        ).format(n["tables"]),
                        (t, facts["schema"], facts.get("dim")),
                    )
                    return self._bump(conn, run_id, token, 0, "CREATE")
            except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateTable) as err:
                raise CommitConflict(
                    f"the table {self.location.url!r} was created meanwhile ({self._scrub(err)})"
                ) from None
            except psycopg.errors.LockNotAvailable as err:
                raise CommitConflict(f"the table's version row stayed locked ({self._scrub(err)})") from None

    def commit(self, run_id: str, token: str, batch: Sequence[tuple[str, str]], read_version: int) -> int:
        """Move the staged rows of ``batch`` (``(sb, payload)`` pairs) into the table and record them,
        in one transaction, as one version of ``run_id`` made by ``token``, read at ``read_version``.
        Returns the new version; raises :class:`~.base.CommitConflict` when a version of the run came
        after ``read_version`` or a SuperBatch of the batch is committed already (nothing lands)."""
        psycopg, _ = _modules()
        from psycopg import sql

        n, t = self._names(sql), self.location.table
        facts = [(sb, json.loads(p)) for sb, p in batch]
        sbs = [sb for sb, _ in facts]
        keys = [f["key"] for _, f in facts]
        rows = sum(int(f["rows"]) for _, f in facts)
        names = sql.SQL(", ").join(sql.Identifier(c.name) for c in _payload_columns(facts[0][1]))
        with self._session() as conn:
            try:
                with conn.transaction():
                    version = self._bump(conn, run_id, token, read_version, "APPEND", sbs, rows)
                    conn.execute(
                        sql.SQL(
                            "INSERT INTO {} (tbl, run, sb, version, token) SELECT %s, %s, unnest(%s::text[]), %s, %s"
                        ).format(n["commits"]),
                        (t, run_id, sbs, version, token),
                    )
                    moved = conn.execute(
                        sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {} WHERE surge_key = ANY(%s)").format(
                            n["target"], names, names, n["staging"]
                        ),
                        (keys,),
                    ).rowcount
                    if moved != rows:
                        raise SurgeOutputError(
                            f"the staging table of {self.location.url!r} holds {moved} of the {rows} staged rows of "
                            f"SuperBatch(es) {sbs[:5]} (dropped or emptied since they were written? a server crash "
                            "empties an UNLOGGED staging table). Nothing was "
                            "committed. Fix: write to a new table (or delete this run's _surge/ records so its "
                            "SuperBatches are encoded again)."
                        )
                    conn.execute(
                        sql.SQL("DELETE FROM {} WHERE surge_key = ANY(%s)").format(n["staging"]), (keys,)
                    )
            except psycopg.errors.UniqueViolation as err:
                raise CommitConflict(
                    f"the table {self.location.url!r} holds SuperBatch(es) of {sbs[:5]} already ({self._scrub(err)})"
                ) from None
            except psycopg.errors.LockNotAvailable as err:
                raise CommitConflict(f"the table's version row stayed locked ({self._scrub(err)})") from None
        return version

    def repair(self, run_id: str, token: str, superbatches: list[str], read_version: int) -> int:
        """Record that ``superbatches`` are held once. ``surge_commits``' primary key lets no SuperBatch
        in twice, so there is no second copy to remove: one version naming them, read at
        ``read_version``. Returns it."""
        psycopg, _ = _modules()
        with self._session() as conn:
            try:
                with conn.transaction():
                    return self._bump(conn, run_id, token, read_version, "REPAIR", repaired=superbatches)
            except psycopg.errors.LockNotAvailable as err:
                raise CommitConflict(f"the table's version row stayed locked ({self._scrub(err)})") from None

    # -- readers -----------------------------------------------------------------------------------

    def _vector_column(self, conn: Any) -> tuple[str, int]:
        """``(kind, dimensions)`` of the table's ``embedding`` column."""
        for col, kind in self._columns_now(conn, self.location.table):
            if col == "embedding" and kind.startswith(("vector(", "halfvec(")):
                name, _, d = kind.partition("(")
                return name, int(d.rstrip(")"))
        raise SurgeOutputError(
            f"the table {self.location.url!r} has no pgvector 'embedding' column. Fix: pass a dask-surge "
            "pgvector output."
        )

    def read(self) -> pa.Table:
        """Every committed row, ordered by ``(partition, row)`` when the table has them, as Arrow (the
        schema the run wrote; ``embedding`` a ``fixed_size_list`` of float32 or float16)."""
        from psycopg import sql

        with self._session() as conn:
            if not self._regclass(conn, self.location.schema, self.location.table):
                raise SurgeOutputError(f"no table at {self.location.url!r}. Fix: pass the output of a run.")
            self._ensure_extension(conn)
            from pgvector.psycopg import register_vector

            register_vector(conn)
            stored = None
            if self._adopted(conn) is not None:
                row = conn.execute(
                    sql.SQL("SELECT arrow_schema FROM {} WHERE tbl = %s").format(self._names(sql)["tables"]),
                    (self.location.table,),
                ).fetchone()
                stored = schema_of(row[0]) if row and row[0] else None
            have = [c for c, _ in self._columns_now(conn, self.location.table)]
            order = [c for c in ("partition", "row") if c in have]
            query = sql.SQL("SELECT {} FROM {}").format(
                sql.SQL(", ").join(sql.Identifier(c) for c in have), self._names(sql)["target"]
            )
            if order:
                query += sql.SQL(" ORDER BY {}").format(sql.SQL(", ").join(sql.Identifier(c) for c in order))
            with conn.cursor(binary=True) as cur:
                cur.execute(query)
                rows = cur.fetchall()
                kinds = dict(self._columns_now(conn, self.location.table))
        columns = list(zip(*rows, strict=True)) if rows else [() for _ in have]
        arrays = {}
        for name, values in zip(have, columns, strict=True):
            kind = kinds[name]
            if kind.startswith(("vector(", "halfvec(")):
                d = int(kind[kind.index("(") + 1 : -1])
                dtype = np.float16 if kind.startswith("halfvec") else np.float32
                flat = np.concatenate(
                    [
                        np.zeros(d, dtype) if v is None else v.to_numpy().astype(dtype, copy=False)
                        for v in values
                    ]
                    or [np.zeros(0, dtype)]
                )
                mask = pa.array([v is None for v in values], pa.bool_()) if None in values else None
                arrays[name] = pa.FixedSizeListArray.from_arrays(pa.array(flat), d, mask=mask)
            else:
                arrays[name] = pa.array(list(values))
        if stored is not None and stored.names == have:
            out = [
                arrays[f.name].cast(f.type) if arrays[f.name].type != f.type else arrays[f.name]
                for f in stored
            ]
            return pa.Table.from_arrays(out, schema=stored)
        if not rows:
            return pa.table({name: pa.array([], _arrow_of(kinds[name])) for name in have})
        return pa.table(arrays)

    # -- a column merged into an existing table (dask_surge.backfill) -----------------------------

    def _missing_table(self) -> SurgeOutputError:
        return SurgeOutputError(
            f"there is no table {self.location.schema}.{self.location.table} at {self.location.url!r}; a "
            "backfill adds a vector column to a table that exists. Nothing was written. Fix: pass table= an "
            "existing table ('name' or 'schema.name'), or create it first (encode(..., format='pgvector') "
            "makes a new table of embeddings)."
        )

    def dataset(self) -> _PgScan:
        """The table as a backfill scans it (:class:`_PgScan`: its Arrow ``schema`` and ``to_table``);
        the pgvector extension is created where it is missing (or one line says who must) before
        anything is encoded. An error naming the fix when there is no such table."""
        with self._session() as conn:
            if not self._regclass(conn, self.location.schema, self.location.table):
                raise self._missing_table()
            self._ensure_extension(conn)
            return _PgScan(self, self._columns_now(conn, self.location.table))

    def vector_shape(self, column: str, kind: pa.DataType) -> tuple[pa.DataType | None, int | None]:
        """``(value type, dimension)`` of the vectors ``column`` (of Arrow type ``kind``, as
        :class:`_PgScan` maps ``vector(d)`` and ``halfvec(d)``) holds; a ``vector`` without a declared
        dimension: ``(float32, None)``; anything else ``(None, None)``."""
        if pa.types.is_fixed_size_list(kind):
            return kind.value_type, kind.list_size
        if pa.types.is_list(kind) and (
            pa.types.is_float32(kind.value_type) or pa.types.is_float16(kind.value_type)
        ):
            return kind.value_type, None
        return None, None

    def holds(self, kind: pa.DataType) -> bool:
        """True for float32 (``vector``) and float16 (``halfvec``) vectors: pgvector's dense types."""
        return pa.types.is_float32(kind) or pa.types.is_float16(kind)

    def _comments(self, conn: Any) -> dict[str, dict]:
        """column -> the JSON object its comment holds (columns whose comment is not one are left out)."""
        from psycopg import sql

        rows = conn.execute(
            "SELECT a.attname, col_description(a.attrelid, a.attnum) FROM pg_attribute a WHERE a.attrelid = "
            "to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped",
            (self._names(sql)["target"].as_string(conn),),
        ).fetchall()
        out = {}
        for col, text in rows:
            try:
                facts = json.loads(text) if text else None
            except ValueError:
                continue
            if isinstance(facts, dict):
                out[col] = facts
        return out

    def recorded(self, name: str) -> str | None:
        """The value ``name`` holds in the comment of the column it names (:func:`_recorded_column`):
        ``COMMENT ON COLUMN`` holds a JSON object ``{name: value}``; None: not recorded."""
        column = _recorded_column(name)
        with self._session() as conn:
            facts = self._comments(conn).get(column, {})
        if name not in facts:
            return None
        value = facts[name]
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)

    def record(self, name: str, value: str) -> int:
        """Record ``value`` as ``name`` in the comment of the column ``name`` names (one transaction;
        returns 1). Where that column does not exist yet, the comment is made in the transaction that
        adds it (the first :meth:`merge_chunk`), so a column is never without its record (returns 0)."""
        column = _recorded_column(name)
        with self._session() as conn:
            if column not in dict(self._columns_now(conn, self.location.table)):
                self._pending[name] = value
                return 0
            with conn.transaction():
                self._comment(conn, column, {name: value})
        return 1

    def _comment(self, conn: Any, column: str, values: dict[str, str]) -> None:
        """Inside the caller's transaction: set ``values`` in the JSON object ``column`` 's comment holds."""
        from psycopg import sql

        facts = {**self._comments(conn).get(column, {}), **_json_values(values)}
        conn.execute(
            sql.SQL("COMMENT ON COLUMN {}.{} IS {}").format(
                self._names(sql)["target"],
                sql.Identifier(column),
                sql.Literal(json.dumps(facts, sort_keys=True)),
            )
        )

    def merge_chunk(self, chunk: pa.Table, key: str, props: dict[str, str]) -> int:
        """Merge ``chunk`` into the table on ``key``: where its vector or hash column is missing, one
        transaction adds it (``vector(d)`` / ``halfvec(d)``, ``bytea``; nullable, no default: a
        catalog change only, its lock held for an instant) with the comment :meth:`record` kept for it;
        then ONE transaction binary-COPYs ``chunk`` into a temporary table and ``UPDATE`` s the table's
        rows from it, joined on ``key``: readers see the chunk whole or not at all. ``props`` (the
        backfill's JSON) is that transaction's ``dask_surge.backfill`` setting (a trigger's
        ``current_setting`` sees it). Returns the transactions made (1 or 2)."""
        psycopg, _ = _modules()
        from pgvector import HalfVector
        from pgvector.psycopg import register_vector
        from psycopg import sql

        target = self._names(sql)["target"]
        vector = next(f for f in chunk.schema if pa.types.is_fixed_size_list(f.type))
        rest = [f for f in chunk.schema if f.name not in (key, vector.name)]
        kind = "halfvec" if pa.types.is_float16(vector.type.value_type) else "vector"
        dim = vector.type.list_size
        stage = sql.Identifier(f"surge_backfill_{uuid.uuid4().hex[:12]}")
        made = 0
        with self._session() as conn:
            ext = self._ensure_extension(conn)
            register_vector(conn)
            have = dict(self._columns_now(conn, self.location.table))
            if key not in have:
                raise SurgeOutputError(
                    f"the key column {key!r} of {self.location.url!r} is gone (it has {sorted(have)}). Nothing of "
                    "this chunk was written. Fix: pass key= one of its columns."
                )
            native = _KEY_COPY.get(_base_type(have[key]))
            missing = [f for f in (vector, *rest) if f.name not in have]
            try:
                if missing:
                    with conn.transaction():
                        for f in missing:
                            kind_sql = (
                                sql.SQL("{}({})").format(sql.Identifier(ext, kind), sql.Literal(dim))
                                if f is vector
                                else sql.SQL("bytea")
                            )
                            conn.execute(
                                sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {}").format(
                                    target, sql.Identifier(f.name), kind_sql
                                )
                            )
                        pending = {
                            n: v for n, v in self._pending.items() if _recorded_column(n) == vector.name
                        }
                        if pending:
                            self._comment(conn, vector.name, pending)
                    made += 1
                    for n in pending:  # recorded with the column: nothing left to keep for it
                        del self._pending[n]
                with conn.transaction():
                    conn.execute(
                        "SELECT set_config('dask_surge.backfill', %s, true)",
                        (json.dumps(_json_values(props), sort_keys=True),),
                    )
                    k = sql.Identifier(key)
                    conn.execute(
                        sql.SQL(
                            "CREATE TEMPORARY TABLE {} ON COMMIT DROP AS SELECT {} AS k, {} FROM {} WITH NO DATA"
                        ).format(
                            stage,
                            k if native else sql.SQL("{}::text").format(k),
                            sql.SQL(", ").join(sql.Identifier(f.name) for f in (vector, *rest)),
                            target,
                        )
                    )
                    names = ["k", vector.name, *(f.name for f in rest)]
                    copy_sql = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(
                        stage, sql.SQL(", ").join(sql.Identifier(n) for n in names)
                    )
                    keys = chunk.column(key).to_pylist()
                    vectors = _embedding_rows(chunk.column(vector.name), kind)
                    if kind == "halfvec":
                        vectors = [None if v is None else HalfVector(v) for v in vectors]
                    columns = [keys, vectors, *(chunk.column(f.name).to_pylist() for f in rest)]
                    with conn.cursor() as cur, cur.copy(copy_sql) as copy:
                        copy.set_types([native or "text", kind, *("bytea" for _ in rest)])
                        for row in zip(*columns, strict=True):
                            copy.write_row(row)
                    on = sql.SQL("t.{} = s.k" if native else "t.{}::text = s.k").format(k)
                    conn.execute(
                        sql.SQL("UPDATE {} AS t SET {} FROM {} AS s WHERE {}").format(
                            target,
                            sql.SQL(", ").join(
                                sql.SQL("{} = s.{}").format(sql.Identifier(n), sql.Identifier(n))
                                for n in names[1:]
                            ),
                            stage,
                            on,
                        )
                    )
                made += 1
            except psycopg.Error as err:
                raise SurgeOutputError(
                    f"PostgreSQL refused a backfill chunk of {self.location.url!r} ({self._scrub(err)}). Nothing of "
                    "this chunk was written (the chunks before it are in). Fix: correct what it names, then rerun "
                    "the same backfill: it continues with the rows still missing."
                ) from None
        return made

    # -- index and search --------------------------------------------------------------------------

    def build_index(self, metric: str = "cosine", *, m: int = 16, ef_construction: int = 64) -> str:
        """Build an HNSW index of ``embedding`` for ``metric`` (``"cosine"``, ``"l2"`` or ``"dot"``),
        ``CREATE INDEX CONCURRENTLY`` (writers go on meanwhile); an invalid index left by a failed build
        is dropped first. Returns the index's name."""
        from psycopg import sql

        _, ops = _metric(metric)
        name = self.location.table + _INDEX_SUFFIX[metric]
        with self._session() as conn:
            ext = self._ensure_extension(conn)
            kind, dim = self._vector_column(conn)
            most = 2000 if kind == "vector" else 4000
            if dim > most:
                raise SurgeOutputError(
                    f"pgvector's HNSW index takes {kind} columns of up to {most} dimensions, and "
                    f"{self.location.url!r} has {dim}. Fix: encode with precision='float16' (halfvec: up to "
                    "4000), or fewer dimensions (dimensions=)."
                )
            index = sql.Identifier(self.location.schema, name)
            valid = conn.execute(
                "SELECT i.indisvalid FROM pg_index i WHERE i.indexrelid = to_regclass(%s)",
                (index.as_string(conn),),
            ).fetchone()
            if valid is not None and not valid[0]:
                conn.execute(sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(index))
            conn.execute(
                sql.SQL(
                    "CREATE INDEX CONCURRENTLY IF NOT EXISTS {} ON {} USING hnsw (embedding {}) "
                    "WITH (m = {}, ef_construction = {})"
                ).format(
                    sql.Identifier(name),
                    self._names(sql)["target"],
                    sql.Identifier(ext, f"{kind}_{ops}"),
                    sql.Literal(int(m)),
                    sql.Literal(int(ef_construction)),
                )
            )
        return name

    def _search_sql(
        self, conn: Any, metric: str, k: int, columns: Sequence[str] = ("partition", "row")
    ) -> Any:
        """The statement of the ``k`` nearest rows' ``columns`` and pgvector's distance (last), ordered by
        pgvector's own operator (what an HNSW index serves); the query vector is its two parameters."""
        from psycopg import sql

        op, _ = _metric(metric)
        ext = self._ensure_extension(conn)
        kind, _ = self._vector_column(conn)
        distance = sql.SQL("embedding OPERATOR({}.{}) CAST(%s AS {})").format(
            sql.Identifier(ext), sql.SQL(op), sql.Identifier(ext, kind)
        )
        return sql.SQL("SELECT {}{} AS surge_distance FROM {} ORDER BY {} LIMIT {}").format(
            sql.SQL("").join(sql.SQL("{}, ").format(sql.Identifier(c)) for c in columns),
            distance,
            self._names(sql)["target"],
            distance,
            sql.Literal(int(k)),
        )

    # -- the index as every output's (dask_surge.io.index) ----------------------------------------

    def columns(self) -> list[str]:
        """The names of the table's columns."""
        with self._session() as conn:
            return [c for c, _ in self._columns_now(conn, self.location.table)]

    def read_rows(self, keys: Any, on: list[str], columns: list[str]) -> Any:
        """The ``on`` + ``columns`` of the rows whose ``on`` values (integers: ``partition``, ``row``,
        ``chunk``) ``keys`` (a pandas frame) names: one statement joining the table to the keys."""
        import pandas as pd
        from psycopg import sql

        wanted = [*on, *columns]
        alias = [sql.Identifier(f"k{i}") for i in range(len(on))]
        query = sql.SQL("SELECT {} FROM {} AS t JOIN unnest({}) AS k({}) ON {}").format(
            sql.SQL(", ").join(sql.SQL("t.{}").format(sql.Identifier(c)) for c in wanted),
            self._names(sql)["target"],
            sql.SQL(", ").join(sql.SQL("%s::bigint[]") for _ in on),
            sql.SQL(", ").join(alias),
            sql.SQL(" AND ").join(
                sql.SQL("t.{} = k.{}").format(sql.Identifier(c), a) for c, a in zip(on, alias, strict=True)
            ),
        )
        params = [[int(v) for v in keys[c]] for c in on]
        with self._session(vectors="embedding" in columns) as conn:
            rows = conn.execute(query, params).fetchall()
        if not rows:
            return pd.DataFrame({c: pd.Series([], dtype="int64" if c in on else object) for c in wanted})
        frame = pd.DataFrame(rows, columns=wanted)
        if "embedding" in columns:
            frame["embedding"] = [None if v is None else np.asarray(v.to_numpy()) for v in frame["embedding"]]
        return frame

    def _surge_indexes(self, conn: Any) -> list[tuple[str, str]]:
        """``(metric, name)`` of the valid HNSW indexes :meth:`build_index` made on the table."""
        from psycopg import sql

        target = self._names(sql)["target"].as_string(conn)
        names = {
            r[0]
            for r in conn.execute(
                "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                "WHERE i.indrelid = to_regclass(%s) AND i.indisvalid",
                (target,),
            ).fetchall()
        }
        t = self.location.table
        return [(m, t + suffix) for m, suffix in _INDEX_SUFFIX.items() if t + suffix in names]

    def _count(self, conn: Any) -> int:
        from psycopg import sql

        return int(
            conn.execute(sql.SQL("SELECT count(*) FROM {}").format(self._names(sql)["target"])).fetchone()[0]
        )

    def build_native_index(self, metric: str) -> dict:
        """Build the HNSW index of ``embedding`` for ``metric`` (:meth:`build_index`, ``CONCURRENTLY``) and
        drop dask-surge's index of another metric, as Lance replaces its own; returns its ``rows`` and
        parameters (what :func:`dask_surge.io.index.build_index` reports)."""
        from psycopg import sql

        name = self.build_index(metric)
        with self._session() as conn:
            for _, other in self._surge_indexes(conn):
                if other != name:
                    conn.execute(
                        sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(
                            sql.Identifier(self.location.schema, other)
                        )
                    )
            rows = self._count(conn)
        return {"rows": rows, "index_type": "HNSW", "index": name, "m": 16, "ef_construction": 64}

    def describe_native_index(self) -> tuple[str, dict] | None:
        """``(metric, description)`` of the HNSW index :meth:`build_index` made (None: there is none). An
        HNSW index holds every row (PostgreSQL adds each row as it is inserted)."""
        with self._session() as conn:
            if not self._regclass(conn, self.location.schema, self.location.table):
                return None
            found = self._surge_indexes(conn)
            if not found:
                return None
            metric, name = found[0]
            rows = self._count(conn)
        return metric, {"rows": rows, "rows_indexed": rows, "index_type": "HNSW", "index": name}

    def nearest(self, vector: Any, k: int, metric: str, columns: list[str]) -> Any:
        """The ``k`` rows nearest ``vector`` by ``metric`` through the HNSW index (``hnsw.ef_search`` at
        least 64 and ``k``), with ``columns`` and ``_distance`` (as every output's index returns it,
        :func:`_distances`), as a pandas frame, nearest first."""
        import pandas as pd

        vec = np.asarray(vector, dtype=np.float32).ravel()
        with self._session(vectors=True) as conn, conn.transaction():
            conn.execute("SELECT set_config('hnsw.ef_search', %s, true)", (str(min(1000, max(64, int(k)))),))
            rows = conn.execute(self._search_sql(conn, metric, k, columns), (vec, vec)).fetchall()
        frame = pd.DataFrame(rows, columns=[*columns, "_distance"])
        frame["_distance"] = _distances(metric, frame["_distance"].to_numpy(np.float64))
        return frame

    def search(
        self,
        queries: Any,
        k: int = 10,
        *,
        metric: str = "cosine",
        ef_search: int | None = None,
        exact: bool = False,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The ``k`` nearest rows of each query (``queries``: an ``(n, d)`` array) by ``metric``.

        Returns ``(distances, partitions, rows)``, each ``(n, k)`` (fewer columns when the table has
        fewer rows), nearest first; distances as every output's index returns them (:func:`_distances`):
        cosine ``1 - cos``, l2 the squared Euclidean distance, dot ``1 - inner product``. ``ef_search``
        sets ``hnsw.ef_search`` (pgvector's default: 40); ``exact`` scans the table (no index).
        """
        q = np.atleast_2d(np.asarray(queries, dtype=np.float32))
        out_d, out_p, out_r = [], [], []
        with self._session(vectors=True) as conn, conn.transaction():
            query = self._search_sql(conn, metric, k)
            if ef_search is not None:
                conn.execute("SELECT set_config('hnsw.ef_search', %s, true)", (str(int(ef_search)),))
            if exact:
                conn.execute("SELECT set_config('enable_indexscan', 'off', true)")
            with conn.cursor(binary=True) as cur:
                for vec in q:
                    cur.execute(query, (vec, vec), prepare=True)
                    got = cur.fetchall()
                    out_p.append([int(r[0]) for r in got])
                    out_r.append([int(r[1]) for r in got])
                    out_d.append(_distances(metric, np.array([float(r[2]) for r in got])).tolist())
        width = min((len(x) for x in out_d), default=0)
        return (
            np.array([x[:width] for x in out_d], dtype=np.float64).reshape(len(q), width),
            np.array([x[:width] for x in out_p], dtype=np.int64).reshape(len(q), width),
            np.array([x[:width] for x in out_r], dtype=np.int64).reshape(len(q), width),
        )

    def search_plan(self, query: Any, k: int = 10, *, metric: str = "cosine", exact: bool = False) -> str:
        """The ``EXPLAIN`` of :meth:`search`'s statement for one query (to see whether an index serves it)."""
        from psycopg import sql

        vec = np.asarray(query, dtype=np.float32).ravel()
        with self._session(vectors=True) as conn, conn.transaction():
            if exact:
                conn.execute("SELECT set_config('enable_indexscan', 'off', true)")
            plan = conn.execute(
                sql.SQL("EXPLAIN ") + self._search_sql(conn, metric, k), (vec, vec)
            ).fetchall()
        return "\n".join(r[0] for r in plan)


#: a key column's type (without its modifiers) -> the type its binary COPY sends; other keys are staged
#: as text and matched through ``::text``
_KEY_COPY = {
    "bigint": "int8",
    "integer": "int4",
    "smallint": "int2",
    "text": "text",
    "character varying": "varchar",
    "double precision": "float8",
    "real": "float4",
    "bytea": "bytea",
    "boolean": "bool",
}
#: a column's type (without its modifiers) -> its Arrow type, as a table is read and a backfill scans
#: it (a key's type among these is in :data:`_KEY_COPY` too, or is no key; any other type is read as
#: text, ``::text``, as a key of it is matched)
_SCAN_TYPES = {
    "bigint": pa.int64(),
    "integer": pa.int32(),
    "smallint": pa.int16(),
    "double precision": pa.float64(),
    "real": pa.float32(),
    "text": pa.string(),
    "character varying": pa.string(),
    "bytea": pa.binary(),
    "boolean": pa.bool_(),
    "real[]": pa.list_(pa.float32()),
    "double precision[]": pa.list_(pa.float64()),
    "vector": pa.list_(pa.float32()),
    "halfvec": pa.list_(pa.float16()),
}


def _base_type(kind: str) -> str:
    """``kind`` (``format_type``'s) without its modifiers: ``character varying(20)`` -> ``character varying``.

    Examples
    --------
    >>> _base_type("character varying(20)"), _base_type("vector(8)"), _base_type("real[]")
    ('character varying', 'vector', 'real[]')
    """
    return re.sub(r"\(\d+(?:,\d+)?\)", "", kind).strip()


def _recorded_column(name: str) -> str:
    """The column whose comment holds ``name`` (``<EMBEDDING_PROPERTY><column>``)."""
    if not name.startswith(EMBEDDING_PROPERTY) or len(name) == len(EMBEDDING_PROPERTY):
        raise SurgeValueError(
            f"{name!r} is not a record a pgvector table keeps: it keeps {EMBEDDING_PROPERTY}<column> in the column's "
            "comment. Fix: name a column."
        )
    return name[len(EMBEDDING_PROPERTY) :]


class _PgScan:
    """A table as :func:`dask_surge.backfill.backfill` scans it: its Arrow ``schema`` (``vector(d)`` a
    fixed-size list of float32, ``halfvec(d)`` of float16, types it does not know as text, read through
    ``::text``) and :meth:`to_table`."""

    def __init__(self, table: PgVectorTable, columns: list[tuple[str, str]]) -> None:
        self._table, self.kinds = table, dict(columns)
        self.schema = pa.schema([pa.field(name, _arrow_of(kind)) for name, kind in columns])

    def to_table(self, columns: Sequence[str]) -> pa.Table:
        """``columns`` of every row (one consistent snapshot), as Arrow of :attr:`schema` 's types."""
        from psycopg import sql

        t = self._table
        wanted = [self.schema.field(c) for c in columns]
        select = [
            sql.Identifier(f.name)
            if _base_type(self.kinds[f.name]) in _SCAN_TYPES
            else sql.SQL("{}::text").format(sql.Identifier(f.name))
            for f in wanted
        ]  # as merge_chunk matches a key: by value where its COPY sends the type, else as text
        with t._session(vectors=True) as conn:
            rows = conn.execute(
                sql.SQL("SELECT {} FROM {}").format(sql.SQL(", ").join(select), t._names(sql)["target"])
            ).fetchall()
        values = list(zip(*rows, strict=True)) if rows else [() for _ in wanted]
        arrays = []
        for f, col in zip(wanted, values, strict=True):
            if pa.types.is_fixed_size_list(f.type) or pa.types.is_list(f.type):
                lists = [None if v is None else np.asarray(_numpy(v)).tolist() for v in col]
                arrays.append(pa.array(lists, f.type))
            else:
                arrays.append(pa.array(list(col), f.type))
        return pa.Table.from_arrays(arrays, schema=pa.schema(wanted))


def _json_values(values: dict[str, str]) -> dict[str, Any]:
    """``values`` (JSON text, or text) with each value parsed where it is JSON, kept as text where not.

    Examples
    --------
    >>> _json_values({"dask-surge.backfill": '{"chunk": 0}', "note": "x"})
    {'dask-surge.backfill': {'chunk': 0}, 'note': 'x'}
    """
    out: dict[str, Any] = {}
    for name, value in values.items():
        try:
            out[name] = json.loads(value)
        except ValueError:
            out[name] = value
    return out


def _numpy(value: Any) -> Any:
    """A pgvector ``Vector`` / ``HalfVector`` (or a list) as numpy."""
    return value.to_numpy() if hasattr(value, "to_numpy") else value


def _distances(metric: str, pg: np.ndarray) -> np.ndarray:
    """pgvector's distances ``pg`` for ``metric`` as every output's index returns them
    (:func:`dask_surge.io.index.exact_distances`): cosine ``<=>`` as it is (1 - cosine similarity), l2
    ``<->`` squared (pgvector's is the Euclidean distance), dot ``1 + <#>`` (pgvector's is the negative
    inner product); the order is pgvector's either way.

    Examples
    --------
    >>> _distances("l2", np.array([3.0])).tolist(), _distances("dot", np.array([-7.0])).tolist()
    ([9.0], [-6.0])
    """
    pg = np.asarray(pg, dtype=np.float64)
    if metric == "l2":
        return pg * pg
    if metric == "dot":
        return 1.0 + pg
    return pg


def _metric(metric: str) -> tuple[str, str]:
    try:
        return METRICS[metric]
    except KeyError:
        raise SurgeValueError(
            f"metric={metric!r} is not one pgvector indexes. Fix: pass one of {sorted(METRICS)}."
        ) from None


def _arrow_of(kind: str) -> pa.DataType:
    """The Arrow type of a PostgreSQL column type as :class:`_Column` spells it (``format_type``'s):
    ``vector(d)`` a fixed-size list of float32, ``halfvec(d)`` of float16, the others by
    :data:`_SCAN_TYPES`, text where it has none.

    Examples
    --------
    >>> _arrow_of("vector(3)"), _arrow_of("character varying(20)"), _arrow_of("uuid")
    (FixedSizeListType(fixed_size_list<item: float>[3]), DataType(string), DataType(string))
    """
    if kind.startswith(("vector(", "halfvec(")):
        d = int(kind[kind.index("(") + 1 : -1])
        return pa.list_(pa.float16() if kind.startswith("halfvec") else pa.float32(), d)
    return _SCAN_TYPES.get(_base_type(kind), pa.string())


# -- where a pgvector output's run keeps its state -------------------------------------------------


def _rebuild(uri: str, schema: str, table: str, unlogged: bool) -> PgVectorTable:
    """A table unpickled (see :meth:`PgVectorTable.__reduce__`)."""
    return PgVectorTable(uri, (schema, table), unlogged=unlogged)


def is_address(output: Any) -> bool:
    """True when ``output`` is a PostgreSQL URI (``postgresql://`` or ``postgres://``), not a path.

    Examples
    --------
    >>> is_address("postgresql://app@db:5432/search"), is_address("/data/emb")
    (True, False)
    """
    return isinstance(output, str) and output.lower().startswith(_SCHEMES)


def split_output(output: str, table: str | None = None) -> tuple[str, str]:
    """``(uri, table)`` of a pgvector ``output``: the table is ``table``, else the ``#schema.table`` that
    ends the URI (as :attr:`PgLocation.url` shows a location, so a result's ``output`` names it
    again), else ``surge.table``.

    Examples
    --------
    >>> split_output("postgresql://app@db/search#public.docs")
    ('postgresql://app@db/search', 'public.docs')
    >>> split_output("postgresql://app@db/search", "docs")
    ('postgresql://app@db/search', 'docs')
    """
    uri, named = output, ""
    cut = output.rfind("#")
    if cut > output.rfind("@") and cut > output.find("://") + 2:  # not a '#' of the user info
        uri, named = output[:cut], output[cut + 1 :]
    if table and named and table != named and f"public.{table}" != named:
        raise SurgeValueError(
            f"output={redact_uri(output)!r} names table {named!r}, and table={table!r}. Fix: name the table "
            "once (table='schema.name', or the URI's #schema.name)."
        )
    name = table or named or get("table")
    if not name:
        raise SurgeValueError(
            f"output={redact_uri(uri)!r} is a PostgreSQL database, and no table is named. Fix: pass "
            "table='doc_embeddings' (or 'schema.name'), --table NAME on the command line, or set surge.table."
        )
    return uri, str(name)


def state_root() -> str:
    """Where pgvector outputs keep their runs' state: ``surge.pgvector-state``, else the user's cache
    directory's ``dask-surge/pgvector`` (``platformdirs.user_cache_dir``; ``~/.cache/dask-surge/pgvector``
    on Linux). On a cluster, set it to a path every process sees."""
    configured = get("pgvector-state")
    if configured:
        return os.path.expanduser(str(configured))
    try:
        import platformdirs

        base = platformdirs.user_cache_dir("dask-surge", appauthor=False)
    except ImportError:  # pragma: no cover - platformdirs comes with distributed's dependencies
        base = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "dask-surge")
    return os.path.join(os.path.expanduser(base), "pgvector")


def _server(uri: str) -> dict[str, str]:
    """Host, port, database and user of ``uri`` (with libpq's environment defaults): the server and
    role the table belongs to, without the password."""
    psycopg, _ = _modules()
    try:
        params = psycopg.conninfo.conninfo_to_dict(uri)
    except psycopg.Error:
        raise SurgeValueError(
            f"output={redact_uri(uri)!r} is not a libpq connection URI. Fix: pass "
            "output='postgresql://user@host:5432/db' (percent-encode special characters)."
        ) from None
    user = str(params.get("user") or os.environ.get("PGUSER") or getpass.getuser())
    return {
        "host": str(params.get("host") or params.get("hostaddr") or os.environ.get("PGHOST") or ""),
        "port": str(params.get("port") or os.environ.get("PGPORT") or "5432"),
        "dbname": str(params.get("dbname") or os.environ.get("PGDATABASE") or user),
        "user": user,
    }


def state_store(
    output: str,
    table: str | None = None,
    storage_options: dict | None = None,
    *,
    writing: bool = False,
) -> Any:
    """The state directory of the pgvector output ``output`` (a PostgreSQL URI) and ``table``
    (:func:`split_output`), as an :class:`~dask_surge.io.store.OutputStore` whose ``location`` is the
    table as messages show it (:attr:`PgLocation.url`, no password).

    The directory is ``<state_root()>/<db.schema.table>-<hash>``, the hash of the server, database,
    user and qualified table name, so one table's runs always find their manifest there. ``writing``:
    create it and its :data:`MARKER_FILE` (the redacted URI, schema and table). A password in the URI
    is kept in this process (:data:`_SECRETS`) and nowhere else.
    """
    uri, name = split_output(output, table)
    pg = PgVectorTable(uri, name)  # names checked
    loc, server = pg.location, _server(uri)
    key = json.dumps([*(server[k] for k in ("host", "port", "dbname", "user")), loc.schema, loc.table])
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    readable = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{server['dbname']}.{loc.schema}.{loc.table}")[:60]
    store = OutputStore.open(
        f"{state_root().rstrip('/')}/{readable}-{digest}", storage_options, writing=writing
    )
    store.location = loc.url
    secret = pg._secret()
    if secret:
        _SECRETS[redact_uri(uri)] = secret
    if writing:
        marker = f"{store.root}/{MARKER_FILE}"
        if not store.exists(marker):
            store.makedirs(store.root)
            facts = {"uri": redact_uri(uri), "schema": loc.schema, "table": loc.table}
            store.write(marker, json.dumps(facts, sort_keys=True).encode())
    return store


def secrets_plugin(table: Any) -> Any:
    """A Dask worker plugin that holds the password of ``table`` 's URI (given in the URI, kept in this
    process) in each worker's memory while it is registered (None: there is none to pass; libpq's
    ``PGPASSWORD`` and ``~/.pgpass`` are read by each process itself).

    The plugin travels to the scheduler and the workers over Dask's own connections (TLS where the
    cluster is configured with it), as task data does, is never written to disk, and its repr shows the
    redacted URI only; unregistering it (the run's end) removes the password from the workers."""
    if not isinstance(table, PgVectorTable):
        return None
    key = redact_uri(table.location.uri)
    secret = table._secret()
    return _plugin_class()({key: secret}) if secret else None


def _plugin_class() -> type:
    """The worker plugin class of :func:`secrets_plugin`, made on first use (it needs ``distributed``);
    pickled by reference as ``dask_surge.io.tables.pgvector._SecretsPlugin`` (see ``__getattr__``)."""
    cls = globals().get("_SECRETS_PLUGIN")
    if cls is None:
        from distributed import WorkerPlugin

        class _SecretsPlugin(WorkerPlugin):
            def __init__(self, secrets: dict[str, str]) -> None:
                self.secrets = dict(secrets)
                self.added: list[str] = []

            def __repr__(self) -> str:
                return f"_SecretsPlugin({sorted(self.secrets)})"

            def setup(self, worker: Any) -> None:
                self.added = [k for k in self.secrets if k not in _SECRETS]
                _SECRETS.update(self.secrets)

            def teardown(self, worker: Any) -> None:
                for k in self.added:  # only what it put there (an in-process worker shares the client's)
                    _SECRETS.pop(k, None)

        _SecretsPlugin.__module__, _SecretsPlugin.__qualname__ = __name__, "_SecretsPlugin"
        globals()["_SECRETS_PLUGIN"] = cls = _SecretsPlugin
    return cls


def __getattr__(name: str) -> Any:
    if name == "_SecretsPlugin":
        return _plugin_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
