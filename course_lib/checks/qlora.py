"""Checks for the exercise of lesson 5 (QLoRA on a T4).

Exercise 5.1 is checked by measurement: the learner's recipe is built, one optimizer step is run and
its peak measured by course_lib.qlora.measure_recipe, then compared with the memory budget.
"""

from __future__ import annotations

from collections.abc import Callable

from course_lib.measure import format_bytes
from course_lib.qlora import Recipe, RecipeError, measure_recipe, training_arguments

__all__ = ["check_fit_in_budget"]


def check_fit_in_budget(fit_in_budget: Callable, config, budget_bytes: int, effective_batch: int,
                        seq: int = 64) -> None:
    """Exercise 5.1: `fit_in_budget(config, budget_bytes, effective_batch, seq)` returns a Recipe whose
    measured peak fits the budget, with the asked effective batch and sequence length."""
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
        "is split, not its size")
    assert recipe.seq == seq, f"the recipe trains sequences of {recipe.seq} tokens; the task is {seq}"
    args = training_arguments(recipe, "/tmp/course_lib_check", max_steps=1)
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == effective_batch
    row = measure_recipe(config, recipe)
    assert row.measured_peak <= budget_bytes, (
        f"measured peak {format_bytes(row.measured_peak)} is over the budget of {format_bytes(budget_bytes)} "
        f"(the planner predicted {format_bytes(row.predicted_peak)}). Switch on more tricks: a smaller "
        "micro-batch with more accumulation, checkpointing, an 8-bit optimizer, a 4-bit base")
    print(f"OK: {recipe.describe()}: measured peak {format_bytes(row.measured_peak)} <= budget "
          f"{format_bytes(budget_bytes)} (planner: {format_bytes(row.predicted_peak)})")
