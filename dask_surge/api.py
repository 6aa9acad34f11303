"""Typed functions behind the ``.surge`` accessor and the CLI."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Sequence
from typing import Any, Literal, overload

from . import config
from ._version import __version__
from .errors import SurgeError, SurgeInputError, SurgeValueError
from .execution.calibrate import calibrate
from .execution.calibrate import calibrate as run_probe
from .execution.cluster import local_cluster, local_cluster_threads
from .execution.graph import superbatch_collection
from .execution.plugins import register_encoder
from .execution.runner import write_run
from .execution.superbatch import SuperBatchEncoder
from .io.manifest import find_run
from .io.precision import check_precision, check_truncate_dim
from .io.readers import read_embeddings, skipped_rows, status
from .models.devices import gpu_count
from .models.encoders import Encoder
from .models.modelid import redact
from .options import Dtype, EngineName, OnNull, Precision
from .planning.costmodel import advise, predict
from .planning.identity import IDENTITY_OPTIONS, input_identity
from .planning.policy import SuperBatch, plan_superbatches
from .planning.sizes import PartitionSizes, known_sizes, partition_sizes
from .planning.thresholds import Thresholds, requested_thresholds, resolve_thresholds
from .planning.tokens import sample_texts, token_counter
from .planning.units import streamed_plan, unit_partitions
from .results import EncodeResult, SurgePlan

__all__ = ["encode", "plan", "fingerprint", "status", "read_embeddings", "skipped_rows", "EncodeResult",
           "SurgePlan"]

logger = logging.getLogger(__name__)
RESERVED = ("partition", "row", "embedding")
SCHEDULERS = (None, "sync", "synchronous", "threads")
#: where a written encode runs: a ``distributed.Client``, a local scheduler, or None (the
#: active Client, else a local cluster started for the call)
Scheduler = Any | Literal["sync", "synchronous", "threads"] | None


def _check_columns(ddf, column: str, keep: Sequence[str]) -> tuple[str, ...]:
    columns = list(ddf.columns)
    if not isinstance(column, str) or column not in columns:
        raise SurgeInputError(
            f"text column {column!r} is not in the DataFrame, whose columns are {columns}. "
            "Fix: pass the name of the column that holds the texts."
        )
    if isinstance(keep, str):
        keep = [keep]
    keep = tuple(dict.fromkeys(keep))
    clash = [k for k in keep if k in RESERVED]
    if clash:
        raise SurgeInputError(
            f"keep={list(keep)} includes {clash}, which the output reserves for (partition, row, "
            "embedding). Fix: rename those columns first, e.g. ddf.rename(columns={...})."
        )
    missing = [k for k in keep if k not in columns]
    if missing:
        raise SurgeInputError(f"keep={list(keep)} names missing column(s) {missing}; columns are {columns}. "
                              "Fix: keep only existing columns.")
    return keep


def _resolve_encoder(model: Any, opts: dict) -> Encoder:
    if isinstance(model, Encoder):
        given = {k: v for k, v in opts.items() if v is not None and v is not False}
        if given:
            raise SurgeValueError(
                f"{', '.join(f'{k}={redact(v)!r}' for k, v in given.items())} given alongside a ready Encoder "
                f"({model!r}), which holds its own options, so they would be dropped. Fix: "
                f"model.with_options({', '.join(f'{k}=...' for k in given)}), or pass the model's name with them."
            )
        return model
    model = config.get("model") if model is None else model
    return Encoder(
        model, device=config.get("device", opts.get("device")), dtype=config.get("dtype", opts.get("dtype")),
        engine=config.get("engine", opts.get("engine")), batch_size=config.get("batch-size", opts.get("batch_size")),
        max_tokens=config.get("max-tokens", opts.get("max_tokens")), prompt=opts.get("prompt"),
        prompt_name=opts.get("prompt_name"), revision=opts.get("revision"),
        trust_remote_code=bool(opts.get("trust_remote_code")), model_kwargs=opts.get("model_kwargs"),
    )


def plan(ddf, column: str, *, b_min: int | str | None = None, b_max: int | str | None = None,
         max_bytes: int | str | None = None, model: Any = None, params: Any = None, calibrate: bool = False,
         client: Any = None, token_sample: int | None = None, prompt: str | None = None,
         prompt_name: str | None = None, revision: str | None = None, trust_remote_code: bool = False,
         model_kwargs: dict | None = None, scheduler: Any = None) -> SurgePlan:
    """Plan the SuperBatches for ``ddf[column]`` without encoding anything.

    Parameters
    ----------
    ddf, column, b_min, b_max, max_bytes, model
        As for :func:`encode`.
    prompt, prompt_name, revision, trust_remote_code, model_kwargs
        As for :func:`encode` (a prompt adds to every text's tokens).
    params : dask_surge.planning.costmodel.CostParams, optional
        Cost-model parameters; with them the plan predicts every policy.
    calibrate : bool
        Measure the parameters on the live cluster first (a probe of 10-20 s,
        cached per model, device and cluster shape; see :mod:`dask_surge.execution.calibrate`).
    client : distributed.Client, optional
        Cluster to calibrate on and plan for (default: the active one, else this process).
    scheduler : None, distributed.Client, "threads" or "sync"
        Where :func:`encode` would run, as its ``scheduler``: the plan uses that many worker
        threads (None: the active Client, else the local cluster encode() would start).
    token_sample : int, optional
        With parameters, texts sampled (row-weighted, from partitions spread
        over the frame) and tokenized with ``model``'s tokenizer (default
        ``surge.model``: pass the model the parameters were calibrated for), so
        automatic thresholds and predictions use the token lengths of this data
        rather than of the calibration texts (default ``surge.token-sample``,
        2048; set that to None to skip).

    Examples
    --------
    >>> import pandas as pd, dask.dataframe as dd
    >>> ddf = dd.from_pandas(pd.DataFrame({"text": ["a"] * 10}), npartitions=5)
    >>> plan(ddf, "text", b_min=4, b_max=6)
    SurgePlan(10 rows in 5 partitions -> 3 SuperBatches of 2-4 rows; b_min=4, b_max=6, sizes from metadata)
    """
    _check_columns(ddf, column, ())
    model_opts = {"prompt": prompt, "prompt_name": prompt_name, "revision": revision,
                  "trust_remote_code": trust_remote_code, "model_kwargs": model_kwargs}
    if any(v is not None and v is not False for v in model_opts.values()):
        model = _resolve_encoder(model, model_opts)  # the probe and the token sample use this model
    max_bytes = _max_bytes(max_bytes)
    frame = ddf[[column]]
    known = known_sizes(frame, column, max_bytes)
    # an input that encode() streams is sized here with one pass, to show its SuperBatches
    sizes = known if known is not None else partition_sizes(frame, column if max_bytes else None)
    if hasattr(scheduler, "submit"):  # a Client, as encode() takes it
        client, scheduler = scheduler, None
    active = client if client is not None else (_active_client() if scheduler is None else None)
    if calibrate and params is None:

        params = run_probe(_resolve_encoder(model, {}), client=active)
    tokens_source, raw_params = None, params
    if params is not None and sizes.total:  # predictions (and known-size thresholds) use this data's tokens
        params, tokens_source = _params_for_data(ddf, column, sizes, params, model, token_sample)
    threads = _threads(active, scheduler)
    # as encode() resolves them: a streamed input is not sampled before it starts
    th = _run_thresholds(b_min, b_max, known, params if known is not None else raw_params,
                         gpu=gpu_count() > 0, threads=threads, max_bytes=max_bytes)
    if known is not None:
        superbatches = _plan(sizes, th.b_min, th.b_max, max_bytes)
    else:
        per_unit = unit_partitions(len(sizes.sizes), threads)
        superbatches = streamed_plan(sizes.sizes, th.b_min, th.b_max, per_unit, nbytes=sizes.nbytes,
                                     max_bytes=max_bytes)
    result = SurgePlan(sizes, superbatches, th.b_min, th.b_max, params=params, max_bytes=max_bytes,
                       tokens_source=tokens_source, unit_partitions=None if known is not None else per_unit)
    if params is not None and sizes.total:

        # predict the plan shown, under the byte cap it was made with
        result.predictions = predict(sizes.sizes, params, b_min=th.b_min, b_max=th.b_max, nbytes=sizes.nbytes,
                                     max_bytes=max_bytes, superbatches=superbatches)
        result.advice = advise(sizes.sizes, params, b_min=th.b_min, b_max=th.b_max, nbytes=sizes.nbytes,
                               max_bytes=max_bytes, superbatches=superbatches)
    return result


def _plan(sizes: PartitionSizes, b_min: int, b_max: int, max_bytes: int | None) -> list[SuperBatch]:
    """The SuperBatches for these sizes; the byte cap applies where text bytes are known."""
    cap = max_bytes if sizes.nbytes is not None else None
    return plan_superbatches(sizes.sizes, b_min, b_max, nbytes=sizes.nbytes, max_bytes=cap)


def _max_bytes(value: Any) -> int | None:
    """The byte cap: ``value``, else ``surge.max-bytes``, as a positive int or None."""
    cap = config.get("max-bytes", value)
    return None if cap is None else int(cap)


def _threads(client, scheduler: Any = None) -> int:
    """Worker threads that run the units: a distributed Client's; one for the local
    schedulers (units run one at a time); without either, those of the cluster encode()
    starts (:func:`dask_surge.execution.cluster.local_cluster_threads`)."""
    if client is not None:
        return sum(client.nthreads().values())
    if scheduler is not None:
        return 1

    return local_cluster_threads()


def _run_thresholds(b_min, b_max, known: PartitionSizes | None, params, *, gpu: bool, threads: int,
                    max_bytes: int | None) -> Thresholds:
    """The thresholds a run uses, the same for :func:`plan` and :func:`encode`: sizes
    count only where the run knows them before it starts (else it streams); then an
    automatic ``b_min`` is balanced over the threads on the plan the run would make."""
    if known is None:
        return resolve_thresholds(b_min, b_max, gpu=gpu, workers=threads, params=params)
    return resolve_thresholds(
        b_min, b_max, gpu=gpu, workers=threads, params=params, total_rows=known.total,
        n_max=max(known.sizes, default=0), partitions=len(known.sizes),
        superbatch_work=lambda lo, hi: _work(known, _plan(known, lo, hi, max_bytes)),
    )


def _work(sizes: PartitionSizes, superbatches: list[SuperBatch]) -> list[int]:
    """The work of each SuperBatch: its text bytes plus 8 a row (tokens follow bytes, and
    each text adds its special tokens) where bytes are known, else its rows. Measured
    (MiniLM on a CPU): SuperBatches of 374 and 226 rows took 3.8 s and 2.0 s, so rows
    alone balanced the tail badly."""
    if sizes.nbytes is None:
        return [sb.rows for sb in superbatches]
    return [sum(8 * s.rows + sizes.nbytes[s.partition] * s.rows // max(1, sizes.sizes[s.partition])
                for s in sb.spans) for sb in superbatches]


def _params_for_data(ddf, column: str, sizes: PartitionSizes, params, model, token_sample):
    """``params`` re-based on the token lengths of a sample of the user's texts, and where they came from."""

    n = config.get("token-sample", token_sample)
    if n is None:
        return params, f"calibration texts ({params.tokens_per_text:.1f} tokens a text)"
    texts = sample_texts(ddf, column, sizes.sizes, n=n)
    if not texts:
        return params, f"calibration texts ({params.tokens_per_text:.1f} tokens a text): no text to sample"
    lengths = token_counter(_resolve_encoder(model, {}))(texts)
    params = params.with_token_lengths(lengths)
    return params, f"a sample of {len(texts):,} texts ({params.tokens_per_text:.1f} tokens a text)"


