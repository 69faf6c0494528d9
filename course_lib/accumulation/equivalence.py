"""Is accumulation exact? One batch whole vs as K micro-batches, in fp32 and fp64 (lesson 2).

`compare_accumulation` measures the gradients and buffers both ways from the same initial weights:
exact up to rounding when each micro-batch's loss sum is divided by the item count of the whole batch
and no item's loss depends on the other rows; BatchNorm and the mean of per-micro-batch means break it.
"""

from __future__ import annotations

import copy
import html
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from course_lib import validate
from course_lib.accumulation.batches import batch_size, cast_batch, check_accumulation_steps, split_batch
from course_lib.accumulation.losses import Batch, SampleLoss, TokenLoss, default_loss
from course_lib.errors import UserError
from course_lib.measure import PlainTextTable
from course_lib.validate import checked


@checked
@dataclass
class GradientDiff:
    """Largest gradient difference of one parameter: whole batch vs accumulated."""

    name: str
    max_abs: float  # max |g_acc - g_whole|
    max_rel: float  # max_abs / max |g_whole|, see `compare_accumulation`
    exact_zero: bool = False  # the whole-batch gradient is zero up to rounding (measured against the model's)


@checked
@dataclass
class BufferDiff:
    """A buffer (running mean/var, num_batches_tracked) after the whole batch vs after accumulation."""

    name: str
    whole: float | int  # the value for a scalar buffer, else the max |value|
    accumulated: float | int
    max_abs: float


@checked
@dataclass
class DtypeComparison:
    """What `compare_accumulation` measured in one dtype."""

    dtype: str
    loss_whole: float
    loss_accumulated: float
    gradients: list[GradientDiff]
    buffers: list[BufferDiff]

    @property
    def max_rel_grad(self) -> float:
        return max((g.max_rel for g in self.gradients), default=0.0)

    @property
    def max_abs_grad(self) -> float:
        return max((g.max_abs for g in self.gradients), default=0.0)

    @property
    def max_buffer_diff(self) -> float:
        return max((b.max_abs for b in self.buffers), default=0.0)

    @property
    def max_running_stat_diff(self) -> float:
        """Largest difference of a floating buffer (running mean/var), num_batches_tracked excluded."""
        return max((b.max_abs for b in self.buffers if not b.name.endswith("num_batches_tracked")), default=0.0)

    @property
    def batches_tracked(self) -> tuple[int, int] | None:
        """num_batches_tracked of the first BatchNorm: (whole batch, accumulated), None without BatchNorm."""
        for b in self.buffers:
            if b.name.endswith("num_batches_tracked"):
                return int(b.whole), int(b.accumulated)
        return None


_SUMMARY_HEADER = (
    "dtype",
    "max rel grad diff",
    "max abs grad diff",
    "running-stat diff",
    "batches tracked whole / acc.",
    "loss whole / accumulated",
)


@checked
@dataclass
class AccumulationReport(PlainTextTable):
    """Result of `compare_accumulation` (lesson 2, "the proof, checked")."""

    k: int
    normalization: str
    micro_batch_rows: list[int]
    micro_batch_items: list[int]
    comparisons: dict[str, DtypeComparison]

    def __getitem__(self, dtype: str | torch.dtype) -> DtypeComparison:
        return self.comparisons[str(dtype).replace("torch.", "")]

    def summary_rows(self) -> list[tuple[str, ...]]:
        rows = []
        for name, c in self.comparisons.items():
            tracked = c.batches_tracked
            rows.append(
                (
                    name,
                    f"{c.max_rel_grad:.2e}",
                    f"{c.max_abs_grad:.2e}",
                    f"{c.max_running_stat_diff:.3g}",
                    "-" if tracked is None else f"{tracked[0]} / {tracked[1]}",
                    f"{c.loss_whole:.6f} / {c.loss_accumulated:.6f}",
                )
            )
        return rows

    def __str__(self) -> str:
        lines = [
            f"Whole batch vs {self.k} micro-batches ({self.normalization} normalisation), "
            f"rows per micro-batch {self.micro_batch_rows}, items {self.micro_batch_items}"
        ]
        table = [_SUMMARY_HEADER, *self.summary_rows()]
        widths = [max(len(row[i]) for row in table) for i in range(len(_SUMMARY_HEADER))]
        for row in table:
            lines.append("  " + "  ".join(f"{cell:>{w}}" for cell, w in zip(row, widths)))
        return "\n".join(lines)

    def buffer_table(self, dtype: str | torch.dtype = "float32") -> str:
        """Every buffer after the whole batch and after accumulation (max |value| for a tensor)."""
        lines = [f"{'buffer':<28} {'whole':>12} {'accumulated':>12} {'max diff':>10}"]
        for b in self[dtype].buffers:
            lines.append(f"{b.name:<28} {b.whole:>12.6g} {b.accumulated:>12.6g} {b.max_abs:>10.3g}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{h}</th>" for h in _SUMMARY_HEADER)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in self.summary_rows()
        )
        caption = html.escape(f"Whole batch vs {self.k} micro-batches ({self.normalization} normalisation)")
        return f"<table><caption>{caption}</caption><tr>{head}</tr>{body}</table>"


def max_abs(t: torch.Tensor) -> float:
    return float(t.detach().abs().max()) if t.numel() else 0.0


def model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _relative(diff: float, reference: float) -> float:
    if reference == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / reference


