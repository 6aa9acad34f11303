"""Property tests of the one micro-batching rule (dask_surge.engine.batching).

The engine runs this rule and the cost model replays it; these tests pin what
both rely on: every text is in exactly one micro-batch, a micro-batch keeps to
its token budget (unless one text alone exceeds it), the padding accounting adds
up, and the engine's micro-batches are the ones the rule plans.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from dask_surge.engine import batching
from dask_surge.engine.batching import BLOCK_TEXTS, cut, plan_batches, replay, sort_order, blocks
from dask_surge.planning import costmodel

lengths_st = arrays(np.int64, st.integers(0, 300), elements=st.integers(0, 512))
budget_st = st.integers(1, 20_000)


@settings(max_examples=200, deadline=None)
@given(lengths_st, budget_st)
def test_every_text_in_exactly_one_micro_batch_in_budget(lengths, max_tokens):
    plan = plan_batches(lengths, max_tokens)
    assert sorted(plan.order.tolist()) == list(range(len(lengths)))  # a permutation
    assert plan.bounds[0] == 0 and plan.bounds[-1] == len(lengths)
    sizes = np.diff(plan.bounds)
    assert (sizes >= 1).all()
    for start, stop, width in plan.batches():
        assert width == max(int(plan.lengths[start]), 1)  # as wide as its longest text
        assert (plan.lengths[start:stop] <= width).all()
        assert (stop - start) * width <= max_tokens or stop - start == 1  # in budget, or one long text
        if stop < len(lengths):  # at least half full: only a window's last micro-batch may hold less
            assert stop - start >= max(1, (max_tokens // width) // 2)


@settings(max_examples=200, deadline=None)
@given(lengths_st, budget_st)
def test_greedy_cut_fills_every_micro_batch(lengths, max_tokens):
    plan = plan_batches(lengths, max_tokens, split_runs=False)
    for start, stop, width in plan.batches():
        assert (stop - start) * width <= max_tokens or stop - start == 1
        if stop < len(lengths):  # greedy: one more text of this width would break the budget
            assert (stop - start + 1) * width > max_tokens


@settings(max_examples=300, deadline=None)
@given(lengths_st, budget_st)
def test_micro_batches_are_cut_where_the_length_changes(lengths, max_tokens):
    """Issue 27 item 5: a micro-batch mixes lengths (needs padding and a mask) only when the run of
    its first length is too short to fill half of it; long runs are cut into one-length batches."""
    plan = plan_batches(lengths, max_tokens)
    x = plan.lengths
    uniform = plan.uniform
    for (start, stop, width), same in zip(plan.batches(), uniform):
        assert same == bool((np.maximum(x[start:stop], 1) == width).all())
        half = max(1, (max_tokens // width) // 2)
        run = int(np.sum(x[start:] == x[start]))  # the run of the first length, from here on (sorted)
        if not same:
            assert run < half  # mixed only when its first run is short
        elif run >= half:
            assert stop <= start + run  # a long run is never mixed with the next length
    padding = sum(
        (stop - start) * width - int(np.maximum(x[start:stop], 1).sum())
        for (start, stop, width), same in zip(plan.batches(), uniform)
        if not same
    )
    assert plan.padded_tokens - int(np.maximum(x, 1).sum()) == padding  # all padding is in mixed batches


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 512), st.integers(1, 2000), budget_st)
def test_one_length_needs_no_padding_at_all(length, n, max_tokens):
    plan = plan_batches(np.full(n, length), max_tokens)
    assert plan.uniform.all() and plan.padded_tokens == plan.real_tokens
    greedy = plan_batches(np.full(n, length), max_tokens, split_runs=False)
    assert plan.forwards == greedy.forwards  # near-equal pieces: no more forward passes than greedy


@settings(max_examples=200, deadline=None)
@given(lengths_st, budget_st)
def test_sorted_longest_first_and_stable(lengths, max_tokens):
    plan = plan_batches(lengths, max_tokens)
    assert (np.diff(plan.lengths) <= 0).all()
    np.testing.assert_array_equal(plan.lengths, lengths[plan.order])
    for a, b in zip(plan.order[:-1], plan.order[1:]):  # ties keep input order
        if lengths[a] == lengths[b]:
            assert a < b


@settings(max_examples=200, deadline=None)
@given(lengths_st, budget_st)
def test_padding_accounting(lengths, max_tokens):
    plan = plan_batches(lengths, max_tokens)
    expected = sum((stop - start) * width for start, stop, width in plan.batches())
    assert plan.padded_tokens == expected >= plan.real_tokens == int(lengths.sum())
    assert plan.padding_ratio >= 1.0
    assert replay(plan.lengths, max_tokens) == (float(expected), plan.forwards)


@settings(max_examples=100, deadline=None)
@given(lengths_st, st.integers(1, 64))
def test_batch_rows_rule(lengths, batch_rows):
    bounds, widths = cut(np.sort(lengths)[::-1], batch_rows=batch_rows)
    sizes = np.diff(bounds)
    assert (sizes[:-1] == batch_rows).all() and (len(sizes) == 0 or 1 <= sizes[-1] <= batch_rows)
    assert len(widths) == len(sizes)


def test_no_budget_no_rows_is_one_batch():
    bounds, widths = cut(np.array([9, 4, 1]))
    assert bounds.tolist() == [0, 3] and widths.tolist() == [9]


def test_fractional_lengths_keep_their_width():  # the cost model replays quantiles, not integers
    bounds, widths = cut(np.array([27.5, 27.5, 10.0]), max_tokens=60)
    assert widths.dtype == np.float64 and widths.tolist() == [27.5, 10.0] and bounds.tolist() == [0, 2, 3]


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_budget_is_refused_with_a_fix(bad):
    with pytest.raises(ValueError, match=r"max_tokens=.*must be an int >= 0.*Fix"):
        cut(np.array([3]), max_tokens=bad)


def test_blocks_and_sort_order():
    assert list(blocks(3 * BLOCK_TEXTS + 1)) == [0, BLOCK_TEXTS, 2 * BLOCK_TEXTS, 3 * BLOCK_TEXTS]
    assert BLOCK_TEXTS >= 65_536  # issue 17: sort over blocks of at least 64k texts
    assert sort_order(np.array([1, 3, 3, 2])).tolist() == [1, 2, 3, 0]
    with pytest.raises(ValueError, match="block=0"):
        blocks(5, 0)


def test_a_large_call_can_start_with_a_small_block_then_full_ones():
    from dask_surge.engine.batching import FIRST_BLOCK_TEXTS

    n = 2 * BLOCK_TEXTS
    assert blocks(n, first=FIRST_BLOCK_TEXTS) == [0, FIRST_BLOCK_TEXTS, FIRST_BLOCK_TEXTS + BLOCK_TEXTS]
    small = 16 * FIRST_BLOCK_TEXTS - 1  # tokenized quickly anyway: cutting it would only cost padding
    assert blocks(small, first=FIRST_BLOCK_TEXTS) == blocks(small) == [0]
    assert blocks(n, first=0) == blocks(n)
    with pytest.raises(ValueError, match=r"first=-1 must be >= 0.*Fix"):
        blocks(5, first=-1)


def test_cost_model_tokenizes_in_the_engines_blocks():
    assert costmodel._CHUNK == BLOCK_TEXTS


def test_engine_runs_the_planned_micro_batches(monkeypatch, tmp_path):
    """The engine's forward passes are exactly the micro-batches plan_batches cuts."""
    from sentence_transformers import SentenceTransformer

    from dask_surge.engine.transformer import TransformerEngine
    from dask_surge.testing import make_tiny_model

    model = SentenceTransformer(make_tiny_model(tmp_path / "tiny"), device="cpu")
    engine = TransformerEngine.from_sentence_transformer(model, max_tokens=40)
    texts = ["a", "a b c d e f g h", "", "x y z", "a b c d e f g h i j k l m n o p"] * 7
    shapes = []
    forward = engine._forward
    monkeypatch.setattr(
        engine, "_forward", lambda ids, valid: shapes.append(tuple(ids.shape)) or forward(ids, valid)
    )
    engine.encode(texts)
    plan = plan_batches(engine.count_tokens(texts), 40)
    assert shapes == [(stop - start, width) for start, stop, width in plan.batches()]
