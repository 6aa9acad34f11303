import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_surge import OnlinePlanner, SurgeValueError, plan_superbatches
from dask_surge.planning.policy import Span, SuperBatch, max_superbatch_rows, validate_thresholds

sizes_st = st.lists(st.integers(min_value=0, max_value=500), min_size=0, max_size=80)


@st.composite
def layouts(draw):
    sizes = draw(sizes_st)
    b_min = draw(st.integers(min_value=1, max_value=300))
    b_max = draw(st.integers(min_value=b_min, max_value=600))
    return sizes, b_min, b_max


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_every_row_exactly_once_in_order(layout):
    sizes, b_min, b_max = layout
    plan = plan_superbatches(sizes, b_min, b_max)
    flat = [(s.partition, r) for sb in plan for s in sb.spans for r in range(s.start, s.stop)]
    expected = [(p, r) for p, n in enumerate(sizes) for r in range(n)]
    assert flat == expected
    # every partition, even an empty one, is covered, in order
    covered = [s.partition for sb in plan for s in sb.spans]
    assert sorted(set(covered)) == list(range(len(sizes)))
    assert [sb.index for sb in plan] == list(range(len(plan)))


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_thresholds_and_lemma3_bound(layout):
    sizes, b_min, b_max = layout
    plan = plan_superbatches(sizes, b_min, b_max)
    bound = max_superbatch_rows(sizes, b_min, b_max)
    for k, sb in enumerate(plan):
        assert sb.rows <= b_max
        assert sb.rows <= bound
        is_slice = len(sb.spans) == 1 and sizes[sb.spans[0].partition] > b_max
        if k < len(plan) - 1 and not is_slice:
            # every SB but the last reaches b_min ... unless the next partition would overflow b_max
            nxt = plan[k + 1].spans[0].partition
            assert sb.rows >= b_min or sb.rows + sizes[nxt] > b_max
        if is_slice:
            n = sizes[sb.spans[0].partition]
            assert sb.spans[0].start % b_max == 0
            assert len(
                [x for x in plan if x.spans[0].partition == sb.spans[0].partition and len(x.spans) == 1]
            ) >= math.ceil(n / b_max)


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_online_equals_offline(layout):
    sizes, b_min, b_max = layout
    planner = OnlinePlanner(b_min, b_max)
    online = [sb for n in sizes for sb in planner.push(n)] + planner.finish()
    assert online == plan_superbatches(sizes, b_min, b_max)


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_multi_partition_superbatches_hold_whole_partitions(layout):
    sizes, b_min, b_max = layout
    for sb in plan_superbatches(sizes, b_min, b_max):
        if len(sb.spans) > 1:
            assert all(s.start == 0 and s.stop == sizes[s.partition] for s in sb.spans)
            assert [s.partition for s in sb.spans] == list(
                range(sb.spans[0].partition, sb.spans[-1].partition + 1)
            )


def test_worked_example():
    plan = plan_superbatches([3, 4, 20, 1], b_min=5, b_max=8)
    assert [sb.rows for sb in plan] == [7, 8, 8, 4, 1]
    assert [tuple((s.partition, s.start, s.stop) for s in sb.spans) for sb in plan] == [
        ((0, 0, 3), (1, 0, 4)),
        ((2, 0, 8),),
        ((2, 8, 16),),
        ((2, 16, 20),),
        ((3, 0, 1),),
    ]


def test_no_partitions_no_superbatches():
    assert plan_superbatches([], 10, 20) == []


@pytest.mark.parametrize(
    "b_min,b_max,match",
    [
        (0, 10, "must be positive"),
        (-1, 10, "must be positive"),
        (10, 5, "larger than b_max"),
        (1.5, 10, "not an integer"),
        ("10", 20, "not an integer"),
        (True, 10, "not an integer"),
    ],
)
def test_bad_thresholds_are_named(b_min, b_max, match):
    with pytest.raises(SurgeValueError, match=match):
        validate_thresholds(b_min, b_max)


def test_bad_size_and_push_after_finish():
    p = OnlinePlanner(2, 4)
    with pytest.raises(SurgeValueError, match="partition 0 has size -1"):
        p.push(-1)
    p.finish()
    with pytest.raises(SurgeValueError, match="after finish"):
        p.push(1)


