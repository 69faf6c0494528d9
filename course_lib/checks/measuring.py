"""Checks for the exercises of lesson 0 (measuring memory)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

import course_lib
from course_lib.checks.hints import assert_byte_count, passed, refuse_reference
from course_lib.measure import measure_step
from course_lib.validate import checked

__all__ = ["check_adam_state_bytes", "check_saved_bytes"]


def _models_and_inputs() -> list[tuple[str, torch.nn.Module, torch.Tensor]]:
    """Models of different shapes and dtypes with a batch each: one shares a weight between two layers,
    two are 16-bit, one has a frozen embedding (no gradient, so no AdamW state)."""
    torch.manual_seed(0)
    tied = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8, bias=False))
    tied[2].weight = tied[0].weight
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    frozen = torch.nn.Sequential(torch.nn.Embedding(50, 12), torch.nn.LayerNorm(12), torch.nn.Linear(12, 3))
    frozen[0].weight.requires_grad_(False)
    return [
        ("an fp32 Linear", torch.nn.Linear(3, 5), torch.randn(4, 3)),
        ("an fp32 MLP", mlp, torch.randn(4, 16)),
        (
            "an fp32 Embedding + LayerNorm",
            torch.nn.Sequential(torch.nn.Embedding(50, 12), torch.nn.LayerNorm(12)),
            torch.randint(0, 50, (4, 3)),
        ),
        ("an MLP with a tied weight", tied, torch.randn(4, 8)),
        ("a bf16 MLP", copy.deepcopy(mlp).to(torch.bfloat16), torch.randn(4, 16, dtype=torch.bfloat16)),
        ("an fp16 Linear", torch.nn.Linear(24, 6).to(torch.float16), torch.randn(4, 24, dtype=torch.float16)),
        ("a model whose embedding is frozen", frozen, torch.randint(0, 50, (4, 3))),
    ]


def _adam_hint(predicted: int, measured: int, model: torch.nn.Module) -> str | None:
    """The hint for a plausible wrong prediction of AdamW's state, None if it is none of them."""
    trained = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    if predicted == measured - 4 * len(trained):
        return "almost: each parameter tensor also gets a 'step' counter, a float32 scalar tensor of 4 bytes; add it"
    if predicted == measured - sum(4 - p.element_size() for p in trained) != measured:
        return "the 'step' counter is a float32 scalar (4 bytes) whatever the parameter's dtype"
    listed = [p for _, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
    if len(listed) > len(trained) and predicted == sum(2 * p.numel() * p.element_size() + 4 for p in listed):
        return (
            "too much: a weight shared by two layers is one Parameter and gets one state; iterate over "
            "model.parameters(), which lists it once"
        )
    if frozen and predicted == measured + sum(2 * p.numel() * p.element_size() + 4 for p in frozen):
        return (
            "a frozen parameter (requires_grad=False) gets no gradient, and AdamW keeps no state for a "
            "parameter without one: leave it out"
        )
    if predicted != measured and predicted in (
        sum(8 * p.numel() + 4 for p in ps) for ps in (trained, trained + frozen)
    ):
        return (
            "exp_avg and exp_avg_sq take the parameter's dtype: 4 bytes each in fp32 but 2 in bf16 or fp16 "
            "(p.element_size()), not always 8 bytes per parameter"
        )
    return None


@checked
def check_adam_state_bytes(adam_state_bytes: Callable) -> None:
    """Exercise 0.1: `adam_state_bytes(model)` predicts what AdamW allocates at its first step."""
    for name, model, x in _models_and_inputs():
        optimizer = torch.optim.AdamW(model.parameters())  # frozen parameters included, as people write it
        measured = measure_step(model, optimizer, lambda: model(x).sum(), inputs=[x]).optimizer_state
        with refuse_reference(course_lib, instead="predict it from the parameters' shapes and dtypes"):
            predicted = adam_state_bytes(model)
        assert_byte_count(predicted, "adam_state_bytes")
        hint = _adam_hint(predicted, measured, model)
        assert hint is None, f"{name}: {hint}"
        assert predicted == measured, (
            f"for {name} with {sum(p.numel() for p in model.parameters())} parameters AdamW allocated "
            f"{measured} bytes of state, you predicted {predicted}: exp_avg and exp_avg_sq take the parameter's "
            "dtype and shape"
        )
    passed("Correct: your formula matches AdamW's real state on every model: fp32, bf16, fp16, tied and frozen.")


def _mlp(widths: tuple[int, ...]) -> torch.nn.Sequential:
    """Linear(widths[0], widths[1]) -> ReLU -> Linear(widths[1], widths[2]) -> ... -> Linear(.., widths[-1])."""
    layers: list[torch.nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _saved_hint(predicted, batch: int, widths: tuple[int, ...]) -> str | None:
    """The hint for a plausible wrong count of the MLP's saved activations, None if it is none of them."""
    inputs, hidden, out = widths[0], sum(widths[1:-1]), widths[-1]
    right = 4 * batch * (inputs + hidden)
    if predicted == right:
        return None
    if len(widths) > 3 and predicted == 4 * batch * (inputs + widths[1]):
        return (
            "every hidden layer's ReLU output is saved (it is the next Linear's input), not only the first "
            "one's: count each hidden width"
        )
    if hidden and predicted == 4 * batch * (inputs + 2 * hidden):
        return (
            "each hidden activation once: ReLU's output is the next Linear's input (one storage), and the "
            "Linear's output before ReLU is freed as soon as ReLU has run"
        )
    if predicted in (right + 4 * batch * out, 4 * batch * sum(widths)):
        return "the last Linear's output is not saved: the loss .sum() keeps nothing for backward"
    if predicted == 4 * batch * hidden:
        return "the first Linear saves its input x too: its weight's gradient needs it"
    if predicted == batch * (inputs + hidden):
        return "that is a number of values: return bytes (fp32 takes 4 bytes per value)"
    if predicted == 4 * (inputs + hidden):
        return "every saved tensor holds one row per sample: multiply by the batch"
    return None


@checked
def check_saved_bytes(saved_bytes: Callable) -> None:
    """Exercise 0.2: `saved_bytes(batch, widths)` predicts what an MLP of any depth saves for backward."""
    for batch, widths in (
        (1, (3, 5, 2)),
        (8, (16, 64, 32, 2)),
        (5, (100, 7, 9, 7, 1)),
        (3, (10, 3)),
        (32, (6, 40, 12, 40, 12, 5)),
    ):
        model = _mlp(widths)
        x = torch.randn(batch, widths[0])
        measured = measure_step(model, None, lambda: model(x).sum(), inputs=[x]).saved_for_backward
        with refuse_reference(course_lib, instead="predict it from the layers' shapes"):
            predicted = saved_bytes(batch, widths)
        assert_byte_count(predicted, "saved_bytes")
        case = f"batch={batch}, widths={widths}"
        hint = _saved_hint(predicted, batch, widths)
        assert hint is None, f"{case}: {hint}"
        assert predicted == measured, (
            f"{case}: autograd saved {measured} bytes, you predicted {predicted}. Which tensors does each layer "
            "need for its backward? Weights are parameters, not saved activations."
        )
    passed("Correct: your count matches what autograd saved, to the byte, at every depth.")
