"""Checks for the exercises of lesson 2 (gradient accumulation), and of the DDP cross-check.

Each check builds small models and data, runs the learner's function and an independent ground truth
(the whole window as one batch), and raises AssertionError with a hint naming the classic mistake it
recognised. `tests/accumulation/test_accumulation.py` proves that each mistake is caught, by running these checks
on the broken loops of `course_lib.accumulation.broken` and on the exercise's planted loop.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Sequence

import torch

from course_lib.accumulation import (
    DDPReport,
    SampleLoss,
    TinyTokenLM,
    TokenLoss,
    concat_batches,
    max_weight_difference,
    padded_token_batches,
    regression_batches,
    tiny_mlp,
    train_whole_windows,
)
from course_lib.checks.hints import passed
from course_lib.validate import checked

__all__ = ["check_accumulate_gradients", "check_training_loop", "training_loop_problem", "check_ddp_accumulation"]

WEIGHT_TOLERANCE = 1e-5  # max relative weight difference allowed against the whole-window ground truth
GRAD_TOLERANCE = 1e-5  # max relative gradient difference in fp32


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _rel_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    scale = max(float(t.abs().max()) for t in b) or 1.0
    return max(float((x - y).abs().max()) for x, y in zip(a, b)) / scale


def _whole_gradient(model_factory, batches, loss) -> tuple[list[torch.Tensor], float]:
    model = model_factory()
    whole = concat_batches(batches)
    value = loss.sum(model, whole) / loss.count(whole)
    value.backward()
    return _grads(model), value.item()


def _naive_gradient(model_factory, batches, loss) -> list[torch.Tensor]:
    model = model_factory()
    for mb in batches:
        (loss.sum(model, mb) / loss.count(mb) / len(batches)).backward()
    return _grads(model)


@checked
def check_accumulate_gradients(accumulate_gradients: Callable) -> None:
    """Exercise 2.1: `accumulate_gradients(model, micro_batches, loss)` accumulates the window's gradient.

    Requirements checked: the accumulated gradient equals the gradient of the whole window as one
    batch (also when token counts differ between micro-batches, and when a micro-batch has no valid
    token), one backward per micro-batch, the window's loss (sum / count) is returned, and a window
    without any valid token raises ValueError instead of producing NaN.
    """
    cases = [
        (
            "equal-size regression micro-batches",
            lambda: tiny_mlp("layer"),
            regression_batches(3, 4, seed=1),
            SampleLoss("mse"),
        ),
        (
            "padded token micro-batches (token counts differ)",
            TinyTokenLM,
            padded_token_batches(4, batch_size=2, seed=3),
            TokenLoss(),
        ),
    ]
    with_empty = padded_token_batches(3, batch_size=2, seed=5)
    with_empty[1]["labels"][:] = -100
    cases.append(
        ("a micro-batch whose labels are all ignore_index (no valid token)", TinyTokenLM, with_empty, TokenLoss())
    )
    for label, factory, batches, loss in cases:
        model = factory()
        backward_calls = []
        first = next(model.parameters())
        first.register_hook(lambda g: backward_calls.append(1))
        returned = accumulate_gradients(model, batches, loss)
        got = _grads(model)
        expected, expected_loss = _whole_gradient(factory, batches, loss)
        if any(not torch.isfinite(g).all() for g in got):
            raise AssertionError(
                f"{label}: the gradient has NaN or inf. A micro-batch without valid tokens must "
                "add nothing; its own mean is 0/0. Divide each sum by the window's count."
            )
        if all(float(g.abs().max()) == 0.0 for g in got):
            raise AssertionError(f"{label}: no gradient at all: call backward() on each micro-batch's loss")
        diff = _rel_diff(got, expected)
        if diff > GRAD_TOLERANCE:
            if isinstance(loss, TokenLoss) and _rel_diff(got, _naive_gradient(factory, batches, loss)) < GRAD_TOLERANCE:
                raise AssertionError(
                    f"{label}: you averaged the per-micro-batch means. With padding the token "
                    "counts differ, so tokens of short micro-batches weigh more. Divide each "
                    "micro-batch's loss sum by the token count of the whole window."
                )
            ratio = float(got[0].flatten()[0] / expected[0].flatten()[0]) if float(expected[0].flatten()[0]) else 0.0
            raise AssertionError(
                f"{label}: the accumulated gradient differs from the whole window's by "
                f"{diff:.2e} (relative; ratio of one entry {ratio:.3f}). Each micro-batch should "
                "contribute loss.sum(model, mb) / (sum of loss.count over the window)."
            )
        if len(backward_calls) != len(batches):
            raise AssertionError(
                f"{label}: backward ran {len(backward_calls)} time(s) for {len(batches)} "
                "micro-batches. Call backward once per micro-batch: summing the losses and "
                "calling backward once keeps every micro-batch's activations alive at the same "
                "time, which is the memory accumulation exists to save."
            )
        if returned is not None and not math.isfinite(float(returned)):
            raise AssertionError(
                f"{label}: the returned loss is {float(returned)}. A micro-batch without valid "
                "tokens has a mean of 0/0; add its sum (0) divided by the window's count instead."
            )
        if returned is None or not abs(float(returned) - expected_loss) <= 1e-5 * max(1.0, abs(expected_loss)):
            raise AssertionError(
                f"{label}: return the window's loss, sum over micro-batches of loss.sum divided by "
                f"the window's count (expected {expected_loss:.6f}, got {returned!r})"
            )
    empty = padded_token_batches(2, batch_size=2, seed=7)
    for mb in empty:
        mb["labels"][:] = -100
    model = TinyTokenLM()
    try:
        accumulate_gradients(model, empty, TokenLoss())
    except ValueError:
        pass
    else:
        raise AssertionError(
            "a window in which every label is ignore_index has no valid token: its mean loss is "
            "0/0. Raise ValueError with a clear message rather than returning NaN or 0."
        )
    passed("Correct: your accumulated gradients equal the whole window's, padding and empty micro-batches included.")


class StepProbe:
    """Counts optimizer and scheduler steps and records whether gradients were None at each forward."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
        self.optimizer_steps = 0
        self.scheduler_steps = 0
        self.grads_none_at_forward: list[bool] = []
        self.grads_zero_tensors_at_forward: list[bool] = []
        optimizer.register_step_post_hook(self._on_step)
        model.register_forward_pre_hook(self._on_forward)
        self.params = list(model.parameters())
        original = scheduler.step

        def counted_step(*args, **kwargs):
            self.scheduler_steps += 1
            return original(*args, **kwargs)

        scheduler.step = counted_step

    def _on_step(self, optimizer, args, kwargs) -> None:
        self.optimizer_steps += 1

    def _on_forward(self, module, args) -> None:
        self.grads_none_at_forward.append(all(p.grad is None for p in self.params))
        self.grads_zero_tensors_at_forward.append(all(p.grad is not None and not p.grad.any() for p in self.params))


