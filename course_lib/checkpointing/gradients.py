"""Do gradients reach every trainable parameter? The LoRA + reentrant checkpointing trap (lesson 3)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from course_lib.errors import UserError
from course_lib.validate import checked


def _loss_of(output) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None:
        tensor = (
            output
            if isinstance(output, torch.Tensor)
            else (getattr(output, "logits", None) if not isinstance(output, (tuple, list)) else output[0])
        )
        if tensor is None:
            raise UserError("cannot find a loss in the model's output: pass loss_fn(output) -> scalar")
        loss = tensor.float().pow(2).mean()
    return loss


@checked
def assert_gradients_flow(
    model: nn.Module, batch: dict | Sequence[torch.Tensor] | torch.Tensor, loss_fn: Callable | None = None
) -> None:
    """Run one forward and backward on `batch` and fail loudly if a trainable parameter gets no
    gradient (lesson 3, "the LoRA + reentrant trap").

    `batch`: a dict of keyword arguments (a Hugging Face batch), a tuple of positional arguments, or
    one tensor. The loss is `loss_fn(output)`, else `output.loss`, else the mean square of the output
    (any loss that reaches every parameter will do). Gradients are cleared before and after.
    """
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise AssertionError("the model has no trainable parameter (every requires_grad is False): nothing to train")
    model.zero_grad(set_to_none=True)
    was_training = model.training
    model.train()
    try:
        if isinstance(batch, dict):
            output = model(**batch)
        elif isinstance(batch, (tuple, list)):
            if not batch:
                raise UserError("batch is empty: give the model's inputs (a tensor, a tuple of them or a dict)")
            output = model(*batch)
        else:
            output = model(batch)
        loss = loss_fn(output) if loss_fn is not None else _loss_of(output)
        if not loss.requires_grad:
            missing = [name for name, _ in trainable]
        else:
            loss.backward()
            missing = [name for name, p in trainable if p.grad is None]
    finally:
        model.train(was_training)
    model.zero_grad(set_to_none=True)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise AssertionError(
            f"{len(missing)} of {len(trainable)} trainable parameters got no gradient: {shown}. "
            "The usual cause is reentrant checkpointing (use_reentrant=True) with frozen inputs: the "
            "embeddings are frozen (LoRA), so no input of a checkpointed segment requires grad and its "
            "output is cut from the graph. Fix: checkpoint with use_reentrant=False "
            "(model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) "
            "or course_lib.checkpointing.apply_plan), or call model.enable_input_require_grads() "
            "before training."
        )
