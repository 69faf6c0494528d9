"""A chunked cross-entropy: the output layer and the loss computed a chunk of tokens at a time, each
chunk's logits recomputed in backward (lesson 7, "chunked loss").

The plain loss of a causal LM materializes batch x seq x vocab logits (in the model's dtype), their
fp32 upcast, the log-softmax cross_entropy saves, and in backward their gradient: for a 128k-token
vocabulary that dwarfs a decoder layer's activations. Here each chunk of `chunk_size` tokens runs
lm_head + cross_entropy under `torch.utils.checkpoint` (non-reentrant), so forward keeps only the
hidden states it already had and backward rebuilds one chunk's logits at a time. The loss is Hugging
Face's `ForCausalLMLoss` (transformers/loss/loss_utils.py): labels shifted left with `ignore_index`
padding the end, logits upcast to fp32, the sum over tokens divided by `num_items_in_batch` when given,
else the mean over tokens whose label is not `ignore_index`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, noop_context_fn

from course_lib import validate
from course_lib.errors import UserError
from course_lib.validate import Count, checked


def _chunk_loss_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    softcap: float | None,
    ignore_index: int,
) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:  # Gemma-2's final_logit_softcapping, as its ForCausalLM applies it
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")


@checked
def _described(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} on {tensor.device.type}"


def _token_tensors(input_ids: torch.Tensor, **alike: torch.Tensor | None) -> None:
    """input_ids an integer (batch, sequence) tensor with data, and each of `alike` (labels, the attention
    mask) one of the same shape, or None."""
    if input_ids.dim() != 2 or input_ids.is_floating_point():
        raise UserError(
            f"input_ids must be token ids, an integer tensor of (batch, sequence), got {_described(input_ids)}"
        )
    for name, tensor in alike.items():
        if tensor is not None and (tensor.shape != input_ids.shape or tensor.device != input_ids.device):
            raise UserError(
                f"{name} must have input_ids' shape {tuple(input_ids.shape)} and device, got {_described(tensor)}"
            )


@checked
def shifted_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Hugging Face's shift: position t is scored on token t+1; the last position on nothing."""
    if labels.dim() == 0 or labels.is_floating_point():
        raise UserError(f"labels must be token ids, an integer tensor of (batch, sequence), got {_described(labels)}")
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


