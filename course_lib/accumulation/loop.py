"""The reference accumulation loop, and the ground truth it is checked against (lesson 2, section 5).

`train_with_accumulation` runs `AccumulationLoop`, whose steps are small methods: count the window's
items, divide each micro-batch's loss sum, decide which backward synchronises under DDP, finish the
window (unscale, clip, step, schedule, zero). `course_lib.accumulation.broken` gets each classic
mistake by overriding one of them; the reference loop itself has no switches.
`train_whole_windows` is the ground truth: each window concatenated into one batch.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib import validate
from course_lib.accumulation.batches import check_accumulation_steps, concat_batches
from course_lib.accumulation.equivalence import max_abs, model_device
from course_lib.accumulation.losses import Batch, SampleLoss, TokenLoss
from course_lib.errors import UserError
from course_lib.measure import PlainTextTable
from course_lib.validate import checked


@checked
@dataclass
class TrainResult(PlainTextTable):
    """What a training loop did, window by window (lesson 2, "the reference loop")."""

    windows: int = 0  # windows seen (optimizer steps attempted)
    steps: int = 0  # optimizer steps applied
    skipped_steps: int = 0  # steps GradScaler skipped (inf/NaN gradients); the scheduler did not step
    empty_windows: int = 0  # windows with no valid item, skipped (empty_window="skip")
    micro_batches: int = 0
    losses: list[float] = field(default_factory=list)  # per window: loss sum / item count (global)
    items: list[int] = field(default_factory=list)  # per window: item count (global)
    lrs: list[float] = field(default_factory=list)  # learning rate of each step
    grad_norms: list[float] = field(default_factory=list)  # total norm before clipping (when clipping)

    def __str__(self) -> str:
        lines = [
            f"{self.windows} windows ({self.micro_batches} micro-batches), {self.steps} optimizer steps, "
            f"{self.skipped_steps} skipped by GradScaler, {self.empty_windows} empty windows skipped",
            f"  {'window':>6}  {'items':>6}  {'loss':>8}  {'lr':>9}"
            + (f"  {'grad norm':>9}" if self.grad_norms else ""),
        ]
        for i, (items, value) in enumerate(zip(self.items, self.losses)):
            lr = f"{self.lrs[i]:>9.3g}" if i < len(self.lrs) else f"{'-':>9}"
            norm = f"  {self.grad_norms[i]:>9.4f}" if i < len(self.grad_norms) else ""
            lines.append(f"  {i + 1:>6}  {items:>6}  {value:>8.4f}  {lr}{norm}")
        return "\n".join(lines)


@checked
def windows(batches: Iterable[Batch], k: int) -> Iterator[list[Batch]]:
    """Group micro-batches into windows of `k`; the last window may be shorter (lesson 2)."""
    k = check_accumulation_steps(k)
    window: list[Batch] = []
    for batch in batches:
        window.append(batch)
        if len(window) == k:
            yield window
            window = []
    if window:
        yield window


def _is_ddp(model: nn.Module) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


def _all_reduce_number(value: float | int, device: torch.device, dtype=torch.float64) -> float:
    t = torch.tensor([value], dtype=dtype, device=device)
    dist.all_reduce(t)
    return t.item()


@checked
class AccumulationLoop:
    """The reference loop: one optimizer step per window of K micro-batches (lesson 2, section 5).

    Every detail, each tested:
    - the window's item count (tokens for `TokenLoss`) is counted from the labels before any forward
      pass, summed over the window (and all-reduced across ranks under DDP), and each micro-batch's
      loss sum is divided by it: the gradient equals the whole window's, whatever the padding;
    - a short final window is normalised by its own count, and stepped;
    - optimizer and scheduler step once per window; a step that GradScaler skips (inf/NaN gradients)
      does not step the scheduler;
    - with a GradScaler: unscale once, after the last micro-batch, then clip, then `scaler.step`,
      `scaler.update`;
    - gradients are reset with `zero_grad(set_to_none=True)` (memory freed between windows);
    - for a model with `no_sync()` (DDP), forward and backward of all but the last micro-batch run
      inside it: one gradient all-reduce per window; under DDP the loss is multiplied by the world
      size because DDP averages gradients over ranks;
    - a tqdm progress bar over optimizer steps (`progress=False` silences it).
    A window with no valid item raises ValueError (`empty_window="error"`) or is skipped without a
    step (`empty_window="skip"`); its loss is never a NaN.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss: SampleLoss | TokenLoss,
        accumulation_steps: int,
        *,
        scheduler: Any = None,
        max_grad_norm: float | None = None,
        scaler: torch.amp.GradScaler | None = None,
        autocast_dtype: torch.dtype | None = None,
        empty_window: str = "error",
        progress: bool = True,
    ) -> None:
        self.k = check_accumulation_steps(accumulation_steps)
        validate.model_and_optimizer(model, optimizer)
        validate.choice("empty_window", empty_window, ("error", "skip"))
        if max_grad_norm is not None:
            validate.positive("max_grad_norm (or None: no clipping)", max_grad_norm)
        self.model, self.optimizer, self.loss = model, optimizer, loss
        self.scheduler, self.max_grad_norm, self.scaler = scheduler, max_grad_norm, scaler
        self.autocast_dtype, self.empty_window, self.progress = autocast_dtype, empty_window, progress
        self.ddp = _is_ddp(model)
        self.skips_sync = callable(getattr(model, "no_sync", None))  # DDP, FSDP1 and their stand-ins
        self.world = torch.distributed.get_world_size() if self.ddp else 1
        self.device = model_device(model)
        self.params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        self.result = TrainResult()
        self._stepped: list[bool] = []

    # The steps. A broken loop (course_lib.accumulation.broken) overrides exactly one of them.

    def window_items(self, counts: list[int]) -> int:
        """The item count every micro-batch of the window is divided by: all ranks' items together."""
        items = sum(counts)
        return int(_all_reduce_number(items, self.device)) if self.ddp else items

    def divisor(self, i: int, counts: list[int], items: int) -> float:
        """What micro-batch `i`'s loss sum is divided by. DDP averages over ranks: undo it."""
        return items / self.world

    def synchronises(self, i: int, n: int) -> bool:
        """With `no_sync()` (DDP): whether micro-batch `i` of `n` all-reduces its gradients (the last only)."""
        return i == n - 1

    def after_micro_batch(self, i: int, n: int) -> None:
        """Nothing happens between the micro-batches of a window."""

    def steps_after(self, window: list[Batch]) -> bool:
        """Every window is stepped, the short last one too."""
        return True

    def unscale(self) -> None:
        """With a GradScaler, unscale once, after the last micro-batch, before clipping."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)

    def clip(self) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips optimizer.step() when the gradients hold inf/NaN
            self.scaler.update()
        else:
            self.optimizer.step()

    # The loop.

    def finish_window(self) -> None:
        if self.max_grad_norm is not None:
            self.unscale()
            self.result.grad_norms.append(self.clip())
        self.result.lrs.append(float(self.optimizer.param_groups[0]["lr"]))
        self._stepped.clear()
        self.optimizer_step()
        if not self._stepped:
            self.result.skipped_steps += 1
        else:
            self.result.steps += 1
            if self.scheduler is not None:
                self.scheduler.step()
        self.zero_grad()

    def train_window(self, window: list[Batch]) -> None:
        self.result.windows += 1
        counts = [self.loss.count(mb) for mb in window]
        items = self.window_items(counts)
        if items == 0:
            if self.empty_window == "error":
                raise UserError(
                    f"window {self.result.windows} has no valid item (every label is ignore_index): "
                    "its mean loss is 0/0. Fix the data, or pass empty_window='skip'."
                )
            self.result.empty_windows += 1
            return
        autocast = (
            torch.autocast(self.device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype
            else contextlib.nullcontext()
        )
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)  # read once per window
        for i, mb in enumerate(window):
            quiet = self.skips_sync and not self.synchronises(i, len(window))
            with self.model.no_sync() if quiet else contextlib.nullcontext():
                with autocast:
                    s = self.loss.sum(self.model, mb)
                part = s / self.divisor(i, counts, items)
                (self.scaler.scale(part) if self.scaler is not None else part).backward()
            loss_sum += s.detach().double()
            self.result.micro_batches += 1
            self.after_micro_batch(i, len(window))
        if self.ddp:
            torch.distributed.all_reduce(loss_sum)  # for the reported loss only
        self.result.losses.append(loss_sum.item() / items)
        self.result.items.append(items)
        if self.steps_after(window):
            self.finish_window()

    def run(self, batches: Iterable[Batch]) -> TrainResult:
        """Train over `batches` (micro-batches), one optimizer step per window of K."""
        from tqdm.auto import tqdm  # off the import path: tqdm.auto imports ipywidgets in a notebook

        if isinstance(batches, (str, bytes, dict)) or not isinstance(batches, Iterable):
            raise UserError(f"batches must be a list (or an iterable) of micro-batches, got {type(batches).__name__}")

        total = math.ceil(len(batches) / self.k) if hasattr(batches, "__len__") else None
        self.model.train()
        self.zero_grad()
        hook = self.optimizer.register_step_post_hook(lambda *args: self._stepped.append(True))
        with hook, tqdm(total=total, disable=not self.progress, desc="optimizer steps", unit="step") as bar:
            for window in windows(batches, self.k):
                self.train_window(window)
                if self.result.losses:
                    bar.set_postfix(loss=f"{self.result.losses[-1]:.4f}")
                bar.update(1)
        if not self.result.windows:
            raise UserError("batches is empty: give at least one micro-batch to train on")
        return self.result


@checked
def train_with_accumulation(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Batch],
    loss: SampleLoss | TokenLoss,
    accumulation_steps: int,
    *,
    scheduler: Any = None,
    max_grad_norm: float | None = None,
    scaler: torch.amp.GradScaler | None = None,
    autocast_dtype: torch.dtype | None = None,
    empty_window: str = "error",
    progress: bool = True,
) -> TrainResult:
    """Train over `batches` (micro-batches), one optimizer step per window of K (lesson 2).

    Runs the reference loop, `AccumulationLoop` (its docstring lists every detail it gets right).
    """
    loop = AccumulationLoop(
        model,
        optimizer,
        loss,
        accumulation_steps,
        scheduler=scheduler,
        max_grad_norm=max_grad_norm,
        scaler=scaler,
        autocast_dtype=autocast_dtype,
        empty_window=empty_window,
        progress=progress,
    )
    return loop.run(batches)


@checked
def train_whole_windows(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[Batch],
    loss: SampleLoss | TokenLoss,
    accumulation_steps: int,
    *,
    scheduler: Any = None,
    max_grad_norm: float | None = None,
) -> TrainResult:
    """The ground truth accumulation must match: each window concatenated into one batch (lesson 2).

    One forward and backward of the whole window, its loss sum divided by its item count, then clip,
    step and scheduler step. Independent of `train_with_accumulation` on purpose: the checks compare
    the two.
    """
    result = TrainResult()
    model.train()
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for window in windows(batches, accumulation_steps):
        whole = concat_batches(window)
        n = loss.count(whole)
        if n == 0:
            raise UserError("a window has no valid item")
        optimizer.zero_grad(set_to_none=True)
        s = loss.sum(model, whole)
        (s / n).backward()
        if max_grad_norm is not None:
            result.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm)))
        result.lrs.append(float(optimizer.param_groups[0]["lr"]))
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        result.windows += 1
        result.steps += 1
        result.micro_batches += len(window)
        result.losses.append(float(s.detach()) / n)
        result.items.append(n)
    optimizer.zero_grad(set_to_none=True)
    return result


def max_weight_difference(a: nn.Module, b: nn.Module) -> float:
    """Largest |difference| between same-named parameters of two models, relative to the largest |weight|."""
    for name, model in (("a", a), ("b", b)):
        validate.instance(name, model, nn.Module, "a torch.nn.Module")
    a_params, b_params = dict(_unwrap(a).named_parameters()), dict(_unwrap(b).named_parameters())
    shapes = {name: tuple(p.shape) for name, p in a_params.items()}
    if shapes != {name: tuple(q.shape) for name, q in b_params.items()}:
        raise UserError("a and b must be two copies of one model: their parameters differ in names or shapes")
    worst = 0.0
    for name, p in a_params.items():
        q = b_params[name]
        scale = max(max_abs(q), 1e-12)
        worst = max(worst, max_abs(p.detach().double() - q.detach().double().to(p.device)) / scale)
    return worst


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if _is_ddp(model) else model
