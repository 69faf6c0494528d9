"""Losses as two numbers, the sum over items and the item count: what accumulation needs (lesson 2).

Batches are either a tuple `(inputs, targets)` (a per-sample loss, `SampleLoss`: the rows are the
items) or a dict with `input_ids`, `attention_mask` and `labels` (a next-token loss, `TokenLoss`: the
rows are sequences, the items are the target tokens that are not `ignore_index`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.errors import UserError
from course_lib.validate import checked

IGNORE_INDEX = -100

# a tuple (inputs, targets) or a dict of tensors (input_ids, attention_mask, labels)
Batch = tuple[torch.Tensor, ...] | dict[str, torch.Tensor]


# --------------------------------------------------------------------------------------------------
# Losses as (sum over items, item count): the two numbers accumulation needs
# --------------------------------------------------------------------------------------------------


class SampleLoss:
    """A per-sample loss on `(inputs, targets)` batches; the items are the samples (lesson 2).

    `sum(model, batch)` is the sum over samples of each sample's loss (for "mse" the mean over the
    output features of one sample); `count(batch)` is the number of samples. The loss of a batch is
    `sum / count`.
    """

    def __init__(self, criterion: str = "mse") -> None:
        if criterion not in ("mse", "cross_entropy"):
            raise UserError(f"unknown criterion {criterion!r}: use 'mse' or 'cross_entropy'")
        self.criterion = criterion

    def count(self, batch: Batch) -> int:
        _check_batch(
            batch,
            isinstance(batch, (tuple, list)) and len(batch) == 2 and all(map(torch.is_tensor, batch)),
            "a pair (inputs, targets) of tensors, as regression_batches makes",
        )
        return int(batch[0].shape[0])

    def sum(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        inputs, targets = batch
        out = model(inputs)
        if self.criterion == "cross_entropy":
            return F.cross_entropy(out, targets, reduction="sum")
        return F.mse_loss(out, targets, reduction="none").flatten(1).mean(1).sum()

    def __repr__(self) -> str:
        return f"SampleLoss({self.criterion!r})"


@checked
class TokenLoss:
    """Next-token cross-entropy over the valid labels of a padded token batch (lesson 2).

    The items are the target tokens: `labels[:, 1:] != ignore_index` (the prediction at position t
    targets the label at t + 1, as in Hugging Face causal LMs). `sum` is the summed cross-entropy
    over those tokens, computed in float32 at least (half-precision logits are upcast first, as
    Hugging Face does); `count` is their number, computed from the labels alone so that a loop can
    know a window's count before any forward pass.
    """

    def __init__(self, ignore_index: int = IGNORE_INDEX) -> None:
        self.ignore_index = ignore_index

    def count(self, batch: Batch) -> int:
        _check_batch(
            batch,
            isinstance(batch, dict)
            and all(torch.is_tensor(batch.get(key)) and batch[key].dim() == 2 for key in ("input_ids", "labels")),
            "a dict with input_ids and labels tensors (batch, seq), as padded_token_batches makes",
        )
        return int((batch["labels"][:, 1:] != self.ignore_index).sum())

    def sum(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
        logits = getattr(out, "logits", out)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        logits = logits[:, :-1].reshape(-1, logits.shape[-1])
        labels = batch["labels"][:, 1:].reshape(-1).to(logits.device)
        return F.cross_entropy(logits, labels, ignore_index=self.ignore_index, reduction="sum")

    def __repr__(self) -> str:
        return f"TokenLoss(ignore_index={self.ignore_index})"


def _check_batch(batch: Batch, fits: bool, what: str) -> None:
    """One line for a micro-batch the loss cannot read, before any forward pass (lesson 2)."""
    if not fits:
        shown = repr(batch) if len(repr(batch)) < 60 else repr(batch)[:57] + "..."
        raise UserError(f"each micro-batch must be {what}, got {shown} ({type(batch).__name__})")


@checked
def default_loss(batch: Batch) -> SampleLoss | TokenLoss:
    """`TokenLoss` for a dict batch with labels, `SampleLoss("mse")` for a tuple batch."""
    if isinstance(batch, dict):
        if "labels" not in batch:
            raise UserError("a dict batch needs 'labels' (with ignore_index at padding) for TokenLoss")
        return TokenLoss()
    return SampleLoss("mse")
