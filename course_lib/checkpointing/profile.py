"""What each layer of a stack stores and costs, measured on one unchecked step (lesson 3, "what a
layer stores"): the inputs of the cost model."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from course_lib.checkpointing.optimal import optimal_plan, plan_frontier
from course_lib.checkpointing.plans import Plan, PlanCost, plan_cost
from course_lib.errors import UserError
from course_lib.layers import find_layer_stack
from course_lib.measure import LiveStorageTracker, storage_bytes, training_loss, unique_storages
from course_lib.validate import checked


def flop_counter():
    """torch's FlopCounterMode, taught CPU flash attention too (torch counts only the CUDA kernels)."""
    aten = torch.ops.aten
    mapping = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mapping = {
            aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *args, out_shape=None, **kwargs: (
                sdpa_flop_count(q, k, v)
            ),
            aten._scaled_dot_product_flash_attention_for_cpu_backward: lambda grad, q, k, v, *args, out_shape=None, **kwargs: (
                sdpa_backward_flop_count(grad, q, k, v)
            ),
        }
    return FlopCounterMode(display=False, custom_mapping=mapping)


def _storage_keys(obj) -> set:
    tensors = [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]
    return set(unique_storages(tensors))


@checked
@dataclass
class StackProfile:
    """What each layer of a stack stores and costs, measured on one unchecked training step: the
    inputs of `plan_cost` (lesson 3, "what a layer stores").

    `saved_bytes`, `input_bytes`: the two the cost model needs (see `plan_cost`). The rest refines
    it: `output_bytes`, `grad_bytes` (parameter gradients per layer), `transient_bytes` (how far each
    layer's backward climbed above its start), `head_bytes` and `head_grad_bytes` (the head and loss
    after the stack), `compute` (forward FLOPs per layer), `output_saved` (layers that save their
    own output). `baseline_input_bytes`: the stack's input
    when it was live before the step (a batch fed straight into the stack), subtracted from
    predictions compared with `measure_step` (whose peak is relative to what was live before).
    """

    saved_bytes: list[int]
    input_bytes: list[int]
    output_bytes: int
    grad_bytes: list[int]
    transient_bytes: list[int]
    head_bytes: int
    head_grad_bytes: int
    compute: list[float]
    output_saved: list[bool] = field(default_factory=list)
    baseline_input_bytes: int = 0

    @property
    def n_layers(self) -> int:
        return len(self.saved_bytes)

    def model_kwargs(self, refined: bool = True) -> dict:
        """Keyword arguments for plan_cost / plan_frontier / optimal_plan after the two size lists.
        `refined=False`: only the layers' compute (the simple model: saved and input sizes alone)."""
        kwargs = {"compute": self.compute}
        if refined:
            kwargs.update(
                output_bytes=self.output_bytes,
                grad_bytes=self.grad_bytes,
                transient_bytes=self.transient_bytes,
                head_bytes=self.head_bytes,
                head_grad_bytes=self.head_grad_bytes,
                output_saved=self.output_saved,
            )
        return kwargs

    def cost(self, plan, refined: bool = True) -> PlanCost:
        """plan_cost of a plan (or plan name) for this stack."""
        return plan_cost(self.saved_bytes, self.input_bytes, plan, **self.model_kwargs(refined))

    def predicted_step_peak(self, plan, refined: bool = True) -> int:
        """Predicted peak of a training step above what was live before it (measure_step's
        peak - baseline, optimizer step excluded). The simple model gets all gradients added."""
        peak = self.cost(plan, refined).peak_bytes - self.baseline_input_bytes
        if not refined:
            peak += sum(self.grad_bytes) + self.head_grad_bytes
        return peak

    def frontier(self) -> list[tuple[int, float, Plan]]:
        return plan_frontier(self.saved_bytes, self.input_bytes, **self.model_kwargs())

    def optimal_plan(self, budget_bytes: int) -> Plan:
        return optimal_plan(self.saved_bytes, self.input_bytes, budget_bytes, **self.model_kwargs())


