"""Lesson 7's tricks in the planner: the optimizer step in backward, the chunked loss and activation
offloading (lesson 7, "the planner learns them").

Each is traced, not assumed: the meta-device step of `trace` runs the same code the lesson measures,
`course_lib.toolbox`'s chunked loss, its `HostOffload` hooks (what `save_on_cpu` does: every saved
tensor leaves the device in forward and comes back in backward) and, for the step in backward, a
post-accumulate-grad hook that makes the step's temporaries of that one tensor and frees its gradient.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from course_lib.measure import format_bytes
from course_lib.models import legacy_causal_lm_loss
from course_lib.paging.policies import PCIE3_X16
from course_lib.planner.states.model_states import model_states, optimizer_step_extra
from course_lib.toolbox.activation_offload import transfer_seconds
from course_lib.toolbox.chunked_loss import chunked_causal_lm_loss

DEFAULT_CHUNK = 1024  # tokens per chunk of the chunked loss that "what makes it fit" tries


def toolbox_tricks(setup) -> list[tuple[str, object]]:
    """Lesson 7's exact tricks for "what makes it fit" (time only, same result), in the order
    practitioners stack them. "What makes it fit" tries them after the tricks of lessons 1 to 5 (the
    recipe lesson 5 trains), when those are not enough; a combination the planner refuses (the step in
    backward after accumulation, any of them with --gpus) is skipped there."""
    tricks = []
    if not setup.optimizer_in_backward:
        tricks.append(("optimizer step in backward", replace(setup, optimizer_in_backward=True)))
    if setup.chunked_loss is None:
        tricks.append((f"chunked loss ({DEFAULT_CHUNK} tokens a chunk)", replace(setup, chunked_loss=DEFAULT_CHUNK)))
    if not setup.offload_activations:
        tricks.append(("activation offloading to host memory (save_on_cpu)", replace(setup, offload_activations=True)))
    return tricks


def traced_loss(model: torch.nn.Module, ids: torch.Tensor, setup, autocast=None):
    """(loss, outputs kept by the loop) of the traced step: the model's own loss, or lesson 7's chunked one
    (each chunk's recompute under `autocast`, the trace's autocast on the meta device, as torch.autocast's
    state is restored for a checkpoint's recompute)."""
    if setup.legacy_causal_lm_loss:
        return legacy_causal_lm_loss(model, ids, ids)
    if setup.chunked_loss is None:
        outputs = model(input_ids=ids, labels=ids, use_cache=False)
        return outputs.loss, outputs
    again = None if autocast is None else (lambda: autocast)
    return chunked_causal_lm_loss(model, ids, ids, setup.chunked_loss, recompute_context=again), None


def step_in_backward_hook(tracer, model: torch.nn.Module, spec, setup, cuda: bool):
    """A post-accumulate-grad hook for the traced step of `model` (`spec`'s): the step's temporaries for this
    one tensor, then its gradient freed, as `course_lib.toolbox.OptimizerInBackward` does (lesson 7); an
    embedding weight an 8-bit optimizer steps in 32 bits (the Trainer's override)."""
    mixed = setup.precision.startswith("mixed")
    state_itemsize = model_states(spec, setup, cuda=cuda).state_itemsize
    embeddings = frozenset(id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding))

    def hook(param):
        grad = param.grad
        shape = tuple(param.shape)
        extra = optimizer_step_extra(
            setup.optimizer, [shape], state_itemsize, grad.element_size(), cuda, mixed, [id(param) in embeddings]
        )
        temporaries = torch.empty(extra, dtype=torch.uint8, device=param.device) if extra else None
        del temporaries
        tracer.grad_bytes -= grad.untyped_storage().nbytes()
        del grad
        param.grad = None

    return hook


def toolbox_notes(setup, trace, card=None) -> tuple[list[str], dict]:
    """The plan's notes and details for lesson 7's options; `card`: the target GPU (its host link), or None."""
    notes, detail = [], {}
    if setup.optimizer_in_backward:
        notes.append(
            "optimizer in backward: each parameter is updated in its post-accumulate-grad hook and its "
            "gradient freed there: no full set of gradients, no accumulation, and no global norm clip "
            "(a recipe's clip, the Trainer's max_grad_norm=1.0 by default, is lost)"
        )
    if setup.chunked_loss is not None:
        notes.append(
            f"chunked loss: the output layer and the loss run {setup.chunked_loss} tokens at a time, each "
            "chunk's logits recomputed in backward (lesson 7)"
        )
        tokens = setup.batch * setup.seq
        if setup.chunked_loss >= tokens:
            notes.append(
                f"chunked loss of {setup.chunked_loss} tokens a chunk: the micro-batch has {tokens} "
                f"(batch {setup.batch} x seq {setup.seq}), so it is one chunk and backward rebuilds all of "
                f"its logits at once; a chunk below {tokens} tokens is what saves memory"
            )
    if setup.offload_activations:
        rate = PCIE3_X16 if card is None else card.host_link_bytes_per_s
        link = "PCIe 3.0 x16, no --gpu given" if card is None else f"the {card.name}'s {card.host_link}"
        seconds = transfer_seconds(trace.offloaded, trace.offloaded, rate)
        detail.update(offload_bytes_each_way=trace.offloaded, offload_seconds_predicted=seconds)
        notes.append(
            f"offload activations: {format_bytes(trace.offloaded)} to host memory in forward and back in "
            f"backward, weights saved by matmuls included; predicted {seconds * 1e3:,.1f} ms per step at "
            f"{rate / 1e9:.2f} GB/s each way ({link}), not overlapped"
        )
    return notes, detail
