"""What :func:`dask_surge.encode` and :func:`dask_surge.plan` return."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np
import pandas as pd

from .errors import SurgeValueError
from .families import DENSE
from .io.layout import FAMILY_COLUMNS
from .io.tables import display_name
from .planning.costmodel import predict
from .planning.policy import SuperBatch
from .planning.sizes import PartitionSizes
from .planning.units import streamed_plan
from .plots import plot_advice, plot_run, run_timeline

__all__ = ["SurgePlan", "EncodeResult", "SuperBatchReport"]


@dataclass
class SurgePlan:
    """What :func:`encode` will do: partition sizes, SuperBatch boundaries and,
    when cost-model parameters are known, predictions for every policy.

    Attributes
    ----------
    predictions : pandas.DataFrame or None
        Indexed by policy (``surge``, ``pbp``, ``fb``, ``pb-pbp-lb``) with columns
        ``texts_per_s``, ``seconds``, ``calls``, ``peak_memory_bytes``, ``ttfo_s``...
        (:func:`dask_surge.planning.costmodel.predict`).
    advice : dask_surge.planning.costmodel.Advice or None
        phi, CV, the predicted speed-up over one call per partition, and the knob
        that matters.
    long_texts : dict or None
        With ``long_texts=`` given, from a token sample of the data: ``mode``, ``sampled``
        texts, ``over_window`` (the fraction longer than the model's window),
        ``texts_over`` and ``windows`` (estimates for the whole input: texts over the window,
        and the token windows they make in chunk or mean mode, every text counting one at least).
    reuse : dict or None
        With ``reuse=`` given, from a sample of the data's text hashes looked up in the
        reused outputs: ``sampled``, ``found`` (fraction), and the estimates ``reused`` and
        ``encoded`` (texts the model will see) for the whole input.
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
    unit_partitions: int | None = None  # a streamed input: SuperBatches form unit by unit
    long_texts: dict | None = None
    reuse: dict | None = None
    #: ``calibrate=True`` was asked for but gave no parameters (a noisy probe now gives low-confidence
    #: ones, so this is left for a calibration that could not run at all)
    calibration_failed: bool = False

    def _no_params(self, what: str) -> SurgeValueError:
        """The error of a method that needs cost-model parameters this plan lacks, saying why; it
        never asks a user who passed ``calibrate=True`` to pass it."""
        if self.calibration_failed:
            return SurgeValueError(
                f"this plan has no cost-model parameters, so {what}: the calibration asked for "
                "(calibrate=True) gave none (the warning logged with it says why). Fix: pass params= from "
                "dask_surge.execution.calibrate.calibrate(model, client=..., seconds=30)."
            )
        return SurgeValueError(
            f"this plan has no cost-model parameters, so {what}. "
            "Fix: call plan(..., calibrate=True) or pass params=."
        )

    @property
    def rows(self) -> int:
        return self.sizes.total

    def summary(self) -> dict:
        rows = [sb.rows for sb in self.superbatches]
        sizes = np.asarray(self.sizes.sizes, dtype=float)
        return {
            "partitions": len(self.sizes.sizes),
            "rows": self.rows,
            "superbatches": len(rows),
            "b_min": self.b_min,
            "b_max": self.b_max,
            "sizes_source": self.sizes.source,
            "largest_superbatch": max(rows, default=0),
            "smallest_superbatch": min(rows, default=0),
            "n_max": int(sizes.max()) if sizes.size else 0,
            "cv": float(sizes.std() / sizes.mean()) if sizes.size and sizes.mean() else 0.0,
            "max_bytes": self.max_bytes,
            "largest_superbatch_bytes": _largest_bytes(self.superbatches, self.sizes),
        }

    def __repr__(self) -> str:
        s = self.summary()
        return (
            f"SurgePlan({s['rows']:,} rows in {s['partitions']:,} partitions -> "
            f"{s['superbatches']:,} SuperBatches of {s['smallest_superbatch']:,}-"
            f"{s['largest_superbatch']:,} rows; b_min={s['b_min']:,}, b_max={s['b_max']:,}, "
            f"sizes from {s['sizes_source']})"
        )

    def _basis(self) -> str:
        basis = "cost model, calibrated on this cluster"
        meta = dict(getattr(self.params, "meta", ()))
        runs = max(int(meta.get("refreshes", 0) or 0), int(meta.get("run_terms_refreshes", 0) or 0))
        if runs:
            basis += f", refreshed by {runs:,} written run{'s' if runs > 1 else ''}"
        if getattr(self.params, "confidence", None) == "low":
            basis += (
                " with low confidence (the probe could not separate the encode cost from timing noise; "
                "runs refresh it)"
            )
        return basis + (f"; tokens from {self.tokens_source}" if self.tokens_source else "")

    def _table(self):
        cols = ["texts_per_s", "seconds", "calls", "peak_memory_bytes", "ttfo_s"]
        return self.predictions[cols].round({"texts_per_s": 0, "seconds": 2, "ttfo_s": 2})

    def _texts(self) -> list[str]:
        """Lines on long texts and reuse, estimated from a sample (empty when not asked for)."""
        lines = []
        if self.long_texts:
            lt = self.long_texts
            line = (
                f"long texts: {lt['over_window']:.1%} of a sample of {lt['sampled']:,} texts are over the "
                f"model's window (~{lt['texts_over']:,} texts)"
            )
            if lt["mode"] in ("chunk", "mean"):
                line += f"; long_texts={lt['mode']!r} encodes ~{lt['windows']:,} windows"
            lines.append(line)
        if self.reuse:
            ru = self.reuse
            lines.append(
                f"reuse: {ru['found']:.1%} of a sample of {ru['sampled']:,} texts are in the reused "
                f"outputs: ~{ru['reused']:,} texts copied, ~{ru['encoded']:,} encoded"
            )
        return lines

    def __str__(self) -> str:
        text = "\n".join([repr(self), *self._texts()])
        if self.predictions is not None:
            text += f"\npredicted ({self._basis()}):\n" + self._table().to_string()
        if self.advice is not None:
            text += f"\nphi={self.advice.phi:.3f}, CV={self.advice.cv:.2f}: {self.advice.text}"
        return text

    def _repr_html_(self) -> str:
        import html

        out = f"<p><b>{html.escape(repr(self))}</b></p>" + "".join(
            f"<p>{html.escape(t)}</p>" for t in self._texts()
        )
        if self.predictions is not None:
            out += f"<p>predicted ({html.escape(self._basis())}):</p>" + self._table().to_html()
        if self.advice is not None:
            out += (
                f"<p>phi={self.advice.phi:.3f}, CV={self.advice.cv:.2f}: {html.escape(self.advice.text)}</p>"
            )
        return out

    def sweep(self, b_mins: Sequence[int] | None = None):
        """Predicted SURGE throughput, peak memory and TTFO for a range of ``b_min``
        (``b_max = max(b_max, 4 b_min)``), as a DataFrame indexed by ``b_min``."""

        if self.params is None:
            raise self._no_params("nothing to predict")
        if b_mins is None:
            top = max(self.rows, 2)
            b_mins = sorted({int(x) for x in np.geomspace(max(1, top // 1000), top, 12)})
        rows = []
        for b in b_mins:
            b_max = max(self.b_max, 4 * b)
            plan = None
            if self.unit_partitions is not None:
                plan = streamed_plan(
                    self.sizes.sizes,
                    b,
                    b_max,
                    self.unit_partitions,
                    nbytes=self.sizes.nbytes,
                    max_bytes=self.max_bytes,
                )
            pred = predict(
                self.sizes.sizes,
                self.params,
                b_min=b,
                b_max=b_max,
                nbytes=self.sizes.nbytes,
                max_bytes=self.max_bytes,
                superbatches=plan,
            ).loc["surge"]
            rows.append(
                {
                    "b_min": b,
                    "texts_per_s": pred["texts_per_s"],
                    "peak_memory_bytes": pred["peak_memory_bytes"],
                    "ttfo_s": pred["ttfo_s"],
                }
            )
        return pd.DataFrame(rows).set_index("b_min")

    def plot(self, b_mins: Sequence[int] | None = None):
        """Throughput, memory and TTFO against ``b_min`` (the shape of the paper's Fig. 8).

        Needs matplotlib. Returns the figure.
        """
        import matplotlib.pyplot as plt

        table = self.sweep(b_mins)
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
        for ax, col, label in zip(
            axes,
            ["texts_per_s", "peak_memory_bytes", "ttfo_s"],
            ["texts/s", "peak memory per worker (bytes)", "TTFO (s)"],
        ):
            ax.plot(table.index, table[col], marker="o")
            ax.axvline(self.b_min, color="grey", linestyle="--")
            ax.set_xscale("log")
            ax.set_xlabel("b_min (rows)")
            ax.set_ylabel(label)
        fig.tight_layout()
        return fig

    def plot_advice(self):
        """Where this workload sits on the phi/CV advisor's map.

        phi (the share of a mean partition's encode call spent in fixed per-call cost) on
        the x axis, the CV of partition sizes on the y axis, coloured by the predicted
        speed-up of SuperBatches over one call per partition (the cost model on log-normal
        sizes with this plan's partition count, ``b_min`` and ``b_max``); a line where the
        gain reaches 5%, and a star for this workload with its own prediction and the
        advice's text (:func:`dask_surge.planning.costmodel.advise`).

        Needs matplotlib (``pip install 'dask-surge[plot]'``) and a plan with cost-model
        parameters (``plan(..., calibrate=True)`` or ``params=``). Returns the figure; no
        backend is chosen (a notebook shows it inline, a script saves it).
        """
        if self.params is None or self.advice is None:
            raise self._no_params("no advice to draw")
        return plot_advice(self)


def _largest_bytes(superbatches: Sequence[SuperBatch], sizes: PartitionSizes) -> int | None:
    """Text bytes of the largest SuperBatch (slices pro rata), or None when bytes are unknown."""
    if sizes.nbytes is None:
        return None
    return max(
        (
            round(
                sum(sizes.nbytes[s.partition] * s.rows / max(1, sizes.sizes[s.partition]) for s in sb.spans)
            )
            for sb in superbatches
        ),
        default=0,
    )


@dataclass(frozen=True)
class SuperBatchReport:
    """What writing one SuperBatch did (one per SuperBatch a written run encoded in this call,
    :attr:`EncodeResult.records`).

    Attributes
    ----------
    sb : str
        The SuperBatch's key (:func:`dask_surge.io.directory.sb_key` of its first row).
    rows, skipped : int
        Rows written, and null texts left out (``on_null="skip"``).
    file : str
        The committed file's name in the output directory; ``""`` when another attempt of
        this SuperBatch committed first (``committed`` is False).
    bytes : int
        Size of the Parquet file written.
    spans : tuple of (partition, start, stop, partition rows)
        The input rows it accounts for, as its commit record names them.
    started_at, committed_at : float
        Wall-clock times (``time.time()``) when its task started encoding it and when its
        commit record was created (on the client's clock once the run loop received it).
    encode_s, write_s : float
        Seconds spent encoding, and writing and committing.
    committed : bool
        Whether this attempt's commit won.
    engine : str
        What encoded it on the worker: ``"fast"``, ``"sentence-transformers"`` or ``"callable"``.
    task_end : float or None
        When its task ended, on the worker's clock (set by the run loop, which maps
        ``committed_at`` onto the client's clock with it).
    output_rows : int
        Rows of its file: ``rows`` but with ``long_texts="chunk"``, one per window.
    truncated, encoded, reused : int
        Texts cut at the model's window (-1: the model cannot tell), distinct texts that went
        through the model, texts whose embeddings were copied from a ``reuse`` output.
    clock_shift : float
        Seconds :meth:`on_client_clock` added to its times (0: none): the clocks' difference plus
        the transfer, which varies from task to task; a timeline takes the run's smallest.
    model_s : float
        Seconds of ``encode_s`` spent in the model's call (tokenizing and forward passes; not
        gathering, hashing or framing the rows): what the cost model's encode curve describes.
    sequences, tokens, padded_tokens, forwards : int
        What that call's forward passes computed: sequences (texts, or windows), real and padded
        tokens, and forward passes (micro-batches); -1 where the backend does not count them (only
        the fast engine does). A run refreshes its calibration from these
        (:func:`dask_surge.execution.calibrate.refresh_from_run`).
    """

    sb: str
    rows: int
    skipped: int
    file: str
    bytes: int
    spans: tuple[tuple[int, int, int, int], ...]
    started_at: float
    encode_s: float
    write_s: float
    committed: bool
    committed_at: float
    engine: str
    task_end: float | None = None
    output_rows: int = 0
    truncated: int = 0
    encoded: int = 0
    reused: int = 0
    clock_shift: float = 0.0
    model_s: float = 0.0
    sequences: int = -1
    tokens: int = -1
    padded_tokens: int = -1
    forwards: int = -1

    def as_dict(self) -> dict:
        """The report as a plain dict (JSON-serializable)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def with_task_end(self, task_end: float) -> SuperBatchReport:
        return replace(self, task_end=task_end)

    def on_client_clock(self, now: float) -> SuperBatchReport:
        """This report with ``committed_at`` (and ``started_at``) shifted onto the clock of a client that received it at
        ``now``: by the difference between ``now`` and when its task ended (an upper bound: it
        counts the transfer), so time to first output never mixes two machines' clocks."""
        if self.task_end is None:
            return self
        shift = now - self.task_end
        return replace(
            self,
            committed_at=self.committed_at + shift,
            started_at=self.started_at + shift,
            clock_shift=shift,
        )

    def __getitem__(self, name: str):
        """``report["rows"]``: read access by field name, for scripts written against the report
        as a dict (prefer the attribute)."""
        if name not in _REPORT_FIELDS:
            raise KeyError(name)
        return getattr(self, name)


_REPORT_FIELDS = frozenset(f.name for f in fields(SuperBatchReport))


_EVERY_TOKEN = "long_texts='chunk' or 'mean' encode every token"


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
    engine: str = ""  # what encoded this call's SuperBatches: "fast", "sentence-transformers", "callable"
    #: rows of the output files: ``rows`` but, with ``long_texts="chunk"``, one per token window
    output_rows: int = 0
    #: texts over the model's window that were cut (``long_texts="truncate"``), over the whole run;
    #: -1 when the model cannot tell (a callable without a tokenizer)
    truncated: int = 0
    #: distinct texts that went through the model (repeats within a SuperBatch encode once), over the run
    encoded: int = 0
    #: texts whose embeddings were copied from a ``reuse`` output, over the run
    reused: int = 0
    #: what one text became (:data:`dask_surge.families.FAMILIES`): "dense" (``embedding``), "sparse"
    #: (``indices``, ``values``) or "multivector" (``vectors``, ``tokens``)
    family: str = "dense"
    #: the searchable index built once the run completed (``build_index=...``):
    #: :func:`dask_surge.io.index.build_index`'s description, ``built`` False when the one there was kept
    index: dict | None = None
    #: what writing each SuperBatch encoded in this call did, in the order they were received
    records: tuple[SuperBatchReport, ...] = field(default=(), repr=False)

    @property
    def texts_per_s(self) -> float:
        """Rows encoded in this call per second (resumed rows not counted)."""
        done = sum(r.rows for r in self.records)
        return done / self.seconds if self.seconds > 0 else 0.0

    def timeline(self) -> pd.DataFrame:
        """This call's SuperBatches on one clock, as a DataFrame in commit order.

        Columns ``sb``, ``rows``, ``skipped``, ``start_s`` and ``commit_s`` (seconds since the
        call started, on the client's clock), ``encode_s``, ``write_s``, ``committed``,
        ``lane`` (SuperBatches running at the same time get different lanes; the reports do
        not name their worker) and ``rows_committed`` (cumulative, from the rows a resumed run
        had already committed to :attr:`rows`). Empty when nothing was encoded in this call.
        """
        done = sum(r.rows + r.skipped for r in self.records if r.committed)
        return run_timeline(self.records, self.ttfo_s, already_rows=max(0, self.rows - done))

    def plot(self):
        """Where the time went: a 2x2 figure of this call.

        Rows committed over time (ending at :attr:`rows`; a resumed run starts at what was
        already committed), the SuperBatches in flight (encode, then write and commit, one
        lane per concurrent task), throughput over the run with its mean, time to first
        output marked, and each SuperBatch's size against ``b_min`` and ``b_max``. A call
        that encoded nothing (a complete run rerun) draws a figure that says so.

        Needs matplotlib (``pip install 'dask-surge[plot]'``); nothing is imported until it
        is called. Returns the figure; no backend is chosen (a notebook shows it inline, a
        script calls ``fig.savefig``).
        """
        return plot_run(self)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("records")
        d["texts_per_s"] = self.texts_per_s
        return d

    @property
    def nothing_to_do(self) -> bool:
        """Whether this call found the run complete and encoded nothing (a rerun of a complete run)."""
        return self.resumed and not self.records and self.superbatches == self.skipped_superbatches

    def __str__(self) -> str:
        if self.nothing_to_do:
            return (
                f"complete: {self.rows:,} rows in {self.superbatches:,} SuperBatches already in {self.output}, "
                f"nothing to do (checked in {self.seconds:.1f} s)"
            ) + self._index_words()
        ttfo = f"{self.ttfo_s:.2f} s" if self.ttfo_s is not None else "n/a"
        return (
            f"{self.rows:,} rows from {self.partitions:,} partitions in {self.superbatches:,} "
            f"SuperBatches ({self.skipped_superbatches:,} already committed) -> {self.output}\n"
            f"{self.seconds:.1f} s, {self.texts_per_s:,.0f} texts/s, first output after {ttfo}\n"
            f"b_min={self.b_min:,}, b_max={self.b_max:,}"
            + (f": {self.thresholds_reason.rstrip('.')}." if self.thresholds_reason else "")
            + (f"\nengine: {self.engine}" if self.engine else "")
            + (
                ("; " if self.engine else "\n")
                + f"{self.family} output ({', '.join(FAMILY_COLUMNS[self.family])})"
                if self.family != DENSE
                else ""
            )
            + (
                f"\n{self.output_rows:,} rows written: one per token window (long_texts='chunk')"
                if self.output_rows and self.output_rows != self.rows
                else ""
            )
            + (
                f"\n{self.truncated:,} texts were over the model's window and cut (long_texts='truncate'); "
                + (_EVERY_TOKEN if self.family == DENSE else "long_texts='error' refuses them instead")
                if self.truncated > 0
                else ""
            )
            + (
                f"\n{self.reused:,} texts reused from earlier outputs, {self.encoded:,} distinct texts encoded"
                if self.reused
                else ""
            )
            + (
                f"\n{self.nulls_skipped:,} null texts left out (on_null='skip'); their (partition, row) "
                f"are in dask_surge.skipped_rows({self.output!r})"
                if self.nulls_skipped
                else ""
            )
            + self._index_words()
        )

    def _index_words(self) -> str:
        """The summary's line on the searchable index (``build_index``), or nothing."""
        i = self.index
        if not i:
            return ""
        how = "built" if i.get("built", True) else "already up to date, kept"
        if i.get("kind") != "faiss":  # the table format's own index
            what = f"the {display_name(str(i.get('kind')))} table's own {i.get('index_type', 'vector')} index"
        else:
            what = f"a FAISS {i.get('index', 'HNSW')} index at {i.get('path')}"
        return (
            f"\nsearchable index ({how}): {what}, {i.get('metric')} distance, {int(i.get('rows', 0)):,} rows; "
            f"open it with dask_surge.io.index.open_index({self.output!r})"
        )
