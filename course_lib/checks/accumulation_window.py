"""The check of lesson 2's exercise 2.2: the end of a window, when GradScaler skips a step.

The check accumulates each window itself (rightly) and calls the learner's `finish_window` after the
window's last backward; it compares the weights with training on each window as one batch, the window
whose gradients overflowed left out. `tests/accumulation/test_accumulation.py` proves that each mistake is named.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch

from course_lib.accumulation import (
    SampleLoss,
    TinyTokenLM,
    TokenLoss,
    max_weight_difference,
    padded_token_batches,
    regression_batches,
    tiny_mlp,
    train_whole_windows,
)
from course_lib.accumulation import loop as reference_loop
from course_lib.checks.accumulation import WEIGHT_TOLERANCE, StepProbe, model_optimizer_scheduler
from course_lib.checks.hints import passed, refuse_reference
from course_lib.validate import checked

__all__ = ["check_finish_window"]


def _overflowing(batches: list, index: int) -> list:
    """`batches` with micro-batch `index`'s first target set to inf: its window's gradients overflow."""
    inputs, targets = batches[index]
    targets = targets.clone()
    targets[0, 0] = math.inf
    return [*batches[:index], (inputs, targets), *batches[index + 1 :]]


_WINDOW_SCENARIOS = [
    # name, model factory, batches, loss, K, max_grad_norm, GradScaler init scale, the windows GradScaler skips
    (
        "no GradScaler (6 micro-batches, K=2)",
        lambda: tiny_mlp("layer"),
        lambda: regression_batches(6, 4, seed=21),
        SampleLoss("mse"),
        2,
        None,
        None,
        set(),
    ),
    (
        "GradScaler and clipping (max_grad_norm=0.05, init_scale=2**12)",
        TinyTokenLM,
        lambda: padded_token_batches(6, batch_size=2, seed=22),
        TokenLoss(),
        2,
        0.05,
        2.0**12,
        set(),
    ),
    (
        "GradScaler, window 2 of 4 overflows (an inf in its gradients)",
        lambda: tiny_mlp("layer"),
        lambda: _overflowing(regression_batches(8, 4, seed=23), 3),
        SampleLoss("mse"),
        2,
        0.5,
        2.0**12,
        {1},
    ),
]


def _check_finish_window(finish_window: Callable) -> None:
    for name, factory, make_batches, loss, k, max_norm, init_scale, skipped in _WINDOW_SCENARIOS:
        batches = make_batches()
        model, optimizer, scheduler = model_optimizer_scheduler(factory)
        probe = StepProbe(model, optimizer, scheduler)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=10**6) if init_scale else None
        returned, steps_before = [], 0
        for start in range(0, len(batches), k):  # the lesson's accumulation of a window, right
            window = batches[start : start + k]
            items = sum(loss.count(mb) for mb in window)
            for mb in window:
                part = loss.sum(model, mb) / items
                (scaler.scale(part) if scaler is not None else part).backward()
            with (
                refuse_reference(reference_loop, instead="write the end of the window yourself"),
                warnings.catch_warnings(),
            ):
                warnings.simplefilter("ignore")  # the scheduler-before-optimizer warning of a skipped step
                returned.append(finish_window(model, optimizer, scheduler, scaler, max_norm))
            stepped, steps_before = probe.optimizer_steps > steps_before, probe.optimizer_steps
            window_no = start // k
            if not all(torch.isfinite(p).all() for p in model.parameters()):
                raise AssertionError(
                    f"{name}: after window {window_no + 1} the weights hold inf or NaN: the optimizer "
                    "stepped on gradients that overflowed. With a GradScaler, step through "
                    "scaler.step(optimizer): it skips the step when the gradients hold inf or NaN"
                )
            if stepped == (window_no in skipped):
                raise AssertionError(
                    f"{name}: window {window_no + 1}'s optimizer step was "
                    f"{'taken' if stepped else 'skipped'}; expected it "
                    f"{'skipped' if stepped else 'taken'}. Step once per window, through "
                    "scaler.step(optimizer) when there is a GradScaler"
                )
            if any(p.grad is not None for p in model.parameters()):
                raise AssertionError(
                    f"{name}: after window {window_no + 1} the gradients are still there: end the "
                    "window with optimizer.zero_grad(set_to_none=True), skipped step or not"
                )
            if probe.scheduler_steps != probe.optimizer_steps:
                raise AssertionError(
                    f"{name}: after window {window_no + 1} the scheduler had stepped "
                    f"{probe.scheduler_steps} times for {probe.optimizer_steps} optimizer steps. "
                    "A step that GradScaler skipped is no step: the learning rate must not move "
                    "on; step the scheduler only after a step that was taken"
                )
            if returned[-1] is not stepped:
                raise AssertionError(
                    f"{name}: finish_window returned {returned[-1]!r} for window {window_no + 1}, "
                    f"whose step was {'taken' if stepped else 'skipped by GradScaler'}: return True "
                    "when the optimizer stepped, False when GradScaler skipped the step"
                )
        if scaler is not None and scaler.get_scale() != init_scale * 0.5 ** len(skipped):
            raise AssertionError(
                f"{name}: the GradScaler's scale is {scaler.get_scale():g}, expected "
                f"{init_scale * 0.5 ** len(skipped):g}: call scaler.update() after each "
                "scaler.step(optimizer), which lowers the scale after a skipped step"
            )
        kept = [mb for i, mb in enumerate(batches) if i // k not in skipped]
        truth, t_opt, t_sched = model_optimizer_scheduler(factory)
        train_whole_windows(truth, t_opt, kept, loss, k, scheduler=t_sched, max_grad_norm=max_norm)
        diff = max_weight_difference(model, truth)
        if not diff <= WEIGHT_TOLERANCE:
            hint = (
                "clip after scaler.unscale_(optimizer): before it the gradients are multiplied by the scale"
                if scaler is not None and max_norm is not None
                else "clip the gradients to max_grad_norm, then step the optimizer"
            )
            raise AssertionError(
                f"{name}: the weights end {diff:.2e} away from training on each window taken as one batch: {hint}"
            )


@checked
def check_finish_window(finish_window: Callable) -> None:
    """Exercise 2.2: `finish_window(model, optimizer, scheduler, scaler, max_grad_norm)` ends a window.

    Run after the window's last backward, on three scenarios against training on each window as one
    batch (a window whose gradients overflowed left out): no GradScaler; a GradScaler with clipping;
    and a GradScaler whose second of four windows overflows (an inf target), so that its step is
    skipped. Checked after each window: no inf or NaN in the weights, the optimizer step taken (or
    skipped by GradScaler), the gradients set to None, True returned exactly when the optimizer
    stepped, and the scheduler stepped as often as the optimizer; at the end, the scale lowered once
    per skipped step (scaler.update()) and the weights. An answer that calls the lesson's reference loop
    (course_lib.accumulation.loop) is refused. The first problem found is raised as an AssertionError
    naming it.
    """
    _check_finish_window(finish_window)
    passed(
        "Correct: your window ends step, clip and schedule as whole-window training does, and a step "
        "that GradScaler skipped moves neither the weights nor the learning rate."
    )
