"""Checks for the exercises of lesson 3 (gradient checkpointing).

Exercise 3.1 is checked on its structure and against measured memory (a plan applied to a real MLP
and measured with course_lib.measure); exercise 3.2 against brute force over every plan on small
stacks and against course_lib.checkpointing.optimal_plan on a stack too long for brute force.
"""

from __future__ import annotations

import random
import time
import warnings
from collections.abc import Callable

import torch

from course_lib.checkpointing import (all_plans, measure_plan, min_feasible_peak, mlp_stack, optimal_plan,
                                      plan_cost, profile_stack, segments_plan)
from course_lib.measure import MiB

__all__ = ["check_segment_plan", "check_best_plan"]


def _sizes(n: int, k: int, cuts: list[int]) -> list[int]:
    return [b - a for a, b in zip(cuts, cuts[1:] + [n])]


def check_segment_plan(segment_plan: Callable[[int, int], list[int]]) -> None:
    """Exercise 3.1: `segment_plan(n_layers, k)` splits a stack into k near-equal segments and
    checkpoints all but the last; then it is applied to a real MLP and its memory measured."""
    for n in range(1, 41):
        for k in range(1, n + 1):
            got = segment_plan(n, k)
            assert got is not None, "segment_plan returned None: return the list of boundaries"
            got = [int(b) for b in got]
            where = f"segment_plan({n}, {k}) returned {got}"
            if k == 1:
                assert got == [], f"{where}: one segment is the last one, which runs normally: return []"
                continue
            if got == segments_plan(n, k, checkpoint_last=True):
                raise AssertionError(f"{where}: you checkpoint the last segment too. Its backward starts right "
                                     "after the forward, so checkpointing it recomputes it for no memory saved: "
                                     "leave it out (no boundary at n)")
            assert got and got[0] == 0, f"{where}: the first segment starts at layer 0"
            assert all(a < b for a, b in zip(got, got[1:])), f"{where}: boundaries must strictly increase"
            assert got[-1] < n, f"{where}: the last segment runs normally, so no boundary may be {n}"
            assert len(got) == k, f"{where}: k={k} segments need k starts (the last start begins the unchecked one)"
            sizes = _sizes(n, k, got)
            if max(sizes) - min(sizes) > 1:
                hint = (" (this is checkpoint_sequential's split: every segment n // k layers and the remainder "
                        "piled onto the last one)") if sizes[:-1] == [n // k] * (k - 1) else ""
                raise AssertionError(f"{where}: segment sizes {sizes} differ by more than one layer{hint}; "
                                     "spread the remainder, one extra layer to each of the first n % k segments")
    # measured: the plan on a 16-layer ReLU MLP
    warnings.filterwarnings("ignore", message=".*use_reentrant.*")
    torch.manual_seed(0)
    model, x = mlp_stack(16, 64, "relu"), torch.randn(512, 64)
    loss_fn = lambda: model(x).pow(2).mean()  # noqa: E731
    profile = profile_stack(model, loss_fn, [x])
    none = measure_plan(model, loss_fn, [x], [], profile=profile, repeats=0)
    yours = measure_plan(model, loss_fn, [x], segment_plan(16, 4), profile=profile, repeats=0)
    assert yours.measured_peak <= 0.6 * none.measured_peak, (
        f"measured: your 4-segment plan peaks at {yours.measured_peak / MiB:.2f} MiB, no checkpointing at "
        f"{none.measured_peak / MiB:.2f} MiB; expected a saving of about half")
    print(f"Correct. Measured on a 16-layer ReLU MLP: no checkpointing {none.measured_peak / MiB:.2f} MiB, "
          f"your 4 segments {yours.measured_peak / MiB:.2f} MiB (cost model: {yours.predicted_peak / MiB:.2f} MiB), "
          f"for {yours.recompute_fraction:.0%} of a forward recomputed.")


def _instances(seed: int, count: int, max_layers: int):
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.randint(1, max_layers)
        inputs = [rng.randint(1, 4) for _ in range(n)]
        saved = [i + rng.randint(0, 9) for i in inputs]  # every layer saves its input, and more
        yield saved, inputs


def _recomputed(plan: list[int]) -> int:
    return plan[-1] - plan[0] if len(plan) >= 2 else 0


def _check_one(best_plan, saved, inputs, budget, best_recompute) -> None:
    where = f"best_plan(saved={saved}, inputs={inputs}, budget={budget})"
    plan = best_plan(saved, inputs, budget)
    assert plan is not None, f"{where} returned None: return a list of boundaries ([] for no checkpointing)"
    plan = [int(b) for b in plan]
    try:
        cost = plan_cost(saved, inputs, plan)
    except ValueError as error:
        raise AssertionError(f"{where} returned {plan}, which is not a valid plan: {error}") from None
    assert cost.peak_bytes <= budget, (
        f"{where} returned {plan}, whose predicted peak is {cost.peak_bytes} > {budget}: it does not fit. The "
        f"peak is {cost.peak_where}. Check both kinds of moment: the turn (everything held + the output and "
        "its gradient) and each unit's backward (what earlier units hold + the unit's saved bytes + the "
        "gradient arriving)")
    assert _recomputed(plan) <= best_recompute, (
        f"{where} returned {plan}, which recomputes {_recomputed(plan)} layers; a plan that fits recomputes "
        f"only {best_recompute}. Does your search try every end j of the next segment, and the unchecked "
        "prefix and tail?")


def check_best_plan(best_plan: Callable[[list[int], list[int], int], list[int]]) -> None:
    """Exercise 3.2: `best_plan(saved, inputs, budget)` returns the plan with the fewest recomputed
    layers whose predicted peak fits the budget, and raises ValueError when none fits."""
    checked = 0
    for saved, inputs in _instances(seed=3, count=40, max_layers=7):
        costs = [(plan_cost(saved, inputs, p).peak_bytes, _recomputed(p)) for p in all_plans(len(saved))]
        minimum = min(peak for peak, _ in costs)
        for budget in sorted({minimum, minimum + 1, minimum + 5, minimum + 20, max(p for p, _ in costs)}):
            best = min(r for peak, r in costs if peak <= budget)
            _check_one(best_plan, saved, inputs, budget, best)
            checked += 1
        try:
            plan = best_plan(saved, inputs, minimum - 1)
        except ValueError:
            pass
        else:
            raise AssertionError(f"best_plan(saved={saved}, inputs={inputs}, budget={minimum - 1}) returned {plan}, "
                                 f"but no plan fits (the lowest peak is {minimum}): raise ValueError naming "
                                 "that minimum")
    # a stack far too long for brute force (2^41 plans)
    rng = random.Random(7)
    inputs = [rng.randint(1, 3) for _ in range(40)]
    saved = [i + rng.randint(0, 12) for i in inputs]
    minimum = min_feasible_peak(saved, inputs)
    for budget in (minimum, (minimum + plan_cost(saved, inputs, []).peak_bytes) // 2):
        reference = optimal_plan(saved, inputs, budget)
        start = time.perf_counter()
        _check_one(best_plan, saved, inputs, budget, _recomputed(reference))
        seconds = time.perf_counter() - start
        assert seconds < 30, (f"best_plan took {seconds:.0f} s on 40 layers: memoise on (layer, memory "
                              "held so far) instead of trying every plan")
        checked += 1
    print(f"Correct: your plans fit and recompute as little as brute force allows on {checked} budgets, "
          "and as little as the library's DP on a 40-layer stack.")