def _check_no_dropout(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            raise UserError(
                f"{name or 'the model'} is Dropout(p={module.p}): the whole batch and the micro-batches "
                "would draw different masks, so the comparison would measure randomness. Set p=0."
            )


@checked
def micro_batch_losses(
    loss: SampleLoss | TokenLoss, normalization: str, counts: Sequence[int], k_configured: int | None = None
) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """How each micro-batch's loss sum is turned into the loss that is backpropagated (lesson 2).

    `global`: sum / (item count of the whole window): exact. `naive`: sum / own count / number of
    micro-batches (the mean of per-micro-batch means): wrong when counts differ. An empty micro-batch
    under `naive` is an error (its mean is 0/0), never a NaN.
    """
    total = sum(counts)
    k = k_configured or len(counts)
    if normalization == "global":
        if total == 0:
            raise UserError(
                "the window has no valid items (every label is ignore_index): "
                "its mean loss is 0/0; drop the window or fix the labels"
            )
        return [lambda s: s / total for _ in counts]
    if normalization == "naive":
        for i, n in enumerate(counts):
            if n == 0:
                raise UserError(
                    f"micro-batch {i} has no valid items: its own mean loss is 0/0 (NaN); "
                    "the global normalisation (sum / window count) has no such problem"
                )
        return [lambda s, n=n: s / n / k for n in counts]
    raise UserError(f"unknown normalization {normalization!r}: use 'global' or 'naive'")


@checked
def compare_accumulation(
    model: nn.Module,
    batch: Batch,
    k: int,
    loss: SampleLoss | TokenLoss | None = None,
    *,
    normalization: str = "global",
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64),
    train: bool = True,
) -> AccumulationReport:
    """Run `batch` whole and as `k` micro-batches from the same initial state; compare (lesson 2).

    For each dtype, two deep copies of `model` (cast to that dtype; `model` itself is untouched) get
    the gradient of the batch: one in a single forward/backward, one accumulated over `k`
    micro-batches (`split_batch`). Reported per parameter: the largest absolute difference of the
    gradients and the relative one, `max |g_acc - g_whole| / max |g_whole|`. A parameter whose
    whole-batch gradient is zero up to rounding (below sqrt(eps) times the model's largest gradient
    entry: the bias of a Linear right before a BatchNorm, whose exact gradient is 0) has no scale of
    its own, so its difference is divided by the model's largest gradient entry instead
    (`GradientDiff.exact_zero`). Per buffer (BatchNorm running mean/var, num_batches_tracked): both
    values and their largest difference.

    `normalization="global"` divides each micro-batch's loss sum by the item count of the whole
    batch (exact); `"naive"` averages per-micro-batch means (the padded-token bug).

    Errors (never a silent NaN): `k` <= 0 or larger than the batch, a batch with no valid item,
    a micro-batch with no valid item under `"naive"`, Dropout with p > 0.
    """
    validate.model_and_optimizer(model)
    k = check_accumulation_steps(k)
    loss = loss if loss is not None else default_loss(batch)
    if train:
        _check_no_dropout(model)
    micro = split_batch(batch, k)
    counts = [loss.count(mb) for mb in micro]
    whole_count = loss.count(batch)
    if whole_count == 0:
        raise UserError(
            "the batch has no valid items (every label is ignore_index): its mean loss is 0/0, "
            "so there is no gradient to compare"
        )
    scales = micro_batch_losses(loss, normalization, counts)
    comparisons = {}
    for dtype in dtypes:
        comparisons[str(dtype).replace("torch.", "")] = _compare_in_dtype(
            model, batch, micro, loss, scales, whole_count, dtype, train
        )
    return AccumulationReport(
        k=k,
        normalization=normalization,
        micro_batch_rows=[batch_size(mb) for mb in micro],
        micro_batch_items=counts,
        comparisons=comparisons,
    )


def _compare_in_dtype(model, batch, micro, loss, scales, whole_count, dtype, train) -> DtypeComparison:
    device = next(model.parameters()).device
    whole_model = copy.deepcopy(model).to(dtype)
    acc_model = copy.deepcopy(model).to(dtype)
    for m in (whole_model, acc_model):
        m.train(train)
        m.zero_grad(set_to_none=True)
    whole_loss = loss.sum(whole_model, cast_batch(batch, dtype, device)) / whole_count
    whole_loss.backward()
    acc_loss = 0.0
    for mb, scale in zip(micro, scales):
        part = scale(loss.sum(acc_model, cast_batch(mb, dtype, device)))
        part.backward()
        acc_loss += float(part.detach())
    pairs = []
    acc_params = dict(acc_model.named_parameters())
    for name, p in whole_model.named_parameters():
        q = acc_params[name]
        if p.grad is None and q.grad is None:
            continue
        g_whole = p.grad if p.grad is not None else torch.zeros_like(p)
        g_acc = q.grad if q.grad is not None else torch.zeros_like(q)
        pairs.append((name, max_abs(g_acc - g_whole), max_abs(g_whole)))
    largest = max((scale for _, _, scale in pairs), default=0.0)
    floor = largest * math.sqrt(torch.finfo(dtype).eps)
    gradients = []
    for name, diff, scale in pairs:
        exact_zero = scale <= floor
        gradients.append(GradientDiff(name, diff, _relative(diff, largest if exact_zero else scale), exact_zero))
    buffers = []
    acc_buffers = dict(acc_model.named_buffers())
    for name, b in whole_model.named_buffers():
        a = acc_buffers[name]
        if b.numel() == 1:
            whole_value, acc_value = b.item(), a.item()
        else:
            whole_value, acc_value = max_abs(b), max_abs(a)
        diff = max_abs(a.double() - b.double())
        buffers.append(BufferDiff(name, whole_value, acc_value, diff))
    return DtypeComparison(str(dtype).replace("torch.", ""), float(whole_loss.detach()), acc_loss, gradients, buffers)