@st.composite
def byte_layouts(draw):
    sizes, b_min, b_max = draw(layouts())
    # bytes per row from 0 to 1 MB; a partition's bytes are its rows times its mean row size
    per_row = draw(
        st.lists(st.integers(min_value=0, max_value=10**6), min_size=len(sizes), max_size=len(sizes))
    )
    # plus a per-partition overhead: Parquet footers give even an empty partition some bytes
    overhead = draw(st.integers(min_value=0, max_value=100))
    nbytes = [n * r + overhead for n, r in zip(sizes, per_row)]
    max_bytes = draw(st.integers(min_value=1, max_value=50 * 10**6))
    return sizes, b_min, b_max, nbytes, max_bytes


@settings(max_examples=300, deadline=None)
@given(byte_layouts())
def test_byte_cap_bounds_every_superbatch_and_loses_no_row(layout):
    sizes, b_min, b_max, nbytes, max_bytes = layout
    plan = plan_superbatches(sizes, b_min, b_max, nbytes=nbytes, max_bytes=max_bytes)
    flat = [(s.partition, r) for sb in plan for s in sb.spans for r in range(s.start, s.stop)]
    assert flat == [(p, r) for p, n in enumerate(sizes) for r in range(n)]
    # every partition, even an empty one over the cap, is accounted for
    assert sorted({s.partition for sb in plan for s in sb.spans}) == list(range(len(sizes)))
    for sb in plan:
        assert sb.rows <= b_max
        whole = all(s.start == 0 and s.stop == sizes[s.partition] for s in sb.spans)
        if whole and len(sb.spans) > 1:
            assert sum(nbytes[s.partition] for s in sb.spans if s.rows) <= max_bytes  # empty: no text
        elif not whole:  # a slice: about max_bytes at the partition's mean row size, or one row
            (span,) = sb.spans
            mean = nbytes[span.partition] / sizes[span.partition]
            assert span.rows == 1 or span.rows * mean <= max_bytes
    # online, the same plan
    planner = OnlinePlanner(b_min, b_max, max_bytes)
    online = [sb for n, m in zip(sizes, nbytes) for sb in planner.push(n, m)] + planner.finish()
    assert online == plan


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_byte_cap_that_never_binds_gives_the_rows_only_plan(layout):
    sizes, b_min, b_max = layout
    nbytes = [100 * n for n in sizes]
    assert plan_superbatches(sizes, b_min, b_max, nbytes=nbytes, max_bytes=10**9) == plan_superbatches(
        sizes, b_min, b_max
    )
    assert plan_superbatches(sizes, b_min, b_max, nbytes=None, max_bytes=1) == plan_superbatches(
        sizes, b_min, b_max
    )


def test_a_few_huge_texts_are_not_fused_past_the_byte_cap():
    # 4 partitions of 3 texts of ~1 MB: rows alone would fuse them into one SuperBatch of 12 rows
    sizes, nbytes = [3] * 4, [3 * 2**20] * 4
    assert [sb.rows for sb in plan_superbatches(sizes, 100, 1000)] == [12]
    plan = plan_superbatches(sizes, 100, 1000, nbytes=nbytes, max_bytes=4 * 2**20)
    assert [sb.rows for sb in plan] == [3, 3, 3, 3]
    plan = plan_superbatches(sizes, 100, 1000, nbytes=nbytes, max_bytes=2 * 2**20)
    assert [sb.rows for sb in plan] == [2, 1] * 4


@pytest.mark.parametrize("bad", [0, -1, 1.5, "1 MiB", True])
def test_bad_max_bytes_is_refused_with_the_fix(bad):
    with pytest.raises(SurgeValueError, match="max_bytes=.*positive integer.*Fix"):
        plan_superbatches([1], 1, 2, nbytes=[1], max_bytes=bad)


def test_nbytes_length_must_match_sizes():
    with pytest.raises(SurgeValueError, match="nbytes has 1 entries but sizes has 2"):
        plan_superbatches([1, 2], 1, 2, nbytes=[1], max_bytes=10)