def model_optimizer_scheduler(factory, lr: float = 0.5):
    model = factory()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    return model, optimizer, scheduler


_SCENARIOS = [
    # name, model factory, batches, loss, K, max_grad_norm, scaler init scale, hint when the weights differ
    (
        "full windows (8 equal micro-batches, K=4)",
        lambda: tiny_mlp("layer"),
        lambda: regression_batches(8, 4, seed=11),
        SampleLoss("mse"),
        4,
        None,
        None,
        "the weights after training differ from training on each window as one batch: check the loss "
        "normalisation (sum / window count) and that gradients are zeroed once per window, not per micro-batch",
    ),
    (
        "a short final window (10 equal micro-batches, K=4: windows of 4, 4, 2)",
        lambda: tiny_mlp("layer"),
        lambda: regression_batches(10, 4, seed=12),
        SampleLoss("mse"),
        4,
        None,
        None,
        "the short final window is wrong: normalise it by its own item count (2 micro-batches here), not by "
        "accumulation_steps",
    ),
    (
        "padded token micro-batches (token counts differ)",
        TinyTokenLM,
        lambda: padded_token_batches(8, batch_size=2, seed=13),
        TokenLoss(),
        4,
        None,
        None,
        "with padding the token counts differ between micro-batches: divide each micro-batch's loss sum by the "
        "token count of the whole window, not by its own count (the mean of per-micro-batch means is wrong)",
    ),
    (
        "gradient clipping (max_grad_norm=0.05)",
        TinyTokenLM,
        lambda: padded_token_batches(8, batch_size=2, seed=14),
        TokenLoss(),
        4,
        0.05,
        None,
        "clipping is in the wrong place: clip once per window, after the last micro-batch's backward (the norm "
        "of partial sums is not the norm of the window's gradient)",
    ),
    (
        "GradScaler and clipping (init_scale=2**12)",
        TinyTokenLM,
        lambda: padded_token_batches(8, batch_size=2, seed=15),
        TokenLoss(),
        4,
        0.05,
        2.0**12,
        "with a GradScaler the gradients are multiplied by the scale until unscaled: call scaler.unscale_(optimizer) "
        "once, after the last micro-batch, before clip_grad_norm_; then scaler.step(optimizer) and scaler.update()",
    ),
]


