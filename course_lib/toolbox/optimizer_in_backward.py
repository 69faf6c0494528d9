"""The optimizer step fused into backward (lesson 7, "optimizer step in backward").

PyTorch's recipe ("How to save memory by fusing the optimizer step into the backward pass", the
tutorial in docs/references.md): one optimizer per parameter, stepped in that parameter's
`register_post_accumulate_grad_hook` and its gradient freed there. Only the gradients backward is
producing at the moment are alive, never all of them at once; the price is that no gradient outlives
its own hook, so nothing can look at all of them (a global norm clip) or add several backward passes
into them (accumulation). `accumulation_breaks` and `clipping_breaks` run both and show it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from course_lib import validate
from course_lib.errors import UserError
from course_lib.validate import checked


@checked
class OptimizerInBackward:
    """Per-parameter optimizers stepped inside backward (lesson 7).

    `make_optimizer(params)` builds one optimizer for a list of one parameter, e.g.
    `lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False)`. After `loss.backward()` every
    parameter is updated and its `.grad` is None: `step()` and `zero_grad()` do nothing (they are
    there for loops that call them), `state` is every per-parameter optimizer's state in one mapping.
    `remove()` takes the hooks off.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise UserError("OptimizerInBackward got no parameters that require grad")
        self.optimizers = {p: make_optimizer([p]) for p in self.params}
        self.steps = dict.fromkeys(self.params, 0)  # optimizer steps each parameter took
        self._handles = [p.register_post_accumulate_grad_hook(self._step) for p in self.params]

    def _step(self, param: torch.Tensor) -> None:
        optimizer = self.optimizers[param]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.steps[param] += 1

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers.values() for p, s in opt.state.items()}

    def step(self) -> None:
        """Nothing to do: each parameter was updated in backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: each gradient was freed in backward."""

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((x - b[name]).abs().max().item() for name, x in a.items())


def accumulation_breaks(
    make_model: Callable[[], torch.nn.Module], batches: list[torch.Tensor], make_optimizer: Callable, loss_fn: Callable
) -> dict[str, float]:
    """Run K micro-batches with accumulation, once with a normal step after the last one and once with
    the step in backward, and say how far apart the weights end up (lesson 7, "why no accumulation").

    With the step in backward each micro-batch's backward updates the weights at once: K small steps on
    K micro-batch gradients, not one step on their sum. Returns the optimizer steps each run took and
    the largest weight difference.
    """
    batches = [
        validate.instance("each batch", batch, torch.Tensor, "a torch.Tensor")
        for batch in validate.non_empty("batches", batches, "micro-batches (tensors)")
    ]
    torch.manual_seed(0)
    plain = make_model()
    fused = make_model()
    fused.load_state_dict(plain.state_dict())
    optimizer = make_optimizer(list(plain.parameters()))
    for batch in batches:
        (loss_fn(plain, batch) / len(batches)).backward()
    optimizer.step()
    in_backward = OptimizerInBackward(fused.parameters(), make_optimizer)
    for batch in batches:
        (loss_fn(fused, batch) / len(batches)).backward()
    in_backward.remove()
    return {
        "micro_batches": len(batches),
        "steps_normal": 1,
        "steps_in_backward": max(in_backward.steps.values()),
        "largest_weight_difference": _largest_difference(_snapshot(plain), _snapshot(fused)),
    }


@checked
def clipping_breaks(
    make_model: Callable[[], torch.nn.Module],
    batch: torch.Tensor,
    make_optimizer: Callable,
    loss_fn: Callable,
    max_norm: float,
) -> dict[str, float]:
    """Clip the global gradient norm to `max_norm` in a normal step and try it with the step in backward
    (lesson 7, "why no global clip").

    The global norm needs every gradient; with the step in backward, when the first hook runs the
    other gradients do not exist yet, and after backward none exists any more. Returns the global norm
    the normal step clipped, the gradients left for `clip_grad_norm_` after backward with the step in it
    (none) and the largest weight difference between clipping and not clipping at all (what the fused
    run amounts to).
    """
    validate.positive("max_norm", max_norm)
    torch.manual_seed(0)
    plain, fused = make_model(), make_model()
    if not isinstance(plain, torch.nn.Module):
        raise UserError(f"make_model must build a new torch model each call, got {type(plain).__name__}")
    fused.load_state_dict(plain.state_dict())
    optimizer = make_optimizer(list(plain.parameters()))
    loss_fn(plain, batch).backward()
    norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm).item()
    optimizer.step()
    in_backward = OptimizerInBackward(fused.parameters(), make_optimizer)
    loss_fn(fused, batch).backward()
    in_backward.remove()
    left = sum(p.grad is not None for p in fused.parameters())
    return {
        "global_norm": norm,
        "max_norm": max_norm,
        "gradients_left_after_backward": left,
        "largest_weight_difference": _largest_difference(_snapshot(plain), _snapshot(fused)),
    }
