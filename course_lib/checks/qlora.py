"""Checks for the exercise of lesson 5 (QLoRA on a T4).

Exercise 5.1 is checked by measurement, on the budget the notebook shows and on budgets it does not
(with different minimal answers): each recipe is built, one optimizer step is run and its peak measured
by course_lib.qlora.measure_recipe; it must fit, and every trick it switches on must be needed: the
recipe without that trick must not fit comfortably (measured above 90% of the budget).
"""

from __future__ import annotations

from collections.abc import Callable

from course_lib.checks.hints import passed
from course_lib.measure import MiB, format_bytes
from course_lib.qlora import TRICKS, Recipe, RecipeError, measure_recipe, predict, training_arguments
from course_lib.validate import Count, checked

__all__ = ["check_fit_in_budget"]

HIDDEN_BUDGETS = (24 * MiB, 7 * MiB)  # for the tiny Llama, effective batch 4, 64 tokens
NEEDED = 0.9  # a trick is unnecessary if the recipe fits in 90% of the budget without it


def _enabled(recipe: Recipe) -> list[str]:
    """The tricks the recipe switches on: those that switching off changes (prepare_kbit goes with nf4)."""
    return [trick for trick in TRICKS if trick != "prepare_kbit" and recipe.without(trick) != recipe]


def _check_one(
    fit_in_budget: Callable,
    config,
    budget_bytes: int,
    effective_batch: int,
    seq: int,
    shown: bool,
    measured_peak: Callable[[Recipe], int],
) -> str:
    which = f"the budget of {format_bytes(budget_bytes)}" + ("" if shown else " (one the notebook does not show)")
    recipe = fit_in_budget(config, budget_bytes, effective_batch, seq)
    assert recipe is not None, "fit_in_budget returned None: return a qlora.Recipe"
    assert isinstance(recipe, Recipe), f"return a course_lib.qlora.Recipe, got {type(recipe).__name__}"
    try:
        recipe.validate()
    except RecipeError as error:
        raise AssertionError(f"the recipe cannot be trained: {error}") from None
    assert recipe.effective_batch == effective_batch, (
        f"batch {recipe.batch} x accum {recipe.accum} = {recipe.effective_batch} samples per optimizer step, "
        f"but {effective_batch} were asked: gradient accumulation keeps the effective batch, change how it "
        "is split, not its size"
    )
    assert recipe.seq == seq, f"the recipe trains sequences of {recipe.seq} tokens; the task is {seq}"
    args = training_arguments(recipe, "course_lib_check", max_steps=1)
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == effective_batch
    peak = measured_peak(recipe)
    assert peak <= budget_bytes, (
        f"{which}: measured peak {format_bytes(peak)} is over the budget (the planner predicted "
        f"{format_bytes(predict(config, recipe).total)}). Switch on more tricks: a smaller micro-batch with more "
        "accumulation, checkpointing, an 8-bit optimizer, a 4-bit base"
    )
    for trick in _enabled(recipe):
        without = measured_peak(recipe.without(trick))
        assert without > NEEDED * budget_bytes, (
            f"{which}: {recipe.describe()} fits, but it fits without {trick!r} too (measured "
            f"{format_bytes(without)}): each trick costs time or quality, use only those you need. "
            "Ask the planner, qlora.predict(config, recipe).total, about each candidate"
        )
    return f"{which}: {recipe.describe()}, measured {format_bytes(peak)}"


@checked
def check_fit_in_budget(
    fit_in_budget: Callable, config, budget_bytes: int, effective_batch: Count, seq: Count = 64
) -> None:
    """Exercise 5.1: `fit_in_budget(config, budget_bytes, effective_batch, seq)` returns a Recipe whose
    measured peak fits the budget, with the asked effective batch and sequence length, and no trick
    it does not need; on the shown budget and on hidden ones."""
    peaks: dict[Recipe, int] = {}  # a recipe's measured peak, once: on a CPU it is exact, the same each run

    def measured_peak(recipe: Recipe) -> int:
        if recipe not in peaks:
            peaks[recipe] = measure_recipe(config, recipe, timed_steps=0).measured_peak
        return peaks[recipe]

    lines = [_check_one(fit_in_budget, config, budget_bytes, effective_batch, seq, True, measured_peak)]
    for hidden in HIDDEN_BUDGETS:
        if hidden != budget_bytes:
            lines.append(_check_one(fit_in_budget, config, hidden, effective_batch, seq, False, measured_peak))
    passed("OK, every trick needed and nothing over budget:\n  " + "\n  ".join(lines))
