"""Tests of course_lib.checkpointing's plans, cost model and optimal plan (lesson 3)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from course_lib.checkpointing import (
    PlanCost,
    all_plans,
    min_feasible_peak,
    named_plan,
    optimal_plan,
    plan_cost,
    plan_frontier,
    segments_plan,
    validate_plan,
)
from course_lib.errors import UserError

MiB = 2**20


# ---------------------------------------------------------------------------------------------------
# Plans as segments
# ---------------------------------------------------------------------------------------------------


def test_named_plans_are_segments():
    assert named_plan(4, "none") == []
    assert named_plan(4, "every-layer") == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert named_plan(5, "every-2") == [(0, 2), (2, 4), (4, 5)]
    assert named_plan(4, "every-1") == named_plan(4, "every-layer") == named_plan(4, "hf-every-1")
    assert named_plan(4, "every-9") == [(0, 4)]
    assert named_plan(16, "sqrt") == [(0, 4), (4, 8), (8, 12)]  # checkpoint_sequential(layers, 4, x)
    assert named_plan(10, "sqrt") == [(0, 4), (4, 7)]  # 3 segments of 4, 3, 3: the last runs normally
    assert named_plan(2, "sqrt") == []  # round(sqrt(2)) = 1 segment: nothing worth checkpointing
    assert named_plan(7, "hf-every-3") == [(0, 1), (3, 4), (6, 7)]  # transformers' every_n_layers=3
    assert named_plan(3, " Every-Layer ") == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize("n", range(1, 40))
def test_sqrt_plan_has_round_sqrt_n_segments_of_near_equal_size(n):
    segments = named_plan(n, "sqrt")
    k = round(math.sqrt(n))
    if k == 1:
        assert segments == []
        return
    sizes = [b - a for a, b in segments] + [n - segments[-1][1]]
    assert len(sizes) == k and sum(sizes) == n and max(sizes) - min(sizes) <= 1
    assert segments[0][0] == 0 and all(b == c for (_, b), (c, _) in zip(segments, segments[1:]))


@pytest.mark.parametrize(
    "n, plan",
    [
        (0, "none"),
        (-3, "sqrt"),
        (4, "every-0"),
        (4, "every-"),
        (4, "most"),
        (4, "every-layer-2"),
        (4, "hf-every-0"),
        (4, None),
    ],
)
def test_bad_named_plans_are_refused(n, plan):
    with pytest.raises(ValueError):
        named_plan(n, plan)


@pytest.mark.parametrize(
    "plan, words",
    [
        ([(0, 5)], "out of range"),
        ([(-1, 2)], "out of range"),
        ([(2, 2)], "out of range"),
        ([(2, 4), (0, 2)], "sorted and disjoint"),
        ([(0, 3), (2, 4)], "sorted and disjoint"),
        ([(0, 1.5)], "pair of integers"),
        ([(0, 1, 2)], "pair of integers"),
        ([0, 2], "segments"),
        ([(True, 2)], "pair of integers"),
    ],
)
def test_bad_plans_are_refused_with_a_clear_message(plan, words):
    with pytest.raises(ValueError, match=words):
        plan_cost([2] * 4, [1] * 4, plan)


def test_plans_from_json_lists_are_accepted():
    assert validate_plan([[0, 2], [3, 4]], 4) == [(0, 2), (3, 4)]


def test_segments_plan():
    assert segments_plan(16, 4) == [(0, 4), (4, 8), (8, 12)]
    assert segments_plan(16, 4, checkpoint_last=True) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert segments_plan(10, 3, checkpoint_last=True) == [(0, 4), (4, 7), (7, 10)]
    assert segments_plan(5, 1) == []
    assert segments_plan(5, 1, checkpoint_last=True) == [(0, 5)]
    with pytest.raises(ValueError):
        segments_plan(5, 6)


def _fib(k):
    a, b = 0, 1
    for _ in range(k):
        a, b = b, a + b
    return a


@pytest.mark.parametrize("n", range(1, 8))
def test_all_plans_are_every_labelling_once(n):
    plans = [tuple(p) for p in all_plans(n)]
    assert len(plans) == len(set(plans)) == _fib(2 * n + 1)
    for plan in plans:
        assert validate_plan(list(plan), n) == list(plan)
    assert [(0, 1), (2, 3)] in [list(p) for p in plans] if n >= 3 else True  # gaps between segments


# ---------------------------------------------------------------------------------------------------
# The cost model
# ---------------------------------------------------------------------------------------------------


def test_cost_of_no_checkpointing_is_everything_saved_and_no_recompute():
    cost = plan_cost([3, 3, 3, 3], [1, 1, 1, 1], [])
    assert isinstance(cost, PlanCost)
    assert cost.recompute_fraction == 0
    assert cost.forward_bytes == 12 + 1  # all saved bytes and the stack's output
    assert cost.peak_bytes == 12 + 1 + 1  # ... and the loss gradient beside them


def test_every_layer_saves_nothing_when_layers_store_only_their_input():
    saved = inputs = [4 * MiB] * 16
    none, every, sqrt = (plan_cost(saved, inputs, name) for name in ("none", "every-layer", "sqrt"))
    assert every.peak_bytes == none.peak_bytes
    assert every.recompute_fraction == 1.0
    assert sqrt.peak_bytes < 0.6 * none.peak_bytes
    assert sqrt.recompute_fraction == pytest.approx(3 / 4)  # (k-1)/k with k = 4


def test_sqrt_beats_every_layer_when_layers_store_a_little_more_than_their_input():
    inputs, saved = [MiB] * 16, [2 * MiB] * 16  # ratio 2 < sqrt(16)
    assert plan_cost(saved, inputs, "sqrt").peak_bytes < plan_cost(saved, inputs, "every-layer").peak_bytes


def test_recompute_fraction_weighs_layers_by_their_compute():
    assert plan_cost([2, 2, 2], [1, 1, 1], [(0, 1)], compute=[3, 1, 1]).recompute_fraction == pytest.approx(3 / 5)
    assert plan_cost([2, 2, 2], [1, 1, 1], [(0, 1), (2, 3)], compute=[3, 1, 1]).recompute_fraction == pytest.approx(
        4 / 5
    )


def test_a_gap_between_segments_keeps_the_unchecked_layers_saved_bytes():
    saved, inputs = [10, 10, 10], [1, 1, 1]
    gap = plan_cost(saved, inputs, [(0, 1), (2, 3)])
    assert gap.forward_bytes == 1 + 10 + 1 + 1  # input of 0, saved of 1, input of 2, the output
    assert gap.recompute_fraction == pytest.approx(2 / 3)


def test_mismatched_sizes_are_refused():
    with pytest.raises(UserError, match=r"input_bytes must have 2 byte counts \(one per layer\), got 1"):
        plan_cost([2, 2], [1], [])
    with pytest.raises(UserError, match=r"saved_bytes\[1\] must be a whole number >= 0, got -2"):
        plan_cost([2, -2], [1, 1], [])
    with pytest.raises(UserError, match=r"saved_bytes\[0\] must be a whole number >= 0, got 2.5 \(it has a fraction\)"):
        plan_cost([2.5, 2], [1, 1], [])
    with pytest.raises(UserError, match="saved_bytes must be a list of byte counts, got 'abc'"):
        plan_cost("abc", [1, 1, 1], [])


def test_layers_that_save_their_output_hold_it_in_their_backward():
    plain = plan_cost([4, 4], [4, 4], [(0, 2)], output_bytes=4, head_bytes=0)
    relu = plan_cost([4, 4], [4, 4], [(0, 2)], output_bytes=4, head_bytes=0, output_saved=[False, True])
    assert relu.peak_bytes == plain.peak_bytes + 4


def test_peak_where_names_the_moment():
    assert "turn" in plan_cost([1] * 4, [1] * 4, []).peak_where
    assert "layers 0..3 (recomputed)" in plan_cost([9] * 4, [1] * 4, [(0, 4)]).peak_where


# ---------------------------------------------------------------------------------------------------
# The optimal plan over all plans: dynamic programming == brute force
# ---------------------------------------------------------------------------------------------------


@st.composite
def stacks(draw, max_layers=8):
    n = draw(st.integers(1, max_layers))
    sizes = st.lists(st.integers(0, 40), min_size=n, max_size=n)
    kwargs = {"compute": draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))}
    if draw(st.booleans()):
        kwargs.update(
            output_bytes=draw(st.integers(0, 20)),
            grad_bytes=draw(sizes),
            transient_bytes=draw(sizes),
            head_bytes=draw(st.integers(0, 30)),
            head_grad_bytes=draw(st.integers(0, 10)),
            output_saved=draw(st.lists(st.booleans(), min_size=n, max_size=n)),
        )
    return draw(sizes), draw(st.lists(st.integers(0, 20), min_size=n, max_size=n)), kwargs


def _brute_force(saved, inputs, kwargs):
    return [plan_cost(saved, inputs, plan, **kwargs) for plan in all_plans(len(saved))]


@settings(max_examples=80, deadline=None)
@given(stacks(), st.integers(0, 200))
def test_optimal_plan_matches_brute_force_over_every_labelling(stack, slack):
    saved, inputs, kwargs = stack
    costs = _brute_force(saved, inputs, kwargs)
    minimum = min(c.peak_bytes for c in costs)
    assert min_feasible_peak(saved, inputs, **kwargs) == minimum
    budget = minimum + slack
    best = min(c.recompute_fraction for c in costs if c.peak_bytes <= budget)
    plan = optimal_plan(saved, inputs, budget, **kwargs)
    cost = plan_cost(saved, inputs, plan, **kwargs)
    assert cost.peak_bytes <= budget
    assert cost.recompute_fraction == pytest.approx(best, abs=1e-9)


@settings(max_examples=40, deadline=None)
@given(stacks(max_layers=7))
def test_frontier_is_exactly_the_pareto_set_of_all_plans(stack):
    saved, inputs, kwargs = stack
    points = {(c.peak_bytes, round(c.recompute_fraction, 9)) for c in _brute_force(saved, inputs, kwargs)}
    pareto = sorted(
        (m, r) for m, r in points if not any((m2 <= m and r2 <= r) and (m2, r2) != (m, r) for m2, r2 in points)
    )
    frontier = plan_frontier(saved, inputs, **kwargs)
    assert [(m, round(r, 9)) for m, r, _ in frontier] == pareto
    for peak, recompute, plan in frontier:  # each point is what plan_cost says of its plan
        cost = plan_cost(saved, inputs, plan, **kwargs)
        assert (cost.peak_bytes, cost.recompute_fraction) == (peak, pytest.approx(recompute))


def test_the_optimum_may_leave_a_layer_unchecked_between_segments():
    # layer 1 costs much to recompute: the best plan checkpoints its neighbours and leaves it out
    saved, inputs, compute = [2, 2, 30], [1, 1, 1], [1, 9, 1]
    plan = optimal_plan(saved, inputs, 34, compute=compute)
    assert plan == [(0, 1), (2, 3)]
    gap_free = [p for p in all_plans(3) if all(b == c for (_, b), (c, _) in zip(p, p[1:]))]
    best_gap_free = min(
        plan_cost(saved, inputs, p, compute=compute).recompute_fraction
        for p in gap_free
        if plan_cost(saved, inputs, p, compute=compute).peak_bytes <= 34
    )
    assert plan_cost(saved, inputs, plan, compute=compute).recompute_fraction == pytest.approx(2 / 11)
    assert best_gap_free == pytest.approx(10 / 11)


def test_optimal_plan_on_uneven_layers_checkpoints_the_cheap_ones():
    saved, inputs, compute = [30, 30, 2, 2, 30, 30], [1] * 6, [1, 1, 1, 1, 9, 9]
    assert plan_cost(saved, inputs, [], compute=compute).peak_bytes > 100
    assert optimal_plan(saved, inputs, 70, compute=compute) == [(0, 2)]


def test_a_budget_below_the_minimum_is_refused_naming_the_minimum():
    saved, inputs = [8] * 9, [1] * 9
    minimum = min_feasible_peak(saved, inputs)
    assert optimal_plan(saved, inputs, minimum) is not None
    with pytest.raises(ValueError, match=f"minimum feasible activation memory of {minimum} bytes"):
        optimal_plan(saved, inputs, minimum - 1)
    with pytest.raises(ValueError, match="non-negative"):
        optimal_plan(saved, inputs, -5)


def test_a_generous_budget_needs_no_checkpointing():
    assert optimal_plan([8] * 9, [1] * 9, 10**9) == []


def test_plan_cost_names_the_layer_whose_backward_holds_the_peak():
    """The planner splits a backward peak into gradients and activations at that layer (lesson 1)."""
    saved, inputs = [10, 10, 10, 10], [1, 1, 1, 1]
    # large parameter gradients: the first layer's backward, when all the others' are made, is the peak
    late = plan_cost(saved, inputs, [(0, 4)], grad_bytes=[50, 50, 50, 50])
    assert late.peak_layer == 0 and "layer" in late.peak_where
    # a large head: the turn from forward to backward is the peak, no layer's backward
    turn = plan_cost(saved, inputs, [], head_bytes=1000)
    assert turn.peak_layer is None and "turn" in turn.peak_where
    # the last layer's backward climbing above the turn (everything is still held then)
    last = plan_cost(saved, inputs, [], transient_bytes=[0, 0, 0, 5])
    assert last.peak_layer == 3, last