def _active_client():
    try:
        from distributed import get_client

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
def encode(
    ddf: Any,
    column: str,
    output: None = None,
    *,
    model: Any = None,
    b_min: int | Literal["auto"] | None = None,
    b_max: int | Literal["auto"] | None = None,
    max_bytes: int | str | None = None,
    keep: Sequence[str] = (),
    normalize: bool | None = None,
    precision: Precision | None = None,
    truncate_dim: int | None = None,
    on_null: OnNull | None = None,
    device: str | None = None,
    dtype: Dtype | None = None,
    engine: EngineName | None = None,
    batch_size: int | None = None,
    max_tokens: int | None = None,
    prompt: str | None = None,
    prompt_name: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    model_kwargs: dict | None = None,
    overwrite: bool = False,
    storage_options: dict | None = None,
    scheduler: Scheduler = None,
    progress: bool | None = None,
    input_token: str | None = None,
) -> Any: ...


@overload
def encode(
    ddf: Any,
    column: str,
    output: str,
    *,
    model: Any = None,
    b_min: int | Literal["auto"] | None = None,
    b_max: int | Literal["auto"] | None = None,
    max_bytes: int | str | None = None,
    keep: Sequence[str] = (),
    normalize: bool | None = None,
    precision: Precision | None = None,
    truncate_dim: int | None = None,
    on_null: OnNull | None = None,
    device: str | None = None,
    dtype: Dtype | None = None,
    engine: EngineName | None = None,
    batch_size: int | None = None,
    max_tokens: int | None = None,
    prompt: str | None = None,
    prompt_name: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    model_kwargs: dict | None = None,
    overwrite: bool = False,
    storage_options: dict | None = None,
    scheduler: Scheduler = None,
    progress: bool | None = None,
    input_token: str | None = None,
) -> EncodeResult: ...


