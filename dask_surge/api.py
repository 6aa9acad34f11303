"""Typed functions behind the ``.surge`` accessor and the CLI."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from . import config
from ._version import __version__
from .cluster import gpu_count
from .encoders import Encoder
from .errors import SurgeError, SurgeInputError, SurgeValueError
from .graph import cull, superbatch_collection
from .identity import input_identity
from .manifest import Manifest, current_run, finish_run, open_run
from .policy import SuperBatch, plan_superbatches, validate_thresholds
from .precision import check_precision, check_truncate_dim
from .progress import Progress
from .sink import SuperBatchWriter
from .sizes import PartitionSizes, partition_sizes
from .superbatch import SuperBatchEncoder

__all__ = ["encode", "plan", "status", "read_embeddings", "skipped_rows", "fingerprint", "EncodeResult",
           "SurgePlan"]

logger = logging.getLogger(__name__)
RESERVED = ("partition", "row", "embedding")
MIN_SUPERBATCHES_PER_WORKER = 4
#: SuperBatches one GPU worker runs at once: one on the GPU, one reading or writing
SUPERBATCHES_PER_GPU = 2
SCHEDULERS = (None, "sync", "synchronous", "threads")


@dataclass
class SurgePlan:
    """What :func:`encode` will do: partition sizes, SuperBatch boundaries and,
    when cost-model parameters are known, predictions for every policy.

    Attributes
    ----------
    predictions : pandas.DataFrame or None
        Indexed by policy (``surge``, ``pbp``, ``fb``, ``pb-pbp-lb``) with columns
        ``texts_per_s``, ``seconds``, ``calls``, ``peak_memory_bytes``, ``ttfo_s``...
        (:func:`dask_surge.costmodel.predict`).
    advice : dask_surge.costmodel.Advice or None
        phi, CV, the predicted speed-up over one call per partition, and the knob
        that matters.
    """

    sizes: PartitionSizes
    superbatches: list[SuperBatch]
    b_min: int
    b_max: int
    params: Any = None
    max_bytes: int | None = None
    predictions: Any = None
    advice: Any = None
    tokens_source: str | None = None

    @property
    def rows(self) -> int:
        return self.sizes.total

    def summary(self) -> dict:
        rows = [sb.rows for sb in self.superbatches]
        sizes = np.asarray(self.sizes.sizes, dtype=float)
        return {
            "partitions": len(self.sizes.sizes), "rows": self.rows, "superbatches": len(rows),
            "b_min": self.b_min, "b_max": self.b_max, "sizes_source": self.sizes.source,
            "largest_superbatch": max(rows, default=0), "smallest_superbatch": min(rows, default=0),
            "n_max": int(sizes.max()) if sizes.size else 0,
            "cv": float(sizes.std() / sizes.mean()) if sizes.size and sizes.mean() else 0.0,
            "max_bytes": self.max_bytes,
            "largest_superbatch_bytes": _largest_bytes(self.superbatches, self.sizes),
        }

    def __repr__(self) -> str:
        s = self.summary()
        return (f"SurgePlan({s['rows']:,} rows in {s['partitions']:,} partitions -> "
                f"{s['superbatches']:,} SuperBatches of {s['smallest_superbatch']:,}-"
                f"{s['largest_superbatch']:,} rows; b_min={s['b_min']:,}, b_max={s['b_max']:,}, "
                f"sizes from {s['sizes_source']})")

    def _basis(self) -> str:
        basis = "cost model, calibrated on this cluster"
        return basis + (f"; tokens from {self.tokens_source}" if self.tokens_source else "")

    def _table(self):
        cols = ["texts_per_s", "seconds", "calls", "peak_memory_bytes", "ttfo_s"]
        return self.predictions[cols].round({"texts_per_s": 0, "seconds": 2, "ttfo_s": 2})

    def __str__(self) -> str:
        text = repr(self)
        if self.predictions is not None:
            text += f"\npredicted ({self._basis()}):\n" + self._table().to_string()
        if self.advice is not None:
            text += f"\nphi={self.advice.phi:.3f}, CV={self.advice.cv:.2f}: {self.advice.text}"
        return text

    def _repr_html_(self) -> str:
        import html

        out = f"<p><b>{html.escape(repr(self))}</b></p>"
        if self.predictions is not None:
            out += f"<p>predicted ({html.escape(self._basis())}):</p>" + self._table().to_html()
        if self.advice is not None:
            out += f"<p>phi={self.advice.phi:.3f}, CV={self.advice.cv:.2f}: {html.escape(self.advice.text)}</p>"
        return out

    def sweep(self, b_mins: Sequence[int] | None = None):
        """Predicted SURGE throughput, peak memory and TTFO for a range of ``b_min``
        (``b_max = max(b_max, 4 b_min)``), as a DataFrame indexed by ``b_min``."""
        from .costmodel import predict

        if self.params is None:
            raise SurgeValueError("this plan has no cost-model parameters. Fix: call plan(..., calibrate=True) or pass params=.")
        if b_mins is None:
            top = max(self.rows, 2)
            b_mins = sorted({int(x) for x in np.geomspace(max(1, top // 1000), top, 12)})
        rows = []
        for b in b_mins:
            pred = predict(self.sizes.sizes, self.params, b_min=b, b_max=max(self.b_max, 4 * b),
                           nbytes=self.sizes.nbytes, max_bytes=self.max_bytes).loc["surge"]
            rows.append({"b_min": b, "texts_per_s": pred["texts_per_s"],
                         "peak_memory_bytes": pred["peak_memory_bytes"], "ttfo_s": pred["ttfo_s"]})
        return pd.DataFrame(rows).set_index("b_min")

    def plot(self, b_mins: Sequence[int] | None = None):
        """Throughput, memory and TTFO against ``b_min`` (the shape of the paper's Fig. 8).

        Needs matplotlib. Returns the figure.
        """
        import matplotlib.pyplot as plt

        table = self.sweep(b_mins)
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
        for ax, col, label in zip(axes, ["texts_per_s", "peak_memory_bytes", "ttfo_s"],
                                  ["texts/s", "peak memory per worker (bytes)", "TTFO (s)"]):
            ax.plot(table.index, table[col], marker="o")
            ax.axvline(self.b_min, color="grey", linestyle="--")
            ax.set_xscale("log")
            ax.set_xlabel("b_min (rows)")
            ax.set_ylabel(label)
        fig.tight_layout()
        return fig


def _largest_bytes(superbatches: Sequence[SuperBatch], sizes: PartitionSizes) -> int | None:
    """Text bytes of the largest SuperBatch (slices pro rata), or None when bytes are unknown."""
    if sizes.nbytes is None:
        return None
    return max((round(sum(sizes.nbytes[s.partition] * s.rows / max(1, sizes.sizes[s.partition])
                          for s in sb.spans)) for sb in superbatches), default=0)


def _plan(sizes: PartitionSizes, b_min: int, b_max: int, max_bytes: int | None) -> list[SuperBatch]:
    """The SuperBatches for these sizes; the byte cap applies where text bytes are known."""
    return plan_superbatches(sizes.sizes, b_min, b_max, nbytes=sizes.nbytes, max_bytes=max_bytes)


@dataclass
class EncodeResult:
    """Summary of a written encode run."""

    output: str
    run_id: str
    rows: int
    partitions: int
    superbatches: int
    skipped_superbatches: int
    seconds: float
    ttfo_s: float | None
    sizes_source: str
    resumed: bool
    b_min: int = 0
    b_max: int = 0
    thresholds_reason: str = ""
    nulls_skipped: int = 0
    records: list[dict] = field(default_factory=list, repr=False)

    @property
    def texts_per_s(self) -> float:
        """Rows encoded in this call per second (resumed rows not counted)."""
        done = sum(r["rows"] for r in self.records)
        return done / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("records")
        d["texts_per_s"] = self.texts_per_s
        return d

    def __str__(self) -> str:
        ttfo = f"{self.ttfo_s:.2f} s" if self.ttfo_s is not None else "n/a"
        return (f"{self.rows:,} rows from {self.partitions:,} partitions in {self.superbatches:,} "
                f"SuperBatches ({self.skipped_superbatches:,} already committed) -> {self.output}\n"
                f"{self.seconds:.1f} s, {self.texts_per_s:,.0f} texts/s, first output after {ttfo}\n"
                f"b_min={self.b_min:,}, b_max={self.b_max:,} ({self.thresholds_reason})"
                + (f"\n{self.nulls_skipped:,} null texts left out (on_null='skip'); their (partition, row) "
                   f"are in dask_surge.skipped_rows({self.output!r})" if self.nulls_skipped else ""))


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
                f"{', '.join(f'{k}={v!r}' for k, v in given.items())} given alongside a ready Encoder "
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
         model_kwargs: dict | None = None) -> SurgePlan:
    """Plan the SuperBatches for ``ddf[column]`` without encoding anything.

    Parameters
    ----------
    ddf, column, b_min, b_max, max_bytes, model
        As for :func:`encode`.
    prompt, prompt_name, revision, trust_remote_code, model_kwargs
        As for :func:`encode` (a prompt adds to every text's tokens).
    params : dask_surge.costmodel.CostParams, optional
        Cost-model parameters; with them the plan predicts every policy.
    calibrate : bool
        Measure the parameters on the live cluster first (a probe of 10-20 s,
        cached per model, device and cluster shape; see :mod:`dask_surge.calibrate`).
    client : distributed.Client, optional
        Cluster to calibrate on (default: the active one, else this process).
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
    SurgePlan(10 rows in 5 partitions -> 3 SuperBatches of 2-4 rows; b_min=4, b_max=6, sizes from len-pass)
    """
    _check_columns(ddf, column, ())
    model_opts = dict(prompt=prompt, prompt_name=prompt_name, revision=revision,
                      trust_remote_code=trust_remote_code, model_kwargs=model_kwargs)
    if any(v is not None and v is not False for v in model_opts.values()):
        model = _resolve_encoder(model, model_opts)  # the probe and the token sample use this model
    max_bytes = config.get("max-bytes", max_bytes)
    sizes = _sizes(ddf[[column]], column, max_bytes)
    if calibrate and params is None:
        from .calibrate import calibrate as run_probe

        encoder = _resolve_encoder(model, {})
        params = run_probe(encoder, client=client if client is not None else _active_client())
    tokens_source = None
    if params is not None and sizes.total:  # automatic thresholds and predictions both use this data's tokens
        params, tokens_source = _params_for_data(ddf, column, sizes, params, model, token_sample)
    active = client if client is not None else _active_client()
    workers = sum(active.nthreads().values()) if active is not None else 1
    b_min, b_max, _ = _thresholds(b_min, b_max, sizes, params, gpu=gpu_count() > 0, workers=workers)
    superbatches = _plan(sizes, b_min, b_max, max_bytes)
    result = SurgePlan(sizes, superbatches, b_min, b_max, params=params, max_bytes=max_bytes,
                       tokens_source=tokens_source)
    if params is not None and sizes.total:
        from .costmodel import advise, predict

        capped = dict(nbytes=sizes.nbytes, max_bytes=max_bytes)  # predict the plan shown
        result.predictions = predict(sizes.sizes, params, b_min=b_min, b_max=b_max, **capped)
        result.advice = advise(sizes.sizes, params, b_min=b_min, b_max=b_max, **capped)
    return result


def _params_for_data(ddf, column: str, sizes: PartitionSizes, params, model, token_sample):
    """``params`` re-based on the token lengths of a sample of the user's texts, and where they came from."""
    from .tokens import sample_texts, token_counter

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


def _thresholds(b_min, b_max, sizes: PartitionSizes, params, *, gpu: bool,
                workers: int = 1) -> tuple[int, int, str]:
    """Resolve the thresholds; ``"auto"`` uses the cost model when parameters are known.

    An automatic ``b_min`` is also capped so that every worker gets at least
    :data:`MIN_SUPERBATCHES_PER_WORKER` SuperBatches: with fewer, the last one runs
    alone while the other workers idle (measured: N=125k on 2 workers ran at
    4.0k texts/s with 3 SuperBatches against 7.5k with 21).
    """
    raw_min = config.get("b-min") if b_min is None else b_min
    raw_max = config.get("b-max") if b_max is None else b_max
    autos = [name for name, raw in (("b_min", raw_min), ("b_max", raw_max)) if raw == "auto"]
    if params is not None and autos and sizes.sizes:
        from .costmodel import auto_thresholds

        budget = config.get("memory-budget") or 2 * 1024**3
        b_min, b_max, why = auto_thresholds(
            params, memory_budget_bytes=budget, ttfo_target_s=config.get("ttfo-target"), n_max=max(sizes.sizes),
            b_min=None if raw_min == "auto" else validate_thresholds(raw_min, raw_min)[0],
            b_max=None if raw_max == "auto" else validate_thresholds(raw_max, raw_max)[0])
    else:
        b_min, b_max = config.thresholds(b_min, b_max, gpu=gpu)
        why = "as given" if not autos else (
            f"{' and '.join(autos)} auto without a cached calibration: the {'GPU' if gpu else 'CPU'} default")
    if raw_min == "auto" and sizes.total:
        spread = max(1, -(-sizes.total // (MIN_SUPERBATCHES_PER_WORKER * max(1, workers))))
        if spread < b_min:
            b_min = spread
            why += (f"; b_min lowered to {b_min:,} so each of {workers} worker thread(s) gets "
                    f"{MIN_SUPERBATCHES_PER_WORKER}+ SuperBatches")
    b_min, b_max = validate_thresholds(b_min, b_max)
    return b_min, b_max, why


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
    from distributed import Client, get_client

    with contextlib.suppress(ValueError):
        yield get_client()
        return
    from .cluster import local_cluster

    with local_cluster() as cluster, Client(cluster) as client:
        logger.warning("dask-surge: started %s; dashboard: %s", type(cluster).__name__, client.dashboard_link)
        yield client


def encode(
    ddf,
    column: str,
    output: str | None = None,
    *,
    model: Any = None,
    b_min: int | None = None,
    b_max: int | None = None,
    max_bytes: int | str | None = None,
    keep: Sequence[str] = (),
    normalize: bool | None = None,
    precision: str | None = None,
    truncate_dim: int | None = None,
    on_null: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    engine: str | None = None,
    batch_size: int | None = None,
    max_tokens: int | None = None,
    prompt: str | None = None,
    prompt_name: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    model_kwargs: dict | None = None,
    overwrite: bool = False,
    storage_options: dict | None = None,
    scheduler: Any = None,
    progress: bool | None = None,
):
    """Embed ``ddf[column]`` in SuperBatches.

    Parameters
    ----------
    ddf : dask.dataframe.DataFrame
        Input; partition ``i`` of ``ddf`` is logical partition ``i``.
    column : str
        The text column.
    output : str, optional
        Directory (local path or fsspec URL) to write to. ``None`` returns a lazy
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
        packs the sign bits into ``ceil(d / 8)`` bytes; see :mod:`dask_surge.precision`.
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
    keep = _check_columns(ddf, column, keep)
    if not isinstance(overwrite, bool):
        raise SurgeValueError(f"overwrite={overwrite!r} must be True or False. Fix: pass overwrite=True to replace a different run.")
    encoder = _resolve_encoder(model, dict(device=device, dtype=dtype, engine=engine, batch_size=batch_size,
                                           max_tokens=max_tokens, prompt=prompt, prompt_name=prompt_name,
                                           revision=revision, trust_remote_code=trust_remote_code,
                                           model_kwargs=model_kwargs))
    on_gpu = (encoder.spec.device or ("cuda" if gpu_count() else "cpu")).startswith("cuda")
    validate_thresholds(*config.thresholds(b_min, b_max, gpu=on_gpu))  # fail before any work
    max_bytes = config.get("max-bytes", max_bytes)
    normalize = config.get("normalize", normalize)
    sbe = SuperBatchEncoder(
        column, keep, encoder, normalize=normalize,
        precision=check_precision(config.get("precision", precision), normalize),
        on_null=config.get("on-null", on_null),
        truncate_dim=check_truncate_dim(config.get("truncate-dim", truncate_dim), encoder.dimension),
    )
    frame = ddf[[column, *[k for k in keep if k != column]]]
    thresholds = functools.partial(_resolve_auto, b_min, b_max, encoder, frame, column, gpu=on_gpu)
    if output is None:
        if sbe.on_null == "skip":
            raise SurgeValueError(
                "on_null='skip' leaves null rows out and records their (partition, row) in the output's "
                "commit records, so it needs output=...; a lazy frame has nowhere to record them. Fix: "
                "pass output='dir/', or use on_null='error' (default) or 'empty'."
            )
        return _lazy(frame, sbe, thresholds, max_bytes)
    with _client_for(scheduler) as client:
        return _write(frame, sbe, output, thresholds, max_bytes, client=client, scheduler=scheduler,
                      overwrite=overwrite, storage_options=storage_options,
                      progress=config.get("progress", progress))


def _resolve_auto(b_min, b_max, encoder: Encoder, frame, column: str, sizes: PartitionSizes, client, *,
                  gpu: bool):
    """Thresholds for a run: ``"auto"`` uses a cached calibration of this encoder and
    cluster when there is one (see :func:`plan` with ``calibrate=True``), re-based on a
    token sample of the data as :func:`plan` does, so both pick the same thresholds."""
    params = None
    raw = (config.get("b-min") if b_min is None else b_min, config.get("b-max") if b_max is None else b_max)
    if "auto" in raw:
        from .calibrate import calibrate

        try:
            params = calibrate(encoder, client=client, probe=False)
        except Exception as err:  # a broken cache must not stop a run: fall back to defaults
            logger.warning("dask-surge: calibration cache not usable (%s); using default thresholds", err)
    if params is not None and sizes.total:
        params, _ = _params_for_data(frame, column, sizes, params, encoder, None)
    workers = sum(client.nthreads().values()) if client is not None else 1
    return _thresholds(b_min, b_max, sizes, params, gpu=gpu, workers=workers)


def _lazy(frame, sbe: SuperBatchEncoder, thresholds, max_bytes: int | None):
    _register(sbe.encoder)
    sizes = _sizes(frame, sbe.column, max_bytes)
    b_min, b_max, _ = thresholds(sizes, _active_client())
    superbatches = _plan(sizes, b_min, b_max, max_bytes)
    return superbatch_collection(frame, superbatches, sizes.sizes, sbe, sbe.meta(frame._meta))


def _register(encoder: Encoder, client=None) -> None:
    """Ship the encoder to the workers of ``client`` (or the active one) once."""
    if client is None:
        try:
            from distributed import get_client

            client = get_client()
        except ValueError:
            return
    from .plugins import register_encoder

    register_encoder(client, encoder)


def fingerprint(frame, sbe: SuperBatchEncoder, sizes: PartitionSizes, b_min: int, b_max: int,
                max_bytes: int | None = None) -> dict:
    """What makes two runs the same run (and lets a rerun resume)."""
    import hashlib

    # the plan is a function of rows (and text bytes, under a byte cap): both are in the digest
    max_bytes = max_bytes if sizes.nbytes is not None else None  # no bytes known: planned by rows
    layout = np.asarray(sizes.sizes, dtype=np.int64).tobytes()
    if max_bytes is not None and sizes.nbytes is not None:
        layout += np.asarray(sizes.nbytes, dtype=np.int64).tobytes()
    digest = hashlib.sha256(layout).hexdigest()[:16]
    return {
        "input": input_identity(frame), "column": sbe.column, "keep": list(sbe.keep),
        "partitions": len(sizes.sizes), "rows": sizes.total, "sizes": digest,
        "model": sbe.encoder.identity(), "dimension": sbe.dimension,
        "b_min": b_min, "b_max": b_max, "max_bytes": max_bytes, "normalize": sbe.normalize, "precision": sbe.precision,
        "truncate_dim": sbe.truncate_dim,
        "on_null": sbe.on_null, "library": __version__,
    }


def _write(frame, sbe, output, thresholds, max_bytes, *, client, scheduler, overwrite, storage_options,
           progress):
    t0 = time.perf_counter()
    sizes = _sizes(frame, sbe.column, max_bytes)
    b_min, b_max, reason = thresholds(sizes, client)
    superbatches = _plan(sizes, b_min, b_max, max_bytes)
    fp = fingerprint(frame, sbe, sizes, b_min, b_max, max_bytes)
    summary = {"superbatches": len(superbatches), "partitions": len(sizes.sizes), "rows": sizes.total}
    manifest, resumed = open_run(output, fp, overwrite=overwrite, storage_options=storage_options,
                                 plan_summary=summary)
    done = manifest.committed(repair=True)
    todo = [sb for sb in superbatches if sb.index not in done]
    bar = Progress(len(superbatches), sizes.total, enabled=progress, done_sbs=len(done),
                   done_rows=sum(_accounted(r) for r in done.values()))
    records: list[dict] = []
    ttfo = None
    if todo:
        writer = SuperBatchWriter(sbe, manifest)
        coll = superbatch_collection(frame, todo, sizes.sizes, writer, writer.meta())
        window = config.get("in-flight") or 2 * max(1, sum(client.nthreads().values()) if client else 1)
        if client is not None:
            _register(sbe.encoder, client)
        try:
            for rec in _stream(coll, todo, client, scheduler, window, manifest, sbe.column):
                if ttfo is None:
                    ttfo = time.perf_counter() - t0
                records.append(rec)
                bar.update(_accounted(rec))
        except BaseException as err:
            # a run that stops before its first commit may then be replaced (see open_run)
            manifest.mark_stopped(f"{type(err).__name__}: {err}")
            if isinstance(err, KeyboardInterrupt):
                _interrupted(manifest, output, len(superbatches))
            raise
    committed = manifest.committed()
    missing = [sb.index for sb in superbatches if sb.index not in committed]
    if missing:  # pragma: no cover - each SB either raised or committed above
        raise SurgeInputError(
            f"{len(missing)} SuperBatch(es) were not committed (first: {missing[:5]}); the output is "
            "incomplete. Fix: rerun the same call to resume."
        )
    accounted = sum(_accounted(r) for r in committed.values())
    if accounted != sizes.total:  # pragma: no cover - a bug guard: never mark a lossy run complete
        raise SurgeError(
            f"the committed SuperBatches hold {accounted:,} rows (written + skipped nulls) but the input "
            f"has {sizes.total:,}; the run is left incomplete rather than marked done. Fix: rerun the "
            "same call; if it happens again, please report it with the output's _surge directory."
        )
    finish_run(manifest, committed)
    return EncodeResult(
        output=str(output), run_id=manifest.run_id, rows=sizes.total, partitions=len(sizes.sizes),
        superbatches=len(superbatches), skipped_superbatches=len(done), seconds=time.perf_counter() - t0,
        ttfo_s=ttfo, sizes_source=sizes.source, resumed=resumed, b_min=b_min, b_max=b_max,
        thresholds_reason=reason, records=records,
        nulls_skipped=sum(int(r.get("skipped", 0)) for r in committed.values()),
    )


def _not_utf8(column: str, err: UnicodeDecodeError, kept: str) -> SurgeInputError:
    return SurgeInputError(
        f"the text column {column!r} holds bytes that are not valid UTF-8 ({err}). {kept}. Fix: decode "
        "the column yourself first, e.g. .map(lambda b: b.decode('utf-8', errors='replace')), then rerun."
    )


def _sizes(frame, column: str, max_bytes: int | None) -> PartitionSizes:
    """Partition sizes (and text bytes under a byte cap), before anything is written."""
    try:
        return partition_sizes(frame, column if max_bytes else None)
    except UnicodeDecodeError as err:  # the size pass reads the column
        raise _not_utf8(column, err, "Nothing was written") from err


def _stream(coll, todo, client, scheduler, window, manifest: Manifest, column: str):
    """:func:`_run` with its failures turned into errors that say what is kept and how to go on."""
    try:
        yield from _run(coll, todo, client, scheduler, window, _task_resources(client))
    except UnicodeDecodeError as err:
        raise _not_utf8(column, err, f"{len(manifest.committed())} SuperBatches are committed and kept") from err
    except Exception as err:
        if type(err).__name__ != "KilledWorker":
            raise
        raise SurgeError(
            f"a SuperBatch task killed its worker repeatedly ({err}); the usual cause is running "
            f"out of memory. {len(manifest.committed())} SuperBatches are committed and kept. Fix: "
            "lower b_min/b_max (or max_bytes for huge texts, or max_tokens), give workers more memory, "
            "then rerun the same call to resume."
        ) from err


def _accounted(record: dict) -> int:
    """Input rows a commit record accounts for: written rows plus skipped nulls."""
    return int(record["rows"]) + int(record.get("skipped", 0))


def _interrupted(manifest: Manifest, output: str, planned: int) -> None:
    n = len(manifest.committed())
    logger.warning(
        "dask-surge: interrupted; %d of %d SuperBatches are committed in %s and kept. "
        "Rerun the same call to resume from there.", n, planned, output,
    )


def _chunks(superbatches: Sequence[SuperBatch]) -> list[list[SuperBatch]]:
    """Group SuperBatches for submission: the slices of one partition travel together
    (so the partition is read once), every other SuperBatch alone."""
    chunks: list[list[SuperBatch]] = []
    for sb in superbatches:
        first = sb.spans[0].partition
        if chunks and len(sb.spans) == 1 and chunks[-1][-1].spans[-1].partition == first \
                and len(chunks[-1][-1].spans) == 1:
            chunks[-1].append(sb)
        else:
            chunks.append([sb])
    return chunks


def _task_resources(client) -> dict | None:
    """Worker resources for SuperBatch tasks: when workers advertise ``GPU`` (dask-cuda
    workers from :func:`dask_surge.cluster.local_cluster` or :mod:`dask_surge.hpc`), each
    task claims ``1 / SUPERBATCHES_PER_GPU`` of one, so SuperBatches run only on GPU workers,
    at most two at a time per GPU (the engine serializes the forward passes; the other
    reads, tokenizes or writes). The claim covers the whole submitted graph, so a
    SuperBatch's input-read tasks run on GPU workers too (where their output is consumed).
    ``None`` when no worker advertises a GPU."""
    if client is None:
        return None
    workers = client.scheduler_info(n_workers=-1).get("workers", {}).values()
    if any(w.get("resources", {}).get("GPU", 0) >= 1 for w in workers):
        return {"GPU": 1 / SUPERBATCHES_PER_GPU}
    return None


def _run(coll, todo, client, scheduler, in_flight: int, resources: dict | None = None):
    """Yield commit records as SuperBatches finish, with at most ``in_flight`` SBs submitted.

    The SuperBatch graph is optimized and materialized once; SuperBatches are then
    submitted in plan order, a few at a time, each with only the input tasks it
    consumes. So the first commits early (TTFO) and no worker is handed more than
    a bounded number of SuperBatches (memory ``O(b_min + n_max)`` per SB).
    """
    opt = coll.optimize()
    dsk = dict(opt.__dask_graph__())
    keys = opt.__dask_keys__()
    position = {sb.index: i for i, sb in enumerate(todo)}
    batches = [[keys[position[sb.index]] for sb in chunk] for chunk in _chunks(todo)]
    if client is None:
        from dask.local import get_sync
        from dask.threaded import get as get_threads

        get = get_sync if scheduler in ("sync", "synchronous") else get_threads
        for batch in batches:
            for frame in get(cull(dsk, batch), batch):
                yield from frame.to_dict("records")
        return
    from distributed import as_completed

    pending = iter(batches)
    running = as_completed()
    live: list = []

    def submit_more() -> None:
        while running.count() < in_flight:
            batch = next(pending, None)
            if batch is None:
                return
            futures = client.get(cull(dsk, batch), batch, sync=False, resources=resources)
            live.extend(futures)
            running.update(futures)

    try:
        submit_more()
        for fut in running:
            records = fut.result().to_dict("records")
            fut.release()
            submit_more()
            yield from records
    finally:
        client.cancel([f for f in live if not f.done()])


def status(output: str, storage_options: dict | None = None) -> dict:
    """Progress of the run in ``output``: SuperBatches and rows committed of planned.

    Examples
    --------
    >>> status("/nonexistent/path")["state"]
    'empty'
    """
    manifest = current_run(output, storage_options)
    if manifest is None:
        return {"output": output, "state": "empty"}
    planned = manifest.plan
    committed = manifest.committed()
    rows = sum(r["rows"] for r in committed.values())
    skipped = sum(int(r.get("skipped", 0)) for r in committed.values())
    # complete: every planned SuperBatch committed and every input row accounted for
    state = "complete" if len(committed) == planned.get("superbatches") \
        and rows + skipped == planned.get("rows") else "incomplete"
    last = max((r["committed_at"] for r in committed.values()), default=None)
    return {
        "output": output, "state": state, "run": manifest.run_id,
        "superbatches_committed": len(committed), "superbatches_planned": planned.get("superbatches"),
        "rows_committed": rows, "rows_planned": planned.get("rows"), "nulls_skipped": skipped,
        "last_commit": last,
    }


def _existing_run(output: str, storage_options: dict | None) -> Manifest:
    """The current run in ``output``, or a clear error when there is none (for readers)."""
    manifest = current_run(output, storage_options)
    if manifest is None:
        raise SurgeInputError(
            f"{output!r} holds no dask-surge run (no {output}/_surge/CURRENT). Fix: pass the output "
            "directory of ddf.surge.encode(..., output=...)."
        )
    return manifest


def skipped_rows(output: str, storage_options: dict | None = None) -> pd.DataFrame:
    """The ``(partition, row)`` of the null texts a run left out (``on_null="skip"``).

    Read from the files that the commit records of the current run in ``output``
    name (one small Parquet file per SuperBatch that skipped any), sorted.

    Examples
    --------
    >>> import tempfile, dask.dataframe as dd, pandas as pd
    >>> ddf = dd.from_pandas(pd.DataFrame({"text": ["a", None, "c"]}), npartitions=1)
    >>> out = tempfile.mkdtemp()
    >>> res = encode(ddf, "text", out, b_min=2, b_max=4, on_null="skip", scheduler="sync", progress=False,
    ...              model=lambda texts: [[float(len(t))] for t in texts])
    >>> skipped_rows(out).values.tolist()
    [[0, 1]]
    """
    manifest = _existing_run(output, storage_options)
    import pyarrow.parquet as pq

    files = [f"{manifest.run_dir}/skipped/{r['skipped_file']}" for r in manifest.committed().values()
             if r.get("skipped")]
    frames = []
    for path in files:
        with manifest.fs.open(path, "rb") as f:
            frames.append(pq.read_table(f).to_pandas())
    empty = pd.DataFrame({"partition": pd.Series([], dtype="int64"), "row": pd.Series([], dtype="int64")})
    out = pd.concat(frames, ignore_index=True) if frames else empty
    return out.sort_values(["partition", "row"], ignore_index=True)


def read_embeddings(path: str, *, partition: int | None = None, columns: Sequence[str] | None = None,
                    storage_options: dict | None = None, backend: str = "pandas"):
    """Read the committed rows of an output directory as a Dask DataFrame.

    Only files named by commit records of the current run are read; orphan or
    half-written files are never a source of rows.

    Parameters
    ----------
    path : str
        Output directory of :func:`encode`.
    partition : int, optional
        Only this input partition's rows (only the files that hold it are read).
    columns : sequence of str, optional
        Columns to read.
    backend : {"pandas", "cudf"}
        ``"cudf"`` returns a dask-cuDF DataFrame (needs RAPIDS).

    Examples
    --------
    >>> ddf = read_embeddings("emb/")          # doctest: +SKIP
    >>> ddf.partition.nunique().compute()      # doctest: +SKIP
    """
    import dask.dataframe as dd

    manifest = _existing_run(path, storage_options)
    records = sorted(manifest.committed().values(), key=lambda r: r["sb"])
    if partition is not None:
        records = [r for r in records if any(s[0] == partition and s[2] > s[1] for s in r["spans"])]
    files = [f"{manifest.root}/{r['file']}" for r in records]
    proto = manifest.fs.protocol if isinstance(manifest.fs.protocol, str) else manifest.fs.protocol[0]
    if proto not in ("file", "local"):
        files = [f"{proto}://{f}" for f in files]
    if not files:
        raise SurgeInputError(f"{path!r} has no committed rows" + (
            f" for partition {partition}" if partition is not None else "") + ". Fix: run (or resume) "
            "the encode into it first, or check the partition id against dask_surge.status(path).")
    filters = [("partition", "==", partition)] if partition is not None else None
    if backend not in ("pandas", "cudf"):
        raise SurgeValueError(f"backend={backend!r} is not supported. Fix: use backend='pandas' or 'cudf'.")
    if backend == "cudf":
        return dd.read_parquet(files, columns=list(columns) if columns else None, filters=filters,
                               storage_options=storage_options).to_backend("cudf")
    return dd.read_parquet(files, columns=list(columns) if columns else None, filters=filters,
                           storage_options=storage_options,
                           arrow_to_pandas={"types_mapper": _embedding_types})


def _embedding_types(pa_type):
    """Read fixed-size lists (embeddings) as pandas ArrowDtype columns, zero-copy."""
    import pyarrow as pa

    return pd.ArrowDtype(pa_type) if pa.types.is_fixed_size_list(pa_type) else None

