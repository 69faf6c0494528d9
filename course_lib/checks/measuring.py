"""Checks for the exercises of lesson 0 (measuring memory)."""

from __future__ import annotations

import torch

from course_lib import measure, memory
from course_lib.checks.hints import refuse_reference
from course_lib.measure import measure_step

__all__ = ["check_adam_state_bytes", "check_saved_bytes"]


def _models_and_inputs() -> list[tuple[torch.nn.Module, torch.Tensor]]:
    """A few models of different shapes with a batch each; one shares a weight between two layers."""
    torch.manual_seed(0)
    tied = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8, bias=False))
    tied[2].weight = tied[0].weight
    return [(torch.nn.Linear(3, 5), torch.randn(4, 3)),
            (torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)), torch.randn(4, 16)),
            (torch.nn.Sequential(torch.nn.Embedding(50, 12), torch.nn.LayerNorm(12)), torch.randint(0, 50, (4, 3))),
            (tied, torch.randn(4, 8))]


def check_adam_state_bytes(adam_state_bytes) -> None:
    """Exercise 0.1: `adam_state_bytes(model)` predicts what AdamW allocates at its first step."""
    for model, x in _models_and_inputs():
        optimizer = torch.optim.AdamW(model.parameters())
        measured = measure_step(model, optimizer, lambda: model(x).sum(), inputs=[x]).optimizer_state
        with refuse_reference(measure, memory, instead="predict it from the parameters' shapes and dtypes"):
            predicted = adam_state_bytes(model)
        n_tensors = len(list(model.parameters()))
        assert predicted is not None, "adam_state_bytes returned None: return the number of bytes"
        if predicted == measured - 4 * n_tensors:
            raise AssertionError("almost: each parameter tensor also gets a 'step' counter, a float32 scalar "
                                 "tensor of 4 bytes; add it")
        if predicted == 2 * measured:
            raise AssertionError("twice too much: a weight shared by two layers is one Parameter and gets one "
                                 "state; iterate over model.parameters(), which lists it once")
        assert predicted == measured, (
            f"for {model.__class__.__name__} with {sum(p.numel() for p in model.parameters())} parameters "
            f"AdamW allocated {measured} bytes of state, you predicted {predicted}: exp_avg and exp_avg_sq "
            "take the parameter's dtype and shape")
    print("Correct: your formula matches AdamW's real state on every model.")


def check_saved_bytes(saved_bytes) -> None:
    """Exercise 0.2: `saved_bytes(batch, d_in, hidden)` predicts what the MLP saves for backward."""
    for batch, d_in, hidden in ((1, 3, 5), (8, 16, 64), (32, 100, 7)):
        model = torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))
        x = torch.randn(batch, d_in)
        measured = measure_step(model, None, lambda: model(x).sum(), inputs=[x]).saved_for_backward
        with refuse_reference(measure, memory, instead="predict it from the layers' shapes"):
            predicted = saved_bytes(batch, d_in, hidden)
        assert predicted is not None, "saved_bytes returned None: return the number of bytes"
        if predicted == measured + 4 * batch * hidden:
            raise AssertionError("close: ReLU saves its output and the second Linear saves its input, but they "
                                 "are the same tensor (one storage): count it once")
        assert predicted == measured, (
            f"batch={batch}, d_in={d_in}, hidden={hidden}: autograd saved {measured} bytes, you predicted "
            f"{predicted}. Which tensors does each layer need for its backward? Weights are parameters, "
            "not saved activations.")
    print("Correct: your count matches what autograd saved, to the byte.")
