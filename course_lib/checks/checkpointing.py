"""Checks for the exercises of lesson 3 (gradient checkpointing).

Exercise 3.1 (`checkpointed_forward` with torch.utils.checkpoint) is checked by gradient equality, by
counting each layer's forward runs, by a measured peak and on a model with dropout; exercise 3.2 (the
cheapest plan over all plans) against brute force over every plan on small stacks and against the
library's `optimal_plan` on a stack too long for brute force. Neither accepts an answer that only
calls the library's own reference.
"""

from __future__ import annotations

import random
import time
import warnings
from collections.abc import Callable

import torch

from course_lib import checkpointing
from course_lib.checkpointing import all_plans, apply_plan, min_feasible_peak, mlp_stack, optimal_plan, plan_cost
from course_lib.checks.hints import passed, refusing
from course_lib.measure import MiB, measure_step
from course_lib.validate import checked

__all__ = ["check_checkpointed_forward", "check_best_plan"]


# The library's reference for both exercises: an answer that calls one of these is refused.
_REFERENCES = (
    checkpointing.checkpointed_forward,
    checkpointing.apply_plan,
    checkpointing.optimal_plan,
    checkpointing.plan_frontier,
    checkpointing.min_feasible_peak,
    checkpointing.segments_plan,
    checkpointing.named_plan,
    checkpointing.all_plans,
)
_WRITE_IT = "write it yourself (torch.utils.checkpoint and plain Python are fine)"


# ---------------------------------------------------------------------------------------------------
# Exercise 3.1: checkpointed_forward
# ---------------------------------------------------------------------------------------------------


def _grads(model, loss_fn, where: str = ""):
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    try:
        loss.backward()
    except RuntimeError as error:
        raise AssertionError(
            f"{where}: the backward failed ({' '.join(str(error).split())[:120]}). With "
            "use_reentrant=True a segment whose input does not require grad is cut from the "
            "graph: use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
        ) from None
    grads = {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _same_grads(expected, got, where: str) -> None:
    torch.testing.assert_close(got[0], expected[0], msg=f"{where}: the loss differs from the plain forward's")
    for name, grad in expected[1].items():
        if got[1][name] is None:
            raise AssertionError(
                f"{where}: parameter {name} got no gradient. With use_reentrant=True a segment "
                "whose input does not require grad is cut from the graph: use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
            )
        torch.testing.assert_close(
            got[1][name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: the gradient of {name} differs. {m}"
        )


@checked
def check_checkpointed_forward(checkpointed_forward: Callable) -> None:
    """Exercise 3.1: `checkpointed_forward(layers, x, plan)` runs the layers one after the other on x,
    each segment (start, end) of the plan under one torch.utils.checkpoint.checkpoint(...,
    use_reentrant=False), the other layers normally."""
    checkpointed_forward = refusing(checkpointed_forward, *_REFERENCES, instead=_WRITE_IT)
    warnings.filterwarnings("ignore", message=".*(use_reentrant|requires_grad=True).*")
    torch.manual_seed(0)
    layers, x = mlp_stack(6, 32, "gelu"), torch.randn(16, 32)  # x does not require grad, like token embeddings
    plain = _grads(layers, lambda: layers(x).pow(2).mean())
    for plan in ([], [(0, 6)], [(0, 2), (2, 4)], [(0, 1), (2, 3), (4, 6)], [(1, 5)]):
        where = f"checkpointed_forward(layers, x, {plan})"
        out = checkpointed_forward(layers, x, plan)
        assert isinstance(out, torch.Tensor), f"{where} returned {type(out).__name__}: return the output tensor"
        assert out.shape == (16, 32), f"{where} returned shape {tuple(out.shape)}: run every layer once, in order"
        _same_grads(plain, _grads(layers, lambda: checkpointed_forward(layers, x, plan).pow(2).mean(), where), where)

    # forward runs: twice in a segment (forward, then the recompute), once outside
    plan = [(0, 2), (3, 5)]
    runs = [0] * 6
    hooks = [
        layer[0].register_forward_hook(lambda *a, i=i: runs.__setitem__(i, runs[i] + 1))
        for i, layer in enumerate(layers)
    ]
    try:
        checkpointed_forward(layers, x, plan).pow(2).mean().backward()
    finally:
        for hook in hooks:
            hook.remove()
        layers.zero_grad(set_to_none=True)
    expected = [2, 2, 1, 2, 2, 1]
    assert runs == expected, f"forward runs of each layer under {plan}: {runs}, expected {expected}. " + (
        "Nothing was recomputed: run each segment inside torch.utils.checkpoint.checkpoint"
        if runs == [1] * 6
        else "Each segment's layers run twice (forward and recompute), the others once"
    )

    # dropout: the recompute must draw the same masks
    torch.manual_seed(0)
    drop = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Dropout(0.3)) for _ in range(4)])

    def seeded(run):
        torch.manual_seed(7)
        return _grads(drop, lambda: run().pow(2).mean())

    _same_grads(
        seeded(lambda: drop(x)),
        seeded(lambda: checkpointed_forward(drop, x, [(0, 3)])),
        "with dropout, plan [(0, 3)] (keep torch's preserve_rng_state=True)",
    )

    # measured: a 16-layer ReLU MLP, the sqrt plan
    torch.manual_seed(0)
    relu, xr = mlp_stack(16, 64, "relu"), torch.randn(512, 64)
    sqrt = [(0, 4), (4, 8), (8, 12)]
    none = measure_step(relu, None, lambda: relu(xr).pow(2).mean(), [xr])
    yours = measure_step(relu, None, lambda: checkpointed_forward(relu, xr, sqrt).pow(2).mean(), [xr])
    with apply_plan(relu, sqrt):
        reference = measure_step(relu, None, lambda: relu(xr).pow(2).mean(), [xr])
    peak, base, ref = (m.peak - m.baseline for m in (yours, none, reference))
    assert peak <= 1.02 * ref, (
        f"measured: your sqrt plan peaks at {peak / MiB:.2f} MiB, the library's at {ref / MiB:.2f} MiB (no "
        f"checkpointing: {base / MiB:.2f} MiB). Does each segment keep only its input?"
    )
    passed(
        f"Correct. Same loss and gradients as the plain forward on 5 plans and with dropout; each segment's "
        f"layers ran twice. Measured on a 16-layer ReLU MLP: no checkpointing {base / MiB:.2f} MiB, your sqrt "
        f"plan {peak / MiB:.2f} MiB."
    )


