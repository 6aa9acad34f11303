"""The runner's units: a run killed after any commit and resumed in any order accounts for every row once.

No Dask here: units run in this process in a random order (as workers of any cluster shape
would finish them), with a writer that keeps commits in a dict (the exclusive-create rule of
:meth:`dask_surge.io.manifest.Manifest.commit`: the first attempt of a key wins).
"""

from __future__ import annotations

import random
import threading

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_surge.execution.inputs import Unit
from dask_surge.execution.unit import UnitRunner, planned_units, streaming_units
from dask_surge.io.directory import sb_key
from dask_surge.io.manifest import Coverage
from dask_surge.planning.policy import plan_superbatches
from dask_surge.planning.units import unit_partitions
from dask_surge.results import SuperBatchReport


class Killed(Exception):
    """The process died (kill -9) before this commit."""


class Store:
    """Commit records by key, as the manifest keeps them; ``budget`` commits, then a kill."""

    def __init__(self, budget: int | None = None) -> None:
        self.records: dict[str, tuple] = {}
        self.budget = budget

    def commit(self, key: str, spans: tuple) -> bool:
        if key in self.records:
            return False  # another attempt won
        if self.budget is not None:
            if self.budget == 0:
                raise Killed
            self.budget -= 1
        self.records[key] = spans
        return True


class Encoderless:
    column = "text"


class Writer:
    """Stands in for :class:`dask_surge.execution.sink.SuperBatchWriter`: checks what it is given and commits spans."""

    encoder = Encoderless()

    def __init__(self, store: Store) -> None:
        self.store = store

    def sees_output(self) -> None:
        """The stand-in store is in this process: always seen."""

    def encode(self, parts, spans):
        by_partition = dict(zip(sorted({s.partition for s, _ in spans}), parts))
        for span, n in spans:  # the rows it was given are the rows it was planned
            assert len(by_partition[span.partition]) == n
            assert 0 <= span.start < span.stop <= n or (span.start == span.stop == 0 == n)
        return spans

    def commit(self, spans) -> SuperBatchReport:
        first = spans[0][0]
        key = sb_key(first.partition, first.start)
        spans = tuple((s.partition, s.start, s.stop, n) for s, n in spans)
        won = self.store.commit(key, spans)
        return SuperBatchReport(
            sb=key,
            rows=sum(b - a for _, a, b, _ in spans),
            skipped=0,
            file="f" if won else "",
            bytes=0,
            spans=spans,
            started_at=0.0,
            encode_s=0.0,
            write_s=0.0,
            committed=won,
            committed_at=0.0,
            engine="callable",
        )


class Source:
    def __init__(self, sizes) -> None:
        self.sizes = sizes

    def iterate(self, partitions, external):
        for p in partitions:
            yield p, pd.DataFrame({"text": [f"{p}:{i}" for i in range(self.sizes[p])]})


def _units(mode: str, sizes, b_min, b_max, per_unit, store: Store) -> list[Unit]:
    coverage = Coverage.of(store.records.values())
    if mode == "planned":
        plan = plan_superbatches(sizes, b_min, b_max)
        return planned_units(plan, sizes, set(store.records), coverage)
    return streaming_units(len(sizes), per_unit, coverage)