@given(
    sizes=st.lists(st.integers(0, 400), min_size=1, max_size=30),
    b_min=st.one_of(st.none(), st.just("auto"), st.integers(1, 500)),
    b_max=st.one_of(st.none(), st.just("auto"), st.integers(1, 800)),
    threads=st.integers(1, 16),
    gpu=st.booleans(),
)
def test_plan_and_encode_resolve_the_same_thresholds(sizes, b_min, b_max, threads, gpu):
    """plan() and encode() call one resolver with the same inputs, so they cannot disagree;
    an automatic threshold never contradicts a given one."""
    from dask_surge.errors import SurgeValueError
    from dask_surge.planning.run import thresholds_for
    from dask_surge.planning.sizes import PartitionSizes

    known = PartitionSizes(tuple(sizes), "metadata")
    try:
        got = thresholds_for((b_min, b_max), known, None, gpu=gpu, threads=threads, max_bytes=None)
    except SurgeValueError as err:  # only two given, contradicting thresholds are refused
        assert isinstance(b_min, int) and isinstance(b_max, int) and b_min > b_max, err
        return
    assert 1 <= got.b_min <= got.b_max
    if isinstance(b_min, int):
        assert got.b_min == b_min
    if isinstance(b_max, int):
        assert got.b_max == b_max
    again = thresholds_for((b_min, b_max), known, None, gpu=gpu, threads=threads, max_bytes=None)
    assert again == got


# -- the ramp: small first SuperBatches, thresholds doubling up to b_min -------------------------------


@settings(max_examples=300, deadline=None)
@given(layouts(), st.integers(min_value=1, max_value=400))
def test_a_ramp_keeps_every_row_once_and_the_cap_and_ramps_its_thresholds(layout, first):
    sizes, b_min, b_max = layout
    plan = plan_superbatches(sizes, b_min, b_max, first=first)
    flat = [(s.partition, r) for sb in plan for s in sb.spans for r in range(s.start, s.stop)]
    assert flat == [(p, r) for p, n in enumerate(sizes) for r in range(n)]
    assert [sb.index for sb in plan] == list(range(len(plan)))
    for k, sb in enumerate(plan):
        assert sb.rows <= b_max
        threshold = min(b_min, first * 2**k)
        is_slice = len(sb.spans) == 1 and sizes[sb.spans[0].partition] > b_max
        if k < len(plan) - 1 and not is_slice:
            nxt = plan[k + 1].spans[0].partition
            assert sb.rows >= threshold or sb.rows + sizes[nxt] > b_max  # the ramp's threshold, as b_min's
            # ... and flushed as soon as it was reached: without its last partition it was under the threshold
            whole = [s for s in sb.spans if s.start == 0 and s.stop == sizes[s.partition]]
            if len(whole) == len(sb.spans) > 1:
                assert sb.rows - sizes[sb.spans[-1].partition] < threshold


@settings(max_examples=300, deadline=None)
@given(layouts(), st.integers(min_value=1, max_value=400))
def test_a_cut_ramp_holds_each_of_its_superbatches_at_its_threshold(layout, first):
    """A new run's ramp cuts partitions: while it lasts each SuperBatch holds exactly its threshold
    (the last one of the input at most), whatever the partitions; then the plan is SURGE's over
    what is left, every row still once and in order."""
    sizes, b_min, b_max = layout
    plan = plan_superbatches(sizes, b_min, b_max, first=first, cut=True)
    flat = [(s.partition, r) for sb in plan for s in sb.spans for r in range(s.start, s.stop)]
    assert flat == [(p, r) for p, n in enumerate(sizes) for r in range(n)]
    assert [sb.index for sb in plan] == list(range(len(plan)))
    assert all(sb.rows <= b_max for sb in plan)
    for k, sb in enumerate(plan):
        threshold = min(b_min, first * 2**k)
        if threshold < b_min:
            assert sb.rows <= threshold
            if k < len(plan) - 1:
                assert sb.rows == threshold
    if first >= b_min:  # no ramp: nothing to cut
        assert plan == plan_superbatches(sizes, b_min, b_max)