# ---------------------------------------------------------------------------------------------------
# Exercise 3.2: the cheapest plan over all plans
# ---------------------------------------------------------------------------------------------------


def _instances(seed: int, count: int, max_layers: int):
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.randint(1, max_layers)
        inputs = [rng.randint(1, 4) for _ in range(n)]
        saved = [i + rng.randint(0, 9) for i in inputs]  # every layer saves its input, and more
        yield saved, inputs


def _recomputed(plan) -> int:
    return sum(b - a for a, b in plan)


def _check_one(best_plan, saved, inputs, budget, best_recompute) -> None:
    where = f"best_plan(saved={saved}, inputs={inputs}, budget={budget})"
    plan = best_plan(saved, inputs, budget)
    assert plan is not None, f"{where} returned None: return a list of (start, end) segments ([] for none)"
    try:
        plan = [(int(a), int(b)) for a, b in plan]
        cost = plan_cost(saved, inputs, plan)
    except (TypeError, ValueError) as error:
        raise AssertionError(f"{where} returned {plan!r}, which is not a valid plan: {error}") from None
    assert cost.peak_bytes <= budget, (
        f"{where} returned {plan}, whose predicted peak is {cost.peak_bytes} > {budget}: it does not fit. The "
        f"peak is {cost.peak_where}. Check both kinds of moment: the turn (everything held + the output and "
        "its gradient) and each layer's backward (what earlier units hold + the saved bytes live then + the "
        "gradient arriving)"
    )
    assert _recomputed(plan) <= best_recompute, (
        f"{where} returned {plan}, which recomputes {_recomputed(plan)} layers; a plan that fits recomputes "
        f"only {best_recompute}. Does your search try, at every layer, both running it unchecked and starting "
        "a segment there (of every length)? The best plan may leave layers unchecked between segments"
    )


@checked
def check_best_plan(best_plan: Callable[[list[int], list[int], int], list[tuple[int, int]]]) -> None:
    """Exercise 3.2: `best_plan(saved, inputs, budget)` returns the plan, over all plans (segments with
    gaps between them), with the fewest recomputed layers whose predicted peak fits the budget, and
    raises ValueError when none fits."""
    best_plan = refusing(best_plan, *_REFERENCES, instead=_WRITE_IT)
    checked = 0
    for saved, inputs in _instances(seed=3, count=30, max_layers=7):
        costs = [(plan_cost(saved, inputs, p).peak_bytes, _recomputed(p)) for p in list(all_plans(len(saved)))]
        minimum = min(peak for peak, _ in costs)
        for budget in sorted({minimum, minimum + 1, minimum + 5, minimum + 20, max(p for p, _ in costs)}):
            _check_one(best_plan, saved, inputs, budget, min(r for peak, r in costs if peak <= budget))
            checked += 1
        try:
            plan = best_plan(saved, inputs, minimum - 1)
        except ValueError:
            pass
        else:
            raise AssertionError(
                f"best_plan(saved={saved}, inputs={inputs}, budget={minimum - 1}) returned "
                f"{plan}, but no plan fits (the lowest peak is {minimum}): raise ValueError "
                "naming that minimum"
            )
    # a stack far too long for brute force
    rng = random.Random(7)
    inputs = [rng.randint(1, 3) for _ in range(40)]
    saved = [i + rng.randint(0, 12) for i in inputs]
    minimum = min_feasible_peak(saved, inputs)
    budgets = (minimum, (minimum + plan_cost(saved, inputs, []).peak_bytes) // 2)
    references = [optimal_plan(saved, inputs, budget) for budget in budgets]
    for budget, reference in zip(budgets, references):
        start = time.perf_counter()
        _check_one(best_plan, saved, inputs, budget, _recomputed(reference))
        seconds = time.perf_counter() - start
        assert seconds < 30, (
            f"best_plan took {seconds:.0f} s on 40 layers: memoise on (layer, memory held "
            "so far) instead of trying every plan"
        )
        checked += 1
    passed(
        f"Correct: your plans fit and recompute as little as brute force over every plan allows on {checked - 2} "
        "budgets, and as little as the library's DP on a 40-layer stack."
    )