def _run(units, runner: UnitRunner, source: Source, rng: random.Random) -> None:
    order = list(units)
    rng.shuffle(order)  # workers finish units in any order
    for unit in order:
        runner(source, [], unit)


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=30),
    b_min=st.integers(1, 30),
    extra=st.integers(0, 30),
    mode=st.sampled_from(["planned", "streaming"]),
    threads=st.integers(1, 8),
    budget=st.integers(0, 40),
    kills=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_resume_after_kills_accounts_for_every_row_once_and_equals_the_undisturbed_run(
    sizes, b_min, extra, mode, threads, budget, kills, seed
):
    b_max = b_min + extra
    rng = random.Random(seed)
    per_unit = unit_partitions(len(sizes), threads)  # recorded with the run: a resume cuts the same units
    source = Source(sizes)

    undisturbed = Store()
    runner = UnitRunner(Writer(undisturbed), b_min, b_max, None)  # type: ignore[arg-type]
    _run(_units(mode, sizes, b_min, b_max, per_unit, undisturbed), runner, source, rng)

    store = Store(budget)
    for _ in range(kills + 1):  # killed after `budget` commits, then resumed (and killed again)
        runner = UnitRunner(Writer(store), b_min, b_max, None)  # type: ignore[arg-type]
        try:
            _run(_units(mode, sizes, b_min, b_max, per_unit, store), runner, source, rng)
        except Killed:
            store.budget = rng.randint(0, 5)
            continue
        break
    store.budget = None
    runner = UnitRunner(Writer(store), b_min, b_max, None)  # type: ignore[arg-type]
    _run(_units(mode, sizes, b_min, b_max, per_unit, store), runner, source, rng)  # the final resume

    assert store.records == undisturbed.records
    rows = [(p, r) for spans in store.records.values() for p, a, b, _ in spans for r in range(a, b)]
    assert sorted(rows) == [(p, r) for p, n in enumerate(sizes) for r in range(n)]  # each row exactly once
    assert not _units(mode, sizes, b_min, b_max, per_unit, store)  # nothing left to run


@pytest.mark.parametrize("mode", ["planned", "streaming"])
def test_a_complete_run_has_no_units_left(mode):
    sizes, store = [3, 0, 12, 5], Store()
    runner = UnitRunner(Writer(store), 4, 6, None)  # type: ignore[arg-type]
    _run(_units(mode, sizes, 4, 6, 2, store), runner, Source(sizes), random.Random(0))
    assert not _units(mode, sizes, 4, 6, 2, store)
    assert Coverage.of(store.records.values()).missing(len(sizes)) == []


# -- a unit encodes its next SuperBatch while its writer thread commits the last one --------------


class OverlapWriter(Writer):
    """A writer whose commit of a SuperBatch waits until the next SuperBatch's encoding has started:
    it finishes only when the two overlap (a unit that encoded and committed in series would wait
    here until the timeout)."""

    def __init__(self, store: Store, fail_commit: int | None = None, fail_encode: int | None = None) -> None:
        super().__init__(store)
        self.encodes = 0
        self.next_encode = [threading.Event() for _ in range(64)]
        self.events: list[str] = []
        self.fail_commit, self.fail_encode = fail_commit, fail_encode

    def encode(self, parts, spans):
        i = self.encodes
        self.encodes += 1
        self.events.append(f"encode {i}")
        self.next_encode[i].set()
        if i == self.fail_encode:
            raise ValueError(f"encode {i} failed")
        return super().encode(parts, spans), i

    def commit(self, batch) -> SuperBatchReport:
        spans, i = batch
        last = i == self.expected - 1
        assert last or self.next_encode[i + 1].wait(30), f"commit {i} did not overlap encode {i + 1}"
        if i == self.fail_commit:
            self.events.append(f"commit {i} failed")
            raise OSError(f"commit {i}: disk full")
        report = super().commit(spans)
        self.events.append(f"commit {i}")
        return report


def _streaming_unit(sizes) -> Unit:
    return streaming_units(len(sizes), len(sizes), Coverage.of([]))[0]


def test_a_unit_encodes_its_next_superbatch_while_the_last_one_commits():
    sizes, store = [4, 4, 4, 4, 4], Store()
    writer = OverlapWriter(store)
    writer.expected = 5  # b_min=b_max=4: one SuperBatch per partition
    reports = UnitRunner(writer, 4, 4, None)(Source(sizes), [], _streaming_unit(sizes))  # type: ignore[arg-type]
    assert [r.sb for r in reports] == [sb_key(p, 0) for p in range(5)]  # committed in order, each reported
    assert list(store.records) == [sb_key(p, 0) for p in range(5)]
    commits = [e for e in writer.events if e.startswith("commit")]
    assert commits == [f"commit {i}" for i in range(5)]
    # commit i never starts before encode i ended, nor is commit i+1 queued before commit i ended
    assert all(writer.events.index(f"encode {i}") < writer.events.index(f"commit {i}") for i in range(5))