def test_a_cut_ramp_gives_a_first_superbatch_of_first_rows_from_large_partitions():
    """The small-run case: ten partitions of 100 rows, first 32: the first output waits for 32 rows,
    not a whole partition of 100 (the ramp of whole partitions)."""
    whole = [sb.rows for sb in plan_superbatches([100] * 10, b_min=704, b_max=1024, first=32)]
    cut = plan_superbatches([100] * 10, b_min=704, b_max=1024, first=32, cut=True)
    assert whole[:3] == [100, 100, 200]
    assert [sb.rows for sb in cut] == [32, 64, 128, 256, 512, 8]  # thresholds 32..512 < b_min: all cut
    assert cut[1].spans == (Span(0, 32, 96),)  # the rest of partition 0 goes on to the next ones


def test_a_cut_ramp_keeps_the_byte_cap():
    """A piece the ramp cuts never takes a SuperBatch over the byte cap (bytes pro rata the rows)."""
    plan = plan_superbatches(
        [4, 100], b_min=64, b_max=128, first=8, cut=True, nbytes=[4_000, 100_000], max_bytes=6_000
    )
    per_row = {0: 1_000, 1: 1_000}
    for sb in plan:
        assert sum((s.stop - s.start) * per_row[s.partition] for s in sb.spans) <= 6_000
    assert sum(sb.rows for sb in plan) == 104


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_a_ramp_from_b_min_or_more_is_no_ramp(layout):
    sizes, b_min, b_max = layout
    assert plan_superbatches(sizes, b_min, b_max, first=b_min) == plan_superbatches(sizes, b_min, b_max)
    assert plan_superbatches(sizes, b_min, b_max, first=None) == plan_superbatches(sizes, b_min, b_max)


def test_a_ramp_gives_a_small_first_superbatch_then_b_min_ones():
    rows = [sb.rows for sb in plan_superbatches([10] * 100, b_min=400, b_max=800, first=16)]
    assert rows[:6] == [20, 40, 70, 130, 260, 400]  # thresholds 16, 32, 64, 128, 256, then b_min
    assert set(rows[5:-1]) == {400} and sum(rows) == 1000


@pytest.mark.parametrize("bad", [0, -3, 2.5, "256", True])
def test_a_bad_ramp_is_refused_with_the_fix(bad):
    with pytest.raises(SurgeValueError, match=r"first=.*Fix: pass e.g. first=256"):
        plan_superbatches([3], 5, 8, first=bad)


def test_dask_tokens_of_plans_and_units_are_cheap_and_tell_them_apart():
    """Span, SuperBatch and Unit give Dask plain tuples to hash (Dask's field-by-field walk of
    dataclasses cost 0.1 ms a Span): equal values hash equal, any changed field changes the token."""
    from dask.tokenize import tokenize

    from dask_surge.execution.inputs import Unit

    sb = SuperBatch(0, (Span(0, 0, 5), Span(1, 0, 3)))
    assert tokenize(sb) == tokenize(SuperBatch(0, (Span(0, 0, 5), Span(1, 0, 3))))
    others = [
        SuperBatch(1, sb.spans),
        SuperBatch(0, (Span(0, 0, 5), Span(1, 0, 4))),
        SuperBatch(0, (Span(0, 1, 5), Span(1, 0, 3))),
        SuperBatch(0, (Span(2, 0, 5), Span(1, 0, 3))),
    ]
    assert len({tokenize(x) for x in [sb, *others]}) == 5
    unit = Unit((0, 1), (sb,), sizes=(5, 3))
    changed = [
        Unit((0, 1), (others[1],), sizes=(5, 3)),
        Unit((0, 1), (sb,), sizes=(5, 4)),
        Unit((0, 1), (sb,), frozenset({"000000000-000000000000"}), sizes=(5, 3)),
        Unit((0, 1), (sb,), sizes=(5, 3), expect=((1, 3, None),)),
        Unit((0, 1), None),
    ]
    assert tokenize(unit) == tokenize(Unit((0, 1), (sb,), sizes=(5, 3)))
    assert len({tokenize(x) for x in [unit, *changed]}) == 6
