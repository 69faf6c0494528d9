"""Deliberately broken accumulation loops: one classic mistake each (lesson 2, "what each mistake breaks").

Each class is the reference `AccumulationLoop` with exactly one step overridden, so that the few
lines below are the whole mistake. Never train with them: they exist so that the lesson can show what
each mistake does to the weights, and the tests can prove that the exercise checks catch each one.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from course_lib import validate
from course_lib.accumulation.batches import padded_token_batches
from course_lib.accumulation.loop import AccumulationLoop, TrainResult, max_weight_difference, train_whole_windows
from course_lib.accumulation.losses import Batch, SampleLoss, TokenLoss
from course_lib.accumulation.tiny_models import TinyTokenLM
from course_lib.errors import UserError
from course_lib.validate import checked


def _own_count(counts: list[int], i: int) -> int:
    if counts[i] == 0:
        raise UserError(
            f"micro-batch {i} has no valid items: its own mean loss is 0/0 (NaN); "
            "the global normalisation (sum / window count) has no such problem"
        )
    return counts[i]


class MeanPerMicroBatch(AccumulationLoop):
    """each micro-batch's own mean loss, averaged over the window (the padded-token bug of the Hugging Face
    Trainer, fixed in October 2024)"""

    def divisor(self, i, counts, items):
        return _own_count(counts, i) * len(counts)


class DivideByConfiguredK(AccumulationLoop):
    """each micro-batch's mean divided by the configured accumulation steps, also in a short final window"""

    def divisor(self, i, counts, items):
        return _own_count(counts, i) * self.k


class NoStepAfterShortWindow(AccumulationLoop):
    """steps only when (i + 1) % K == 0, so a short final window is never applied"""

    def steps_after(self, window):
        return len(window) == self.k


class OptimizerStepPerMicroBatch(AccumulationLoop):
    """the optimizer stepped (and gradients zeroed) after every micro-batch: no accumulation at all"""

    def after_micro_batch(self, i, n):
        if i < n - 1:
            self.optimizer_step()
            self.zero_grad()


class SchedulerPerMicroBatch(AccumulationLoop):
    """the learning-rate scheduler stepped after every micro-batch"""

    def after_micro_batch(self, i, n):
        if i < n - 1 and self.scheduler is not None:
            self.scheduler.step()


class ClipBeforeLastMicroBatch(AccumulationLoop):
    """gradients clipped after every micro-batch, i.e. partial sums clipped"""

    def after_micro_batch(self, i, n):
        if i < n - 1 and self.max_grad_norm is not None:
            self.clip()


class ClipBeforeUnscale(AccumulationLoop):
    """with a GradScaler, clipping the still-scaled gradients, then unscaling"""

    def unscale(self):
        pass  # scaler.step() unscales later, after the clipping


class ZeroGradToZero(AccumulationLoop):
    """zero_grad(set_to_none=False): gradient memory kept and filled with zeros"""

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=False)


class NeverZeroGrad(AccumulationLoop):
    """gradients never reset: each window adds to the previous windows' gradients"""

    def zero_grad(self):
        pass


class SyncEveryMicroBatch(AccumulationLoop):
    """under DDP, no no_sync(): an all-reduce after every micro-batch"""

    def synchronises(self, i, n):
        return True


class NeverSync(AccumulationLoop):
    """under DDP, no_sync() around every micro-batch, the last too: ranks never agree"""

    def synchronises(self, i, n):
        return False


class CountPerRank(AccumulationLoop):
    """under DDP, each rank divides by its own item count instead of the global one"""

    def window_items(self, counts):
        return sum(counts)

    def divisor(self, i, counts, items):
        return max(items, 1)


BROKEN_LOOPS: dict[str, type[AccumulationLoop]] = {
    "mean_per_micro_batch": MeanPerMicroBatch,
    "divide_by_configured_k": DivideByConfiguredK,
    "no_step_after_short_window": NoStepAfterShortWindow,
    "optimizer_step_per_micro_batch": OptimizerStepPerMicroBatch,
    "scheduler_per_micro_batch": SchedulerPerMicroBatch,
    "clip_before_last_micro_batch": ClipBeforeLastMicroBatch,
    "clip_before_unscale": ClipBeforeUnscale,
    "zero_grad_to_zero": ZeroGradToZero,
    "never_zero_grad": NeverZeroGrad,
    "sync_every_micro_batch": SyncEveryMicroBatch,
    "never_sync": NeverSync,
    "count_per_rank": CountPerRank,
}
MISTAKES: dict[str, str] = {name: " ".join(cls.__doc__.split()) for name, cls in BROKEN_LOOPS.items()}
DDP_MISTAKES = ("sync_every_micro_batch", "never_sync", "count_per_rank")


def loop_class(mistakes: Sequence[str] = ()) -> type[AccumulationLoop]:
    """The reference loop for `()`, the broken loop for `(name,)`; one mistake at a time."""
    empty = isinstance(mistakes, (list, tuple)) and not mistakes  # the reference loop; 0, {} or None name nothing
    mistakes = () if empty else validate.choices("mistake", mistakes, sorted(BROKEN_LOOPS))
    if len(mistakes) > 1:
        raise UserError(f"one mistake at a time, got {mistakes}")
    return BROKEN_LOOPS[mistakes[0]] if mistakes else AccumulationLoop


def train_with_mistake(
    mistake: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Batch],
    loss: SampleLoss | TokenLoss,
    accumulation_steps: int,
    **options,
) -> TrainResult:
    """`train_with_accumulation`, with the broken loop `BROKEN_LOOPS[mistake]` instead of the reference."""
    return loop_class((mistake,))(model, optimizer, loss, accumulation_steps, **options).run(batches)


def sgd_and_schedule(model: nn.Module, lr: float = 0.5):
    """SGD with momentum and a halving schedule: the setup that makes each mistake visible (lesson 2)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    return opt, sched


@checked
def demonstrate_mistakes(mistakes: str | Iterable[str] | None = None, seed: int = 0) -> list[tuple[str, float]]:
    """Train with each single-process broken loop; how far do the weights end from the truth (lesson 2)?

    Same tiny token model, padded data (10 micro-batches, K=4: a short final window), SGD with
    momentum, a decaying schedule and clipping, against `train_whole_windows`; `clip_before_unscale`
    also gets a GradScaler (exact in fp32 with a power-of-two scale). Returns (name, max relative
    weight difference); "none" (the reference loop) first. The DDP mistakes need two processes: see
    `ddp_accumulation_demo`.
    """
    names = ["none"] + list(
        validate.choices("mistakes", mistakes, sorted(BROKEN_LOOPS))
        if mistakes is not None
        else [m for m in BROKEN_LOOPS if m not in DDP_MISTAKES]
    )
    batches = padded_token_batches(10, batch_size=3, seed=seed)
    loss = TokenLoss()
    out = []
    truth = TinyTokenLM(seed=seed)
    opt, sched = sgd_and_schedule(truth)
    train_whole_windows(truth, opt, batches, loss, 4, scheduler=sched, max_grad_norm=0.5)
    for name in names:
        model = TinyTokenLM(seed=seed)
        opt, sched = sgd_and_schedule(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if name == "clip_before_unscale" else None
        loop = loop_class(() if name == "none" else (name,))
        with warnings.catch_warnings():  # scheduler_per_micro_batch makes torch warn about the order: expected
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            loop(model, opt, loss, 4, scheduler=sched, max_grad_norm=0.5, scaler=scaler, progress=False).run(batches)
        out.append((name, max_weight_difference(model, truth)))
    return out
