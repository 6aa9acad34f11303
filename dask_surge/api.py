"""Typed functions behind the ``.surge`` accessor and the CLI."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, get_overloads, overload

import numpy as np
import pandas as pd

from . import _compat, config
from .engine.placement import gpu_count
from .errors import SurgeInputError, SurgeValueError
from .execution import calibrate as calibration  # called through the module: tests swap its calibrate
from .execution.cluster import local_cluster, local_cluster_threads
from .execution.graph import superbatch_collection
from .execution.inputs import input_files
from .execution.preflight import preflight, runs_in_process, say_in_process
from .execution.progress import RunProgress, logging_through
from .execution.runner import RunRequest, write_run
from .execution.stops import not_utf8
from .execution.superbatch import SuperBatchTask
from .families import DENSE, check_family_options
from .io import readers
from .io.directory import check_output
from .io.hashing import text_hashes
from .io.index import index_for
from .io.layout import reserved_columns
from .io.precision import check_precision, check_truncate_dim
from .io.readers import frame_of, skipped_rows
from .io.reuse import ReuseIndex, embedding_identity
from .io.tables import detect_output, named_catalog, open_output, output_class, output_store, require
from .io.tables.pgvector import is_address, secrets_plugin
from .io.verify import table_format, table_summary
from .models.encoders import Encoder
from .options import EncodeOptions, PlanOptions, document, options_of, signature
from .planning.costmodel import advise, predict
from .planning.identity import fingerprint
from .planning.run import (
    RunThresholds,
    TextSample,
    encoder_for,
    params_for_data,
    planned_run,
    superbatches_for,
    thresholds_for,
    windowed_bytes,
)
from .planning.sizes import known_sizes, partition_sizes
from .planning.thresholds import requested_thresholds
from .results import EncodeResult, SurgePlan

if TYPE_CHECKING:
    from typing import Unpack

__all__ = [
    "encode",
    "plan",
    "fingerprint",
    "status",
    "read_embeddings",
    "skipped_rows",
    "EncodeResult",
    "SurgePlan",
]

logger = logging.getLogger(__name__)
SCHEDULERS = (None, "sync", "synchronous", "threads")


def status(output: str, storage_options: dict | None = None) -> dict:
    """Progress of the run in ``output``: partitions, SuperBatches and rows committed.

    What :func:`dask_surge.io.readers.status` says of the run's manifest (``state``: ``"complete"``,
    ``"incomplete"`` or ``"empty"``; ``rows_committed``, ``superbatches_committed``, ``last_commit``,
    ``model``, ...); a table output (``format="lance"``, ``"delta"``, ``"iceberg"``) adds ``table``:
    its format, ``rows`` and ``version`` now, ``versions`` (``run_versions`` of this run) and
    ``last_commit`` (:func:`dask_surge.io.verify.table_summary`).

    Examples
    --------
    >>> status("/nonexistent/path")["state"]
    'empty'
    """
    store = output_store(output, storage_options)  # a database's: its runs' state directory
    info = readers.status(store.url(store.root) if is_address(output) else output, storage_options)
    if is_address(output):
        info["output"] = store.location
    if info["state"] == "empty":
        return info
    fmt = table_format(store)
    if fmt is not None:
        info["table"] = table_summary(store, fmt, info["run"])
    return info


def _check_columns(
    ddf, column: str, keep: Sequence[str], *, chunked: bool = False, family: str = DENSE
) -> tuple[str, ...]:
    columns = list(ddf.columns)
    if isinstance(keep, str):
        keep = [keep]
    twice = sorted({k for k in keep if isinstance(k, str) and list(keep).count(k) > 1})
    if twice:
        raise SurgeValueError(
            f"keep={list(keep)} names {', '.join(repr(k) for k in twice)} more than once; an output holds each "
            f"column once. Fix: name each column once, e.g. keep={list(dict.fromkeys(keep))}."
        )
    keep = tuple(keep)
    labels = [c for c in (column, *keep) if not isinstance(c, str)]
    if labels and all(c in columns for c in labels):
        raise SurgeInputError(
            f"column label(s) {labels} of types {sorted({type(c).__name__ for c in labels})} name the text "
            "column or keep=; dask-surge takes str labels, because the output is Parquet, whose column names "
            "are strings. Fix: ddf = ddf.rename(columns=str), then pass the labels as strings (e.g. "
            f"{str(labels[0])!r})."
        )
    if labels:
        raise SurgeInputError(
            f"the text column and keep= take column names (str), but {labels} "
            f"{'is' if len(labels) == 1 else 'are'} not; the DataFrame's columns are {columns}. "
            "Fix: pass the text column's name, e.g. encode(ddf, 'text', keep=['id'])."
        )
    if column not in columns:
        raise SurgeInputError(
            f"text column {column!r} is not in the DataFrame, whose columns are {columns}"
            f"{_index_hint(ddf, [column])}. Fix: pass the name of the column that holds the texts."
        )
    reserved = reserved_columns(chunked, family)
    clash = [k for k in keep if k in reserved]
    if clash:
        raise SurgeInputError(
            f"keep={list(keep)} includes {clash}, which the output reserves for its own columns "
            f"({', '.join(reserved)}){' with long_texts=chunk' if chunked else ''}. Fix: rename those columns "
            f"first, e.g. ddf = ddf.rename(columns={{{clash[0]!r}: 'my_{clash[0]}'}})."
        )
    missing = [k for k in keep if k not in columns]
    if missing:
        raise SurgeInputError(
            f"keep={list(keep)} names missing column(s) {missing}; columns are {columns}"
            f"{_index_hint(ddf, missing)}. Fix: keep only existing columns."
        )
    _check_source_texts(ddf, column)
    return keep


def _check_source_texts(ddf, column: str) -> None:
    """Refuse a text column read straight from a pandas DataFrame (``dd.from_pandas``) whose
    object column holds values that are not strings, checked in that DataFrame as the user built
    it: Dask's ``dataframe.convert-string`` (on by default) turns it into strings (``5`` into
    ``"5"``) before any task sees it, so the run's own check, value by value, would pass them.

    A column of bytes alone is left to Dask's conversion, which decodes UTF-8 (and fails on what
    does not decode). Other inputs are checked as they arrive: Parquet by its schema, and an
    object column that Dask did not convert by each task.

    Examples
    --------
    >>> import dask.dataframe as dd
    >>> ddf = dd.from_pandas(pd.DataFrame({"text": pd.Series(["a", 5], dtype=object)}), npartitions=1)
    >>> _check_source_texts(ddf, "text")
    Traceback (most recent call last):
    dask_surge.errors.SurgeInputError: text column 'text' holds a int (5) at index 1 of the pandas ...
    """
    source = _compat.simplified(ddf[[column]].expr) if hasattr(ddf, "expr") else None
    if not isinstance(source, _compat.FromPandas) or not source.pyarrow_strings_enabled:
        return
    frame = getattr(source.frame, "_data", None)
    if not isinstance(frame, pd.DataFrame) or column not in frame.columns or frame[column].dtype != object:
        return
    values = frame[column]
    if pd.api.types.infer_dtype(values, skipna=True) in ("string", "bytes", "empty"):
        return
    label, value = next(
        ((k, v) for k, v in values.items() if not isinstance(v, str) and not _is_null(v)), (None, None)
    )
    if label is None:
        return
    raise SurgeInputError(
        f"text column {column!r} holds a {type(value).__name__} ({value!r:.60}) at index {label!r} of the pandas "
        "DataFrame given to dd.from_pandas: only strings can be encoded. Checked in that DataFrame as built, "
        "because Dask's dataframe.convert-string turns such values into strings (5 into '5') before the run "
        f"sees them. Fix: convert or clean the column before dd.from_pandas, e.g. "
        f"df[{column!r}] = df[{column!r}].astype(str)."
    )


def _is_null(value: Any) -> bool:
    """A null as ``pandas.api.types.infer_dtype(skipna=True)`` skips it: None, NA, NaT, a float NaN."""
    return value is None or value is pd.NA or value is pd.NaT or (isinstance(value, float) and value != value)


def _index_hint(ddf, names: Sequence[str]) -> str:
    """What to add to a missing-column error when a name is the index's: the output keeps
    columns only (rows are found by ``partition``, ``row``), so the index must become one."""
    index = getattr(getattr(ddf, "index", None), "name", None)
    if index is None or index not in names:
        return ""
    return (
        f" ({index!r} is the index, which the output does not keep: make it a column first, "
        f"ddf = ddf.reset_index())"
    )


def plan(ddf, column: str, **options: Unpack[PlanOptions]) -> SurgePlan:
    """Plan the SuperBatches for ``ddf[column]`` without encoding anything.

    The options are those of :func:`encode` that shape the plan (a prompt adds to every
    text's tokens), and the cost model's.

    Parameters
    ----------
    ddf : dask.dataframe.DataFrame
        Input, as for :func:`encode`.
    column : str
        The text column.
    {options}

    Examples
    --------
    >>> import pandas as pd, dask.dataframe as dd
    >>> ddf = dd.from_pandas(pd.DataFrame({"text": ["a"] * 10}), npartitions=5)
    >>> plan(ddf, "text", b_min=4, b_max=6)
    SurgePlan(10 rows in 5 partitions -> 3 SuperBatches of 2-4 rows; b_min=4, b_max=6, sizes from metadata)
    """
    opts = config.bind("plan", options)
    requested = requested_thresholds(opts["b_min"], opts["b_max"])
    model, params, client, scheduler = (opts[k] for k in ("model", "params", "client", "scheduler"))
    long_texts, overlap, max_bytes, n = (
        opts[k] for k in ("long_texts", "chunk_overlap", "max_bytes", "token_sample")
    )
    _check_columns(ddf, column, ())
    model_opts = {o.name: opts[o.name] for o in options_of("plan") if "Encoder" in o.takers}
    if any(v is not None and v is not False for v in model_opts.values()):
        model = encoder_for(model, model_opts)  # the probe and the token sample use this model
    max_bytes = windowed_bytes(
        max_bytes, requested[1], encoder_for(model, {}), long_texts, overlap, gpu=gpu_count() > 0
    )  # as encode() caps it
    frame = ddf[[column]]
    known = known_sizes(frame, column, max_bytes)
    # an input that encode() streams is sized here with one pass, to show its SuperBatches
    sizes = known if known is not None else partition_sizes(frame, column if max_bytes else None)
    if hasattr(scheduler, "submit"):  # a Client, as encode() takes it
        client, scheduler = scheduler, None
    active = client if client is not None else (_active_client() if scheduler is None else None)
    if opts["calibrate"] and params is None:
        params = _calibrated(encoder_for(model, {}), active, scheduler)
    # one sample serves the predictions (with a token sample configured) and the estimates (asked for)
    sample = TextSample(ddf, column, sizes, model, n or 2048, overlap) if sizes.total else None
    threads = _threads(active, scheduler)
    run = planned_run(
        sizes,
        known,
        thresholds_for(
            requested,
            known,
            params,
            gpu=gpu_count() > 0,
            threads=threads,
            max_bytes=max_bytes,
            sample=sample if n is not None else None,
            long_texts=long_texts,
        ),
        threads=threads,
        max_bytes=max_bytes,
    )
    th = run.thresholds
    tokens_source = None
    if params is not None and sample is not None:  # predictions use this data's tokens
        params, tokens_source = params_for_data(params, sample if n is not None else None, long_texts)
    result = SurgePlan(
        sizes,
        run.superbatches,
        th.b_min,
        th.b_max,
        params=params,
        max_bytes=max_bytes,
        tokens_source=tokens_source,
        unit_partitions=run.unit_partitions,
        calibration_failed=bool(opts["calibrate"]) and params is None,
    )
    if sample is not None and sample.texts and (options.get("long_texts") is not None or opts["reuse"]):
        texts, total = sample.texts, sizes.total
        if options.get("long_texts") is not None:
            counts = sample.windows_per_text()
            over = float(np.mean(counts > 1))
            result.long_texts = {
                "mode": long_texts,
                "sampled": len(texts),
                "over_window": over,
                "texts_over": round(over * total),
                "windows": round(float(np.mean(counts)) * total),
            }
        if opts["reuse"]:
            with ReuseIndex(_absolute(opts["reuse"])) as index:
                found = index.find(text_hashes(texts)).found.mean()
            result.reuse = {
                "sampled": len(texts),
                "found": float(found),
                "reused": round(found * total),
                "encoded": total - round(found * total),
            }
    if params is not None and sizes.total:
        # predict the plan shown, under the byte cap it was made with
        result.predictions = predict(
            sizes.sizes,
            params,
            b_min=th.b_min,
            b_max=th.b_max,
            nbytes=sizes.nbytes,
            max_bytes=max_bytes,
            superbatches=run.superbatches,
        )
        result.advice = advise(
            sizes.sizes,
            params,
            b_min=th.b_min,
            b_max=th.b_max,
            nbytes=sizes.nbytes,
            max_bytes=max_bytes,
            superbatches=run.superbatches,
        )
    return result


def _calibrated(encoder: Encoder, active, scheduler: Any):
    """``plan(calibrate=True)`` measures where :func:`encode` would run, so that both resolve
    thresholds from the same calibration (cached per cluster shape): the active Client's
    cluster, this process for ``"threads"``/``"sync"``, else the local cluster ``encode()``
    starts, started here for the probe."""
    if active is not None or scheduler is not None:
        return calibration.calibrate(encoder, client=active, rehearse=_rehearsal(encoder, active, scheduler))
    with _client_for(None) as client:
        return calibration.calibrate(encoder, client=client, rehearse=_rehearsal(encoder, client, None))


def _rehearsal(encoder: Encoder, client, scheduler: Any) -> Callable[..., Any]:
    """A calibration's rehearsal: one written :func:`encode` where the calibration measured."""

    def rehearse(frame, **options: Any) -> None:
        where = client if client is not None else scheduler  # encode() takes a Client as its scheduler
        encode(frame, "text", model=encoder, scheduler=where, progress=False, build_index=False, **options)

    return rehearse


def _threads(client, scheduler: Any = None) -> int:
    """Worker threads that run the units: a distributed Client's; one for the local
    schedulers (units run one at a time); without either, those of the cluster encode()
    starts (:func:`dask_surge.execution.cluster.local_cluster_threads`)."""
    if client is not None:
        return sum(client.nthreads().values())
    if scheduler is not None:
        return 1

    return local_cluster_threads()


def _active_client():
    """The active distributed Client, or None.

    Where ``distributed`` was never imported no Client can exist, and it is not imported to
    find that out: the in-process path of a small run never loads it (``tests/test_lazy_import.py``).
    """
    if "distributed" not in sys.modules:
        return None
    from distributed import get_client

    try:
        return get_client()
    except ValueError:
        return None


@contextlib.contextmanager
def _client_for(scheduler):
    """The active distributed Client, or a new LocalCluster's (closed at exit), or None."""
    if scheduler not in SCHEDULERS and not hasattr(scheduler, "submit"):
        raise SurgeValueError(
            f"scheduler={scheduler!r} is not supported. Fix: pass None (the active distributed Client, "
            "or a new local cluster), a distributed.Client, 'threads' or 'sync'."
        )
    if hasattr(scheduler, "submit"):
        yield scheduler
        return
    if scheduler is not None:
        yield None
        return
    active = _active_client()
    if active is not None:
        yield active
        return
    from distributed import Client

    with local_cluster() as cluster, Client(cluster) as client:
        logger.warning("dask-surge: started %s; dashboard: %s", type(cluster).__name__, client.dashboard_link)
        yield client


@overload
def encode(ddf: Any, column: str, output: None = None, **options: Unpack[EncodeOptions]) -> Any: ...


@overload
def encode(ddf: Any, column: str, output: str, **options: Unpack[EncodeOptions]) -> EncodeResult: ...


def encode(ddf: Any, column: str, output: str | None = None, **options: Unpack[EncodeOptions]) -> Any:
    """Embed ``ddf[column]`` in SuperBatches.

    Parameters
    ----------
    ddf : dask.dataframe.DataFrame
        Input; partition ``i`` of ``ddf`` is logical partition ``i``.
    column : str
        The text column.
    output : str, optional
        Where to write: a directory path or an fsspec URL, new, empty, or holding only
        dask-surge's own files; where it can live is ``docs/output.md`` ("Where output can
        go"). ``None`` returns a lazy Dask DataFrame instead.
    {options}

    Notes
    -----
    With ``output``, a rerun of the same run resumes and a different run is refused
    (see ``overwrite``). A run is what it encodes: the input (the files it reads,
    with their sizes and versions, and every step of its graph, functions included),
    ``column``, ``keep``, and the options that change the embeddings: the model's
    content and revision, ``prompt``/``prompt_name``, ``model_kwargs`` (credentials
    such as ``token`` left out), ``normalize``, ``precision``, ``truncate_dim`` and the
    compute dtype as resolved for the run's device (``dtype="auto"`` is float16 on a
    GPU, float32 on a CPU). Changing ``on_null``, the thresholds, ``device``,
    ``engine``, ``batch_size``, ``max_tokens``, ``scheduler`` or ``progress`` resumes
    the same run (with the thresholds it recorded when it started).
    See :data:`dask_surge.planning.identity.IDENTITY_OPTIONS`.

    Returns
    -------
    dask.dataframe.DataFrame or EncodeResult
        Lazy frame with columns ``partition``, ``row``, kept columns and
        ``embedding`` (one partition per SuperBatch) when ``output`` is None;
        otherwise the run summary.

    Examples
    --------
    >>> import dask.dataframe as dd, pandas as pd
    >>> ddf = dd.from_pandas(pd.DataFrame({"text": ["a b", "c", "d e f"]}), npartitions=2)
    >>> out = encode(ddf, "text", b_min=2, b_max=4, device="cpu")
    >>> out.compute()[["partition", "row"]].values.tolist()
    [[0, 0], [0, 1], [1, 0]]
    """
    with named_catalog(options):  # the Iceberg catalog it names (a Catalog object too), in this thread only
        return _encode(ddf, column, output, **options)


def _encode(ddf: Any, column: str, output: str | None, **options: Any) -> Any:
    """:func:`encode`, with the Iceberg catalog it names in use (:func:`~.io.tables.iceberg.named_catalog`)."""
    started = time.perf_counter()  # TTFO counts from the call (model load and cluster start included)
    opts = config.bind("encode", options)
    long_texts, overlap = opts["long_texts"], opts["chunk_overlap"]
    overwrite, storage_options, scheduler, progress, input_token = (
        opts[k] for k in ("overwrite", "storage_options", "scheduler", "progress", "input_token")
    )
    requested = requested_thresholds(opts["b_min"], opts["b_max"])  # fail before any work
    encoder = encoder_for(opts["model"], opts)
    family = encoder.family  # what one text becomes: the output's columns and the options that apply
    check_family_options(
        family,
        **{
            k: opts[k]
            for k in (
                "precision",
                "normalize",
                "truncate_dim",
                "long_texts",
                "sparse_top_k",
                "sparse_threshold",
            )
        },
    )
    _check_build_index(opts["build_index"], output, family, output_class(opts["format"]))
    keep = _check_columns(ddf, column, opts["keep"], chunked=long_texts == "chunk", family=family)
    on_gpu = _on_gpu(encoder)
    task = _task(column, keep, encoder, opts)
    max_bytes = windowed_bytes(opts["max_bytes"], requested[1], encoder, long_texts, overlap, gpu=on_gpu)
    frame = ddf[[column, *[k for k in keep if k != column]]]
    out_format, mode = opts["format"], opts["mode"]
    kind = output_class(out_format)  # what the format can hold and do, before any work
    kind.check_options(output=output, mode=mode, overwrite=overwrite, precision=task.precision)
    if output is None:
        if task.on_null == "skip":
            raise SurgeValueError(
                "on_null='skip' leaves null rows out and records their (partition, row) in the output's "
                "commit records, so it needs output=...; a lazy frame has nowhere to record them. Fix: "
                "pass output='dir/', or use on_null='error' (default) or 'empty'."
            )
        if task.reuse:
            with _planning_texts(column):
                run_id = fingerprint(
                    frame, task, device="cuda" if on_gpu else "cpu", input_token=input_token, options=opts
                )
            _open_reuse(task, run_id)
        return _lazy(
            frame, task, _thresholds(requested, task, frame, _active_client(), gpu=on_gpu), max_bytes
        )
    # the output is resolved once, and what needs no worker is checked before any starts: where it can
    # live, that it is not inside (or around) the input, that it holds nothing dask-surge did not write
    # (a database's output is its table; the run's manifest is in a state directory of its own)
    store = output_store(output, storage_options, fmt=out_format, table=options.get("table"), writing=True)
    check_output(store, inputs=input_files(frame), contents=not kind.batched)  # a table: its history decides
    starting = scheduler is None and _active_client() is None  # _client_for starts a local cluster
    with _planning_texts(column):
        run_id = fingerprint(
            frame, task, device="cuda" if on_gpu else "cpu", input_token=input_token, options=opts
        )
    # a different run already there is refused, and a complete run answered, before any worker starts
    # (mode="append" to a table: the run decides whether the run there may be followed, _table_overwrite)
    appending = kind.appends and mode == "append"
    target = open_output(out_format, store)
    done = preflight(store, frame, run_id, overwrite=overwrite or appending, started=started, output=target)
    if done is not None:
        return _indexed(done, opts["build_index"], storage_options)
    small = runs_in_process(frame, column) if starting else None
    if small is not None:  # starting workers would take longer than encoding this input
        say_in_process(small)
        scheduler, starting = "threads", False
    # the bar opens now: starting a cluster (workers importing torch) is the first thing a user waits for
    bar = RunProgress(enabled=progress, phase="starting workers" if starting else "planning")
    with (
        bar,
        logging_through(bar),
        _client_for(scheduler) as client,
        _registered(task.encoder, client),
        _secrets(target, client),
    ):
        _open_reuse(task, run_id)
        shape = _shape_of(client)  # as the run starts: a calibration is refreshed only if it held
        result = write_run(
            RunRequest(
                frame,
                task,
                store,
                fingerprint=run_id,
                thresholds=_thresholds(requested, task, frame, client, gpu=on_gpu),
                max_bytes=max_bytes,
                client=client,
                scheduler=scheduler,
                overwrite=overwrite,
                progress=progress,
                started=started,
                bar=bar,
                format=out_format,
                mode=mode,
            )
        )
        _refresh_calibration(task.encoder, result, client, shape)
    return _indexed(result, opts["build_index"], storage_options)  # only a completed run gets here


def _check_build_index(metric: Any, output: str | None, family: str, kind: Any) -> None:
    """Refuse ``build_index`` where no index can follow the run, before any work: no output, an output
    that is not dense vectors, or the index's library missing."""
    if not metric:
        return
    if output is None:
        raise SurgeValueError(
            f"build_index={metric!r} indexes the output a written run leaves, and output=None returns a lazy "
            "frame. Fix: pass output='path/', or leave build_index out."
        )
    if family != DENSE:
        raise SurgeValueError(
            f"build_index={metric!r}: this model's output is {family} (no 'embedding' vector per row); a "
            "vector index is built over dense embeddings. Fix: leave build_index out."
        )
    require(kind.LIBRARY if kind.native_index else "faiss")


def _indexed(result: EncodeResult, metric: Any, storage_options: dict | None) -> EncodeResult:
    """``result`` of a completed run, with the searchable index of its output built (or the one there
    kept when it is up to date) when ``build_index`` asks for one."""
    if metric:
        result.index = index_for(result.output, metric, storage_options=storage_options)
    return result


def _shape_of(client) -> tuple[int, int] | None:
    """The cluster's shape as a calibration's key records it (None where it cannot be read)."""
    try:
        return calibration.cluster_shape(client)
    except Exception:  # noqa: BLE001 - only refreshing the calibration depends on it
        return None


def _refresh_calibration(encoder: Encoder, result: EncodeResult, client, shape) -> None:
    """A written run refreshes the cached calibration of its model, device and cluster shape from
    its SuperBatches' measured timings (:func:`dask_surge.execution.calibrate.refresh_from_run`),
    so the cache converges to what runs cost. Never fails the run."""
    if shape is None or len(result.records) <= calibration.MIN_REFRESH_POINTS:
        return
    try:
        calibration.refresh_from_run(
            encoder, result.records, client=client, shape=shape, seconds=result.seconds
        )
    except Exception as err:  # noqa: BLE001 - the run is written; a cache problem must not fail it
        logger.warning("dask-surge: could not refresh the calibration from this run (%s)", err)


def _on_gpu(encoder: Any) -> bool:
    return (encoder.spec.device or ("cuda" if gpu_count() else "cpu")).startswith("cuda")


def _task(column: str, keep: tuple[str, ...], encoder: Any, opts: dict) -> SuperBatchTask:
    """What a SuperBatch of a run with the bound options ``opts`` does (the one place they become a task)."""
    storage_options = opts["storage_options"]
    return SuperBatchTask(
        column,
        keep,
        encoder,
        normalize=opts["normalize"],
        precision=check_precision(opts["precision"], opts["normalize"]),
        on_null=opts["on_null"],
        truncate_dim=check_truncate_dim(opts["truncate_dim"], encoder.dimension),
        long_texts=opts["long_texts"],
        chunk_overlap=opts["chunk_overlap"],
        reuse=_absolute(opts["reuse"]),
        reuse_storage_options=storage_options if any("://" in r for r in opts["reuse"]) else None,
        sparse_top_k=opts["sparse_top_k"],
        sparse_threshold=opts["sparse_threshold"],
    )


def embedding_identity_for(**options: Any) -> dict:
    """What makes the embeddings of ``encode(..., **options)``: the model (its content, or repo and
    commit), prompt, normalization, precision, ``truncate_dim``, long-text mode and compute dtype, as a
    run's fingerprint records them (:func:`dask_surge.io.reuse.embedding_identity`), without encoding
    anything. What :func:`dask_surge.backfill.backfill` records beside the column it fills.

    Examples
    --------
    >>> from dask_surge.testing import checksum_model
    >>> a = embedding_identity_for(model=checksum_model)
    >>> a == embedding_identity_for(model=checksum_model, scheduler="sync"), a == embedding_identity_for(
    ...     model=checksum_model, truncate_dim=1)
    (True, False)
    """
    import dask.dataframe as dd
    import pandas as pd

    opts = config.bind("encode", options)
    encoder = encoder_for(opts["model"], opts)
    frame = dd.from_pandas(pd.DataFrame({"text": [""]}), npartitions=1)
    run = fingerprint(
        frame,
        _task("text", (), encoder, opts),
        device="cuda" if _on_gpu(encoder) else "cpu",
        input_token="identity",
        options=opts,
    )
    return embedding_identity(run)


@contextlib.contextmanager
def _planning_texts(column: str) -> Iterator[None]:
    """Dask may compute on the texts while a run is planned (``set_index``'s divisions, as the
    fingerprint counts the partitions): text that is not UTF-8 is the same clear error there as in
    a SuperBatch."""
    try:
        yield
    except (UnicodeDecodeError, UnicodeEncodeError) as err:
        raise not_utf8(column, err, "Nothing was encoded") from err


def _absolute(paths: tuple[str, ...]) -> tuple[str, ...]:
    """Local paths made absolute (workers may run elsewhere in the tree); URLs as given."""
    return tuple(p if "://" in p else os.path.abspath(p) for p in paths)


def _open_reuse(task: SuperBatchTask, run_fingerprint: dict) -> None:
    """Check that every ``reuse`` output embedded texts as this run will (else a clear error,
    before anything is written), and build its index here once, so workers only open it."""
    if task.reuse:
        ReuseIndex(
            task.reuse,
            identity=embedding_identity(run_fingerprint),
            storage_options=task.reuse_storage_options,
        ).close()


def _thresholds(requested, task: SuperBatchTask, frame, client, *, gpu: bool) -> RunThresholds:
    """What resolves a new run's thresholds once its sizes are known: ``"auto"`` uses a cached
    calibration of this encoder and cluster when there is one (see :func:`plan` with
    ``calibrate=True``), re-based on a token sample of the data as :func:`plan` does."""

    def cached() -> Any:
        try:
            return calibration.calibrate(task.encoder, client=client, probe=False)
        except Exception as err:  # noqa: BLE001 - a broken cache must not stop a run: fall back to defaults
            logger.warning("dask-surge: calibration cache not usable (%s); using default thresholds", err)
            return None

    return RunThresholds(
        requested,
        task.encoder,
        frame,
        task.column,
        lambda: _threads(client, "sync"),
        gpu,
        long_texts=task.long_texts,
        overlap=task.chunk_overlap,
        calibration=cached,
        token_sample=config.get("token-sample"),
    )


def _lazy(frame, task: SuperBatchTask, thresholds: RunThresholds, max_bytes: int | None):
    """A lazy frame of one partition per SuperBatch. It needs the SuperBatch boundaries
    up front, so an input whose sizes are not known from metadata is sized with one pass."""
    _register(task.encoder)
    known = known_sizes(frame, task.column, max_bytes)
    sizes = known if known is not None else partition_sizes(frame, task.column if max_bytes else None)
    th = thresholds(sizes, max_bytes)
    superbatches = superbatches_for(sizes, th.b_min, th.b_max, max_bytes)
    return superbatch_collection(frame, superbatches, sizes.sizes, task, task.meta(frame._meta))


def _register(encoder: Encoder, client=None) -> None:
    """Ship the encoder to the workers of ``client`` (or the active one) once; they load
    it in the background while the client plans, which brings the first output closer on a
    cold cluster (the fixed-cost study in ``docs/ab_studies.md``)."""
    if client is None:
        client = _active_client()
        if client is None:
            return
    from .execution.plugins import register_encoder  # imports distributed: only with a Client

    register_encoder(client, encoder, background=True)


@contextlib.contextmanager
def _registered(encoder: Encoder, client) -> Iterator[None]:
    """:func:`_register` for a written run on ``client``, whose end leaves the workers as they were and
    unloads the model unless ``surge.keep-model`` (:func:`dask_surge.execution.plugins.registered`)."""
    if client is None:
        yield
        return
    from .execution.plugins import registered  # imports distributed: only with a Client

    with registered(client, encoder, background=True):
        yield


@contextlib.contextmanager
def _secrets(table: Any, client) -> Iterator[None]:
    """While a run on ``client`` writes ``table``, its workers hold in memory the password its URI was
    given with (:func:`~.io.tables.pgvector.secrets_plugin`; none: libpq's ``PGPASSWORD`` or
    ``~/.pgpass`` serve each process, and nothing is registered). A local scheduler runs in this
    process, which holds it already."""
    plugin = secrets_plugin(table) if client is not None else None
    if plugin is None:
        yield
        return
    name = f"dask-surge-secrets-{uuid.uuid4().hex[:12]}"
    client.register_plugin(plugin, name=name)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):  # a cluster that is gone holds nothing any more
            client.unregister_worker_plugin(name)


