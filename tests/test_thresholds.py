"""Threshold resolution: balancing an automatic b_min over the worker threads (pure, property-tested)."""

from __future__ import annotations

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

import dask_surge
from dask_surge.planning.policy import plan_superbatches
from dask_surge.planning.thresholds import balanced_b_min, makespan, resolve_thresholds


def _rows(sizes):
    return lambda lo, hi: [sb.rows for sb in plan_superbatches(sizes, lo, hi)]


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 60), min_size=1, max_size=120),
    b_min=st.integers(1, 300),
    workers=st.integers(1, 8),
)
def test_balancing_never_ends_later_and_replans_only_a_plan_that_could_end_sooner(sizes, b_min, workers):
    b_max = 4 * b_min
    rows = _rows(sizes)
    calls = []

    def counted(lo, hi):
        calls.append(lo)
        return rows(lo, hi)

    got = balanced_b_min(b_min, b_max, workers, counted)
    assert (b_min + 1) // 2 <= got <= b_min
    assert makespan(rows(got, b_max), workers) <= makespan(rows(b_min, b_max), workers)
    assert sum(rows(got, b_max)) == sum(sizes)  # the policy still covers every row
    # the same pick as replanning every candidate; b_min's plan within 1% of total / workers is kept unreplanned
    tried = sorted({max(1, b_min - (b_min * i) // 16) for i in range(9)}, reverse=True)
    spans = {lo: makespan(rows(lo, b_max), workers) for lo in tried}
    assert got == next(lo for lo in tried if spans[lo] <= min(spans.values()) * 1.01)
    assert calls == ([b_min] if spans[b_min] * workers <= sum(sizes) * 1.01 else tried)


@given(rows=st.lists(st.integers(0, 1000), max_size=40), workers=st.integers(1, 6))
def test_makespan_is_between_the_mean_load_and_the_mean_load_plus_the_largest(rows, workers):
    span = makespan(rows, workers)
    assert sum(rows) / workers <= span <= sum(rows) / workers + max(rows, default=0)
    assert makespan(rows, 1) == sum(rows)


def test_the_resolver_balances_only_an_automatic_b_min_with_known_sizes_and_several_threads():
    sizes = [10] * 70
    common = dict(gpu=False, total_rows=700, n_max=10, partitions=70, superbatch_work=_rows(sizes))
    auto = resolve_thresholds("auto", 400, workers=2, **common)
    assert auto.b_min == 66 and "88 -> 66" in auto.reason  # 10 SuperBatches of 70, not 7 of 90 + 1 of 70
    assert resolve_thresholds(100, 400, workers=2, **common).b_min == 100  # as given
    assert resolve_thresholds("auto", 400, workers=1, **common).b_min == 175  # one thread: no tail to balance
    without = dict(common, superbatch_work=None)
    assert resolve_thresholds("auto", 400, workers=2, **without).b_min == 88  # 700 / (4 x 2)
    many = dict(common, partitions=10**6)  # too many partitions to replan: left as planned
    assert resolve_thresholds("auto", 400, workers=2, **many).b_min == 88


def test_plan_and_encode_agree_on_the_balanced_thresholds(tmp_path, client):
    from dask_surge.testing import checksum_model, write_partitioned_parquet

    write_partitioned_parquet(tmp_path / "in", [10] * 70, seed=3)
    ddf = dd.read_parquet(str(tmp_path / "in"))
    with dask.config.set({"surge.b-max": 400}):
        shown = dask_surge.plan(ddf, "text", scheduler=client)
        res = ddf.surge.encode(
            "text", str(tmp_path / "out"), model=checksum_model, scheduler=client, progress=False
        )
    assert (res.b_min, res.superbatches) == (shown.b_min, len(shown.superbatches))
    back = dask_surge.read_embeddings(str(tmp_path / "out")).compute()
    assert len(back) == 700 and np.isfinite(np.stack(back["embedding"].to_numpy())).all()
    assert isinstance(back, pd.DataFrame)


def test_the_documented_auto_thresholds_are_the_resolvers_own():
    """The option docs, the shipped YAML and the quick start state the ``"auto"`` defaults; they
    restate :data:`DEFAULTS` (which the layers keep out of ``options``), so they are checked here."""
    from pathlib import Path

    from dask_surge import config
    from dask_surge.options import option
    from dask_surge.planning.thresholds import DEFAULTS

    (gpu_min, gpu_max), (cpu_min, cpu_max) = DEFAULTS["gpu"], DEFAULTS["cpu"]
    yaml_text = Path(config.DEFAULTS_PATH).read_text()
    quickstart = (Path(__file__).parents[1] / "docs" / "quickstart.md").read_text()
    assert f"{gpu_min:,} on a GPU, {cpu_min:,} on a CPU" in " ".join(option("b_min").doc.split())
    assert f"{gpu_max:,} on a GPU, {cpu_max:,} on a CPU" in " ".join(option("b_max").doc.split())
    assert f"{gpu_min:,} / {gpu_max:,} when encoding on a GPU" in yaml_text
    assert f"{cpu_min:,} / {cpu_max:,} on a CPU" in yaml_text
    assert f"{gpu_min:,} on a GPU and {cpu_min:,} on a CPU" in " ".join(quickstart.split())
    assert f"{gpu_max:,} on a GPU, {cpu_max:,} on" in " ".join(quickstart.split())
