"""The optimal checkpoint plan under a memory budget, pure Python (lesson 3, "the optimal plan").

Over ALL plans: any layer may run unchecked, any run of consecutive layers may be one segment, in any
order. Dynamic programming from the end of the stack: what the layers from i on need, on top of what
the units before them keep, is

    need(unit + rest) = max(backward peak of the unit, what the unit keeps + need(rest)),
    need(nothing) = the stack's output + the head,

where the unit starting at layer i is either layer i unchecked or a segment i .. j-1 for any j > i.
Recompute adds up, and need(unit + rest) grows with need(rest), so keeping only the Pareto-best
(need, recompute) pairs at each position loses nothing: the frontier is exact (a test compares it with
brute force over every plan).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from course_lib.checkpointing.plans import Plan, StackModel, check_layer_count
from course_lib.errors import UserError
from course_lib.measure import format_bytes
from course_lib.validate import checked


@checked
def all_plans(n_layers: int) -> Iterator[Plan]:
    """Every plan for n_layers layers: each layer unchecked or in a segment, segments anywhere.

    F(2n+1) plans (1597 for 8 layers): for brute force on small stacks only (lesson 3).
    """
    check_layer_count(n_layers)

    def rest(i: int):
        if i == n_layers:
            yield []
            return
        for tail in rest(i + 1):  # layer i unchecked
            yield tail
        for j in range(i + 1, n_layers + 1):  # a segment i .. j-1
            for tail in rest(j):
                yield [(i, j)] + tail

    yield from rest(0)


@dataclass(frozen=True)
class _Point:
    need: int
    recompute: float
    plan: tuple[tuple[int, int], ...]  # this suffix's segments


def _pareto(points: list[_Point]) -> list[_Point]:
    """The points no other point beats on both need and recompute (ties: fewest segments, then first)."""
    best: list[_Point] = []
    for p in sorted(points, key=lambda p: (p.need, p.recompute, len(p.plan), p.plan)):
        if not best or p.recompute < best[-1].recompute - 1e-9 * max(1.0, abs(best[-1].recompute)):
            best.append(p)
    return best


def plan_frontier(
    saved_bytes: Sequence[int], input_bytes: Sequence[int], **model_kwargs
) -> list[tuple[int, float, Plan]]:
    """Every best trade-off over all plans: (peak_bytes, recompute_fraction, plan), peak ascending,
    recompute descending; no plan has both a lower peak and less recompute (lesson 3, "the optimal
    plan"). Same inputs as `plan_cost` (keyword arguments passed on)."""
    model = StackModel(saved_bytes, input_bytes, **model_kwargs)
    n = model.n
    best: list[list[_Point]] = [[] for _ in range(n + 1)]
    best[n] = [_Point(model.turn, 0.0, ())]
    for i in range(n - 1, -1, -1):
        peak = model.unit_peak(i, i + 1, False)
        points = [_Point(max(peak, model.saved[i] + rest.need), rest.recompute, rest.plan) for rest in best[i + 1]]
        recompute = 0.0
        for j, peak in model.backward_peaks(i, True):
            recompute += model.costs[j - 1]
            points += [
                _Point(max(peak, model.inputs[i] + rest.need), rest.recompute + recompute, ((i, j),) + rest.plan)
                for rest in best[j]
            ]
        best[i] = _pareto(points)
    total = model.total_cost or 1.0
    return [(p.need, p.recompute / total, list(p.plan)) for p in best[0]]


def min_feasible_peak(saved_bytes: Sequence[int], input_bytes: Sequence[int], **model_kwargs) -> int:
    """The smallest activation peak any plan reaches under the cost model (lesson 3)."""
    return plan_frontier(saved_bytes, input_bytes, **model_kwargs)[0][0]


@checked
def optimal_plan(saved_bytes: Sequence[int], input_bytes: Sequence[int], budget_bytes: int, **model_kwargs) -> Plan:
    """The plan with the least recompute whose predicted activation peak fits in `budget_bytes`, over
    all plans (lesson 3, "the optimal plan"); among equal recompute, the lowest peak.

    Same inputs as `plan_cost` (keyword arguments passed on). Raises ValueError naming the minimum
    feasible memory when no plan fits.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)) or not budget_bytes >= 0:
        raise UserError(f"budget_bytes must be a non-negative number of bytes, got {budget_bytes!r}")
    frontier = plan_frontier(saved_bytes, input_bytes, **model_kwargs)
    fitting = [plan for peak, _, plan in frontier if peak <= budget_bytes]
    if not fitting:
        minimum, _, plan = frontier[0]
        raise UserError(
            f"budget of {int(budget_bytes)} bytes ({format_bytes(budget_bytes)}) is below the minimum "
            f"feasible activation memory of {minimum} bytes ({format_bytes(minimum)}) for these layers, "
            f"reached by the plan {plan}"
        )
    return fitting[-1]  # the frontier's peaks ascend and recomputes descend: the last that fits