_DOC_TEMPLATES = {"encode": encode.__doc__, "plan": plan.__doc__}


def _derive_from_options() -> None:
    """Give :func:`encode` (and its overloads) and :func:`plan` the runtime signature and the
    Parameters of :data:`dask_surge.options.OPTIONS`. Run at import; a test that declares an
    option runs it again."""
    derived: list[tuple[Any, str]] = [(encode, "encode"), (plan, "plan")]
    for func, taker in derived:
        func.__doc__ = document(_DOC_TEMPLATES[taker], taker)
        func.__signature__ = signature(func, taker)
    for overload_ in get_overloads(encode):
        overload_.__signature__ = signature(overload_, "encode")  # type: ignore[attr-defined]


_derive_from_options()


def read_embeddings(
    path: str,
    *,
    partition: int | None = None,
    columns: Any = None,
    storage_options: dict | None = None,
    backend: Literal["pandas", "cudf"] = "pandas",
):
    """Read the rows of an output as a Dask DataFrame, whatever its format.

    A Parquet output's committed part files only (files no commit record names are never read:
    :func:`dask_surge.io.readers.read_embeddings`); a table output's rows as its latest version
    holds them, read through the table's own library (:meth:`~dask_surge.io.tables.Output.read`),
    sorted by ``(partition, row)``.

    Parameters
    ----------
    path : str
        The output of :func:`encode` (a directory, or a table's location).
    partition : int, optional
        Only this input partition's rows, or None for every row.
    columns : sequence of str, optional
        The columns to read, or None for all of them.
    storage_options : dict, optional
        fsspec options of an object store, or None for a local path.
    backend : {"pandas", "cudf"}
        ``"cudf"`` returns a dask-cuDF DataFrame (needs RAPIDS).

    Examples
    --------
    >>> import tempfile, pandas as pd, dask.dataframe as dd
    >>> from dask_surge.testing import checksum_model
    >>> out = tempfile.mkdtemp()
    >>> ddf = dd.from_pandas(pd.DataFrame({"text": ["a", "b"]}), npartitions=1)
    >>> _ = encode(ddf, "text", output=out, model=checksum_model, scheduler="sync", progress=False)
    >>> read_embeddings(out, columns=["row"]).compute().row.tolist()
    [0, 1]
    """
    import dask.dataframe as dd

    store = output_store(path, storage_options)  # a database's: its runs' state directory
    fmt = detect_output(store)
    if not output_class(fmt).batched:
        return readers.read_embeddings(
            path, partition=partition, columns=columns, storage_options=storage_options, backend=backend
        )
    table = open_output(fmt, store).read()
    if partition is not None:
        import pyarrow.compute as pc

        table = table.filter(pc.equal(table.column("partition"), partition))
    if columns:
        table = table.select(list(columns))
    frame = frame_of(table)
    if {"partition", "row"} <= set(frame.columns):
        frame = frame.sort_values(["partition", "row"], ignore_index=True)
    import dask

    with dask.config.set({"dataframe.convert-string": False}):  # text_hash stays bytes, as for part files
        out = dd.from_pandas(frame, npartitions=max(1, -(-len(frame) // 100_000)), sort=False)
    return out.to_backend("cudf") if backend == "cudf" else out