@checked
def profile_stack(
    model: nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    inputs: Iterable[torch.Tensor] = (),
    *,
    stack: Iterable[nn.Module] | None = None,
) -> StackProfile:
    """Measure a stack's `StackProfile` on one unchecked forward and backward (lesson 3).

    `loss_fn()` runs the forward and returns the loss; `inputs` are the batch tensors it reads. The
    live-storage tracker of course_lib.measure follows every allocation (CPU or CUDA tensors alike);
    saved-tensor hooks attribute what autograd saves to the layer running; forward hooks and gradient
    hooks on each layer's output mark where each layer's backward starts. A second, gradient-free
    forward counts each layer's FLOPs. saved_bytes[i] excludes parameters, layer i's output and the
    arguments all layers share (masks, rotary tables).
    """
    layers = list(stack if stack is not None else find_layer_stack(model))
    n = len(layers)
    if any(getattr(layer, "_course_plan", None) is not None for layer in layers):
        raise UserError("a checkpoint plan is applied to this stack: profile it without (remove the plan)")
    model_tensors = list(model.parameters()) + list(model.buffers())
    params = set(unique_storages(model_tensors))
    inputs = [t for t in inputs if isinstance(t, torch.Tensor)]
    baseline_keys = params | set(unique_storages(inputs))
    saved: list[dict] = [dict() for _ in layers]
    in_bytes, in_keys = [0] * n, [None] * n
    outputs: list[set] = [set() for _ in layers]
    shared: list[set] = [set() for _ in layers]
    marks: dict = {}
    active = [None]
    tracker = LiveStorageTracker()

    def mark(name):
        marks[name] = (len(tracker.timeline), tracker.current)

    def pre(index):
        def hook(module, args, kwargs):
            active[0] = index
            hidden = args[0] if args else next(iter(kwargs.values()))
            in_bytes[index] = hidden.untyped_storage().nbytes()
            in_keys[index] = next(iter(_storage_keys(hidden)), None)
            shared[index] = _storage_keys((args[1:], kwargs)) - _storage_keys(hidden)
            if index == 0 and hidden.requires_grad:
                hidden.register_hook(lambda grad: mark(("bwd", -1)))

        return hook

    def post(index):
        def hook(module, args, kwargs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            outputs[index] = _storage_keys(hidden)
            active[0] = None
            if hidden.requires_grad:
                hidden.register_hook(lambda grad: mark(("bwd", index)))
            if index == n - 1:
                marks["out_bytes"] = hidden.untyped_storage().nbytes()
                mark("forward_end")

        return hook

    def pack(tensor):
        if active[0] is not None:
            for key, nbytes in unique_storages([tensor]).items():
                if key not in params:
                    saved[active[0]][key] = nbytes
        return tensor

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(post(i), with_kwargs=True))
    model.zero_grad(set_to_none=True)
    try:
        for tensor in model_tensors + inputs:
            tracker.watch(tensor)
        with tracker:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = training_loss(loss_fn)
            loss.backward()
            del loss
        mark("end")
    finally:
        for handle in handles:
            handle.remove()
    grad_bytes = [storage_bytes(p.grad for p in layer.parameters() if p.grad is not None) for layer in layers]
    model.zero_grad(set_to_none=True)
    if "forward_end" not in marks or ("bwd", n - 1) not in marks:
        raise UserError("the stack's output got no gradient: is the loss computed from the stack?")

    timeline = [current for _, current in tracker.timeline]

    def climb(begin, end) -> int:
        index, level = marks[begin]
        stop = marks[end][0] if end in marks else len(timeline)
        return max([level] + timeline[index:stop]) - level

    transient = [climb(("bwd", i), ("bwd", i - 1) if i > 0 else "end") for i in range(n)]
    out = marks["out_bytes"]
    head = climb("forward_end", ("bwd", n - 1))
    head_grads = max(0, marks[("bwd", n - 1)][1] - marks["forward_end"][1] - out)
    sizes = [sum(v for k, v in s.items() if k not in outputs[i] and k not in shared[i]) for i, s in enumerate(saved)]

    # FLOPs of each layer's forward, on a second, gradient-free pass.
    flops = [0.0] * n
    counter = flop_counter()
    at = [0]

    def flop_pre(index):
        def hook(module, args):
            at[0] = counter.get_total_flops()

        return hook

    def flop_post(index):
        def hook(module, args, output):
            flops[index] = float(counter.get_total_flops() - at[0])

        return hook

    handles = [
        h
        for i, layer in enumerate(layers)
        for h in (layer.register_forward_pre_hook(flop_pre(i)), layer.register_forward_hook(flop_post(i)))
    ]
    try:
        with torch.no_grad(), counter:
            loss_fn()
    finally:
        for handle in handles:
            handle.remove()
    if not any(flops):
        flops = [1.0] * n
    return StackProfile(
        saved_bytes=sizes,
        input_bytes=in_bytes,
        output_bytes=out,
        grad_bytes=grad_bytes,
        transient_bytes=transient,
        head_bytes=head,
        head_grad_bytes=head_grads,
        compute=flops,
        output_saved=[bool(outputs[i] & set(s)) for i, s in enumerate(saved)],
        baseline_input_bytes=in_bytes[0] if in_keys[0] in baseline_keys else 0,
    )