def encode(
    ddf: Any,
    column: str,
    output: str | None = None,
    *,
    model: Any = None,
    b_min: int | Literal["auto"] | None = None,
    b_max: int | Literal["auto"] | None = None,
    max_bytes: int | str | None = None,
    keep: Sequence[str] = (),
    normalize: bool | None = None,
    precision: Precision | None = None,
    truncate_dim: int | None = None,
    on_null: OnNull | None = None,
    device: str | None = None,
    dtype: Dtype | None = None,
    engine: EngineName | None = None,
    batch_size: int | None = None,
    max_tokens: int | None = None,
    prompt: str | None = None,
    prompt_name: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    model_kwargs: dict | None = None,
    overwrite: bool = False,
    storage_options: dict | None = None,
    scheduler: Scheduler = None,
    progress: bool | None = None,
    input_token: str | None = None,
) -> Any:
    """Embed ``ddf[column]`` in SuperBatches.

    Parameters
    ----------
    ddf : dask.dataframe.DataFrame
        Input; partition ``i`` of ``ddf`` is logical partition ``i``.
    column : str
        The text column.
    output : str, optional
        Directory to write to: a local or shared-filesystem path (or ``memory://`` in one
        process), new, empty, or holding only dask-surge's own files; object-store URLs are
        refused for writing (see README "Output and recovery"). ``None`` returns a lazy
        Dask DataFrame instead.
    model : str, path, SentenceTransformer, callable or Encoder, optional
        A Hugging Face Hub name such as ``"BAAI/bge-small-en-v1.5"`` (resolved through
        the HF cache, ``HF_HOME``/``HF_HUB_CACHE``, honouring ``HF_HUB_OFFLINE``), a
        local model directory, a loaded model or callable, or a ready
        :class:`dask_surge.Encoder` (then give no encoder options here). Default
        ``surge.model`` (the packaged all-MiniLM-L6-v2).
    b_min, b_max : int or "auto", optional
        SuperBatch flush threshold and hard cap, in rows (``surge.b-min``/``b-max``;
        ``"auto"`` is 100,000/400,000 on a GPU and 4,096/16,384 on a CPU).
    max_bytes : int or str, optional
        Cap on the text bytes of one SuperBatch (``surge.max-bytes``, 512 MiB; a
        size string such as ``"1 GiB"`` works; set the option to ``None`` to plan
        by rows only). Partitions of a few huge texts are then not fused past it,
        and a partition over it is sliced. Bytes come from Parquet footers or the
        size pass; a frame whose lengths Dask knows in memory is planned by rows.
    keep : sequence of str
        Input columns to carry into the output beside ``partition``/``row``.
    normalize : bool, optional
        L2-normalize embeddings.
    precision : {"float32", "float16", "int8", "binary"}, optional
        Storage type of the embedding values (``surge.precision``): ``int8`` is
        ``round(127 x)`` of unit vectors (needs ``normalize=True``), ``binary``
        packs the sign bits into ``ceil(d / 8)`` bytes; see :mod:`dask_surge.io.precision`.
    truncate_dim : int, optional
        Keep the first ``k`` dimensions (Matryoshka models), re-normalized when
        ``normalize`` (``surge.truncate-dim``).
    on_null : {"error", "empty", "skip"}, optional
        A null text raises (default, naming its partition and row), is encoded
        as ``""``, or is left out of the output with its ``(partition, row)``
        recorded with the run's commit records (``"skip"``, needs ``output``; see
        :func:`skipped_rows`).
    device, dtype, engine, batch_size, max_tokens : optional
        Encoder options, see :class:`dask_surge.Encoder`.
    prompt, prompt_name : str, optional
        As in ``SentenceTransformer.encode``: a text put before every input, or the
        name of one of the model's prompts (``prompt_name="query"``); with neither,
        the model's default prompt applies. Part of the run's fingerprint.
    revision : str, optional
        Branch, tag or commit of a Hub model (``model="org/name"``); the commit it
        resolves to is what every worker loads.
    trust_remote_code : bool
        Let a Hub model run its own modelling code (off by default).
    model_kwargs : dict, optional
        Passed to ``SentenceTransformer(model_kwargs=...)``.
    overwrite : bool
        Replace a different run found at ``output`` (only once this run completes).
    storage_options : dict, optional
        fsspec options for ``output``.
    scheduler : None, distributed.Client, "threads" or "sync"
        Where to run when writing: ``None`` uses the active Client or starts a
        local cluster for this call.
    progress : bool, optional
        Print progress while writing (``surge.progress``).
    input_token : str, optional
        A name you choose for the input, used as its identity instead of the input's
        files and graph. Needed only when a step of the graph cannot be identified
        deterministically (the error says which); you then vouch for the input: a
        rerun with the same name resumes, whatever the data now is.

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
    started = time.perf_counter()  # TTFO counts from the call (model load and cluster start included)
    keep = _check_columns(ddf, column, keep)
    if not isinstance(overwrite, bool):
        raise SurgeValueError(f"overwrite={overwrite!r} must be True or False. Fix: pass overwrite=True to replace a different run.")
    requested = requested_thresholds(b_min, b_max)  # fail before any work
    encoder = _resolve_encoder(model, {
        "device": device, "dtype": dtype, "engine": engine, "batch_size": batch_size, "max_tokens": max_tokens,
        "prompt": prompt, "prompt_name": prompt_name, "revision": revision, "trust_remote_code": trust_remote_code,
        "model_kwargs": model_kwargs})
    on_gpu = (encoder.spec.device or ("cuda" if gpu_count() else "cpu")).startswith("cuda")
    max_bytes = _max_bytes(max_bytes)
    normalize = config.get("normalize", normalize)
    sbe = SuperBatchEncoder(
        column, keep, encoder, normalize=normalize,
        precision=check_precision(config.get("precision", precision), normalize),
        on_null=config.get("on-null", on_null),
        truncate_dim=check_truncate_dim(config.get("truncate-dim", truncate_dim), encoder.dimension),
    )
    frame = ddf[[column, *[k for k in keep if k != column]]]
    if output is None:
        if sbe.on_null == "skip":
            raise SurgeValueError(
                "on_null='skip' leaves null rows out and records their (partition, row) in the output's "
                "commit records, so it needs output=...; a lazy frame has nowhere to record them. Fix: "
                "pass output='dir/', or use on_null='error' (default) or 'empty'."
            )
        return _lazy(frame, sbe, requested, max_bytes, gpu=on_gpu)
    with _client_for(scheduler) as client:
        if client is not None:
            _register(sbe.encoder, client)
        run_id = fingerprint(frame, sbe, device="cuda" if on_gpu else "cpu", input_token=input_token)
        max_bytes = _recorded_max_bytes(output, run_id, storage_options, requested, max_bytes)
        return write_run(
            frame, sbe, output, fingerprint=run_id,
            resolve=functools.partial(_resolve, requested, encoder, frame, column, client, gpu=on_gpu,
                                      max_bytes=max_bytes),
            max_bytes=max_bytes, client=client, scheduler=scheduler, overwrite=overwrite,
            storage_options=storage_options, progress=config.get("progress", progress), started=started,
        )


def _recorded_max_bytes(output: str, run_id: dict, storage_options: dict | None, requested: tuple,
                        max_bytes: int | None) -> int | None:
    """The byte cap a resumed run plans with: the one it recorded when it started.

    Thresholds do not change the embeddings, so they are not part of a run's identity:
    a rerun that asks for others resumes the same run with the thresholds it recorded
    (its SuperBatches, committed or not, keep their boundaries), and says so.
    """

    try:
        found = find_run(output, run_id, storage_options)
    except (OSError, SurgeError):  # the run proper reports an unreadable output with its own message
        return max_bytes
    plan = found.plan if found is not None else None
    if not plan:
        return max_bytes
    asked = {"b_min": requested[0], "b_max": requested[1]}
    differ = [f"{k}={v!r} (recorded: {plan[k]!r})" for k, v in asked.items()
              if v != "auto" and k in plan and v != plan[k]]
    if "max_bytes" in plan and plan["max_bytes"] != max_bytes:
        differ.append(f"max_bytes={max_bytes!r} (recorded: {plan['max_bytes']!r})")
    if differ:
        logger.warning(
            "dask-surge: resuming the run in %s with the thresholds it recorded when it started; %s "
            "apply to a new run only (write to a new output, or pass overwrite=True).", output, ", ".join(differ))
    return plan.get("max_bytes", max_bytes)


def _resolve(requested, encoder: Encoder, frame, column: str, client, sizes: PartitionSizes | None, *,
             gpu: bool, max_bytes: int | None) -> Thresholds:
    """Thresholds for a new run: ``"auto"`` uses a cached calibration of this encoder and
    cluster when there is one (see :func:`plan` with ``calibrate=True``), re-based on a
    token sample of the data as :func:`plan` does, so both pick the same thresholds."""
    params = None
    if "auto" in requested:

        try:
            params = calibrate(encoder, client=client, probe=False)
        except Exception as err:  # noqa: BLE001 - a broken cache must not stop a run: fall back to defaults
            logger.warning("dask-surge: calibration cache not usable (%s); using default thresholds", err)
    if params is not None and sizes is not None and sizes.total:
        params, _ = _params_for_data(frame, column, sizes, params, encoder, None)
    b_min, b_max = requested
    return _run_thresholds(b_min, b_max, sizes, params, gpu=gpu, threads=_threads(client, "sync"),
                           max_bytes=max_bytes)


def _lazy(frame, sbe: SuperBatchEncoder, requested, max_bytes: int | None, *, gpu: bool):
    """A lazy frame of one partition per SuperBatch. It needs the SuperBatch boundaries
    up front, so an input whose sizes are not known from metadata is sized with one pass."""
    _register(sbe.encoder)
    known = known_sizes(frame, sbe.column, max_bytes)
    sizes = known if known is not None else partition_sizes(frame, sbe.column if max_bytes else None)
    client = _active_client()
    th = _resolve(requested, sbe.encoder, frame, sbe.column, client, sizes, gpu=gpu, max_bytes=max_bytes)
    superbatches = _plan(sizes, th.b_min, th.b_max, max_bytes)
    return superbatch_collection(frame, superbatches, sizes.sizes, sbe, sbe.meta(frame._meta))


def _register(encoder: Encoder, client=None) -> None:
    """Ship the encoder to the workers of ``client`` (or the active one) once; they load
    it in the background while the client plans (measured on a cold 2-worker cluster with
    2,000 files: first output 7.25 -> 6.40 s, ``benchmarks/fixed_cost.py``)."""
    if client is None:
        try:
            from distributed import get_client

            client = get_client()
        except ValueError:
            return

    register_encoder(client, encoder, background=True)


def fingerprint(frame, sbe: SuperBatchEncoder, *, device: str | None = None,
                input_token: str | None = None) -> dict:
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
    sbe : SuperBatchEncoder
    device : str, optional
        Where the run encodes (``"cuda"`` or ``"cpu"``): ``dtype="auto"`` resolves for it.
    input_token : str, optional
        The input's identity as the caller named it (see :func:`encode`).

    Examples
    --------
    >>> import pandas as pd, dask.dataframe as dd
    >>> from dask_surge.execution.superbatch import SuperBatchEncoder
    >>> from dask_surge import Encoder
    >>> ddf = dd.from_pandas(pd.DataFrame({"text": ["a", "b"]}), npartitions=1)
    >>> enc = Encoder("default")
    >>> a = fingerprint(ddf, SuperBatchEncoder("text", (), enc, on_null="error"), device="cpu")
    >>> b = fingerprint(ddf, SuperBatchEncoder("text", (), enc.with_options(batch_size=8), on_null="skip"), device="cpu")
    >>> a == b, a["model"]["dtype"]
    (True, 'float32')
    """

    values = {
        "ddf": input_identity(frame, token=input_token), "column": sbe.column, "keep": list(sbe.keep),
        "model": sbe.encoder.identity(device), "normalize": sbe.normalize, "precision": sbe.precision,
        "truncate_dim": sbe.truncate_dim, "on_null": sbe.on_null,
    }
    names = {"ddf": "input"}  # the fingerprint's own key names (kept from earlier runs)
    found = {names.get(k, k): v for k, v in values.items() if IDENTITY_OPTIONS[k]}
    # what the input and the model imply: the partitions read and the vectors' size
    found.update(partitions=frame.npartitions, dimension=sbe.dimension, library=__version__)
    return found