@checked
def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: Count,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    num_items_in_batch: int | torch.Tensor | None = None,
    softcap: float | None = None,
    shift: bool = True,
    recompute: bool = True,
    recompute_context: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> torch.Tensor:
    """The causal LM loss of `hidden` (batch, seq, hidden) under the output layer `weight` (vocab,
    hidden), `chunk_size` tokens at a time (lesson 7, "chunked loss"); equal to Hugging Face's loss of
    `F.linear(hidden, weight, bias)` within float rounding, gradients included.

    `shift=False`: `labels` are already aligned with the positions (HF's `shift_labels`). Labels that are
    all `ignore_index` give 0 (nothing is scored), where Hugging Face's mean gives NaN (0/0).
    `recompute=False`: the chunks without `torch.utils.checkpoint`, so that forward keeps each chunk's
    fp32 log-softmax for backward (lesson 7 measures what chunking alone buys). `recompute_context`: a
    context each chunk's recompute in backward runs under (checkpoint's `context_fn`): torch restores
    `torch.autocast` there itself; the planner's autocast on the meta device (course_lib.planner.trace.autocast)
    is a TorchFunctionMode, which it does not.
    """
    chunk_size = validate.positive_int("chunk_size", chunk_size)
    if num_items_in_batch is not None and not torch.is_tensor(num_items_in_batch):
        num_items_in_batch = validate.positive_int(
            "num_items_in_batch (the tokens of the whole batch, or None)", num_items_in_batch
        )
    for name, tensor in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        validate.instance(name, tensor, torch.Tensor, "a torch.Tensor")
    if hidden.dim() < 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise UserError(
            f"hidden {tuple(hidden.shape)} must be (batch, seq, hidden) and weight {tuple(weight.shape)} "
            "(vocab, hidden), with the same hidden size"
        )
    if hidden.shape[:-1] != labels.shape:
        raise UserError(
            f"labels {tuple(labels.shape)} must have the shape of hidden without its last "
            f"dimension, {tuple(hidden.shape[:-1])}"
        )
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != weight.dtype or bias.is_meta):
        raise UserError(
            f"bias must be the output layer's, {tuple(weight.shape[:1])} like weight, got {_described(bias)}"
        )
    targets = (shifted_labels(labels, ignore_index) if shift else labels).reshape(-1)
    scored = targets[targets != ignore_index] if not targets.is_meta else targets[:0]
    if scored.numel() and not (0 <= int(scored.min()) and int(scored.max()) < weight.shape[0]):
        raise UserError(
            f"labels must be token ids below the vocabulary's {weight.shape[0]:,} (weight's rows) or "
            f"ignore_index {ignore_index}, got {int(scored.min())}..{int(scored.max())}"
        )
    flat = hidden.reshape(-1, hidden.shape[-1])
    total = hidden.new_zeros((), dtype=torch.float32)
    context_fn = (
        noop_context_fn if recompute_context is None else (lambda: (contextlib.nullcontext(), recompute_context()))
    )
    for h, y in zip(flat.split(chunk_size), targets.split(chunk_size)):
        if recompute:
            total = total + checkpoint(
                _chunk_loss_sum,
                h,
                weight,
                bias,
                y,
                softcap,
                ignore_index,
                use_reentrant=False,
                preserve_rng_state=False,
                context_fn=context_fn,
            )
        else:
            total = total + _chunk_loss_sum(h, weight, bias, y, softcap, ignore_index)
    if num_items_in_batch is None:  # labels all ignore_index: 0 (no token adds to the loss), not HF's NaN (0/0)
        return total / (targets != ignore_index).sum().clamp(min=1)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


@checked
def hidden_states_and_head(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.nn.Linear]:
    """The last hidden states of a Hugging Face causal LM (its decoder, final norm included) and its
    output layer, without computing the logits (lesson 7). A peft model is unwrapped first (its
    adapters live inside the base model's layers)."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    _token_tensors(input_ids, attention_mask=attention_mask)
    output_layer = getattr(model, "get_output_embeddings", None)
    head = output_layer() if callable(output_layer) else None
    decoder = getattr(model, "base_model", model)
    if head is None or decoder is model:
        raise UserError(
            f"{type(model).__name__} is not a Hugging Face causal LM with an output layer "
            "(get_output_embeddings) and a base model"
        )
    for name in ("logit_scale", "logits_scaling"):
        if getattr(model.config, name, None) not in (None, 1, 1.0):
            raise UserError(f"{type(model).__name__} scales its logits ({name}): chunked_causal_lm_loss does not")
    out = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return out.last_hidden_state, head


@checked
def chunked_causal_lm_loss(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: Count,
    *,
    attention_mask: torch.Tensor | None = None,
    ignore_index: int = -100,
    num_items_in_batch: int | torch.Tensor | None = None,
    recompute_context: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> torch.Tensor:
    """`model(input_ids, attention_mask=..., labels=labels).loss` of a Hugging Face causal LM, with the
    output layer and the loss computed `chunk_size` tokens at a time (lesson 7, "chunked loss");
    `recompute_context` as in `chunked_cross_entropy`."""
    hidden, head = hidden_states_and_head(model, input_ids, attention_mask)
    return chunked_cross_entropy(
        hidden,
        head.weight,
        labels,
        chunk_size,
        bias=head.bias,
        ignore_index=ignore_index,
        num_items_in_batch=num_items_in_batch,
        softcap=getattr(model.config, "final_logit_softcapping", None),
        recompute_context=recompute_context,
    )