def test_a_failed_commit_fails_the_unit_and_later_superbatches_are_not_committed():
    sizes, store = [4, 4, 4, 4], Store()
    writer = OverlapWriter(store, fail_commit=1)
    writer.expected = 4
    with pytest.raises(OSError, match="commit 1: disk full"):
        UnitRunner(writer, 4, 4, None)(Source(sizes), [], _streaming_unit(sizes))  # type: ignore[arg-type]
    assert list(store.records) == [sb_key(0, 0)]  # commits stop at the failure: none after it
    assert writer.encodes <= 3  # the failure is heard when the unit queues its next commit


def test_an_encode_error_waits_for_the_pending_commit_and_wins():
    sizes, store = [4, 4, 4], Store()
    writer = OverlapWriter(store, fail_encode=2)
    writer.expected = 3
    threads_before = threading.active_count()
    with pytest.raises(ValueError, match="encode 2 failed"):
        UnitRunner(writer, 4, 4, None)(Source(sizes), [], _streaming_unit(sizes))  # type: ignore[arg-type]
    assert list(store.records) == [
        sb_key(0, 0),
        sb_key(1, 0),
    ]  # the pending commit ended before the error left
    assert threading.active_count() == threads_before  # no writer thread outlives the task


# -- across units: a worker runs its next unit while the last one's final commit is written ------

#: shared by the in-process worker's tasks (their functions travel pickled, Events do not)
_STARTED: dict[str, threading.Event] = {}


class CrossUnitWriter(Writer):
    """Unit ``a``'s commit waits until unit ``b`` started encoding: on a one-thread worker it
    finishes only if the worker ran ``b`` while ``a`` waited for its commit."""

    def __init__(self, store: Store, name: str) -> None:
        super().__init__(store)
        self.name = name

    def encode(self, parts, spans):
        _STARTED[self.name].set()
        return super().encode(parts, spans)

    def commit(self, spans) -> SuperBatchReport:
        if self.name == "a":
            assert _STARTED["b"].wait(20), "unit b did not start while unit a's commit was being written"
        return super().commit(spans)


def test_a_worker_runs_its_next_unit_while_the_last_commit_of_a_unit_is_written():
    distributed = pytest.importorskip("distributed")
    sizes = [4, 4]
    _STARTED.update(a=threading.Event(), b=threading.Event())
    units = planned_units(plan_superbatches(sizes, 4, 4), sizes, set(), Coverage.of([]))
    assert len(units) == 2
    store = Store()
    runners = [UnitRunner(CrossUnitWriter(store, name), 4, 4, None) for name in "ab"]  # type: ignore[arg-type]
    with distributed.Client(
        processes=False, n_workers=1, threads_per_worker=1, dashboard_address=":0"
    ) as client:
        futures = [
            client.submit(runner, Source(sizes), [], unit, pure=False) for runner, unit in zip(runners, units)
        ]
        reports = [r for f in futures for r in f.result(timeout=60)]
    assert [r.sb for r in reports] == [sb_key(0, 0), sb_key(1, 0)]
    assert all(r.committed for r in reports)  # (the worker's writers commit to copies of ``store``)


def test_outside_a_worker_a_unit_waits_for_its_last_commit_in_its_own_thread():
    sizes, store = [4], Store()
    _STARTED.update(a=threading.Event(), b=threading.Event())
    _STARTED["b"].set()  # nothing else to wait for: called by hand, the unit runs and commits in series
    unit = planned_units(plan_superbatches(sizes, 4, 4), sizes, set(), Coverage.of([]))[0]
    threads_before = threading.active_count()
    reports = UnitRunner(CrossUnitWriter(store, "a"), 4, 4, None)(Source(sizes), [], unit)  # type: ignore[arg-type]
    assert [r.sb for r in reports] == [sb_key(0, 0)] and list(store.records) == [sb_key(0, 0)]
    assert threading.active_count() == threads_before