class _DataParallelStandIn(torch.nn.Module):
    """Looks like DistributedDataParallel to a loop (it has `no_sync()`); records which forwards ran in it.

    DDP decides at forward time whether the coming backward all-reduces (the forward inside
    `no_sync()` does not), so the record says which micro-batches would have synchronised.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.quiet_forwards: list[bool] = []
        self._quiet = False

    @contextlib.contextmanager
    def no_sync(self):
        self._quiet = True
        try:
            yield
        finally:
            self._quiet = False

    def forward(self, *args, **kwargs):
        self.quiet_forwards.append(self._quiet)
        return self.module(*args, **kwargs)


def _check_no_sync(train: Callable) -> None:
    batches = padded_token_batches(6, batch_size=2, seed=17)  # K=4: a window of 4, then one of 2
    model, optimizer, scheduler = model_optimizer_scheduler(lambda: _DataParallelStandIn(TinyTokenLM()))
    train(
        model=model,
        optimizer=optimizer,
        batches=batches,
        loss=TokenLoss(),
        accumulation_steps=4,
        scheduler=scheduler,
        max_grad_norm=None,
        scaler=None,
    )
    expected = [True, True, True, False, True, False]
    got = model.quiet_forwards
    if got == expected:
        truth, t_opt, t_sched = model_optimizer_scheduler(TinyTokenLM)
        train_whole_windows(truth, t_opt, batches, TokenLoss(), 4, scheduler=t_sched)
        diff = max_weight_difference(model.module, truth)
        if not diff <= WEIGHT_TOLERANCE:
            raise AssertionError(
                f"with a data-parallel model the weights end {diff:.2e} away from whole-window "
                "training: use no_sync() only as a context around forward and backward"
            )
        return
    if got and all(got):
        what = (
            "every micro-batch ran inside model.no_sync(), the last one too: no gradient is ever all-reduced, "
            "so the data-parallel processes drift apart"
        )
    elif not any(got):
        what = (
            "no micro-batch ran inside model.no_sync(): every backward all-reduces the gradients, K-1 of them "
            "per window for nothing"
        )
    else:
        what = f"the micro-batches that ran inside model.no_sync() were {got}, expected {expected}"
    raise AssertionError(
        f"data parallelism (a model with no_sync(), 6 micro-batches, K=4): {what}. Run forward "
        "and backward of all but the last micro-batch of each window inside model.no_sync(), "
        "and the last one outside it, when the model has no_sync()."
    )


def _check_training_loop(train: Callable) -> None:
    model, optimizer, scheduler = model_optimizer_scheduler(lambda: tiny_mlp("layer"))
    for bad in (0, -1):
        try:
            train(
                model=model,
                optimizer=optimizer,
                batches=regression_batches(2, 4),
                loss=SampleLoss("mse"),
                accumulation_steps=bad,
                scheduler=scheduler,
                max_grad_norm=None,
                scaler=None,
            )
        except ValueError:
            pass
        else:
            raise AssertionError(
                f"accumulation_steps={bad} must raise ValueError: a window needs at least one micro-batch"
            )
    for name, factory, make_batches, loss, k, max_norm, init_scale, hint in _SCENARIOS:
        batches = make_batches()
        windows = -(-len(batches) // k)
        model, optimizer, scheduler = model_optimizer_scheduler(factory)
        probe = StepProbe(model, optimizer, scheduler)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=10**6) if init_scale else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the scheduler-before-optimizer warning of a wrong loop
            train(
                model=model,
                optimizer=optimizer,
                batches=batches,
                loss=loss,
                accumulation_steps=k,
                scheduler=scheduler,
                max_grad_norm=max_norm,
                scaler=scaler,
            )
        if probe.optimizer_steps != windows:
            extra = ""
            if probe.optimizer_steps == windows - 1:
                extra = (
                    " The last, short window needs its step too: after the loop over micro-batches, step if "
                    "anything is left."
                )
            elif probe.optimizer_steps > windows:
                extra = (
                    " Step once per window, after its last micro-batch: stepping after every micro-batch is "
                    "training with small batches, not accumulation."
                )
            raise AssertionError(
                f"{name}: {len(batches)} micro-batches with K={k} make {windows} windows, so "
                f"{windows} optimizer steps; your loop made {probe.optimizer_steps}.{extra}"
            )
        if probe.scheduler_steps != windows:
            raise AssertionError(
                f"{name}: the scheduler stepped {probe.scheduler_steps} times for {windows} "
                "optimizer steps. Step it once per optimizer step (per window), never per "
                "micro-batch: the schedule counts updates, not micro-batches."
            )
        first_forwards = [i for i in range(len(batches)) if i % k == 0]
        if probe.grads_none_at_forward and not all(
            probe.grads_none_at_forward[i] for i in first_forwards if i < len(probe.grads_none_at_forward)
        ):
            zeros = any(probe.grads_zero_tensors_at_forward[i] for i in first_forwards)
            raise AssertionError(
                f"{name}: at the first forward of a window the gradients were "
                f"{'tensors of zeros' if zeros else 'not reset'}. Use "
                "optimizer.zero_grad(set_to_none=True) after each step: the gradient memory is "
                "freed until the next backward, and the optimizer skips parameters without one."
            )
        within = [probe.grads_none_at_forward[i] for i in range(len(probe.grads_none_at_forward)) if i % k]
        if any(within):
            raise AssertionError(
                f"{name}: gradients were reset inside a window. Zero them once per window, "
                "after the optimizer step: the micro-batches of a window must add up."
            )
        truth, t_opt, t_sched = model_optimizer_scheduler(factory)
        train_whole_windows(truth, t_opt, batches, loss, k, scheduler=t_sched, max_grad_norm=max_norm)
        diff = max_weight_difference(model, truth)
        if not diff <= WEIGHT_TOLERANCE:
            raise AssertionError(f"{name}: {hint} (max relative weight difference {diff:.2e}).")
    _check_no_sync(train)


@checked
def training_loop_problem(train: Callable) -> str | None:
    """The first thing `check_training_loop` finds wrong with `train`, as its hint; None when all is right."""
    try:
        _check_training_loop(train)
    except AssertionError as error:
        return str(error)
    return None


@checked
def check_training_loop(train: Callable) -> None:
    """Lesson 2 (not an exercise): the whole accumulation loop gets every detail right.

    `train(model=, optimizer=, batches=, loss=, accumulation_steps=, scheduler=, max_grad_norm=, scaler=)`
    is run on five scenarios against training on each window as one batch (`train_whole_windows`):
    full windows, a short final window, padded tokens, clipping, and GradScaler with clipping. Also
    checked: one optimizer and one scheduler step per window (the short one too), gradients reset to
    None (`zero_grad(set_to_none=True)`) before each window's first forward and not within a window,
    accumulation_steps <= 0 raising ValueError, and with a model that has `no_sync()` (a stand-in for
    DistributedDataParallel) all but the last micro-batch of each window inside it. The first problem
    found is raised as an AssertionError naming the mistake.
    """
    _check_training_loop(train)
    passed(
        "Correct: your loop matches whole-window training in every scenario, with one step per window, "
        "and synchronises once per window."
    )


@checked
def check_ddp_accumulation(report: DDPReport, tolerance: float = WEIGHT_TOLERANCE) -> None:
    """A DDP accumulation run (`ddp_accumulation_demo`) syncs once per window and matches one process."""
    rounds = report.allreduces_per_window
    if any(r == 0 for r in rounds):
        raise AssertionError(
            f"a window had no gradient all-reduce ({rounds}): the last micro-batch of each window "
            "must run outside no_sync(), or the ranks never agree"
        )
    if any(r > 1 for r in rounds):
        raise AssertionError(
            f"gradient all-reduces per window: {rounds}, expected 1 each. Wrap forward and backward "
            "of all but the last micro-batch in model.no_sync(): syncing partial sums is wasted "
            "communication"
        )
    if report.max_diff_between_ranks > tolerance:
        raise AssertionError(f"the ranks ended with different weights ({report.max_diff_between_ranks:.2e})")
    if report.max_diff_vs_single > tolerance:
        raise AssertionError(
            f"DDP ended {report.max_diff_vs_single:.2e} away from one process on the same data. "
            "Normalise by the item count of the window over all ranks (all-reduce it), and "
            "multiply the loss by the world size, since DDP averages gradients over ranks"
        )
