"""Planning a run: the thresholds and SuperBatches that :func:`dask_surge.plan` shows and
:func:`dask_surge.encode` runs, decided by the same functions.

A new run's thresholds come from :func:`thresholds_for`: the requested ``b_min``/``b_max``
(ints, or ``"auto"``), the cost model's parameters where there are some (a cached
calibration), re-based on a token sample of the user's texts (:class:`TextSample`) where the
partition sizes are known before the run starts, and balanced over the worker threads.
Its SuperBatches come from :func:`superbatches_for`: planned ahead where sizes are known,
else formed as the partitions stream in, unit by unit (:func:`planned_run`). The encoder a
name or a ready :class:`~dask_surge.models.encoders.Encoder` stands for is
:func:`encoder_for`'s.

Examples
--------
>>> from dask_surge.planning.sizes import PartitionSizes
>>> sizes = PartitionSizes([2, 2, 2, 2, 2], "metadata")
>>> run = planned_run(sizes, sizes, thresholds_for((4, 6), sizes, None, gpu=False, threads=1,
...                                               max_bytes=None), threads=1, max_bytes=None)
>>> [sb.rows for sb in run.superbatches], run.unit_partitions
([4, 4, 2], None)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import config
from ..errors import SurgeValueError
from ..families import MULTIVECTOR
from ..fingerprint import redact
from ..models.encoders import Encoder
from ..options import options_of
from .costmodel import CostParams
from .policy import SuperBatch, plan_superbatches
from .sizes import PartitionSizes
from .thresholds import Requested, Thresholds, resolve_thresholds, window_byte_cap
from .tokens import sample_texts, token_counter
from .units import streamed_plan, unit_partitions

__all__ = [
    "TextSample",
    "PlannedRun",
    "RunThresholds",
    "encoder_for",
    "windowed_bytes",
    "new_ramp",
    "superbatches_for",
    "thresholds_for",
    "params_for_data",
    "planned_run",
]


def encoder_for(model: Any, given: Mapping[str, Any]) -> Encoder:
    """``model`` as an :class:`Encoder` with the Encoder options in ``given`` (the config's where
    one is None).

    Raises
    ------
    SurgeValueError
        When ``model`` is a ready Encoder and Encoder options are given beside it (they would be
        dropped).
    """
    taken = options_of("Encoder")
    if isinstance(model, Encoder):
        extra = {
            o.name: given[o.name]
            for o in taken
            if given.get(o.name) is not None and given.get(o.name) is not False
        }
        if extra:
            raise SurgeValueError(
                f"{', '.join(f'{k}={redact(v)!r}' for k, v in extra.items())} given alongside a ready Encoder "
                f"({model!r}), which holds its own options, so they would be dropped. Fix: "
                f"model.with_options({', '.join(f'{k}=...' for k in extra)}), or pass the model's name with them."
            )
        return model
    model = config.get("model") if model is None else model
    kwargs = {
        o.name: config.get(o.config, given.get(o.name))
        if o.config
        else o.default
        if given.get(o.name) is None
        else given[o.name]
        for o in taken
    }
    return Encoder(model, **kwargs)


def windowed_bytes(
    max_bytes: int | None, b_max: Requested, encoder: Encoder, long_texts: str, overlap: int, *, gpu: bool
) -> int | None:
    """The byte cap, lowered in chunk/mean mode so a SuperBatch holds about ``b_max`` token windows
    (:func:`~dask_surge.planning.thresholds.window_byte_cap`): its memory counts windows, not texts.
    For a multi-vector model every token is a vector of the output, so a SuperBatch holds about
    ``b_max`` token vectors (a window of one token each)."""
    if encoder.family == MULTIVECTOR:
        return window_byte_cap(max_bytes, b_max, 1, 0, gpu=gpu)
    if long_texts not in ("chunk", "mean") or encoder.window_capacity is None:
        return max_bytes
    return window_byte_cap(max_bytes, b_max, encoder.window_capacity, overlap, gpu=gpu)


class TextSample:
    """Texts sampled from a frame (read once, when first asked for), and what the model makes of
    them: token lengths, and the token windows of chunk/mean mode (cut once)."""

    def __init__(
        self, ddf: Any, column: str, sizes: PartitionSizes, model: Any, n: int, overlap: int
    ) -> None:
        self._args = (ddf, column, sizes.sizes, n)
        self.model, self.overlap = model, overlap
        self._texts: list[str] | None = None
        self._windows: Any = None
        self._lengths: dict[bool, np.ndarray] = {}

    @property
    def texts(self) -> list[str]:
        if self._texts is None:
            ddf, column, sizes, n = self._args
            self._texts = sample_texts(ddf, column, sizes, n=n)
        return self._texts

    @functools.cached_property
    def encoder(self) -> Encoder:
        return encoder_for(self.model, {})

    def _cut(self) -> Any:
        if self._windows is None:
            self._windows = self.encoder.windows(self.texts, chunk_overlap=self.overlap)
        return self._windows

    def windows_per_text(self) -> np.ndarray:
        """Windows each sampled text makes (1 for a text within the model's window)."""
        return np.bincount(self._cut().text, minlength=len(self.texts))

    def token_lengths(self, long_texts: str) -> np.ndarray:
        """Tokens the model runs per sampled text: truncated, or in chunk/mean mode all its windows'
        tokens (each window with the special tokens and the prompt). Counted once per mode."""
        windowed = long_texts in ("chunk", "mean") and self.encoder.window_capacity is not None
        if windowed not in self._lengths:
            if windowed:
                w = self._cut()
                self._lengths[windowed] = np.bincount(
                    w.text,
                    weights=w.tokens.astype(float) + self.encoder.window_overhead,
                    minlength=len(self.texts),
                )
            else:
                self._lengths[windowed] = token_counter(self.encoder)(self.texts)
        return self._lengths[windowed]


def new_ramp() -> tuple[int | None, bool]:
    """The ramp a new run plans with and records: ``(first, cut)``, the first SuperBatch's rows
    (``surge.first-superbatch``; None: ``b_min`` from the start) and whether the ramp cuts
    partitions at its thresholds (a new run's does; runs recorded before did not).

    Examples
    --------
    >>> new_ramp()[1]
    True
    """
    return config.get("first-superbatch"), True


def superbatches_for(
    sizes: PartitionSizes,
    b_min: int,
    b_max: int,
    max_bytes: int | None,
    *,
    ramp: tuple[int | None, bool] | None = None,
) -> list[SuperBatch]:
    """The SuperBatches a run plans ahead over these sizes: the byte cap applies where text bytes
    are known, and the first ones ramp up as ``ramp`` says: ``(first, cut)`` as a run recorded it,
    or None for a new run's (:func:`new_ramp`)."""
    first, cut = new_ramp() if ramp is None else ramp
    cap = max_bytes if sizes.nbytes is not None else None
    return plan_superbatches(
        sizes.sizes, b_min, b_max, nbytes=sizes.nbytes, max_bytes=cap, first=first, cut=cut
    )


def _work(sizes: PartitionSizes, superbatches: list[SuperBatch]) -> list[int]:
    """The work of each SuperBatch: its text bytes plus 8 a row (tokens follow bytes, and each text
    adds its special tokens) where bytes are known, else its rows: a SuperBatch's time follows its
    tokens more than its rows, so rows alone balance the tail badly."""
    if sizes.nbytes is None:
        return [sb.rows for sb in superbatches]
    return [
        sum(
            8 * s.rows + sizes.nbytes[s.partition] * s.rows // max(1, sizes.sizes[s.partition])
            for s in sb.spans
        )
        for sb in superbatches
    ]


def params_for_data(params: CostParams, sample: TextSample | None, long_texts: str) -> tuple[CostParams, str]:
    """``params`` re-based on the token lengths of a sample of the user's texts (None: no token
    sample is configured), and a phrase saying where its tokens came from.

    In chunk/mean mode a text counts all its windows' tokens, so the cost model predicts what
    those runs encode."""
    if sample is None:
        return params, f"calibration texts ({params.tokens_per_text:.1f} tokens a text)"
    if not sample.texts:
        return params, f"calibration texts ({params.tokens_per_text:.1f} tokens a text): no text to sample"
    params = params.with_token_lengths(sample.token_lengths(long_texts))
    return params, f"a sample of {len(sample.texts):,} texts ({params.tokens_per_text:.1f} tokens a text)"


def thresholds_for(
    requested: tuple[Requested, Requested],
    known: PartitionSizes | None,
    params: CostParams | None,
    *,
    gpu: bool,
    threads: int,
    max_bytes: int | None,
    sample: TextSample | None = None,
    long_texts: str = "truncate",
) -> Thresholds:
    """The thresholds of a new run, the same for :func:`dask_surge.plan` and :func:`dask_surge.encode`.

    Parameters
    ----------
    requested : (b_min, b_max)
        As asked: ints or ``"auto"``.
    known : PartitionSizes or None
        The partition sizes the run knows before it starts; None when the input streams (then
        neither the sizes nor the data count).
    params : CostParams or None
        The cost model's parameters (a calibration), or None to use the defaults.
    sample : TextSample, optional
        Texts of the input: ``params`` are re-based on their token lengths where sizes are known.
    """
    if params is not None and known is not None and known.total:
        params, _ = params_for_data(params, sample, long_texts)
    b_min, b_max = requested
    if known is None:
        return resolve_thresholds(b_min, b_max, gpu=gpu, workers=threads, params=params)
    return resolve_thresholds(
        b_min,
        b_max,
        gpu=gpu,
        workers=threads,
        params=params,
        total_rows=known.total,
        n_max=max(known.sizes, default=0),
        partitions=len(known.sizes),
        superbatch_work=lambda lo, hi: _work(known, superbatches_for(known, lo, hi, max_bytes)),
    )


@dataclass(frozen=True)
class PlannedRun:
    """A new run's plan: its thresholds and SuperBatches (formed unit by unit of ``unit_partitions``
    partitions when the input streams; None when planned ahead)."""

    thresholds: Thresholds
    superbatches: list[SuperBatch]
    unit_partitions: int | None


def planned_run(
    sizes: PartitionSizes,
    known: PartitionSizes | None,
    thresholds: Thresholds,
    *,
    threads: int,
    max_bytes: int | None,
) -> PlannedRun:
    """The SuperBatches a new run with ``thresholds`` makes of ``sizes`` (as counted: ``known`` is
    what the run knows before it starts, None when it streams)."""
    if known is not None:
        return PlannedRun(
            thresholds, superbatches_for(sizes, thresholds.b_min, thresholds.b_max, max_bytes), None
        )
    per_unit = unit_partitions(len(sizes.sizes), threads)
    return PlannedRun(
        thresholds,
        streamed_plan(
            sizes.sizes,
            thresholds.b_min,
            thresholds.b_max,
            per_unit,
            nbytes=sizes.nbytes,
            max_bytes=max_bytes,
        ),
        per_unit,
    )


@dataclass(frozen=True)
class RunThresholds:
    """The thresholds :func:`dask_surge.encode` was asked for, resolved by :func:`thresholds_for` for
    a new run once its sizes are known (a :class:`~dask_surge.execution.runner.ThresholdResolver`).

    ``calibration`` is asked for the cost model's parameters only when a threshold is
    ``"auto"`` (a resumed run keeps its recorded thresholds and never asks); the token sample
    (``token_sample`` texts, None for none) is read only then too, and ``threads`` (the worker
    threads that run the units) is counted then: a cluster may still be growing when the run starts.
    """

    requested: tuple[Requested, Requested]
    encoder: Encoder
    frame: Any
    column: str
    threads: Callable[[], int]
    gpu: bool
    long_texts: str = "truncate"
    overlap: int = 0
    calibration: Callable[[], CostParams | None] | None = None
    token_sample: int | None = None

    def __call__(self, sizes: PartitionSizes | None, max_bytes: int | None) -> Thresholds:
        params = self.calibration() if self.calibration is not None and "auto" in self.requested else None
        sample = None
        if params is not None and sizes is not None and sizes.total and self.token_sample is not None:
            sample = TextSample(self.frame, self.column, sizes, self.encoder, self.token_sample, self.overlap)
        return thresholds_for(
            self.requested,
            sizes,
            params,
            gpu=self.gpu,
            threads=self.threads(),
            max_bytes=max_bytes,
            sample=sample,
            long_texts=self.long_texts,
        )
