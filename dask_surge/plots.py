"""Pictures of a run and of a plan (matplotlib, imported only when a picture is asked for).

:meth:`dask_surge.EncodeResult.plot` and :meth:`dask_surge.SurgePlan.plot_advice` call
these; :func:`run_timeline` is the table the run picture is drawn from.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from .planning.costmodel import CostParams, predict
from .synthetic import lognormal_sizes

__all__ = ["run_timeline", "rolling_rate", "plot_run", "plot_advice", "advice_grid"]

#: how far apart two encodes of one task slot may seem to overlap: a task's times move onto the
#: client's clock by when the client heard of its end, which counts the transfer (tens of ms)
CLOCK_SLACK_S = 0.1

_TIMELINE_COLUMNS = [
    "sb",
    "rows",
    "skipped",
    "start_s",
    "commit_s",
    "encode_s",
    "write_s",
    "committed",
    "lane",
    "rows_committed",
]


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - matplotlib is in the [test] extra
        raise ImportError("plots need matplotlib. Fix: pip install 'dask-surge[plot]'.") from err
    return plt


def run_timeline(records: Sequence[Any], ttfo_s: float | None, already_rows: int = 0) -> pd.DataFrame:
    """One row per SuperBatch report, in commit order, on one clock: seconds since the call started.

    ``commit_s`` is when its commit record was created (the client's clock); ``start_s`` is
    when its encode started (``started_at``, moved onto the client's clock with the commit),
    at the latest ``commit_s`` less its encode and write time. The call's start
    is recovered from time to first output (``ttfo_s``), else it is the earliest start.
    ``lane`` numbers SuperBatches that encoded at the same time (the reports do not name their
    worker: one lane is one task slot in use; a SuperBatch's write and commit run on a writer
    thread beside the next encode, so only its encode holds the slot). ``rows_committed`` is the cumulative count of
    rows (written and skipped nulls) committed once it committed, starting from
    ``already_rows`` (a resumed run's rows committed before this call).
    """
    if not records:
        return pd.DataFrame(columns=_TIMELINE_COLUMNS)
    # every report was moved onto the client's clock by its own shift, which counts its transfer (up to
    # seconds on a busy client): all move by the run's smallest instead, so tasks keep their order
    shift = np.array([getattr(r, "clock_shift", 0.0) for r in records], dtype=float)
    shift -= shift.min()
    commit = np.array([r.committed_at for r in records], dtype=float) - shift
    # when its encode started (the task's clock, moved onto the client's with the commit time); a
    # SuperBatch may wait between its encode and its write for the one before it to commit, so
    # ``commit - write - encode`` would place its encode too late, over the next one's
    started = np.array([r.started_at for r in records], dtype=float) - shift
    start = np.minimum(started, commit - np.array([r.encode_s + r.write_s for r in records], dtype=float))
    won = np.array([bool(r.committed) for r in records])
    t0 = float(commit[won].min() - ttfo_s) if ttfo_s is not None and won.any() else float(start.min())
    t0 = min(t0, float(start.min()))
    df = (
        pd.DataFrame(
            {
                "sb": [r.sb for r in records],
                "rows": [r.rows for r in records],
                "skipped": [r.skipped for r in records],
                "start_s": start - t0,
                "commit_s": commit - t0,
                "encode_s": [r.encode_s for r in records],
                "write_s": [r.write_s for r in records],
                "committed": won,
            }
        )
        .sort_values("commit_s", kind="stable")
        .reset_index(drop=True)
    )
    lanes: list[float] = []  # when each lane frees up
    lane_of = np.zeros(len(df), dtype=int)
    for i in np.argsort(df["start_s"].to_numpy(), kind="stable"):
        # a task slot is held while the SuperBatch encodes; its write and commit run on the unit's writer
        # thread beside the next encode, so they do not hold the slot (counting them drew 3 lanes for 2 slots)
        s, e = df.at[i, "start_s"], df.at[i, "start_s"] + df.at[i, "encode_s"]
        free = [k for k, end in enumerate(lanes) if end <= s + CLOCK_SLACK_S]
        k = free[0] if free else len(lanes)
        if k == len(lanes):
            lanes.append(e)
        lanes[k] = e
        lane_of[i] = k
    df["lane"] = lane_of
    df["rows_committed"] = already_rows + ((df["rows"] + df["skipped"]) * df["committed"]).cumsum()
    return df


def rolling_rate(
    commit_s: np.ndarray, rows: np.ndarray, end: float, points: int = 200
) -> tuple[np.ndarray, np.ndarray, float]:
    """Rows committed per second over a rolling window: ``(times, rates, window)``.

    Rows count as arriving steadily between one commit and the next (the cumulative count is
    interpolated linearly from the first commit on), so the rate does not drop to 0 between
    commits, which read as stalls; before the first commit it is 0 (nothing was readable).
    The window is three typical gaps between commits, at least a tenth of the run.

    Examples
    --------
    >>> t, r, w = rolling_rate(np.array([1.0, 2.0, 3.0, 4.0]), np.array([10, 10, 10, 10]), 4.0)
    >>> round(float(r[-1]), 1), round(w, 1)
    (10.0, 3.0)
    """
    commit_s = np.asarray(commit_s, dtype=float)
    rows = np.asarray(rows, dtype=float)
    grid = np.linspace(0.0, max(end, 1e-9), points)
    if commit_s.size == 0:
        return grid, np.zeros_like(grid), end
    order = np.argsort(commit_s, kind="stable")
    times, total = commit_s[order], np.cumsum(rows[order])
    gaps = np.diff(times)
    window = max(3 * float(np.median(gaps)) if gaps.size else end, end / 10, 1e-6)

    def committed(t: np.ndarray) -> np.ndarray:  # rows committed by t, linear between commits
        return np.where(t < times[0], 0.0, np.interp(t, times, total))

    rate = (committed(grid) - committed(grid - window)) / window
    return grid, rate, window


def plot_run(result: Any):
    """The picture of :meth:`dask_surge.EncodeResult.plot` (see there)."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    records = result.records
    if not records:
        fig, ax = plt.subplots(figsize=(7, 2.2))
        ax.set_axis_off()
        ax.set_title("Nothing was encoded in this call")
        ax.text(
            0.5,
            0.5,
            f"all {result.superbatches:,} SuperBatches ({result.rows:,} rows) of run {result.run_id}\n"
            "were already committed: this call resumed a complete run",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
        return fig
    done = sum(r.rows + r.skipped for r in records if r.committed)
    df = run_timeline(records, result.ttfo_s, already_rows=max(0, result.rows - done))
    fig, axes = plt.subplots(2, 2, figsize=(11, 6.5))
    (ax_rows, ax_lanes), (ax_rate, ax_sizes) = axes
    won = df[df["committed"]]
    end = max(float(df["commit_s"].max()), result.seconds)
    first = (
        df["rows_committed"].iloc[0] - (won["rows"].iloc[0] + won["skipped"].iloc[0])
        if len(won)
        else result.rows
    )

    # rows committed over time, from what was there before this call to result.rows
    xs = np.concatenate([[0.0], won["commit_s"].to_numpy(), [end]])
    ys = np.concatenate(
        [[first], won["rows_committed"].to_numpy(), [won["rows_committed"].iloc[-1] if len(won) else first]]
    )
    ax_rows.step(xs, ys, where="post", color="C0", label="rows committed")
    ax_rows.axhline(result.rows, color="grey", linestyle=":", label=f"{result.rows:,} rows")
    ax_rows.set_title("Rows committed over time")
    ax_rows.set_xlabel("seconds since the call started")
    ax_rows.set_ylabel("rows")

    # SuperBatches in flight: a lane per task slot holds the encodes; write + commit (on the writer thread,
    # beside the next encode) is the thin bar under it
    for row in df.itertuples():
        ax_lanes.barh(row.lane, row.encode_s, left=row.start_s, color="C0", height=0.6)
        ax_lanes.barh(row.lane - 0.38, row.write_s, left=row.start_s + row.encode_s, color="C1", height=0.14)
    ax_lanes.legend(
        handles=[
            Patch(color="C0", label="encode (holds a task slot)"),
            Patch(color="C1", label="write + commit (writer thread)"),
        ],
        loc="lower right",
        fontsize="small",
    )
    ax_lanes.set_title("SuperBatches in flight (a lane: one task slot)")
    ax_lanes.title.set_fontsize("small")
    ax_lanes.set_xlabel("seconds since the call started")
    ax_lanes.set_ylabel("lane")
    ax_lanes.set_yticks(range(int(df["lane"].max()) + 1))

    # throughput: a rolling rate of rows committed, and the call's mean
    grid, rate, window = rolling_rate(
        won["commit_s"].to_numpy(), (won["rows"] + won["skipped"]).to_numpy(), end
    )
    ax_rate.plot(grid, rate, color="C2", label=f"rows/s (over {window:.1f} s)")
    ax_rate.axhline(
        result.texts_per_s, color="grey", linestyle="--", label=f"mean {result.texts_per_s:,.0f} rows/s"
    )
    ax_rate.set_title("Throughput over the run")
    ax_rate.set_xlabel("seconds since the call started")
    ax_rate.set_ylabel("rows committed per second")
    for ax in (ax_rows, ax_rate):
        if result.ttfo_s is not None:
            ax.axvline(result.ttfo_s, color="C3", linestyle="--", label=f"first output {result.ttfo_s:.2f} s")
        ax.legend(loc="best", fontsize="small")

    # SuperBatch sizes against the thresholds
    ax_sizes.bar(
        np.arange(len(df)), df["rows"] + df["skipped"], color=np.where(df["committed"], "C0", "lightgrey")
    )
    if result.b_min:
        ax_sizes.axhline(result.b_min, color="C2", linestyle="--", label=f"b_min {result.b_min:,}")
    if result.b_max:
        ax_sizes.axhline(result.b_max, color="C3", linestyle="--", label=f"b_max {result.b_max:,}")
    ax_sizes.set_yscale("log")
    ax_sizes.set_title("SuperBatch sizes against b_min / b_max")
    ax_sizes.set_xlabel("SuperBatch (commit order)")
    ax_sizes.set_ylabel("rows")
    ax_sizes.legend(loc="best", fontsize="small")

    fig.suptitle(
        f"run {result.run_id}: {result.rows:,} rows, {len(won):,} SuperBatches encoded in "
        f"{result.seconds:.1f} s ({result.skipped_superbatches:,} already committed)"
    )
    fig.tight_layout()
    return fig


def _speedup(sizes: Sequence[int], params: CostParams, b_min: int, b_max: int) -> float:
    df = predict(list(sizes), params, b_min=b_min, b_max=b_max)
    return float(df.loc["pbp", "seconds"] / df.loc["surge", "seconds"])


def advice_grid(
    params: CostParams,
    partitions: int,
    b_min: int,
    b_max: int,
    *,
    phis: Sequence[float],
    cvs: Sequence[float],
) -> np.ndarray:
    """Predicted SURGE speed-up over one call per partition on a (CV, phi) grid: log-normal
    partition sizes (``partitions`` of them) whose mean gives each phi and whose spread gives
    each CV."""
    beta = params.beta_s
    out = np.full((len(cvs), len(phis)), np.nan)
    for j, phi in enumerate(phis):
        mean = params.alpha_s * (1 - phi) / (phi * beta) if beta > 0 else np.inf
        if not np.isfinite(mean) or mean < 1:
            continue
        for i, cv in enumerate(cvs):
            sigma = float(np.sqrt(np.log1p(cv * cv)))
            total = max(partitions, round(mean * partitions))
            sizes = (
                lognormal_sizes(total, partitions, sigma=sigma, seed=0)
                if sigma > 0
                else np.full(partitions, total // partitions)
            )
            out[i, j] = _speedup(np.maximum(1, sizes).tolist(), params, b_min, b_max)
    return out


def plot_advice(plan: Any):
    """The picture of :meth:`dask_surge.SurgePlan.plot_advice` (see there)."""
    plt = _pyplot()
    from matplotlib.colors import TwoSlopeNorm

    params, advice = plan.params, plan.advice
    partitions = min(len(plan.sizes.sizes), 400)
    top = params.alpha_s / (params.alpha_s + params.beta_s) if params.alpha_s > 0 else 0.99  # mean of 1 row
    lo = min(1e-3, advice.phi / 2) if advice.phi > 0 else 1e-3
    phis = np.geomspace(lo, max(lo * 10, min(0.95, top)), 14)
    cvs = np.linspace(0.0, max(3.0, advice.cv * 1.25), 9)
    grid = advice_grid(params, partitions, plan.b_min, plan.b_max, phis=phis.tolist(), cvs=cvs.tolist())

    fig, ax = plt.subplots(figsize=(7.5, 5))
    known = np.isfinite(grid).any()
    vmin = min(0.8, float(np.nanmin(grid))) if known else 0.8
    vmax = min(4.0, max(1.5, float(np.nanmax(grid)))) if known else 1.5
    mesh = ax.pcolormesh(
        phis, cvs, grid, shading="nearest", cmap="RdBu", norm=TwoSlopeNorm(vcenter=1.0, vmin=vmin, vmax=vmax)
    )
    fig.colorbar(
        mesh, ax=ax, extend="max", label="predicted speed-up\n(SuperBatches / one call per partition)"
    )
    if known and np.nanmin(grid) < 1.05 < np.nanmax(grid):
        ax.contour(phis, cvs, grid, levels=[1.05], colors="k", linewidths=1)
        ax.plot([], [], color="k", linewidth=1, label="predicted gain 5% (log-normal sizes)")
    ax.axvline(0.05, color="k", linestyle=":", linewidth=1)
    ax.axhline(1.0, color="k", linestyle=":", linewidth=1)
    ax.text(0.052, cvs[-1] * 0.97, "phi > 5%:\nfusing can pay", va="top", fontsize="small")
    ax.text(phis[0] * 1.05, cvs[-1] * 0.97, "partitions\nalready large", va="top", fontsize="small")
    ax.text(phis[0] * 1.05, 1.03, "CV > 1: b_max bounds memory", fontsize="small")
    ax.plot(
        [advice.phi],
        [advice.cv],
        marker="*",
        markersize=16,
        color="gold",
        markeredgecolor="k",
        linestyle="none",
        label=f"this workload: phi={advice.phi:.3f}, CV={advice.cv:.2f}, {advice.predicted_speedup:.2f}x",
    )
    ax.set_xscale("log")
    ax.set_xlabel("phi: share of a mean partition's call spent in fixed per-call cost")
    ax.set_ylabel("CV of partition sizes")
    ax.set_title(f"Where this workload sits (b_min={plan.b_min:,}, b_max={plan.b_max:,})")
    ax.legend(loc="lower right", fontsize="small")
    fig.text(0.01, 0.01, "\n".join(textwrap.wrap(advice.text, 120)), fontsize="x-small", va="bottom")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig
