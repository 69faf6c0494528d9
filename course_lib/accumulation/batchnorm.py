"""BatchNorm breaks accumulation; three remedies, each measured with `compare_accumulation` (lesson 2)."""

from __future__ import annotations

import copy
import html
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from course_lib.accumulation.batches import batch_size, cast_batch, check_accumulation_steps
from course_lib.accumulation.equivalence import DtypeComparison, compare_accumulation, max_abs, model_device
from course_lib.accumulation.losses import Batch, SampleLoss, TokenLoss, default_loss
from course_lib.accumulation.tiny_models import group_count
from course_lib.course import wrapped
from course_lib.errors import UserError
from course_lib.measure import PlainTextTable
from course_lib.validate import Count, Device, checked

_BN = nn.modules.batchnorm._BatchNorm


def _replace_modules(model: nn.Module, make: Callable[[nn.Module], nn.Module | None]) -> nn.Module:
    model = copy.deepcopy(model)
    for name, module in list(model.named_modules()):
        replacement = make(module)
        if replacement is None:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, replacement)
    return model


@checked
def replace_batchnorm(model: nn.Module, kind: str = "group", num_groups: int | None = None) -> nn.Module:
    """A copy of `model` with every BatchNorm replaced by a per-sample norm (lesson 2, remedy 1).

    `kind="group"`: GroupNorm(num_groups, C); `kind="layer"`: GroupNorm(1, C), i.e. LayerNorm over all
    non-batch dimensions with a per-channel affine. The affine weight and bias are copied; running
    statistics disappear (there are none). Fixes: accumulation becomes exact, train and eval behave
    the same. Does not fix: it is a different model (pretrained BatchNorm statistics are dropped and
    accuracy can change); it must be trained (or fine-tuned) that way.
    """
    if kind not in ("group", "layer"):
        raise UserError(f"unknown kind {kind!r}: use 'group' or 'layer'")

    def make(module: nn.Module) -> nn.Module | None:
        if not isinstance(module, _BN):
            return None
        c = module.num_features
        groups = 1 if kind == "layer" else (num_groups or group_count(c))
        norm = nn.GroupNorm(groups, c, eps=module.eps, affine=module.affine)
        if module.affine:
            with torch.no_grad():
                norm.weight.copy_(module.weight)
                norm.bias.copy_(module.bias)
        return norm.to(device=module.weight.device if module.affine else None)

    return _replace_modules(model, make)


class _BatchNormArguments:
    """torch's BatchNorm arguments, annotated so that `checked` refuses a bad one in one line."""

    def __init__(
        self,
        num_features: Count,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: Device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            num_features,
            eps=eps,
            momentum=momentum,
            affine=affine,
            track_running_stats=track_running_stats,
            device=device,
            dtype=dtype,
        )


class _GhostMixin(_BatchNormArguments):
    virtual_batch_size: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or x.shape[0] <= self.virtual_batch_size:
            return super().forward(x)
        return torch.cat([super(_GhostMixin, self).forward(chunk) for chunk in x.split(self.virtual_batch_size)])


@checked
class GhostBatchNorm1d(_GhostMixin, nn.BatchNorm1d):
    """BatchNorm1d that normalises each chunk of `virtual_batch_size` rows on its own (ghost batches)."""


@checked
class GhostBatchNorm2d(_GhostMixin, nn.BatchNorm2d):
    """BatchNorm2d that normalises each chunk of `virtual_batch_size` rows on its own (ghost batches)."""


class _FrozenStatsMixin(_BatchNormArguments):
    def train(self, mode: bool = True):
        return super().train(False)


@checked
class FrozenStatsBatchNorm1d(_FrozenStatsMixin, nn.BatchNorm1d):
    """BatchNorm1d that always normalises with its running statistics; weight and bias still train."""


@checked
class FrozenStatsBatchNorm2d(_FrozenStatsMixin, nn.BatchNorm2d):
    """BatchNorm2d that always normalises with its running statistics; weight and bias still train."""


def _retype(module: nn.Module, cls: type, **attrs) -> nn.Module:
    new = copy.deepcopy(module)
    new.__class__ = cls
    for key, value in attrs.items():
        setattr(new, key, value)
    return new


_GHOST = {nn.BatchNorm1d: GhostBatchNorm1d, nn.BatchNorm2d: GhostBatchNorm2d}
_FROZEN = {nn.BatchNorm1d: FrozenStatsBatchNorm1d, nn.BatchNorm2d: FrozenStatsBatchNorm2d}


@checked
def ghost_batchnorm(model: nn.Module, virtual_batch_size: int) -> nn.Module:
    """A copy of `model` whose BatchNorms use ghost batches of `virtual_batch_size` rows (remedy 2a).

    Ghost batch normalisation (Hoffer et al. 2017, see docs/references.md) normalises every chunk of
    `virtual_batch_size` rows with that chunk's statistics, and updates the running statistics once
    per chunk. With `virtual_batch_size` equal to the micro-batch size, the whole batch and its
    accumulation compute the same thing: gradients and running statistics agree. Fixes: accumulation
    is exactly "the same model on the whole batch", so the effective batch can change without
    changing the result.
    Does not fix: the statistics still come from `virtual_batch_size` rows (noisy when that is small),
    not from the effective batch; it is not what plain BatchNorm on the whole batch computes.
    """
    if virtual_batch_size < 1:
        raise UserError("virtual_batch_size must be >= 1")

    def make(module: nn.Module) -> nn.Module | None:
        cls = _GHOST.get(type(module))
        return _retype(module, cls, virtual_batch_size=virtual_batch_size) if cls else None

    return _replace_modules(model, make)


@torch.no_grad()
@checked
def freeze_batchnorm_stats(
    model: nn.Module,
    calibration_batches: Iterable[Batch | tuple[torch.Tensor, None]] | None = None,  # (inputs, None): inputs only
    forward: Callable[[nn.Module, Batch], Any] | None = None,
) -> nn.Module:
    """A copy of `model` whose BatchNorms normalise with running statistics, frozen (remedy 2b).

    With `calibration_batches`, the running statistics are first re-estimated over them (cumulative
    average, in training mode, no gradients); `forward(model, batch)` runs one batch (default:
    `model(batch[0])` for a tuple, `model(**batch)` minus labels for a dict). Then every BatchNorm
    stays in eval mode even under `model.train()`: each sample is normalised independently of the
    others, so accumulation is exact and the statistics never change. Fixes: exact equivalence, no
    dependence on the micro-batch size. Does not fix: the statistics are stale: they do not follow
    the features as the weights change (fine for fine-tuning, wrong for training from scratch).
    """
    model = copy.deepcopy(model)
    if calibration_batches is not None:
        bns = [m for m in model.modules() if isinstance(m, _BN)]
        saved = [(m, m.momentum) for m in bns]
        for m in bns:
            m.reset_running_stats()
            m.momentum = None
        was_training = model.training
        model.train()
        for batch in calibration_batches:
            if forward is not None:
                forward(model, batch)
            elif isinstance(batch, dict):
                model(**{key: value for key, value in batch.items() if key != "labels"})
            else:
                model(batch[0])
        for m, momentum in saved:
            m.momentum = momentum
        model.train(was_training)

    def make(module: nn.Module) -> nn.Module | None:
        cls = _FROZEN.get(type(module))
        if cls is None:
            return None
        new = _retype(module, cls)
        new.training = False
        return new

    return _replace_modules(model, make)


@checked
@dataclass
class RemedyRow:
    """One BatchNorm remedy, measured with `compare_accumulation` in float64."""

    remedy: str
    max_rel_grad: float
    max_running_stat_diff: float
    batches_tracked: str  # "whole / accumulated"
    fixes: str
    does_not_fix: str
    vs_batchnorm_whole: float = 0.0  # its whole-batch gradient vs plain BatchNorm's (relative to the largest entry)


@checked
@dataclass
class RemedyReport(PlainTextTable):
    """The BatchNorm remedies side by side (lesson 2, "BatchNorm remedies")."""

    k: int
    rows: list[RemedyRow]

    def row(self, remedy: str) -> RemedyRow:
        for r in self.rows:
            if r.remedy == remedy:
                return r
        raise KeyError(remedy)

    def __str__(self) -> str:
        width = max(len(r.remedy) for r in self.rows)
        lines = [
            f"BatchNorm and {self.k}-step accumulation (float64)",
            f"  {'remedy':<{width}}  {'rel grad diff':>13}  {'running-stat diff':>17}  "
            f"{'batches tracked':>15}  {'vs plain BN whole':>17}",
        ]
        for r in self.rows:
            lines.append(
                f"  {r.remedy:<{width}}  {r.max_rel_grad:>13.1e}  {r.max_running_stat_diff:>17.1e}  "
                f"{r.batches_tracked:>15}  {r.vs_batchnorm_whole:>17.1e}"
            )
        return "\n".join(lines)

    def notes(self) -> str:
        """What each remedy fixes and what it does not, one line each."""
        return wrapped("\n".join(f"- {r.remedy}: fixes {r.fixes}; does not fix: {r.does_not_fix}" for r in self.rows))

    def _repr_html_(self) -> str:
        head = "".join(
            f"<th>{h}</th>"
            for h in (
                "remedy",
                "max rel grad diff",
                "running-stat diff",
                "num_batches_tracked whole / acc.",
                "whole-batch gradient vs plain BatchNorm",
                "fixes",
                "does not fix",
            )
        )
        body = "".join(
            f"<tr><td>{html.escape(r.remedy)}</td><td>{r.max_rel_grad:.1e}</td><td>{r.max_running_stat_diff:.1e}</td>"
            f"<td>{html.escape(r.batches_tracked)}</td><td>{r.vs_batchnorm_whole:.1e}</td>"
            f"<td style='text-align:left'>{html.escape(r.fixes)}</td>"
            f"<td style='text-align:left'>{html.escape(r.does_not_fix)}</td></tr>"
            for r in self.rows
        )
        return f"<table><tr>{head}</tr>{body}</table>"


REMEDY_NOTES = {
    "BatchNorm (no remedy)": ("nothing", "gradients and running statistics both depend on the micro-batch"),
    "GroupNorm instead": (
        "exact accumulation; no running statistics; same in train and eval",
        "a different model: BatchNorm weights/statistics do not carry over, accuracy may change",
    ),
    "LayerNorm instead (GroupNorm(1, C))": (
        "exact accumulation; no running statistics; same in train and eval",
        "a different model, as for GroupNorm",
    ),
    "ghost batches of the micro-batch size": (
        "accumulation equals the whole batch computed with ghost batches: gradients and running statistics agree",
        "statistics still come from one micro-batch (noisy when small), not from the effective batch",
    ),
    "frozen statistics": (
        "exact accumulation; statistics no longer depend on the micro-batch",
        "statistics are stale: they do not follow the features as training changes them",
    ),
}


def _running_stats(c: DtypeComparison) -> tuple[float, str]:
    stat = max((b.max_abs for b in c.buffers if not b.name.endswith("num_batches_tracked")), default=0.0)
    tracked = [b for b in c.buffers if b.name.endswith("num_batches_tracked")]
    text = f"{tracked[0].whole} / {tracked[0].accumulated}" if tracked else "none"
    return stat, text


@checked
def compare_batchnorm_remedies(
    model: nn.Module,
    batch: Batch,
    k: int,
    loss: SampleLoss | TokenLoss | None = None,
    dtype: torch.dtype = torch.float64,
) -> RemedyReport:
    """Measure the BatchNorm failure and each remedy on the same model and batch (lesson 2).

    For each variant: how far accumulation is from its own whole batch (gradients, running
    statistics, num_batches_tracked), and how far its whole-batch gradient is from plain BatchNorm's
    on the whole batch (the large-batch computation no remedy reproduces). `model` must contain
    BatchNorm layers. The batch's rows must split evenly into `k` micro-batches (ghost batches have one
    size). Frozen statistics are calibrated on the batch itself first.
    """
    k = check_accumulation_steps(k)
    if not any(isinstance(m, _BN) for m in model.modules()):
        raise UserError("the model has no BatchNorm layer: nothing to remedy")
    n = batch_size(batch)
    if k > n or n % k:
        raise UserError(f"the batch of {n} rows must split evenly into k={k} micro-batches")
    variants = [
        ("BatchNorm (no remedy)", model),
        ("GroupNorm instead", replace_batchnorm(model, "group")),
        ("LayerNorm instead (GroupNorm(1, C))", replace_batchnorm(model, "layer")),
        ("ghost batches of the micro-batch size", ghost_batchnorm(model, n // k)),
        ("frozen statistics", freeze_batchnorm_stats(model, [batch])),
    ]
    loss = loss if loss is not None else default_loss(batch)
    reference = _whole_batch_gradients(model, batch, loss, dtype)
    scale = max((max_abs(g) for g in reference.values()), default=0.0) or 1.0
    rows = []
    for name, variant in variants:
        c = compare_accumulation(variant, batch, k, loss, dtypes=(dtype,))[dtype]
        stat, tracked = _running_stats(c)
        fixes, does_not = REMEDY_NOTES[name]
        grads = _whole_batch_gradients(variant, batch, loss, dtype)
        vs_bn = max(max_abs(grads[n] - reference[n]) for n in reference) / scale
        rows.append(RemedyRow(name, c.max_rel_grad, stat, tracked, fixes, does_not, vs_bn))
    return RemedyReport(k, rows)


def _whole_batch_gradients(model: nn.Module, batch: Batch, loss, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    m = copy.deepcopy(model).to(dtype).train()
    m.zero_grad(set_to_none=True)
    (loss.sum(m, cast_batch(batch, dtype, model_device(m))) / loss.count(batch)).backward()
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach() for n, p in m.named_parameters()}
